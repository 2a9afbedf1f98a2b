"""The configuration package: every name importable from ``shardlm.config`` as before its split, and the
model's own rules checkable on a :class:`ModelConfig` alone, the same rules a run's config applies."""

from __future__ import annotations

import pytest

import shardlm.config
from shardlm.config import Config, ConfigError, ModelConfig, load_config, validate

#: the names that src/, tests/ and bench/ import from ``shardlm.config``
IMPORTED = ["Config", "ConfigError", "DataSource", "LoRAConfig", "ModelConfig", "ParallelConfig",
            "TrainConfig", "apply_init_from", "gradient_accumulation_steps", "load_config", "parse_cli_value",
            "validate"]


def test_every_name_imported_today_is_importable_from_the_package():
    assert not [name for name in IMPORTED if not hasattr(shardlm.config, name)]
    assert set(IMPORTED) <= set(shardlm.config.__all__)
    assert shardlm.config.ParallelConfig.__module__ == "shardlm.config.parallelism"
    assert shardlm.config.Config.__module__ == "shardlm.config.sections"


@pytest.mark.parametrize("fields,message", [
    ({"dim": 0}, "model.dim must be positive, got 0"),
    ({"dim": 64, "n_heads": 3}, "model.n_heads=3 must divide model.dim=64"),
    ({"dim": 64, "n_heads": 4, "n_kv_heads": 3}, "model.n_kv_heads=3 must divide model.n_heads=4"),
    ({"rope_linear_factor": 2.0, "rope_yarn_factor": 4.0}, "one RoPE scaling at a time"),
    ({"n_experts": 4}, "model.n_experts=4: model.family 'llama' is dense"),
])
def test_the_models_rules_on_a_model_config_alone_and_in_a_run_config(fields, message):
    ModelConfig().check()  # the defaults pass
    with pytest.raises(ConfigError, match=message):
        ModelConfig(**fields).check()
    cfg = Config(model=ModelConfig(**fields))
    with pytest.raises(ConfigError, match=message):
        # the run's checks apply the same rule, with the same words
        validate(cfg)
    overrides = [f"--model.{k}={v}" for k, v in fields.items()]
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)
