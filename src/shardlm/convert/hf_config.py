"""The old home of :mod:`shardlm.model.hf_config` (HF ``config.json`` <-> ``ModelConfig``), which moved
below the configuration that reads it: its names stay importable from here."""

from shardlm.model.hf_config import (
    hf_config,
    model_config_from_hf_dict,
    read_model_dir_config,
    rope_scaling_out,
    written_special_ids,
)

__all__ = ["hf_config", "model_config_from_hf_dict", "read_model_dir_config", "rope_scaling_out",
           "written_special_ids"]
