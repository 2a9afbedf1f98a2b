"""Process-group start-up from torchrun's environment, and the one place that picks the device.

torchrun sets RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT for each process
(https://pytorch.org/docs/stable/elastic/run.html). Without them (plain ``python``), a one-process
group is created in memory, so the same code runs unchanged.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from shardlm.config import ConfigError, ParallelConfig


class RankFailed(RuntimeError):
    """Raised on every other rank when rank 0 failed inside :func:`run_on_main`; rank 0 reports the cause."""


@dataclass(frozen=True)
class DistInfo:
    """Where this process sits: global rank, rank on its node, world size, device and backend."""

    rank: int
    local_rank: int
    world_size: int
    device: torch.device
    backend: str

    @property
    def is_main(self) -> bool:
        """True on global rank 0, the rank that writes files and prints."""
        return self.rank == 0


def pick_device(requested: str, local_rank: int) -> torch.device:
    """``cuda:<local_rank>`` when CUDA is available (or requested), else ``cpu``.

    Raises:
        ConfigError: ``cuda`` was requested but no CUDA device is visible.
    """
    if requested == "cpu":
        return torch.device("cpu")
    if torch.cuda.is_available():
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    if requested == "cuda":
        raise ConfigError("parallel.device='cuda' but no CUDA device is available")
    return torch.device("cpu")


def pick_backend(device: torch.device, requested: str = "auto", cpu_collectives: bool = False) -> str:
    """The process-group backend for ``device``: nccl on CUDA, gloo on CPU.

    With ``cpu_collectives`` on CUDA (CPU offload: gradient-norm reductions run on CPU tensors) the
    result is ``"cuda:nccl,cpu:gloo"`` so each device type has its own backend. An explicit
    ``requested`` value other than ``auto`` is returned unchanged.
    """
    if requested != "auto":
        return requested
    if device.type == "cuda":
        return "cuda:nccl,cpu:gloo" if cpu_collectives else "nccl"
    return "gloo"


def init_distributed(pcfg: ParallelConfig, cpu_collectives: bool = False) -> DistInfo:
    """Start (or join the already started) default process group and pick this rank's device.

    With ``pcfg.cpu_offload`` (or ``cpu_collectives``) a CUDA run also gets CPU collectives
    (``cuda:nccl,cpu:gloo``), which clipping offloaded gradient shards needs. The collective
    timeout is ``pcfg.timeout_s``: a rank blocked in a collective whose peer has died raises after
    that long instead of hanging.

    Raises:
        ConfigError: a CUDA device was requested but is missing.
    """
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    device = pick_device(pcfg.device, local_rank)
    backend = pick_backend(device, pcfg.backend, cpu_collectives or pcfg.cpu_offload)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        timeout = timedelta(seconds=pcfg.timeout_s)
        if "MASTER_ADDR" in os.environ:
            dist.init_process_group(backend, timeout=timeout)
        else:
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    return DistInfo(dist.get_rank(), local_rank, dist.get_world_size(), device, backend)


def build_mesh(info: DistInfo) -> DeviceMesh:
    """A 1-D device mesh over all ranks, its dimension named ``dp_shard`` (the FSDP shard group)."""
    return init_device_mesh(info.device.type, (info.world_size,), mesh_dim_names=("dp_shard",))


def all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    """Sum ``t`` in place over all ranks and return it (a no-op for one rank)."""
    if dist.get_world_size() > 1:
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def all_gather_ints(value: int, device: torch.device) -> list[int]:
    """Gather one integer from every rank, in rank order."""
    t = torch.tensor([value], dtype=torch.int64, device=device)
    out = [torch.zeros_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t)
    return [int(x.item()) for x in out]


def run_on_main(fn, info: DistInfo):
    """Run ``fn()`` on rank 0 only; if it raises, every rank raises the same error (no rank hangs).

    Returns ``fn()``'s result on rank 0 and None elsewhere.

    Raises:
        RankFailed: on ranks other than 0 when rank 0 failed (rank 0 re-raises its own error).
    """
    result, error = None, None
    if info.is_main:
        try:
            result = fn()
        except Exception as e:  # noqa: BLE001 - re-raised below, after telling the other ranks
            error = e
    message = [f"{type(error).__name__}: {error}" if error is not None else None]
    if info.world_size > 1:
        dist.broadcast_object_list(message, src=0)
    if error is not None:
        raise error
    if message[0] is not None:
        raise RankFailed(f"rank 0 failed: {message[0]}")
    return result


def shutdown() -> None:
    """Destroy the default process group if one is running."""
    if dist.is_initialized():
        dist.destroy_process_group()
