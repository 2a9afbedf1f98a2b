"""The planner: per-rank peak memory and step time of a config, predicted before launching it; ``shardlm
tune`` (``tune_candidates.py``, ``tune_search.py``, ``tune.py``; its torchrun worker is
``shardlm.cli.tune_worker``) measures the FSDP settings it predicts fit and picks the fastest."""

from shardlm.plan.devices import DEVICES, Device, get_device
from shardlm.plan.ledger import PARTS, MemoryPlan
from shardlm.plan.memory import plan_memory

__all__ = ["DEVICES", "PARTS", "Device", "MemoryPlan", "get_device", "plan_memory"]
