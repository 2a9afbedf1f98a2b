"""Distribution: process group, device mesh, and applying FSDP2 to the model."""

from shardlm.parallel.dist import (
    DistInfo, RankFailed, all_gather_ints, all_reduce_sum, build_mesh, exit_process, init_distributed, pick_backend,
    pick_device, run_on_main, shutdown,
)
from shardlm.parallel.ac import apply_ac, apply_compile
from shardlm.parallel.fsdp import apply_fsdp, build_model, unwrap
from shardlm.parallel.options import set_gradient_sync

__all__ = [
    "DistInfo", "RankFailed", "all_gather_ints", "all_reduce_sum", "apply_ac", "apply_compile", "apply_fsdp",
    "build_mesh", "build_model", "exit_process", "init_distributed", "pick_backend", "pick_device", "run_on_main",
    "set_gradient_sync", "shutdown", "unwrap",
]
