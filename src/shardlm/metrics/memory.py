"""Per-rank memory accounting: bytes of local shards, the allocator's peaks on GPU, the process's RSS
on CPU."""

from __future__ import annotations

import os
import resource
import sys

import torch
from torch import nn


def local_bytes(t: torch.Tensor) -> int:
    """Bytes this rank stores for ``t``: ``to_local().numel() × element_size`` for a DTensor; for a tensor
    subclass that wraps others (torchao's NF4 codes and scales), the bytes of the tensors inside it."""
    if hasattr(t, "to_local"):
        t = t.to_local()
    if hasattr(t, "__tensor_flatten__"):  # plain tensors and Parameters do not define it
        names, _ = t.__tensor_flatten__()
        return sum(local_bytes(getattr(t, n)) for n in names)
    return t.numel() * t.element_size()


def shard_bytes(model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict[str, int]:
    """Local parameter, gradient and optimizer-state bytes on this rank.

    Returns a dict with ``params``, ``grads``, ``optimizer`` and ``total`` (bytes). Tied parameters
    count once. Under FSDP each is about 1/N of the model's; under DDP or one process, all of it.
    """
    params = list(model.parameters())
    out = {
        "params": sum(local_bytes(p) for p in params),
        "grads": sum(local_bytes(p.grad) for p in params if p.grad is not None),
        "optimizer": 0,
    }
    if optimizer is not None:
        for state in optimizer.state.values():
            out["optimizer"] += sum(local_bytes(v) for v in state.values() if isinstance(v, torch.Tensor))
    out["total"] = out["params"] + out["grads"] + out["optimizer"]
    return out


def expected_shard_bytes(model: nn.Module) -> dict[str, int]:
    """:func:`shard_bytes` as it reads after an AdamW step, known before the first one: gradients shaped and
    typed like their parameters, AdamW's two moments likewise plus a 4-byte step count per parameter (fused
    AdamW keeps it as a 0-dim fp32 tensor)."""
    params = [p for p in model.parameters()]
    trained = [p for p in params if p.requires_grad]
    out = {"params": sum(local_bytes(p) for p in params), "grads": sum(local_bytes(p) for p in trained),
           "optimizer": sum(2 * local_bytes(p) + 4 for p in trained)}
    out["total"] = out["params"] + out["grads"] + out["optimizer"]
    return out


def process_rss_bytes() -> int:
    """Resident set size of this process now, in bytes (``/proc/self/statm``; peak RSS where that
    is missing)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:  # not Linux: the peak (ru_maxrss is KiB on Linux and BSD, bytes on macOS)
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak if sys.platform == "darwin" else peak * 1024


def device_memory(device: torch.device) -> dict[str, int]:
    """What users mean by per-rank memory: on CUDA the allocator's peak allocated and reserved bytes since the
    last :func:`reset_device_peaks`; on CPU the process's resident set size (``rss_bytes``)."""
    if device.type != "cuda":
        return {"rss_bytes": process_rss_bytes()}
    return {
        "max_allocated_bytes": torch.cuda.max_memory_allocated(device),
        "max_reserved_bytes": torch.cuda.max_memory_reserved(device),
    }


def reset_device_peaks(device: torch.device) -> None:
    """Start a new peak-memory interval (``torch.cuda.reset_peak_memory_stats``) on CUDA; a no-op on CPU.

    The trainer calls it after each logged record, so each record's ``max_allocated_bytes`` /
    ``max_reserved_bytes`` is the peak of its own logging interval, not of the whole run. Host-side only:
    no device synchronisation.
    """
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def format_bytes(n: float) -> str:
    """Human-readable binary size: 1536 -> '1.5 KiB'."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"  # pragma: no cover
