"""Checkpoints and model directories."""

from shardlm.checkpoint.hf import (
    ModelDirError, gather_full_state_dict, hf_config, load_model_dir, model_config_from_hf, save_model_dir,
)

__all__ = ["ModelDirError", "gather_full_state_dict", "hf_config", "load_model_dir", "model_config_from_hf",
           "save_model_dir"]
