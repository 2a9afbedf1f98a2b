"""The replay's bookkeeping and its result: the parts of the breakdown (:data:`PARTS`), a :class:`Ledger` of
the bytes alive in each and the peak it has seen, and the :class:`MemoryPlan` that
:func:`shardlm.plan.memory.plan_memory` returns (all in bytes, per rank)."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

PARTS = ("params", "grads", "optimizer", "all_gather", "reduce_scatter", "activations", "temporaries",
         "buffers", "reference", "rollout")
"""Categories of the breakdown, in display order."""


@dataclass
class MemoryPlan:
    """Predicted per-rank peak of one step: ``peak`` bytes, its ``breakdown`` and where it happens."""

    peak: int
    breakdown: dict[str, int]
    phase: str
    host_bytes: int = 0
    """Bytes kept in host memory instead (CPU offload on a GPU): sharded params, grads, AdamW state."""
    params: int = 0
    """Number of model parameters P (tied weights once)."""
    micro_batches: int = 1
    notes: list[str] = field(default_factory=list)
    highs: dict[str, int] = field(default_factory=dict)
    """The total at the high point of named phases, when it is not the peak's (``rollout``: online RL's)."""


class Ledger:
    """Bytes alive per category; remembers the largest total and the breakdown at that moment."""

    def __init__(self, device_excludes: set[str]) -> None:
        self.now: dict[str, int] = defaultdict(int)
        self.peak, self.at, self.phase = 0, {}, ""
        self.excluded = device_excludes
        self.highs: dict[str, int] = {}

    def total(self) -> int:
        """Bytes alive on the device now (the parts not excluded)."""
        return sum(v for k, v in self.now.items() if k not in self.excluded)

    def mark(self, name: str) -> None:
        """Remember the total now as the high point of the phase ``name`` if it is the highest seen."""
        self.highs[name] = max(self.highs.get(name, 0), self.total())

    def add(self, part: str, nbytes: int, phase: str) -> None:
        self.now[part] += nbytes
        total = self.total()
        if total > self.peak:
            self.peak, self.phase = total, phase
            self.at = {k: (0 if k in self.excluded else self.now.get(k, 0)) for k in PARTS}

    def free(self, part: str, nbytes: int) -> None:
        self.now[part] -= nbytes
