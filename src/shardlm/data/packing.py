"""Packed instruction samples (``data.pack = true``): several examples per row of ``seq_len + 1`` tokens.

Examples are placed into rows by best-fit decreasing (BFD; Johnson, "Near-optimal bin packing algorithms",
1973; TRL's ``packing_strategy="bfd"``): longest first (ties in a seeded order), each into the row whose free
space is the smallest that holds it, a new row when none does. The rows depend only on the prepared examples,
``seq_len`` and the seed, so they are the same at any world size; the global batch sampler then draws rows
as it draws examples. The rest of a row is padding (document :data:`~shardlm.data.instruct.PADDING_DOCUMENT`,
-1: no document; label -100).

Each example keeps its response-only labels (:mod:`shardlm.data.instruct`); the first token of every example
is never a target, so no target crosses an example boundary. A row carries a third channel, the document
index of each token, which the model turns into block-causal attention and per-example rotary positions
(``model.attention = "block_causal"``, :mod:`shardlm.model.attention`). The loss stays the mean over the
response tokens of the whole global batch: a row counts exactly the targets its examples count unpacked.

An example longer than ``seq_len + 1`` tokens is truncated to that (as unpacked; counted, its lines named in
the summary); one with no response token left after truncation is left out (counted); when none is left the
data is refused.
"""

from __future__ import annotations

import bisect

import numpy as np
import torch

from shardlm.data.instruct import IGNORE_INDEX, PADDING_DOCUMENT, InstructionExamples
from shardlm.errors import DataError


def batch_documents(batch: torch.Tensor) -> torch.Tensor | None:
    """The document index of each input token of a batch, (B, T) int64, when it has one (instruction
    examples, packed rows and :class:`DocumentWindows` are (B, 3, T + 1): tokens, labels, documents; padding
    :data:`~shardlm.data.instruct.PADDING_DOCUMENT`); None for plain samples."""
    return batch[:, 2, :-1] if batch.dim() == 3 and batch.shape[1] == 3 else None


def batch_real_tokens(batch: torch.Tensor) -> torch.Tensor | None:
    """Which input tokens of a batch are real, (B, T) bool: True where the documents channel
    (:func:`batch_documents`) is not :data:`~shardlm.data.instruct.PADDING_DOCUMENT`, i.e. every token of an
    example (prompt and response) or of a text window; None for plain samples (no padding: all real).
    transformers' ``attention_mask`` of the same inputs, as the router statistics of a mixture of experts
    count them (:class:`~shardlm.model.moe.MoE`)."""
    documents = batch_documents(batch)
    return None if documents is None else documents != PADDING_DOCUMENT


def best_fit_decreasing(lengths: np.ndarray, capacity: int, seed: int) -> list[list[int]]:
    """Pack items of ``lengths`` (int, each 1..capacity) into bins of ``capacity``: lists of item indices.

    Items go longest first, equal lengths in the order of ``torch.randperm(n)`` seeded by ``seed``; each into
    the bin with the least free space that holds it (the first such bin opened), else a new bin. Bins are
    returned in the order they were opened, items in the order placed. O(n log capacity).

    Raises:
        ValueError: a length outside 1..capacity.
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    if lengths.size and (lengths.min() < 1 or lengths.max() > capacity):
        raise ValueError(f"item lengths must be in 1..{capacity}")
    tie = torch.randperm(len(lengths), generator=torch.Generator().manual_seed(seed)).numpy()
    order = np.lexsort((tie, -lengths))  # by length descending, then the seeded order
    bins: list[list[int]] = []
    free_values: list[int] = []  # sorted distinct free spaces that some open bin has
    by_free: dict[int, list[int]] = {}  # free space -> bins with it, in opening order
    for item in order.tolist():
        n = int(lengths[item])
        j = bisect.bisect_left(free_values, n)
        if j < len(free_values):
            free = free_values[j]
            b = by_free[free].pop(0)
            if not by_free[free]:
                del by_free[free]
                free_values.pop(j)
        else:
            b, free = len(bins), capacity
            bins.append([])
        bins[b].append(item)
        left = free - n
        if left > 0:
            if left not in by_free:
                by_free[left] = []
                bisect.insort(free_values, left)
            bisect.insort(by_free[left], b)
    return bins


class PackedExamples:
    """The training examples of a prepared instruction directory packed into rows of ``seq_len + 1`` tokens.

    Args:
        examples: the split, loaded with ``skip_untrainable=True`` (examples with no response target left
        out). seed: the order of equally long examples (``train.seed``).

    Attributes: ``rows`` (example ids per row), ``fill`` (example tokens / row tokens), ``truncated`` (ids of
    examples cut to ``seq_len + 1`` tokens), ``dropped`` (ids left out: no response token in the window),
    ``padding`` / ``unpacked_padding`` (padding tokens of the rows / of the same examples one per sample).

    Raises:
        DataError: no example has a response token within its first ``seq_len + 1`` tokens (the count and
            the fix).
    """

    def __init__(self, examples: InstructionExamples, seed: int) -> None:
        self.examples = examples
        self.seq_len = examples.seq_len
        row = self.seq_len + 1
        self.dropped = [int(i) for i in np.flatnonzero(examples.target_counts == 0)]
        keep = np.flatnonzero(examples.target_counts > 0)
        if not keep.size:
            raise DataError(f"no instruction example to train: all {len(examples)} have no response token "
                            f"within their first {row} tokens (train.seq_len={self.seq_len}); raise "
                            "train.seq_len or shorten the prompts")
        lengths = np.diff(examples.offsets)
        self._placed = np.minimum(lengths, row)  # each example's tokens in its row
        self.truncated = [int(i) for i in keep if lengths[i] > row]
        placed = np.minimum(lengths[keep], row)
        self.rows = [[int(keep[j]) for j in b] for b in best_fit_decreasing(placed, row, seed)]
        self.fill = float(placed.sum()) / (len(self.rows) * row)
        #: padding tokens of the rows, and of the same examples one per sample (``seq_len + 1`` tokens each)
        self.padding = len(self.rows) * row - int(placed.sum())
        self.unpacked_padding = len(keep) * row - int(placed.sum())
        self.row_targets = np.asarray([examples.num_targets(r) for r in self.rows], dtype=np.int64)

    def __len__(self) -> int:
        """Number of rows (the samples the global batch sampler draws)."""
        return len(self.rows)

    def num_targets(self, ids: list[int]) -> int:
        """Response targets of rows ``ids`` (the sum of their examples' unpacked counts), known on
        the host."""
        return int(self.row_targets[np.asarray(ids, dtype=np.int64)].sum()) if len(ids) else 0

    def squared_lengths(self, ids) -> int:
        """Σ n² over the documents of the inputs (each row's first ``seq_len`` tokens) of rows ``ids``: each
        example as placed, and the padding as a document of its own (block-causal attention's work,
        :func:`shardlm.metrics.flops.model_flops`)."""
        row, total = self.seq_len + 1, 0
        for i in ids:
            placed = [int(self._placed[e]) for e in self.rows[i]]
            placed = [n for n in placed + [row - sum(placed)] if n]
            placed[-1] -= 1  # the row's last token is only a target
            total += sum(n * n for n in placed)
        return total

    def get(self, ids: list[int]) -> torch.Tensor:
        """Rows ``ids``: int64 (len(ids), 3, seq_len + 1): tokens, labels (-100 off-response, on each
        example's first token and on padding), and each token's document index (0, 1, ... per example;
        padding :data:`~shardlm.data.instruct.PADDING_DOCUMENT`, -1)."""
        row = self.seq_len + 1
        out = torch.empty((len(ids), 3, row), dtype=torch.int64)
        for r, i in enumerate(ids):
            members = self.rows[i]
            sample = self.examples.get(members)  # (k, 2, row): each example alone, truncated and padded
            pos = 0
            for d, e in enumerate(members):
                n = min(int(self.examples.offsets[e + 1] - self.examples.offsets[e]), row)
                out[r, :2, pos:pos + n] = sample[d, :2, :n]
                out[r, 1, pos] = IGNORE_INDEX  # never the target of the previous example's last token
                out[r, 2, pos:pos + n] = d
                pos += n
            out[r, 0, pos:] = self.examples.pad
            out[r, 1, pos:] = IGNORE_INDEX
            out[r, 2, pos:] = PADDING_DOCUMENT
        return out

    def summary(self) -> str:
        """One line for the start-up and preparation summaries: rows, examples, fill ratio, padding saved,
        truncations (their JSONL lines), drops."""
        lines = self.examples.lines
        named = ", ".join(str(int(lines[i])) for i in self.truncated[:5]) + (
            ", ..." if len(self.truncated) > 5 else ""
        )
        n = sum(len(r) for r in self.rows)
        text = (
            f"packed {n:,} examples into {len(self.rows):,} rows of {self.seq_len + 1} tokens, fill "
            f"{100 * self.fill:.1f}%; padding {self.padding:,} tokens instead of "
            f"{self.unpacked_padding:,} unpacked ({100 * (1 - len(self.rows) / n):.1f}% fewer samples); "
            f"{len(self.truncated)} truncated to {self.seq_len + 1} tokens"
            + (f" (lines {named})" if self.truncated else "")
        )
        if self.dropped:
            text += f"; {len(self.dropped)} left out (no response token within {self.seq_len + 1} tokens)"
        return text


class DocumentWindows:
    """Pre-training windows with document boundaries, for block-causal attention (``model.attention``).

    Where documents start comes from the preparation's record (``meta["document_starts"]``, read by
    :meth:`~shardlm.data.loader.TokenWindows.document_starts`: exact even when a document's text holds the
    separator's string). Data prepared before that record existed, or by another program, falls back to the
    separator: the stream is ``BOS doc0 EOD doc1 EOD ...`` (:mod:`shardlm.data.prepare`), so a document starts
    after each ``eod``. Either way a window's first token is in its document 0, the separator is the last
    token of the document it ends, and a document's first token is never a target (label -100), so no target
    crosses a boundary: the end of one document does not learn to predict the next.

    Args:
        windows: :class:`~shardlm.data.loader.TokenWindows` or a mixture of them (``get`` -> (B, seq_len +
        1)). eod: the separator id (``meta["special_ids"]["eod"]``), or None. plain_within_one_document:
        ``get`` returns the plain windows (B, seq_len + 1) when none of them holds a
            document start (training's samples): block-causal attention within one document is causal
            attention, so the model then runs the causal kernel, no mask, the same outputs bit for bit.

    Attributes: ``source`` (``"recorded"`` or ``"eod"``: where the boundaries come from).

    Raises:
        DataError: the data records no document starts and ``eod`` is None (no boundary to go by).
    """

    def __init__(self, windows, eod: int | None, plain_within_one_document: bool = False) -> None:
        self.windows = windows
        self.plain_within_one_document = plain_within_one_document
        self.eod = None if eod is None else int(eod)
        self.seq_len = windows.seq_len
        self.source = "recorded" if len(windows) and windows.document_starts([0]) is not None else "eod"
        if self.source == "eod" and self.eod is None:
            raise DataError("model.attention = 'block_causal' needs document boundaries, but the prepared "
                            "data records no document starts and has no end-of-document token "
                            "(special_ids.eod): prepare it again with this shardlm, or set model.attention = "
                            "'causal'")

    def __len__(self) -> int:
        """Number of windows."""
        return len(self.windows)

    def starts(self, ids: list[int], tokens: torch.Tensor | None = None) -> torch.Tensor:
        """bool (len(ids), seq_len + 1): True at the first token of a document after each window's
        first token."""
        if self.source == "recorded":
            starts = self.windows.document_starts(ids)
        else:
            tokens = self.windows.get(ids) if tokens is None else tokens
            starts = torch.zeros_like(tokens, dtype=torch.bool)
            starts[:, 1:] = tokens[:, :-1] == self.eod
        starts[:, 0] = False
        return starts

    def get(self, ids: list[int]) -> torch.Tensor:
        """Windows ``ids`` as int64 (len(ids), 3, seq_len + 1): tokens, labels (the tokens, -100 at each
        document's first token after the window's start), and each token's document index within its window
        (from 0); or the plain windows when none holds a start and ``plain_within_one_document``."""
        tokens = self.windows.get(ids)
        starts = self.starts(ids, tokens)
        if self.plain_within_one_document and not starts.any():
            return tokens
        labels = tokens.clone()
        labels[starts] = IGNORE_INDEX  # never the target of the previous document's last token
        return torch.stack([tokens, labels, starts.cumsum(dim=1)], dim=1)

    def num_targets(self, ids: list[int]) -> int:
        """Targets of windows ``ids``: ``seq_len`` each, less the document starts (read on the host: every
        rank reads the whole global batch's starts, or windows for the separator rule)."""
        if not len(ids):
            return 0
        return len(ids) * self.seq_len - int(self.starts(ids).sum())
