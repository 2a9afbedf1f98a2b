"""Devices the planner knows: memory, peak matrix throughput and collective bandwidth.

Figures are the vendors' datasheet numbers (dense, no sparsity): NVIDIA H100 SXM (80 GB HBM3,
989 TFLOP/s bf16), H100 with 96 GB HBM3 (the part torchtitan's published Llama 3 runs used; same
compute), H200 SXM (141 GB HBM3e), A100 SXM 80 GB (312 TFLOP/s bf16, 19.5 fp32 / 156 tf32).
Bandwidths are per-GPU bus bandwidths for collectives: NVLink 4 ~450 GB/s per direction (H100/H200),
NVLink 3 ~300 GB/s (A100); across nodes one 400 Gb/s InfiniBand NIC per GPU, ~50 GB/s.
The ``cpu`` entry is nominal (a 2-core machine with gloo over loopback) and only orders magnitudes.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from shardlm.errors import ConfigError

MIB = 1024**2
GIB = 1024**3


@dataclass(frozen=True)
class Device:
    """One accelerator (or the CPU) as the planner sees it."""

    name: str
    """Key used on the command line (``--device``)."""
    memory_bytes: int
    """Memory usable by tensors, in bytes: the total ``nvidia-smi`` reports (HBM less the ECC reserve;
    the 96 GB H100 scaled from the 80 GB part's ratio); the CPU entry uses physical RAM."""
    peak_flops_bf16: float
    """Dense peak FLOP/s for bf16 matrix multiplies."""
    peak_flops_fp32: float
    """Dense peak FLOP/s for fp32 (TF32 on GPUs, as PyTorch uses for matmuls when allowed)."""
    intra_node_bw: float
    """Collective bus bandwidth per rank inside a node, bytes/s."""
    inter_node_bw: float
    """Collective bus bandwidth per rank across nodes, bytes/s."""
    gpus_per_node: int = 8
    """Ranks per node: shard groups larger than this use ``inter_node_bw``."""

    def bandwidth(self, group_size: int) -> float:
        """Bytes/s a collective over ``group_size`` ranks runs at (the slowest link it crosses)."""
        return self.intra_node_bw if group_size <= self.gpus_per_node else self.inter_node_bw


def _cpu_memory() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # pragma: no cover - non-POSIX
        return 16 * GIB


DEVICES: dict[str, Device] = {
    "h100": Device("h100", 81559 * MIB, 989e12, 495e12, 450e9, 50e9),
    "h100-96gb": Device("h100-96gb", 97871 * MIB, 989e12, 495e12, 450e9, 50e9),
    "h200": Device("h200", 143771 * MIB, 989e12, 495e12, 450e9, 50e9),
    "a100-80gb": Device("a100-80gb", 81920 * MIB, 312e12, 156e12, 300e9, 25e9),
    "cpu": Device("cpu", _cpu_memory(), 1e11, 5e10, 5e9, 5e9, gpus_per_node=1 << 30),
}


def get_device(name: str) -> Device:
    """The :class:`Device` called ``name``.

    Raises:
        ConfigError: unknown name (the message lists the known ones).
    """
    if name not in DEVICES:
        raise ConfigError(f"unknown device {name!r} (known: {', '.join(DEVICES)})")
    return DEVICES[name]
