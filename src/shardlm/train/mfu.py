"""The peak FLOP/s that MFU (model FLOPs utilisation) is measured against, per rank.

MFU = model FLOPs per step ÷ (step time × peak FLOP/s), per rank (PaLM, Chowdhery et al. 2022, appendix B;
FLOPs per token from :func:`shardlm.metrics.flops.model_flops_per_token`). The peak has to be the one of
the precision that actually runs (:func:`shardlm.parallel.dist.compute_precision`), or MFU means nothing:

1. ``train.peak_flops`` when set (> 0): the user's figure;
2. on a GPU in the datasheet table (:data:`shardlm.devices.DEVICES`: H100 SXM/PCIe, H200, A100, B200),
   its dense peak for bf16, TF32 or fp32;
3. on a CPU its nominal peak in that precision (:func:`shardlm.metrics.flops.cpu_peak`): the cores this rank
   runs on (its threads, at most the available cores shared by the node's ranks) x the nominal clock x the
   FLOPs per cycle of its widest vector instructions (or bf16 instructions; fp32 for the fp32-multiply
   kernel). A fixed, stated figure: the same run gives the same MFU whatever else the machine runs at start-up
   (a measured peak swung 3x there);
4. otherwise (an unknown GPU, or a CPU whose clock cannot be read) a rate measured once at start-up with large
   matrix products in that precision and with the kernel training uses
   (:func:`shardlm.metrics.flops.measure_matmul_flops`), all ranks measuring together, as they train.

Under ``train.float8`` the peak stays the one of the compute precision (bf16), as torchtitan states MFU under
float8: the float8 GEMMs can take MFU past what bf16 allows, so float8 and bf16 runs compare on tokens/s (the
peak's ``source`` says so).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from shardlm.config import Config
from shardlm.devices import device_for_cuda_name
from shardlm.metrics.flops import cpu_peak, measure_matmul_flops
from shardlm.model.cpu_matmul import use_fp32_matmul
from shardlm.parallel.dist import DistInfo, compute_precision, local_world_size

#: (device, precision, fp32 multiply, world size) -> measured FLOP/s: one measurement per process and setting
_MEASURED: dict[tuple, float] = {}


@dataclass(frozen=True)
class PeakFlops:
    """The peak of one rank: ``flops`` (FLOP/s), the ``precision`` it is for, and where it came from."""

    flops: float
    precision: str
    source: str


def peak_flops_per_rank(cfg: Config, info: DistInfo, seconds: float = 0.5) -> PeakFlops:
    """The MFU peak for ``cfg`` on this rank (see the module docstring for the order).

    A measurement (case 3) is a collective (barriers around it): every rank must call this at the same point.
    It is done once per process and setting, so several trainers in one process share it.
    """
    peak = _peak_flops_per_rank(cfg, info, seconds)
    if cfg.train.float8 == "none":
        return peak
    return PeakFlops(peak.flops, peak.precision, f"{peak.source}; float8 GEMMs counted against this "
                     "peak, as torchtitan does: compare float8 runs on tokens/s")


def _peak_flops_per_rank(cfg: Config, info: DistInfo, seconds: float) -> PeakFlops:
    """:func:`peak_flops_per_rank` before the float8 note."""
    precision = compute_precision(info.device, cfg.parallel)
    if cfg.train.peak_flops > 0:
        return PeakFlops(cfg.train.peak_flops, precision, "train.peak_flops")
    if info.device.type == "cuda":
        known = device_for_cuda_name(torch.cuda.get_device_name(info.device))
        if known is not None:
            return PeakFlops(known.peak_flops(precision), precision, f"{known.name} datasheet")
    fp32_multiply = use_fp32_matmul(cfg.parallel.cpu_bf16_matmul, info.device, cfg.parallel.param_dtype)
    if info.device.type == "cpu":
        nominal = cpu_peak(precision, fp32_multiply, cpu_cores_per_rank())
        if nominal is not None:
            return PeakFlops(nominal.flops, precision, nominal.describe())
    key = (str(info.device), precision, fp32_multiply, info.world_size)
    if key not in _MEASURED:
        dtype = torch.bfloat16 if precision == "bf16" else torch.float32
        size = 8192 if info.device.type == "cuda" else 1024
        _MEASURED[key] = measure_matmul_flops(info.device, dtype, size=size, seconds=seconds,
                                              fp32_multiply=fp32_multiply)
    kernel = " (bf16 operands multiplied in fp32)" if fp32_multiply else ""
    return PeakFlops(_MEASURED[key], precision, f"measured on {info.device.type}{kernel}")


def cpu_cores_per_rank() -> int:
    """Cores one rank computes on: its threads (``torch.get_num_threads``, OMP_NUM_THREADS), at most the cores
    this process may use divided among the node's ranks; at least 1."""
    try:
        available = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        available = os.cpu_count() or 1
    return max(1, min(torch.get_num_threads(), available // max(1, local_world_size())))
