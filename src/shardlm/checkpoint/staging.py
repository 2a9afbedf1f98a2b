"""Staging for asynchronous saves: a host copy of the training state that the background write reads.

DCP's ``async_save`` stages through an :class:`~torch.distributed.checkpoint.staging.AsyncStager`. Its default
for a ``FileSystemWriter`` (``BlockingAsyncStager`` without the cache) builds the copy with
``_create_cpu_state_dict``, which deep-copies every CPU DTensor (its data included) before replacing the local
tensor by an empty one, and allocates fresh memory at every save; its cache pins memory, which needs an
accelerator. :class:`HostStager` copies each local shard once, into host buffers it keeps from one save to the
next (the page faults of fresh memory are paid at the first save only). That is safe because at most one save
is in flight: the next staging starts only after the previous write has finished
(:meth:`shardlm.checkpoint.dcp.Checkpointer.save`).
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.tensor import DTensor


class HostStager(AsyncStager):
    """Copies a (nested) state dict to host memory: tensors and DTensor local shards into reused buffers.

    Non-tensor leaves (the LR scheduler's numbers, AdamW's parameter-group settings) are deep-copied. A tensor
    on an accelerator is copied to the host with ``.to("cpu")`` (a new tensor each save). ``bytes_staged`` is
    the size of the last copy in bytes.
    """

    _synchronize_after_execute = False  # staging is done when stage() returns

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}
        self.bytes_staged = 0

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """A copy of ``state_dict`` whose tensors live in host memory and share nothing with the originals."""
        self.bytes_staged = 0
        with torch.no_grad():
            return self._copy(state_dict, "")

    def _copy(self, obj: Any, key: str) -> Any:
        if isinstance(obj, DTensor):
            if obj.device.type != "cpu":
                return obj.to("cpu")  # a host DTensor with a fresh local copy (as DCP's own stager makes it)
            local = self._buffer(key, obj.to_local())
            return DTensor.from_local(local, obj.device_mesh, obj.placements, run_check=False,
                                      shape=obj.shape, stride=obj.stride())
        if isinstance(obj, torch.Tensor):
            return obj.to("cpu") if obj.device.type != "cpu" else self._buffer(key, obj)
        if isinstance(obj, dict):
            return {k: self._copy(v, f"{key}.{k}") for k, v in obj.items()}
        if type(obj) in (list, tuple):
            items = [self._copy(v, f"{key}.{i}") for i, v in enumerate(obj)]
            return items if type(obj) is list else tuple(items)
        return copy.deepcopy(obj)

    def _buffer(self, key: str, src: torch.Tensor) -> torch.Tensor:
        """``src`` copied into this key's host buffer (allocated again when its shape or dtype changed)."""
        buf = self._buffers.get(key)
        if buf is None or buf.shape != src.shape or buf.dtype != src.dtype:
            buf = torch.empty(src.shape, dtype=src.dtype)
            self._buffers[key] = buf
        buf.copy_(src)
        self.bytes_staged += buf.numel() * buf.element_size()
        return buf

    def synchronize_staging(self) -> None:
        """Nothing to wait for: :meth:`stage` copies synchronously."""

    def close(self) -> None:
        """Free the host buffers."""
        self._buffers = {}
