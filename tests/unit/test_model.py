"""Model shape and configuration checks that need no process group."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from shardlm.config import ConfigError, ModelConfig, load_config
from shardlm.model.decoder import CausalLM, num_params, rotary_tables
from tolerance import EPS, assert_close

ROOT = Path(__file__).resolve().parents[2]


def test_llama3_8b_config_has_8b_parameters():
    cfg = load_config(str(ROOT / "configs/llama3-8b.toml"))
    with torch.device("meta"):
        model = CausalLM(cfg.model)
    assert num_params(model) == 8_030_261_248


def test_hf_parameter_names_and_tying():
    cfg = ModelConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=64, vocab_size=100,
                      max_seq_len=16)
    names = [n for n, _ in CausalLM(cfg).named_parameters()]
    assert names[:3] == ["model.embed_tokens.weight", "model.layers.0.input_layernorm.weight",
                         "model.layers.0.self_attn.q_proj.weight"]
    assert names[-2:] == ["model.norm.weight", "lm_head.weight"]
    cfg.tie_embeddings = True
    tied = CausalLM(cfg)
    assert "lm_head.weight" not in dict(tied.named_parameters())
    tied.to_empty(device="cpu")
    assert tied.lm_head.weight is tied.model.embed_tokens.weight


def test_rotary_tables_match_hf_formula():
    cos, sin = rotary_tables(8, 5, 10000.0)
    inv = 1.0 / (10000.0 ** (torch.arange(0, 8, 2).float() / 8))
    angles = torch.arange(5).float()[:, None] * inv[None, :]
    assert torch.equal(cos, torch.cat([angles, angles], -1).cos())
    assert torch.equal(sin, torch.cat([angles, angles], -1).sin())


def test_init_is_seeded_per_tensor():
    cfg = ModelConfig(dim=32, n_layers=2, n_heads=4, vocab_size=100, max_seq_len=16)
    a, b, c = CausalLM(cfg), CausalLM(cfg), CausalLM(cfg)
    a.init_weights(1), b.init_weights(1), c.init_weights(2)
    for (n, p), (_, q), (_, r) in zip(a.named_parameters(), b.named_parameters(), c.named_parameters()):
        assert torch.equal(p, q), n
        if p.ndim == 2:
            assert not torch.equal(p, r), n


def test_causal_forward_shape_and_masking():
    cfg = ModelConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=1, vocab_size=50, max_seq_len=16)
    model = CausalLM(cfg)
    model.init_weights(0)
    x = torch.randint(0, 50, (2, 10))
    logits = model(x)
    assert logits.shape == (2, 10, 50)
    y = x.clone()
    y[:, 7:] = (y[:, 7:] + 1) % 50  # changing the future must not change the past
    assert_close(model(y)[:, :7], logits[:, :7], rtol=16 * EPS, what="past after a changed future")
    with pytest.raises(ValueError, match="max_seq_len"):
        model(torch.zeros(1, 17, dtype=torch.long))


@pytest.mark.parametrize("override,needle", [
    ("--train.nope=1", "unknown config key 'train.nope'"),
    ("--bogus.x=1", "unknown config section 'bogus'"),
    ("--train.steps=abc", "train.steps: expected an integer"),
    ("--train.lr=true", "train.lr: expected a number"),
    ("--parallel.mode=zero3", "parallel.mode"),
    ("--train.seq_len=2048", "train.seq_len=2048 exceeds"),
    ("--model.n_heads=5", "model.n_heads=5 must divide"),
    ("steps=3", "must look like --section.key=value"),
])
def test_config_errors_name_the_key(override, needle):
    with pytest.raises(ConfigError, match=needle.replace("[", r"\[").replace(".", r"\.")):
        load_config(str(ROOT / "configs/shakespeare-tiny.toml"), [override])


def test_config_precedence_and_types(tmp_path):
    toml = tmp_path / "c.toml"
    toml.write_text('[train]\nsteps = 7\nlr = 1\nbetas = [0.8, 0.9]\n[model]\ntie_embeddings = true\n')
    cfg = load_config(str(toml), ["--train.steps=9"])
    assert cfg.train.steps == 9 and cfg.train.lr == 1.0 and isinstance(cfg.train.lr, float)
    assert cfg.train.betas == (0.8, 0.9) and cfg.model.tie_embeddings is True
    assert cfg.run.name == "c"
    toml.write_text('[train]\nsteps = "many"\n')
    with pytest.raises(ConfigError, match="train.steps"):
        load_config(str(toml))
