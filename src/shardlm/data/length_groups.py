"""Length-grouped sampling (``data.group_by_length_steps``): global batches of samples of similar length, so
that a micro-batch padded to its longest sample computes little padding.

The order is :class:`~shardlm.data.loader.GlobalBatchSampler`'s, regrouped ``k`` steps at a time (a *group*
of ``k · G`` consecutive positions of its stream, G the global batch size): the group's samples are sorted by
length, longest first (ties in stream order), cut into ``k`` global batches, and those batches take the
group's steps in a seeded random order. So every sample is still drawn once per epoch, and the order is still
a function of ``(seed, G, k, step)`` alone (never of the world size: N ranks train exactly what one process
trains); within a global batch the samples stay sorted, so each rank's contiguous share and each
micro-batch hold neighbours in length. It is Hugging Face ``Trainer``'s ``group_by_length``
(``LengthGroupedSampler``: megabatches of 50 batches sorted by length), made deterministic per step and
independent of the number of ranks; unlike it, the longest batch is not moved first (``shardlm plan``
already sizes memory for rows of ``train.seq_len`` tokens).

It changes which samples share a step (a batch of short replies, then one of long ones): off by default.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
import torch

from shardlm.data.loader import GlobalBatchSampler


class LengthGroupedSampler(GlobalBatchSampler):
    """:class:`GlobalBatchSampler`'s stream regrouped by length, ``steps`` global batches at a time (module
    docstring).

    Args:
        lengths: int64 (num_samples,): each sample's tokens as a row holds them (at most ``seq_len + 1``).
        global_batch_size: G, samples per optimizer step over all ranks (>= 1).
        seed: data-order seed (the stream's, and the order of the batches within each group).
        steps: k, global batches per group (>= 2).

    Raises:
        ValueError: ``steps < 2``, no samples, or as :class:`GlobalBatchSampler`.
    """

    _CACHE_GROUPS = 2

    def __init__(self, lengths: np.ndarray, global_batch_size: int, seed: int, steps: int) -> None:
        if steps < 2:
            raise ValueError(f"length groups need at least 2 steps each, got {steps}")
        super().__init__(len(lengths), global_batch_size, seed)
        self.lengths = np.asarray(lengths, dtype=np.int64)
        self.steps = int(steps)
        self._groups: OrderedDict[int, list[list[int]]] = OrderedDict()

    def group(self, index: int) -> list[list[int]]:
        """The ``steps`` global batches of group ``index`` (steps ``index · k`` to ``index · k + k - 1``), in
        step order; each batch's ids sorted longest first (cached: the last two groups)."""
        batches = self._groups.get(index)
        if batches is None:
            k, g = self.steps, self.global_batch_size
            stream = [GlobalBatchSampler.step_ids(self, s) for s in range(index * k, index * k + k)]
            ids = np.asarray([i for batch in stream for i in batch], dtype=np.int64)
            by_length = ids[np.argsort(-self.lengths[ids], kind="stable")]  # longest first, ties in order
            # a generator of its own per group (not the epochs' seeds: seed · 1,000,003 + epoch)
            gen = torch.Generator().manual_seed((self.seed * 1_000_003 + index) * 7919 + 1)
            order = torch.randperm(k, generator=gen).tolist()  # which step takes the j-th longest batch
            batches = [[]] * k
            for j, step in enumerate(order):
                batches[step] = by_length[j * g:(j + 1) * g].tolist()
            self._groups[index] = batches
            while len(self._groups) > self._CACHE_GROUPS:
                self._groups.popitem(last=False)
        return batches

    def step_ids(self, step: int) -> list[int]:
        """Sample ids of global batch ``step`` (0-based): ``global_batch_size`` ids, longest first.

        Raises:
            ValueError: ``step < 0``.
        """
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        return list(self.group(step // self.steps)[step % self.steps])
