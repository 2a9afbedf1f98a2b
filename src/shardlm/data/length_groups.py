"""Length-grouped sampling (``data.group_by_length_steps``): global batches of samples of similar length, so
that a micro-batch padded to its longest sample computes little padding.

Each epoch's order is :class:`~shardlm.data.loader.GlobalBatchSampler`'s permutation, regrouped: from the
epoch's first step boundary on it is cut into runs of ``k`` global batches (``k · G`` samples, G the global
batch size; the epoch's last run shorter), each run is sorted by length, longest first (ties in order), and
cut into batches of G, and the run's whole batches take its steps in a seeded random order (a last, partial
batch stays last: it shares a step with the next epoch's first samples, which stay as drawn, like the
samples before the first boundary). So each epoch is still a permutation of the samples (no sample twice in
a step that lies inside one epoch, however small the data), steps are the plain sampler's positions in that
order, and the order is a function of ``(seed, G, k, step)`` alone (never of the world size: N ranks train
what one process trains); within a batch the samples stay sorted, so each rank's contiguous share and each
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

from shardlm.data.loader import GlobalBatchSampler, cached


class LengthGroupedSampler(GlobalBatchSampler):
    """:class:`GlobalBatchSampler` whose epoch permutations are regrouped by length, ``steps`` global batches
    at a time (module docstring); :meth:`step_ids`, :meth:`rank_ids` and :meth:`micro_batches` are inherited.

    Args:
        lengths: int64 (num_samples,): each sample's tokens as a row holds them (at most ``seq_len + 1``).
        global_batch_size: G, samples per optimizer step over all ranks (>= 1).
        seed: data-order seed (the epochs' permutations, and the order of the batches within each run).
        steps: k, global batches per run (>= 2).

    Raises:
        ValueError: ``steps < 2``, no samples, or as :class:`GlobalBatchSampler`.
    """

    def __init__(self, lengths: np.ndarray, global_batch_size: int, seed: int, steps: int) -> None:
        if steps < 2:
            raise ValueError(f"length groups need at least 2 steps each, got {steps}")
        super().__init__(len(lengths), global_batch_size, seed)
        self.lengths = np.asarray(lengths, dtype=np.int64)
        self.steps = int(steps)
        self._grouped: OrderedDict[int, np.ndarray] = OrderedDict()

    def epoch_permutation(self, epoch: int) -> np.ndarray:
        """Epoch ``epoch``'s order: the plain permutation regrouped by length (module docstring); int64
        ``(num_samples,)``, cached like the plain ones."""
        plain = super().epoch_permutation
        return cached(self._grouped, epoch, lambda: self._regroup(plain(epoch), epoch), self._CACHE_EPOCHS)

    def _regroup(self, plain: np.ndarray, epoch: int) -> np.ndarray:
        """``plain`` (epoch ``epoch``'s int64 permutation) regrouped as the module docstring says."""
        n, g, run = self.num_windows, self.global_batch_size, self.steps * self.global_batch_size
        head = min((-epoch * n) % g, n)  # before the epoch's first step boundary: the previous epoch's step
        # a generator of its own per epoch (not the permutations' seeds: seed · 1,000,003 + epoch)
        gen = torch.Generator().manual_seed((self.seed * 1_000_003 + epoch) * 7919 + 1)
        parts = [plain[:head]]
        for start in range(head, n, run):
            chunk = plain[start:start + run]
            chunk = chunk[np.argsort(-self.lengths[chunk], kind="stable")]  # longest first, ties in order
            whole = [chunk[i:i + g] for i in range(0, len(chunk) - len(chunk) % g, g)]
            parts += [whole[i] for i in torch.randperm(len(whole), generator=gen).tolist()]
            parts.append(chunk[len(chunk) - len(chunk) % g:])  # the epoch's partial last batch (or nothing)
        return np.concatenate(parts)
