"""Merged and PEFT exports in one process: a QLoRA merge records its base and can use the original weights, a
merge into the original needs a pretrained base, and ``--format peft`` refuses a model directory. The README's
LoRA example and its exports are in tests/dist/test_exports.py."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from conftest import cli_error
from shardlm.config import load_config
from shardlm.convert.hf_in import load_model_dir
from shardlm.convert.hf_out import save_model_dir
from shardlm.convert.peft_out import MERGE_RECORD, gather_full_params, merge_lora, save_merged_dir
from shardlm.errors import ConfigError
from shardlm.model.lora import LoRASpec, lora_modules
from shardlm.parallel.dist import DistInfo
from shardlm.train.build import build_model
from tolerance import EPS, assert_close

# ---- in this process -----------------------------------------------------------------------------------
TINY = ["--model.dim=64", "--model.n_layers=2", "--model.n_heads=4", "--model.n_kv_heads=2",
        "--model.ffn_hidden=128", "--model.vocab_size=512", "--model.max_seq_len=64",
        "--parallel.mode=single", "--train.seq_len=32"]
ONE = DistInfo(0, 0, 1, torch.device("cpu"), "gloo")


def test_qlora_merge_records_its_base_and_can_use_the_original_weights(tmp_path):
    """A QLoRA merge goes into the dequantised NF4 base by default (the trained model exactly) and says so in
    ``lora_merge.json``; ``lora.merge_into = original_base`` merges into ``model.init_from``'s bf16 weights,
    recorded as approximate."""
    pytest.importorskip("torchao", reason="pip install -e '.[qlora]'")
    base, _ = build_model(load_config(None, TINY), ONE, None)
    original = {n: p.detach().to(torch.bfloat16) for n, p in base.named_parameters()}  # a 16-bit original
    src = save_model_dir(original, base.cfg, tmp_path / "base")
    cfg = load_config(None, TINY + [f"--model.init_from={src}", "--lora.enabled=true", "--lora.rank=4",
                                    "--lora.alpha=8.0", "--lora.base_dtype=nf4"])
    model, _ = build_model(cfg, ONE, None)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for _, m in lora_modules(model):
            m.lora_B.weight.copy_(torch.randn(m.lora_B.weight.shape, generator=gen) * 0.05)
    state = gather_full_params(model, True)
    spec = LoRASpec(4, 8.0, 0.0, cfg.lora.targets, "nf4")
    tokens = torch.randint(0, 512, (2, 16), generator=gen)
    with torch.no_grad():
        want = model(tokens)
    exact = save_merged_dir(state, cfg.model, spec, "training_base", str(src), tmp_path / "exact", None, None)
    approx = save_merged_dir(state, cfg.model, spec, "original_base", str(src), tmp_path / "approx", None,
                             None)
    assert json.loads((tmp_path / "exact" / MERGE_RECORD).read_text()) == exact
    assert (
        exact["merged_into"] == "training_base" and not exact["approximate"] and "NF4" in exact["description"]
    )
    assert approx["merged_into"] == "original_base" and approx["approximate"]
    assert approx["init_from"] == str(src.resolve()) and "approximate" in approx["description"]
    with torch.no_grad():
        got_exact, got_approx = (
            load_model_dir(tmp_path / "exact")(tokens),
            load_model_dir(tmp_path / "approx")(tokens),
        )
    assert_close(got_exact, want, rtol=64 * EPS, what="merged into the NF4 base")
    merged = load_file(tmp_path / "approx" / "model.safetensors")
    adapters = {k: v for k, v in state.items() if ".lora_" in k}
    expected = merge_lora({**{k: v.float() for k, v in original.items()}, **adapters}, 8.0 / 4)
    q = "model.layers.0.self_attn.q_proj.weight"
    assert torch.equal(merged[q], expected[q]) and torch.equal(merged["model.norm.weight"],
                                                               expected["model.norm.weight"])
    diff = (got_approx - want).abs().max().item()
    print("MEASURED QLoRA merged into the original bf16 weights vs the trained model, max logit diff: "
          f"{diff:.3g}")
    assert diff > 1e-4  # the NF4 rounding the adapters were trained against is gone: an approximation


def test_merge_into_original_needs_a_pretrained_base_and_may_change_at_resume():
    from shardlm.checkpoint.resume_config import TAKES_EFFECT, config_changes

    with pytest.raises(ConfigError, match=r"lora.merge_into='original_base' needs model.init_from"):
        load_config(None, TINY + ["--lora.enabled=true", "--lora.merge_into=original_base"])
    old = load_config(None, TINY + ["--lora.enabled=true"]).to_dict()
    new = json.loads(json.dumps(old))
    new["lora"]["merge_into"] = "original_base"
    (change,) = config_changes(old, new)
    assert change.key == "lora.merge_into" and change.rule == TAKES_EFFECT


def test_export_format_peft_refuses_a_model_directory(tmp_path, capsys):
    base, _ = build_model(load_config(None, TINY), ONE, None)
    src = save_model_dir(dict(base.named_parameters()), base.cfg, tmp_path / "model")
    err = cli_error(capsys, ["export", str(src), str(tmp_path / "out"), "--format", "peft"])
    assert "export a LoRA checkpoint" in err and "final-adapter/" in err
