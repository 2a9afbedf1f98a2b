"""Devices the planner and MFU know (a leaf: imports only the error types): memory, dense peak matrix
throughput per precision, collective bandwidth.

Peaks are the vendors' datasheet numbers, dense (the datasheets print sparse figures twice as high):

| device | bf16 | TF32 | fp32 (no tensor cores) | fp8 | memory | memory bandwidth | source |
|---|---|---|---|---|---|---|---|
| H100 SXM | 989 TFLOP/s | 495 | 67 | 1979 | 80 GB HBM3 | 3.35 TB/s | NVIDIA H100 Tensor Core GPU datasheet |
| H100 PCIe | 756 | 378 | 51 | 1513 | 80 GB HBM2e | 2.0 TB/s | same datasheet |
| H100 96 GB (torchtitan's runs) | 989 | 495 | 67 | 1979 | 96 GB HBM3 | 3.35 TB/s | H100 SXM's (assumed) |
| H200 SXM | 989 | 495 | 67 | 1979 | 141 GB HBM3e | 4.8 TB/s | NVIDIA H200 datasheet |
| A100 SXM 80 GB | 312 | 156 | 19.5 | none | 80 GB HBM2e | 2.039 TB/s | NVIDIA A100 datasheet |
| B200 (HGX) | 2250 | 1100 | 75 | 4500 | 180 GB HBM3e | 8 TB/s | NVIDIA HGX B200 datasheet, per GPU |

The memory bandwidth is what a memory-bound decode step reads its weights and KV cache at (the planner's
rollout time, :mod:`shardlm.plan.rollout`).

The fp8 column is the dense float8 tensor-core peak (e4m3/e5m2; on B200 MXFP8 runs at the same rate): the
GEMMs of ``train.float8``'s converted layers run against it, the rest at bf16's.

Which peak applies is the precision that runs (:func:`shardlm.parallel.dist.compute_precision`): bf16
compute, fp32 with TF32 (the default on CUDA), or fp32 without it (``parallel.tf32 = false``).
Bandwidths are per-GPU bus bandwidths for collectives: NVLink 4 ~450 GB/s per direction (H100/H200),
NVLink 3 ~300 GB/s (A100), NVLink 5 ~900 GB/s (B200); across nodes one 400 Gb/s InfiniBand NIC per GPU,
~50 GB/s. The ``cpu`` entry is nominal (a 2-core machine with gloo over loopback, 20 GB/s of DRAM bandwidth)
and only orders magnitudes; MFU on a CPU uses a measured peak instead (``shardlm/train/mfu.py``).
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
    peak_flops_tf32: float
    """Dense peak FLOP/s for fp32 matrix multiplies run as TF32 on tensor cores (PyTorch with
    TF32 allowed)."""
    peak_flops_fp32: float
    """Dense peak FLOP/s for fp32 without TF32 (the CUDA cores' fp32 rate)."""
    intra_node_bw: float
    """Collective bus bandwidth per rank inside a node, bytes/s."""
    inter_node_bw: float
    """Collective bus bandwidth per rank across nodes, bytes/s."""
    gpus_per_node: int = 8
    """Ranks per node: shard groups larger than this use ``inter_node_bw``."""
    peak_flops_fp8: float = 0.0
    """Dense peak FLOP/s for float8 matrix multiplies (0: no float8 tensor cores)."""
    memory_bandwidth: float = 0.0
    """Device memory (HBM; the CPU's DRAM) bandwidth, bytes/s (0: unknown)."""

    def peak_flops(self, precision: str) -> float:
        """Dense peak FLOP/s for ``precision``: ``"bf16"``, ``"tf32"``, ``"fp32"`` or ``"fp8"`` (0 on a device
        without float8 tensor cores).

        Raises:
            ValueError: another precision name.
        """
        peaks = {"bf16": self.peak_flops_bf16, "tf32": self.peak_flops_tf32, "fp32": self.peak_flops_fp32,
                 "fp8": self.peak_flops_fp8}
        if precision not in peaks:
            raise ValueError(f"unknown precision {precision!r} (known: {', '.join(peaks)})")
        return peaks[precision]

    def bandwidth(self, group_size: int) -> float:
        """Bytes/s a collective over ``group_size`` ranks runs at (the slowest link it crosses)."""
        return self.intra_node_bw if group_size <= self.gpus_per_node else self.inter_node_bw


def _cpu_memory() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # pragma: no cover - non-POSIX
        return 16 * GIB


DEVICES: dict[str, Device] = {
    "h100": Device("h100", 81559 * MIB, 989e12, 495e12, 67e12, 450e9, 50e9, peak_flops_fp8=1979e12,
                   memory_bandwidth=3.35e12),
    "h100-pcie": Device("h100-pcie", 81559 * MIB, 756e12, 378e12, 51e12, 300e9, 50e9, peak_flops_fp8=1513e12,
                        memory_bandwidth=2.0e12),
    "h100-96gb": Device("h100-96gb", 97871 * MIB, 989e12, 495e12, 67e12, 450e9, 50e9, peak_flops_fp8=1979e12,
                        memory_bandwidth=3.35e12),
    "h200": Device("h200", 143771 * MIB, 989e12, 495e12, 67e12, 450e9, 50e9, peak_flops_fp8=1979e12,
                   memory_bandwidth=4.8e12),
    "a100-80gb": Device("a100-80gb", 81920 * MIB, 312e12, 156e12, 19.5e12, 300e9, 25e9,
                        memory_bandwidth=2.039e12),
    "b200": Device("b200", 183359 * MIB, 2250e12, 1100e12, 75e12, 900e9, 50e9, peak_flops_fp8=4500e12,
                   memory_bandwidth=8e12),
    "cpu": Device("cpu", _cpu_memory(), 1e11, 5e10, 5e10, 5e9, 5e9, gpus_per_node=1 << 30,
                  memory_bandwidth=2e10),
}

#: substrings of ``torch.cuda.get_device_name()`` -> key of :data:`DEVICES`, most specific first
#: (e.g. "NVIDIA H100 80GB HBM3" is the SXM part, "NVIDIA H100 PCIe" the PCIe card, "NVIDIA H200",
#: "NVIDIA A100-SXM4-80GB", "NVIDIA B200")
CUDA_NAMES: tuple[tuple[str, str], ...] = (
    ("h100 pcie", "h100-pcie"), ("h100 nvl", "h100-pcie"), ("h100", "h100"), ("h200", "h200"),
    ("a100", "a100-80gb"), ("b200", "b200"),
)


def device_for_cuda_name(name: str) -> Device | None:
    """The :class:`Device` whose datasheet covers the GPU called ``name`` (``torch.cuda.get_device_name()``),
    or None for a GPU not in the table."""
    lowered = name.lower()
    for part, key in CUDA_NAMES:
        if part in lowered:
            return DEVICES[key]
    return None


def get_device(name: str) -> Device:
    """The :class:`Device` called ``name``.

    Raises:
        ConfigError: unknown name (the message lists the known ones).
    """
    if name not in DEVICES:
        raise ConfigError(f"unknown device {name!r} (known: {', '.join(DEVICES)})")
    return DEVICES[name]
