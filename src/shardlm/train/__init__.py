"""The training job: optimizer, schedule, the training step and the loop."""

from shardlm.train.trainer import NonFiniteError, Trainer, data_dir, prepare_data, run_dir

__all__ = ["NonFiniteError", "Trainer", "data_dir", "prepare_data", "run_dir"]
