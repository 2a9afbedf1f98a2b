"""Metrics: the per-step log and per-rank memory accounting."""

from shardlm.metrics.logger import MetricsLogger, read_metrics
from shardlm.metrics.memory import device_memory, format_bytes, local_bytes, shard_bytes

__all__ = ["MetricsLogger", "device_memory", "format_bytes", "local_bytes", "read_metrics", "shard_bytes"]
