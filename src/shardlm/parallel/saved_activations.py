"""Saved-activation bytes: what autograd keeps between a forward and its backward.

Counted with ``torch.autograd.graph.saved_tensors_hooks``: every tensor autograd saves for
backward, once per storage, parameters excluded (they are counted as shards). Activation
checkpointing hides what it keeps from those hooks (the inputs of a checkpointed block, and under
selective checkpointing the saved matmul outputs), so :mod:`shardlm.parallel.ac` reports them
through :func:`note_saved` while a counter is active. Recomputation in backward is not counted.
"""

from __future__ import annotations

from typing import Any

import torch

_active: list[SavedActivationCounter] = []


def note_saved(obj: Any) -> None:
    """Count the tensors in ``obj`` (a tensor, or a tuple/list/dict of them) in the active counter, if any."""
    if _active:
        for t in torch.utils._pytree.tree_leaves(obj):
            if isinstance(t, torch.Tensor):
                _active[-1].add(t)


class SavedActivationCounter:
    """Context manager: ``with SavedActivationCounter() as c: loss = model(x)...``; then ``c.bytes``.

    ``bytes`` is the sum of the storage sizes (bytes) of the distinct non-parameter tensors saved
    for backward during the block; a storage shared by several saved views counts once.
    """

    def __init__(self) -> None:
        self.bytes = 0
        self._seen: set[int] = set()
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def add(self, t: torch.Tensor) -> None:
        """Count ``t``'s storage once, unless ``t`` is a parameter (a leaf that requires grad)."""
        if t.is_leaf and t.requires_grad:
            return
        if hasattr(t, "to_local"):
            t = t.to_local()
        try:
            storage = t.untyped_storage()
            key, nbytes = storage.data_ptr(), storage.nbytes()
        except RuntimeError:
            # a wrapper subclass without storage of its own (a pending collective's result under TP)
            key, nbytes = id(t), t.numel() * t.element_size()
        if key not in self._seen:
            self._seen.add(key)
            self.bytes += nbytes

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        self.add(t)
        return t

    def __enter__(self) -> SavedActivationCounter:
        _active.append(self)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._hooks.__exit__(*exc)
        _active.remove(self)
