"""The model-family registry (``shardlm.model.families``): a family that the existing traits express needs
only a registry entry, and everything downstream (the decoder, ``config.json`` both ways, GGUF names, the
configuration checks, the planner) follows it; the registry refuses clashes and an unregistered family
by name."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from shardlm.config import ConfigError, load_config
from shardlm.convert.gguf_in import hf_name
from shardlm.convert.hf_config import hf_config, model_config_from_hf_dict
from shardlm.errors import ModelDirError
from shardlm.model import families
from shardlm.model.config import ModelConfig
from shardlm.model.decoder import CausalLM
from shardlm.model.families.registry import unregister
from shardlm.plan.activations import block_saved_none, shape_of
from tolerance import EPS, assert_close

#: a toy family: Qwen3's q/k norms plus Qwen2's q/k/v biases, under names no other family uses
TOY = families.Family("toy", "toy_lm", "ToyForCausalLM", qkv_bias=True, qk_norm=True,
                      hf_false_flags=("mlp_bias",), gguf_architecture="toy")


@pytest.fixture
def toy():
    families.register(TOY)
    yield TOY
    unregister(TOY.name)


def small(family: str, **kw) -> ModelConfig:
    return ModelConfig(family=family, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=48,
                       vocab_size=64, max_seq_len=16, **kw)


def test_a_toy_family_needs_only_a_registry_entry(toy):
    cfg = small("toy")
    assert cfg.arch is TOY
    # the decoder builds its traits: q/k/v biases and q/k norms; with zero biases it is Qwen3
    model = CausalLM(cfg)
    names = {n for n, _ in model.named_parameters()}
    assert (
        "model.layers.0.self_attn.q_proj.bias" in names and "model.layers.0.self_attn.k_norm.weight" in names
    )
    model.init_weights(seed=3)
    qwen3 = CausalLM(small("qwen3"))
    qwen3.init_weights(seed=3)  # the same values for the same names: the toy has only the (zero) biases more
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert_close(model(tokens), qwen3(tokens), rtol=16 * EPS, what="toy vs qwen3")
        model.model.layers[0].self_attn.v_proj.bias.fill_(0.5)
        assert (model(tokens) - qwen3(tokens)).abs().max() > 1e-3
    # config.json both ways, in the toy's names
    written = hf_config(cfg, {"bos": 1, "eos": 2})
    assert written["model_type"] == "toy_lm" and written["architectures"] == ["ToyForCausalLM"]
    assert (
        written["hidden_act"] == "silu" and written["mlp_bias"] is False and "attention_bias" not in written
    )
    assert model_config_from_hf_dict(written) == cfg
    with pytest.raises(ModelDirError, match="mlp_bias=true is not supported for toy_lm"):
        model_config_from_hf_dict({**written, "mlp_bias": True})
    # GGUF names, the configuration checks and the planner
    assert hf_name("blk.1.attn_q_norm.weight", "toy") == "model.layers.1.self_attn.q_norm.weight"
    assert families.by_gguf_architecture("toy", "x.gguf") is TOY
    with pytest.raises(ConfigError,
                       match="model.sliding_window applies to model.family 'mistral' or 'gemma3' "
                                          r"or 'mixtral' or 'gpt_oss' \(family is 'toy'\)"):
        load_config(None, ["--model.family=toy", "--model.sliding_window=8"])
    assert load_config(None, ["--model.family=toy"]).model.arch is TOY
    qwen3 = shape_of(small("qwen3"), 1, 16, 4)
    assert shape_of(cfg, 1, 16, 4) == qwen3 and block_saved_none(qwen3) > block_saved_none(
        shape_of(small("llama"), 1, 16, 4)
    )


def test_the_registry_refuses_clashes_and_unknown_names():
    assert list(families.FAMILIES) == ["llama", "qwen2", "qwen3", "mistral", "gemma3", "qwen3_moe", "mixtral",
                                      "gpt_oss"]
    with pytest.raises(ValueError, match="model_type 'qwen2' is already registered by 'qwen2'"):
        families.register(dataclasses.replace(TOY, model_type="qwen2"))
    with pytest.raises(ValueError, match="gguf_architecture 'llama' is already registered by 'llama'"):
        families.register(dataclasses.replace(TOY, gguf_architecture="llama"))
    assert "toy" not in families.FAMILIES
    with pytest.raises(ConfigError,
                       match=r"model.family: 'toy' is not one of \['llama', 'qwen2', 'qwen3', 'mistral', "
                                          r"'gemma3', 'qwen3_moe', 'mixtral', 'gpt_oss'\]"):
        load_config(None, ["--model.family=toy"])
    with pytest.raises(ModelDirError, match="model_type='toy_lm'.*not built"):
        model_config_from_hf_dict({"model_type": "toy_lm"})
    with pytest.raises(ModelDirError,
                       match="general.architecture='mistral'; the GGUF architectures built are "
                                            "llama, qwen2, qwen3, gemma3"):
        families.by_gguf_architecture("mistral", "m.gguf")


def help_text(argv: list[str], capsys) -> str:
    """What ``shardlm ARGV`` prints (a help: it exits 0), its whitespace folded to single spaces."""
    from shardlm.cli.main import main

    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 0
    return " ".join(capsys.readouterr().out.split())


def test_the_help_lists_every_registered_family(toy, capsys):
    """``shardlm --help`` names every family ``shardlm import`` reads (from the registry, so a new one is
    listed: the toy too), and ``import --help`` the GGUF architectures; before, five of eight were
    written out by hand."""
    text = help_text(["--help"], capsys)
    hf = ", ".join(families.FAMILIES)
    assert len(families.FAMILIES) == len(families.BUILT) + 1 and f"(families: {hf})" in text
    assert "gpt_oss" in text and "mixtral" in text and "qwen3_moe" in text and "toy" in text
    gguf = help_text(["import", "--help"], capsys)
    assert "GGUF file (families: llama, qwen2, qwen3, gemma3, toy;" in gguf


@pytest.mark.parametrize("family,pattern,experts", [("gpt_oss", 0, 4), ("gpt_oss", 3, 4), ("mistral", 2, 0),
                                                    ("mixtral", 2, 4)])
def test_a_window_layout_the_export_cannot_express_is_refused(family, pattern, experts):
    """gpt-oss's config.json alternates sliding / full layers (pattern 2) and Mistral's / Mixtral's has every
    layer local (pattern 0): any other pattern would train a model its own export could not load."""
    cfg = ModelConfig(family=family, dim=32, n_layers=4, n_heads=4, ffn_hidden=64, vocab_size=64,
                      max_seq_len=64, sliding_window=8, sliding_window_pattern=pattern, n_experts=experts)
    with pytest.raises(ConfigError, match=f"model.family '{family}' with model.sliding_window builds "
                                          r"model.sliding_window_pattern = [02] .* not " + str(pattern)):
        cfg.check()
    ModelConfig(**{**cfg.__dict__, "sliding_window_pattern": 2 if family == "gpt_oss" else 0}).check()
