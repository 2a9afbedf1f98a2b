"""Configuration: dataclasses with a docstring per field, read from TOML with dotted CLI overrides.

Precedence is command line > TOML file > dataclass defaults, as in torchtitan. Every key is checked: an
unknown section or key, or a value of the wrong type, raises :class:`ConfigError` naming the dotted key. The
sections are in ``sections.py`` (``[parallel]`` in ``parallelism.py``, ``[model]`` is
:class:`~shardlm.model.config.ModelConfig` with its own rules), reading in ``load.py``, the checks in
``checks.py``; every name is importable from here.
"""

from shardlm.config.checks import (
    gradient_accumulation_steps,
    steps_per_generation,
    validate,
    validate_distill,
    validate_preference,
    validate_rl,
)
from shardlm.config.load import apply_init_from, load_config, parse_cli_value
from shardlm.config.parallelism import ParallelConfig
from shardlm.config.sections import (
    KEYWORD_KEYS,
    CheckpointConfig,
    Config,
    DataConfig,
    DataSource,
    DistillConfig,
    LoRAConfig,
    MetricsConfig,
    PreferenceConfig,
    RLConfig,
    RunConfig,
    TrainConfig,
)
from shardlm.errors import ConfigError
from shardlm.model.config import FAMILIES, ModelConfig

__all__ = ["FAMILIES", "KEYWORD_KEYS", "CheckpointConfig", "Config", "ConfigError", "DataConfig",
           "DataSource", "DistillConfig", "LoRAConfig", "MetricsConfig", "ModelConfig", "ParallelConfig",
           "PreferenceConfig", "RLConfig", "RunConfig", "TrainConfig", "apply_init_from",
           "gradient_accumulation_steps", "load_config", "parse_cli_value", "steps_per_generation",
           "validate", "validate_distill", "validate_preference", "validate_rl"]
