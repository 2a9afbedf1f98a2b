"""Metrics: the per-step log and per-rank memory accounting."""

from shardlm.metrics.activations import SavedActivationCounter
from shardlm.metrics.flops import flops_per_token, measure_matmul_flops, mfu, model_flops_per_token
from shardlm.metrics.logger import MetricsLogger, read_metrics
from shardlm.metrics.memory import device_memory, format_bytes, local_bytes, shard_bytes

__all__ = ["MetricsLogger", "SavedActivationCounter", "flops_per_token", "measure_matmul_flops", "mfu",
           "model_flops_per_token", "device_memory", "format_bytes", "local_bytes", "read_metrics", "shard_bytes"]
