"""GGUF imports of small models written as llama.cpp writes them (tests/gguf_files.py; issue 26, items 5
and 6).

Llama 3 RoPE: llama.cpp keeps the llama3 ``rope_scaling`` only as the ``rope_freqs`` tensor; the import
rebuilds it, and the logits equal the HF original's (transformers ``LlamaForCausalLM``, eager fp32) within 64
fp32 roundings of the largest logit, for Llama 3.1's settings, Llama 3.2 1B's real ones on a tiny shape, and a
config whose top-level ``original_max_position_embeddings`` llama.cpp honours (the fitted path). Other
per-dimension frequency tensors are refused by name. Tokenizers: llama, qwen2, qwen3 and gemma3 files whose
vocabulary lacks ``<|endoftext|>`` import with a tokenizer that fits the embedding, and train 2 steps with no
override; a file without tokenizer metadata is one error line.
"""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest
import torch

from conftest import cli_error
from gguf_files import tokenizer_metadata, write_gguf
from shardlm.cli.main import main as shardlm_main
from shardlm.cli.train import main as train_main
from shardlm.convert.hf_in import load_model_dir
from tolerance import EPS, assert_close

transformers = pytest.importorskip("transformers", reason="pip install -e '.[test]'")
gguf = pytest.importorskip("gguf", reason="pip install -e '.[test]'")

VOCAB = 512  # conftest.small_data's tokenizer
IDS = torch.randint(3, VOCAB, (2, 48), generator=torch.Generator().manual_seed(4))

#: (llama3 rope settings, head_dim via hidden/heads, top-level original_max_position_embeddings or None)
ROPE_CASES = {
    "llama31": (dict(rope_theta=500000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                     original_max_position_embeddings=8192), 128, 2, None),
    "llama32_1b": (dict(rope_theta=500000.0, factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                        original_max_position_embeddings=8192), 64, 4, None),
    "top_level_original": (dict(rope_theta=10000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                original_max_position_embeddings=64), 64, 2, 64),
}


def random_llama(rope: dict, hidden: int, heads: int, top_original: int | None, seed: int = 0):
    """A random transformers Llama (GQA, untied, every parameter perturbed) with llama3 RoPE
    scaling ``rope``."""
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=hidden, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=heads, num_key_value_heads=heads // 2 or 1, max_position_embeddings=16384,
        rms_norm_eps=1e-5, tie_word_embeddings=False, rope_parameters={"rope_type": "llama3", **rope})
    if top_original is not None:
        config.original_max_position_embeddings = top_original
    model = transformers.LlamaForCausalLM(config).eval()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.05)
    return model


def _hf_logits(model) -> torch.Tensor:
    model.config._attn_implementation = "eager"
    with torch.no_grad():
        return model(IDS).logits


@pytest.mark.parametrize("case", list(ROPE_CASES))
def test_llama3_rope_from_rope_freqs_equals_the_hf_original(case, small_data, tmp_path):
    rope, hidden, heads, top_original = ROPE_CASES[case]
    model = random_llama(rope, hidden, heads, top_original)
    path = write_gguf(tmp_path / f"{case}.gguf", model,
                      tokenizer_metadata(small_data / "tokenizer.json", "llama"))
    assert "rope_freqs.weight" in {t.name for t in gguf.GGUFReader(str(path)).tensors}
    out = tmp_path / "imported"
    assert shardlm_main(["import", "--gguf", str(path), str(out)]) == 0
    scaling = json.loads((out / "config.json").read_text())["rope_scaling"]
    assert scaling["rope_type"] == "llama3" and scaling["factor"] == rope["factor"], scaling
    if case == "top_level_original":  # fitted from three in-between dimensions: the original values come back
        assert (scaling["low_freq_factor"], scaling["high_freq_factor"]) == (1.0, 4.0), scaling
        assert scaling["original_max_position_embeddings"] == 64, scaling
    theirs = _hf_logits(model)
    with torch.no_grad():
        ours = load_model_dir(out).eval()(IDS).float()
    assert_close(ours, theirs, rtol=64 * EPS, what="imported vs transformers")
    back = transformers.LlamaForCausalLM.from_pretrained(str(out), dtype=torch.float32,
                                                         attn_implementation="eager")
    assert_close(_hf_logits(back.eval()), theirs, rtol=0, what="imported, in transformers")
    # the scaling matters at this length: the same weights without it are far off (what the import
    # wrote before)
    plain = copy.deepcopy(model.config)
    plain.rope_parameters = {"rope_type": "default", "rope_theta": rope["rope_theta"]}
    unscaled = transformers.LlamaForCausalLM(plain).eval()
    unscaled.load_state_dict(model.state_dict())
    assert (_hf_logits(unscaled) - theirs).abs().max().item() > 1e-4


def test_other_per_dimension_frequency_tensors_are_refused_by_name(small_data, tmp_path, capsys):
    rope, hidden, heads, _ = ROPE_CASES["llama32_1b"]
    model = random_llama(rope, hidden, heads, None)
    tok = tokenizer_metadata(small_data / "tokenizer.json", "llama")
    path = write_gguf(tmp_path / "x.gguf", model, tok)
    reader = gguf.GGUFReader(str(path), "r+")  # factors that no llama3 scaling gives (rising, then falling)
    factors = next(t for t in reader.tensors if t.name == "rope_freqs.weight").data
    factors[:] = np.array([1.0, 3.0, 1.0, 2.0, 5.0, 1.5, 7.0, 1.0], dtype=np.float32)
    reader.data.flush()
    del reader
    err = cli_error(capsys, ["import", "--gguf", str(path), str(tmp_path / "o1")])
    assert "rope_freqs.weight" in err and "not a llama3 RoPE scaling" in err, err
    # a Qwen2 file with rope_freqs (shardlm's qwen2 RoPE has no per-dimension factors)
    qwen = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64))
    path = tmp_path / "q.gguf"
    write_gguf(path, qwen, tokenizer_metadata(small_data / "tokenizer.json", "qwen2"),
               extra={"rope_factors_long.weight": np.ones(8, dtype=np.float32)})
    err = cli_error(capsys, ["import", "--gguf", str(path), str(tmp_path / "o2")])
    assert "rope_factors_long.weight" in err and "LongRoPE" in err and "not supported for qwen2" in err, err
    assert not (tmp_path / "o1").exists() and not (tmp_path / "o2").exists()


# ---- tokenizers --------------------------------------------------------------------------------------------

def family_model(family: str, vocab: int):
    """A small random transformers model of ``family`` with ``vocab`` embedding rows."""
    torch.manual_seed(0)
    common = dict(vocab_size=vocab, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-6)
    config = {"llama": lambda: transformers.LlamaConfig(**common, tie_word_embeddings=False),
              "qwen2": lambda: transformers.Qwen2Config(**common, tie_word_embeddings=True),
              "qwen3": lambda: transformers.Qwen3Config(**common, head_dim=16, tie_word_embeddings=True),
              "gemma3": lambda: transformers.Gemma3TextConfig(**common, head_dim=16, sliding_window=16,
                                                              query_pre_attn_scalar=16)}[family]()
    return transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "gemma3"])
def test_gguf_tokenizer_fits_the_model_and_trains_as_is(family, small_data, small_corpus, tmp_path, capsys):
    tok = tokenizer_metadata(small_data / "tokenizer.json", family)
    assert "<|endoftext|>" not in tok["tokens"] and "<mask>" not in tok["tokens"]
    n = len(tok["tokens"])
    path = write_gguf(tmp_path / f"{family}.gguf", family_model(family, n), tok)
    # transformers' own GGUF tokenizer has more ids than the file's vocabulary (what the import wrote before)
    theirs = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    assert len(theirs) > n
    out = tmp_path / "imported"
    capsys.readouterr()
    assert shardlm_main(["import", "--gguf", str(path), str(out)]) == 0
    assert "dropped" in capsys.readouterr().err
    ours = transformers.AutoTokenizer.from_pretrained(str(out))
    assert len(ours) == n and json.loads((out / "config.json").read_text())["vocab_size"] == n
    text = "To be, or not to be: that is the question."
    assert ours(text, add_special_tokens=False).input_ids == theirs(text, add_special_tokens=False).input_ids
    assert max(ours(text).input_ids) < n
    capsys.readouterr()  # shardlm generate reads the import as it is
    assert shardlm_main(["generate", "--model", str(out), "--prompt", "To be", "--max-new-tokens", "4",
                         "--temperature", "0"]) == 0
    assert capsys.readouterr().out.startswith("To be")
    run = tmp_path / "run"
    code = train_main([f"--model.init_from={out}", f"--data.corpus={small_corpus}",
                       f"--data.dir={tmp_path / 'd'}", "--train.seq_len=32", "--train.global_batch_size=4",
                       "--train.micro_batch_size=4", "--train.steps=2", "--train.warmup_steps=0",
                       "--train.eval_interval=0", "--train.log_interval=1", f"--run.dir={run}",
                       "--run.overwrite=true"])
    assert code == 0, capsys.readouterr().err
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r][-1] == 2
    assert (run / "final" / "config.json").is_file()


def test_gguf_without_tokenizer_metadata_is_one_error(tmp_path, capsys):
    path = write_gguf(tmp_path / "bare.gguf", family_model("qwen2", VOCAB), None)
    err = cli_error(capsys, ["import", "--gguf", str(path), str(tmp_path / "out")])
    assert "no tokenizer metadata" in err and "tokenizer.ggml.tokens" in err, err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("theta,head_dim,factor,low,high,original", [
    (500000.0, 16, 8.0, 1.0, 4.0, 16),  # test_families' Llama: one in-between dimension
    (500000.0, 128, 8.0, 1.0, 4.0, 8192),  # Llama 3.1 8B
    (500000.0, 64, 32.0, 1.0, 4.0, 8192),  # Llama 3.2 1B
    (10000.0, 32, 4.0, 2.0, 8.0, 512),  # low_freq_factor 2: an equivalent (low, high, original) comes back
    (500000.0, 8, 16.0, 1.0, 4.0, 8192),  # no in-between dimension
])
def test_rope_scaling_rebuilt_from_llama_cpp_factors_gives_the_same_frequencies(theta, head_dim, factor, low,
                                                                                high, original):
    from gguf_files import llama_cpp_rope_factors
    from shardlm.convert.gguf_in import rope_scaling_from_factors
    from shardlm.model.config import ModelConfig
    from shardlm.model.decoder import rope_inv_freq

    hp = {"rope_scaling": {"rope_type": "llama3", "rope_theta": theta, "factor": factor,
                           "low_freq_factor": low, "high_freq_factor": high},
          "original_max_position_embeddings": original, "head_dim": head_dim, "hidden_size": head_dim * 2,
          "num_attention_heads": 2}
    original_cfg = ModelConfig(family="llama", dim=head_dim * 2, n_heads=2, rope_theta=theta,
                               rope_scaling_factor=factor, rope_low_freq_factor=low,
                               rope_high_freq_factor=high, rope_original_max_seq_len=original)
    rebuilt = ModelConfig(family="llama", dim=head_dim * 2, n_heads=2, rope_theta=theta)
    rope_scaling_from_factors(llama_cpp_rope_factors(hp), rebuilt, "x.gguf")
    assert rebuilt.rope_scaling_factor == factor
    ours, theirs = rope_inv_freq(rebuilt).double(), rope_inv_freq(original_cfg).double()
    assert ((ours - theirs).abs() / theirs).max().item() < 1e-6
    if low == 1.0 and original == 8192:
        assert (rebuilt.rope_low_freq_factor, rebuilt.rope_high_freq_factor,
                rebuilt.rope_original_max_seq_len) == (low, high, original)


def test_import_errors_are_one_line(small_data, tmp_path, capsys):
    model = family_model("qwen2", VOCAB)
    tok = {**tokenizer_metadata(small_data / "tokenizer.json", "qwen2"), "model": "wordpiece-x"}
    path = write_gguf(tmp_path / "tok.gguf", model, tok)
    err = cli_error(capsys, ["import", "--gguf", str(path), str(tmp_path / "o1")])
    assert "transformers cannot build the tokenizer" in err and "wordpiece-x" in err, err
    good = write_gguf(tmp_path / "good.gguf", model,
                      tokenizer_metadata(small_data / "tokenizer.json", "qwen2"))
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(good.read_bytes()[: good.stat().st_size * 2 // 3])
    err = cli_error(capsys, ["import", "--gguf", str(cut), str(tmp_path / "o2")])
    assert str(cut) in err, err
    model.save_pretrained(str(tmp_path / "hf"))
    weights = tmp_path / "hf" / "model.safetensors"
    weights.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not a header}")
    err = cli_error(capsys, ["import", str(tmp_path / "hf"), str(tmp_path / "o3")])
    assert "not a readable safetensors file" in err and str(weights) in err, err
    assert not any((tmp_path / f"o{i}").exists() for i in (1, 2, 3))
