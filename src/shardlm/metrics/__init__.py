"""Metrics: the per-step log (``metrics.jsonl``, TensorBoard, W&B and MLflow trackers), FLOPs and MFU,
per-rank memory, overlap and reports."""

from shardlm.metrics.flops import flops_per_token, measure_matmul_flops, mfu, model_flops_per_token
from shardlm.metrics.logger import MetricsLogger, read_metrics
from shardlm.metrics.memory import device_memory, format_bytes, local_bytes, shard_bytes

__all__ = ["MetricsLogger", "flops_per_token", "measure_matmul_flops", "mfu", "model_flops_per_token",
           "device_memory", "format_bytes", "local_bytes", "read_metrics", "shard_bytes"]
