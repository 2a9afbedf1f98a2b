"""The device table under its old name: :mod:`shardlm.devices` (a leaf below both the planner and the
trainer's MFU), re-exported for code and tests that import it from here."""

from shardlm.devices import CUDA_NAMES, DEVICES, GIB, MIB, Device, device_for_cuda_name, get_device

__all__ = ["CUDA_NAMES", "DEVICES", "GIB", "MIB", "Device", "device_for_cuda_name", "get_device"]
