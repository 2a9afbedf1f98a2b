"""Parallelism: the process group, device and backend choice, the device mesh (dist.py); FSDP2 applied to the
model (fsdp.py) and its options (options.py); activation checkpointing and compile (ac.py) and what they save
(saved_activations.py); lost-rank and lost-node diagnosis (faults.py). Building the model is the trainer's
(:mod:`shardlm.train.build`)."""

from shardlm.parallel.ac import apply_ac, apply_compile
from shardlm.parallel.dist import (
    DistInfo,
    all_gather_ints,
    all_reduce_sum,
    build_mesh,
    exit_process,
    init_distributed,
    pick_backend,
    pick_device,
    run_on_main,
    shutdown,
)
from shardlm.parallel.fsdp import apply_fsdp
from shardlm.parallel.options import set_gradient_sync

__all__ = [
    "DistInfo", "all_gather_ints", "all_reduce_sum", "apply_ac", "apply_compile", "apply_fsdp",
    "build_mesh", "exit_process", "init_distributed", "pick_backend", "pick_device", "run_on_main",
    "set_gradient_sync", "shutdown",
]
