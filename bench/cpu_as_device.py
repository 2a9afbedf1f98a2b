"""The CPU reported as the accelerator, for running torchtitan's unmodified trainer on a CPU
(``bench/torchtitan_cpu.py`` for 0.2.2, ``bench/torchtitan03_cpu.py`` for 0.3.0; a benchmark helper, not
part of shardlm). torchtitan reads the device type and its ``torch.cuda``-style module through
``torch._utils`` when it is imported, so :func:`report_cpu_as_device` must run before the first
``import torchtitan``.
"""

from __future__ import annotations

import os
import types

import torch
import torch._utils as torch_utils


class CpuAsDevice(types.ModuleType):
    """``torch.cpu`` plus the ``torch.cuda``-style calls torchtitan makes (no-ops on a CPU; the memory is the
    machine's RAM in bytes)."""

    def __getattr__(self, name):
        return getattr(torch.cpu, name)

    def get_device_name(self, *args, **kwargs):
        return "cpu"

    def get_device_properties(self, *args, **kwargs):
        return types.SimpleNamespace(total_memory=os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"),
                                     name="cpu")

    def memory_stats(self, *args, **kwargs):
        return {}

    def reset_peak_memory_stats(self, *args, **kwargs):
        pass

    def empty_cache(self, *args, **kwargs):
        pass

    def set_device(self, *args, **kwargs):
        pass

    def current_device(self, *args, **kwargs):
        return 0

    def device_count(self, *args, **kwargs):
        return 1

    def synchronize(self, *args, **kwargs):
        pass


def report_cpu_as_device() -> None:
    """Make ``torch._utils`` report ``cpu`` as the available device type, with :class:`CpuAsDevice` as its
    module (other device types keep their own)."""
    cpu_module = CpuAsDevice("cpu_as_device")
    get_device_module = torch_utils._get_device_module
    torch_utils._get_available_device_type = lambda: "cpu"
    torch_utils._get_device_module = lambda device_type="cpu": (
        cpu_module if device_type == "cpu" else get_device_module(device_type))
