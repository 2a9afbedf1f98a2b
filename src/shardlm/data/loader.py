"""Fixed-length token windows and world-size-independent batch sampling.

A *window* is ``seq_len + 1`` consecutive tokens (inputs are ``w[:-1]``, targets
``w[1:]``). Windows do not overlap. The sample ids of a training step depend only on
``(seed, global_batch_size, step)``, never on the number of ranks, so a run can be
resumed on a different world size and see exactly the same data.
"""

from __future__ import annotations

import math
import pathlib
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from shardlm.data.meta import FORMAT, load_meta
from shardlm.errors import DataError

__all__ = ["TokenStream", "TokenWindows", "GlobalBatchSampler", "eval_windows"]


def cached(cache: OrderedDict, key: Any, make: Callable[[], Any], size: int) -> Any:
    """``cache[key]``, made by ``make()`` on a miss; the ``size`` most recently used entries are kept (the
    samplers' per-epoch and per-period tables: the next step almost always asks for the same key)."""
    value = cache.get(key)
    if value is None:
        value = cache[key] = make()
        while len(cache) > size:
            cache.popitem(last=False)
    else:
        cache.move_to_end(key)
    return value


class TokenStream:
    """The token stream of a prepared directory, memory-mapped: shards back to back (or the legacy ``.bin``).

    Args:
        out_dir: A directory written by :func:`shardlm.data.prepare_corpus`.
        split: ``"train"`` (the first ``train_tokens`` tokens) or ``"val"`` (the rest).

    Raises:
        DataError: missing or invalid meta, a missing token file or one whose size does not match.
    """

    def __init__(self, out_dir: str, split: str) -> None:
        meta = load_meta(out_dir)
        root = pathlib.Path(out_dir).expanduser()
        try:
            self.dtype = np.dtype(meta["dtype"])
        except TypeError as exc:
            raise DataError(f"{out_dir}/meta.json: invalid dtype {meta['dtype']!r}") from exc
        if meta.get("format") == FORMAT:
            files = [(root / s["file"], int(s["tokens"])) for s in meta["shards"]]
            start = 0 if split == "train" else int(meta["train_tokens"])
            length = int(meta["train_tokens"]) if split == "train" else int(meta["val_tokens"])
        else:  # written before shards: one file per split
            path = root / f"{split}.bin"
            if not path.is_file():
                raise DataError(f"{path} not found: run data preparation first (shardlm prepare)")
            size = path.stat().st_size
            if size % self.dtype.itemsize:
                raise DataError(f"{path}: size {size} bytes is not a multiple of {self.dtype.name}")
            files, start, length = [(path, size // self.dtype.itemsize)], 0, size // self.dtype.itemsize
        self.path = root
        self.maps: list[np.ndarray] = []
        self.offsets: list[int] = []  # stream position of each map's first token (within the split)
        pos = 0
        for path, n in files:
            if not path.is_file() or path.stat().st_size != n * self.dtype.itemsize:
                raise DataError(
                    f"{path}: missing or not {n} {self.dtype.name} tokens: prepare the data again"
                )
            lo, hi = max(start, pos), min(start + length, pos + n)
            if hi > lo:
                self.maps.append(np.memmap(path, dtype=self.dtype, mode="r", shape=(n,))[lo - pos : hi - pos])
                self.offsets.append(lo - start)
            pos += n
        self.num_tokens = length
        self._ends = np.asarray([o + len(m) for o, m in zip(self.offsets, self.maps)], dtype=np.int64)
        #: int64 positions (in the whole stream) where a document starts, memory-mapped, when the preparation
        #: recorded them (``meta["document_starts"]``); None for data prepared before that, or elsewhere
        self.document_starts: np.ndarray | None = None
        self._start = start  # the split's first stream position
        rec = meta.get("document_starts")
        if isinstance(rec, dict) and meta.get("format") == FORMAT:
            path = root / rec["file"]
            if not path.is_file() or path.stat().st_size != int(rec["count"]) * 8:
                raise DataError(f"{path}: missing or not {rec['count']} int64 document starts: prepare the "
                                "data again")
            self.document_starts = np.memmap(path, dtype="<i8", mode="r", shape=(int(rec["count"]),))

    def read(self, start: int, length: int) -> np.ndarray:
        """Tokens ``[start, start + length)`` of the split (copied; may span shards)."""
        out = np.empty(length, dtype=self.dtype)
        i = int(np.searchsorted(self._ends, start, side="right"))
        filled = 0
        while filled < length:
            m, off = self.maps[i], self.offsets[i]
            lo = start + filled - off
            take = min(length - filled, len(m) - lo)
            out[filled : filled + take] = m[lo : lo + take]
            filled += take
            i += 1
        return out

    def starts_in(self, start: int, length: int) -> np.ndarray | None:
        """Positions (int64, relative to ``start``) in tokens ``[start, start + length)`` of the split where a
        recorded document starts, ascending; None when the preparation recorded none."""
        if self.document_starts is None:
            return None
        lo, hi = self._start + start, self._start + start + length
        a, b = np.searchsorted(self.document_starts, [lo, hi])
        return np.asarray(self.document_starts[a:b], dtype=np.int64) - lo


class TokenWindows:
    """Non-overlapping windows of ``seq_len + 1`` tokens over a split of a prepared directory.

    Window ``i`` is ``tokens[i*(seq_len+1) : (i+1)*(seq_len+1)]`` of the split's stream
    (:class:`TokenStream`: the shards, memory-mapped, with the dtype recorded in ``meta.json``); a
    trailing partial window is dropped.

    Args:
        out_dir: A directory written by :func:`shardlm.data.prepare_corpus`.
        split: ``"train"`` or ``"val"``.
        seq_len: Model context length in tokens (>= 1).

    Raises:
        DataError: missing/invalid meta or token file, file size not a multiple of
            the dtype size, or fewer than ``seq_len + 1`` tokens in the split.
        ValueError: ``split`` is not ``"train"``/``"val"`` or ``seq_len < 1``.
    """

    def __init__(self, out_dir: str, split: str, seq_len: int) -> None:
        if split not in ("train", "val"):
            raise ValueError(f"split must be 'train' or 'val', got {split!r}")
        if seq_len < 1:
            raise ValueError(f"seq_len must be >= 1, got {seq_len}")
        self.stream = TokenStream(out_dir, split)
        self.dtype = self.stream.dtype
        self.path = self.stream.path
        self.split = split
        self.seq_len = int(seq_len)
        self.num_tokens = self.stream.num_tokens
        self.window = self.seq_len + 1
        self._len = self.num_tokens // self.window
        if self._len == 0:
            raise DataError(
                f"{split} split has {self.num_tokens} tokens, needs at least "
                f"seq_len+1={self.window} for one window ({self.path})"
            )

    def __len__(self) -> int:
        """Number of full windows."""
        return self._len

    def num_targets(self, ids: list[int]) -> int:
        """Target tokens (those the loss counts) in windows ``ids``: every one of their ``seq_len``
        next tokens.

        Known without reading the windows, so every rank can count a whole global batch on the host.
        """
        return len(ids) * self.seq_len

    def get(self, ids: list[int]) -> torch.Tensor:
        """Gather windows.

        Args:
            ids: Window indices in ``[0, len(self))``; may be empty.

        Returns:
            ``torch.LongTensor`` (int64, CPU) of shape ``(len(ids), seq_len + 1)``.

        Raises:
            IndexError: an id is out of range.
        """
        idx = np.asarray(ids, dtype=np.int64).reshape(-1)
        bad = idx[(idx < 0) | (idx >= self._len)]
        if bad.size:
            raise IndexError(f"window id {int(bad[0])} out of range [0, {self._len}) for {self.path}")
        out = np.empty((idx.size, self.window), dtype=np.int64)
        for row, i in enumerate(idx.tolist()):
            out[row] = self.stream.read(i * self.window, self.window)
        return torch.from_numpy(out)

    def document_starts(self, ids: list[int]) -> torch.Tensor | None:
        """Where recorded documents start in windows ``ids``: bool (len(ids), seq_len + 1), True at a
        document's first token; None when the preparation recorded no document starts (see
        :class:`TokenStream`)."""
        if self.stream.document_starts is None:
            return None
        out = torch.zeros((len(ids), self.window), dtype=torch.bool)
        for row, i in enumerate(ids):
            out[row, torch.from_numpy(self.stream.starts_in(int(i) * self.window, self.window))] = True
        return out

    def __repr__(self) -> str:
        return (
            f"TokenWindows(path={str(self.path)!r}, split={self.split!r}, seq_len={self.seq_len}, "
            f"tokens={self.num_tokens}, windows={self._len})"
        )


class GlobalBatchSampler:
    """Deterministic infinite stream of window ids, cut into global batches.

    Epoch ``e`` is ``torch.randperm(num_windows, generator=Generator().manual_seed(
    seed * 1_000_003 + e))``; the stream is epoch 0, then epoch 1, ... . Step ``s``
    (0-based) takes stream positions ``[s*G, (s+1)*G)`` and may straddle epochs.

    Args:
        num_windows: Number of windows in the dataset (>= 1).
        global_batch_size: ``G``, samples per optimizer step over all ranks (>= 1).
        seed: Data-order seed.

    Raises:
        ValueError: ``num_windows < 1`` or ``global_batch_size < 1``.
    """

    _CACHE_EPOCHS = 4

    def __init__(self, num_windows: int, global_batch_size: int, seed: int) -> None:
        if num_windows < 1:
            raise ValueError(f"num_windows must be >= 1, got {num_windows}")
        if global_batch_size < 1:
            raise ValueError(f"global_batch_size must be >= 1, got {global_batch_size}")
        self.num_windows = int(num_windows)
        self.global_batch_size = int(global_batch_size)
        self.seed = int(seed)
        self._perms: OrderedDict[int, np.ndarray] = OrderedDict()

    def epoch_permutation(self, epoch: int) -> np.ndarray:
        """The permutation of ``range(num_windows)`` used in ``epoch`` (cached; the last few epochs kept).

        Returns:
            int64 array of shape ``(num_windows,)`` (8 bytes per window, not a Python int each).
        """
        def make() -> np.ndarray:
            gen = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            return torch.randperm(self.num_windows, generator=gen).numpy()

        return cached(self._perms, epoch, make, self._CACHE_EPOCHS)

    def epoch_of(self, step: int) -> float:
        """Fractional epoch reached at the start of ``step`` (samples seen / num_windows)."""
        return step * self.global_batch_size / self.num_windows

    def step_ids(self, step: int) -> list[int]:
        """Window ids of global batch ``step`` (0-based).

        Returns:
            ``global_batch_size`` ids (within one epoch all distinct).

        Raises:
            ValueError: ``step < 0``.
        """
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        n = self.num_windows
        start = step * self.global_batch_size
        end = start + self.global_batch_size
        ids: list[int] = []
        pos = start
        while pos < end:
            epoch, offset = divmod(pos, n)
            take = min(end - pos, n - offset)
            ids.extend(self.epoch_permutation(epoch)[offset : offset + take].tolist())
            pos += take
        return ids

    def rank_ids(self, step: int, rank: int, world_size: int) -> list[int]:
        """This rank's contiguous share ``[rank*G/W, (rank+1)*G/W)`` of :meth:`step_ids`.

        Raises:
            ValueError: ``G % world_size != 0`` or ``rank`` not in ``[0, world_size)``.
        """
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"invalid rank {rank} for world_size {world_size}")
        g = self.global_batch_size
        if g % world_size:
            raise ValueError(
                f"global_batch_size={g} is not divisible by world_size={world_size}"
            )
        per_rank = g // world_size
        return self.step_ids(step)[rank * per_rank : (rank + 1) * per_rank]

    def micro_batches(
        self, step: int, rank: int, world_size: int, micro_batch_size: int
    ) -> list[list[int]]:
        """:meth:`rank_ids` cut into consecutive chunks of ``micro_batch_size``.

        Returns:
            ``G / (world_size * micro_batch_size)`` lists of ``micro_batch_size`` ids.

        Raises:
            ValueError: the per-rank batch ``G / world_size`` is not divisible by
                ``micro_batch_size`` (or see :meth:`rank_ids`).
        """
        if micro_batch_size < 1:
            raise ValueError(f"micro_batch_size must be >= 1, got {micro_batch_size}")
        ids = self.rank_ids(step, rank, world_size)
        if len(ids) % micro_batch_size:
            raise ValueError(
                f"per-rank batch {len(ids)} (global_batch_size={self.global_batch_size} / "
                f"world_size={world_size}) is not divisible by micro_batch_size={micro_batch_size}"
            )
        return [ids[i : i + micro_batch_size] for i in range(0, len(ids), micro_batch_size)]


def eval_windows(
    num_windows: int,
    eval_tokens: int,
    seq_len: int,
    rank: int,
    world_size: int,
    micro_batch_size: int,
) -> list[list[int]]:
    """This rank's micro-batches of the fixed validation set.

    The validation set is windows ``0..K-1`` with
    ``K = max(1, min(num_windows, eval_tokens // seq_len))``; window ``i`` belongs to
    rank ``i % world_size``. The rank's windows are cut into chunks of
    ``micro_batch_size`` and the list is padded with empty lists to
    ``ceil(ceil(K / world_size) / micro_batch_size)`` entries, the same on every rank
    (collectives need every rank to run the same number of forwards; callers run a
    dummy forward for an empty micro-batch).

    Args:
        num_windows: Windows in the validation split (>= 1).
        eval_tokens: Approximate number of target tokens to evaluate.
        seq_len: Context length in tokens (>= 1).
        rank: This rank, in ``[0, world_size)``.
        world_size: Number of ranks (>= 1).
        micro_batch_size: Windows per forward (>= 1).

    Returns:
        A list of micro-batches (lists of window ids; trailing ones may be empty).

    Raises:
        ValueError: any argument out of range.
    """
    if num_windows < 1:
        raise ValueError(f"num_windows must be >= 1, got {num_windows}")
    if seq_len < 1 or micro_batch_size < 1:
        raise ValueError(f"seq_len and micro_batch_size must be >= 1, got {seq_len}, {micro_batch_size}")
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"invalid rank {rank} for world_size {world_size}")
    k = max(1, min(num_windows, eval_tokens // seq_len))
    mine = list(range(rank, k, world_size))
    batches = [mine[i : i + micro_batch_size] for i in range(0, len(mine), micro_batch_size)]
    n_batches = math.ceil(math.ceil(k / world_size) / micro_batch_size)
    batches.extend([] for _ in range(n_batches - len(batches)))
    return batches
