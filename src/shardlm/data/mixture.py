"""Mixtures of sources: one shared tokenizer, seeded weighted draws that do not depend on the world size.

Sample ``n`` of the run (global batch ``s`` holds samples ``s·G .. s·G + G - 1``) comes from the
source given by a slot pattern (stratified sampling): the samples are cut into periods of ``P``
slots, source ``i`` owns ``q_i`` slots of every period, and period ``k``'s slots are shuffled by a
generator seeded with ``(seed, k)``. ``P`` is the smallest period (at most 10,000) whose
apportionment ``q_i / P`` is within 1e-4 of every normalised weight (0.7 / 0.3 gives ``P = 10``), so
the draws match the weights exactly at every period's end and within ``P`` samples at any point. The
``c``-th sample a source gives is window
``perm_e[c mod N_i]`` of that source (``e = c div N_i``, its own epoch; ``perm_e`` the same seeded
permutation a single dataset uses), so every source counts its epochs on its own. Everything is a
function of ``(seed, n)``: the same sample ids at any world size, and a resumed run continues each
source exactly where it was.

Prepared layout (``data.dir``)::

    tokenizer.json   shared by every source (trained on a seeded sample of all of them, or given), with its
                     tokenizer_config.json (and chat_template.jinja) as in one prepared corpus
    meta.json        {"format": "mixture", "sources": [{"name", "path"}], "model_special_ids", ...}
    <name>/          each source, a directory written by :func:`shardlm.data.prepare_corpus`
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
from collections import OrderedDict
from typing import Any

import numpy as np
import torch

from shardlm.data.corpus import DataError
from shardlm.data.identity import describe_mixture, tokenizer_files
from shardlm.data.loader import GlobalBatchSampler, TokenWindows, cached
from shardlm.data.prepare import (
    META_FILE,
    _sample_texts,
    is_prepared,
    load_meta,
    prepare_corpus,
    staging_dir,
)
from shardlm.data.readers import plan_pieces
from shardlm.data.sync import Sync
from shardlm.data.tokenizer import train_tokenizer
from shardlm.data.tokenizer_files import open_tokenizer, stage_tokenizer

__all__ = ["MIXTURE", "MixtureSampler", "MixtureWindows", "prepare_mixture", "is_mixture_prepared"]

MIXTURE = "mixture"
"""``meta["format"]`` of a prepared mixture directory."""


def apportion(weights: list[float], slots: int) -> list[int]:
    """``slots`` divided among the sources in proportion to ``weights`` (largest remainders; sums
    to ``slots``)."""
    total = float(sum(weights))
    exact = [w / total * slots for w in weights]
    counts = [int(x) for x in exact]
    order = sorted(range(len(weights)), key=lambda i: (-(exact[i] - counts[i]), i))
    for i in order[: slots - sum(counts)]:
        counts[i] += 1
    return counts


def smallest_period(weights: list[float], tol: float = 1e-4, most: int = 10_000) -> int:
    """The smallest ``P <= most`` whose apportionment is within ``tol`` of every normalised weight
    (else ``most``)."""
    total = float(sum(weights))
    for p in range(1, most + 1):
        if all(abs(q / p - w / total) <= tol for q, w in zip(apportion(weights, p), weights)):
            return p
    return most


class MixtureSampler(GlobalBatchSampler):
    """Global batches drawn from several sources by weight (see the module docstring).

    Ids are global: source ``i``'s window ``w`` is ``offset_i + w`` with ``offset_i`` the windows of the
    sources before it (:class:`MixtureWindows` resolves them). :meth:`rank_ids` and
    :meth:`micro_batches` split a global batch as for one dataset.

    Args:
        num_windows: Windows of each source (each >= 1).
        weights: Weight of each source (> 0).
        global_batch_size: ``G``, samples per optimizer step over all ranks.
        seed: Data-order seed.
        period: ``P``, slots per period; 0 picks the smallest within 1e-4 of the weights (up to 10,000).

    Raises:
        ValueError: empty or mismatched lists, a non-positive count or weight.
    """

    _CACHE_PERIODS = 4

    def __init__(self, num_windows: list[int], weights: list[float], global_batch_size: int, seed: int,
                 period: int = 0) -> None:
        if not num_windows or len(num_windows) != len(weights):
            raise ValueError("need one weight per source and at least one source")
        if min(num_windows) < 1 or min(weights) <= 0:
            raise ValueError(
                f"every source needs windows and a positive weight, got {num_windows}, {weights}"
            )
        super().__init__(sum(num_windows), global_batch_size, seed)
        self.sources = [GlobalBatchSampler(n, 1, seed * 7919 + i) for i, n in enumerate(num_windows)]
        self.offsets = np.concatenate([[0], np.cumsum(num_windows)[:-1]]).astype(np.int64)
        self.weights = [float(w) for w in weights]
        self.period = int(period) or smallest_period(self.weights)
        self.quota = np.asarray(apportion(self.weights, self.period), dtype=np.int64)
        self._periods: OrderedDict[int, tuple[np.ndarray, np.ndarray]] = OrderedDict()

    def _pattern(self, k: int) -> tuple[np.ndarray, np.ndarray]:
        """Period ``k``: source of each slot (P,), and samples per source before each slot (P + 1, S)."""
        def make() -> tuple[np.ndarray, np.ndarray]:
            labels = np.repeat(np.arange(len(self.quota)), self.quota)
            labels = np.random.default_rng([self.seed, k]).permutation(labels)
            before = np.zeros((self.period + 1, len(self.quota)), dtype=np.int64)
            before[1:] = np.cumsum(labels[:, None] == np.arange(len(self.quota))[None, :], axis=0)
            return labels, before

        return cached(self._periods, k, make, self._CACHE_PERIODS)

    def drawn_before(self, position: int) -> np.ndarray:
        """Samples each source gave to positions ``0 .. position - 1`` of the run, shape (S,), int64."""
        k, r = divmod(int(position), self.period)
        return k * self.quota + self._pattern(k)[1][r]

    def step_ids(self, step: int) -> list[int]:
        """Global window ids of global batch ``step`` (``G`` ids)."""
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        ids: list[int] = []
        for n in range(step * self.global_batch_size, (step + 1) * self.global_batch_size):
            k, r = divmod(n, self.period)
            labels, before = self._pattern(k)
            src = int(labels[r])
            c = k * int(self.quota[src]) + int(before[r, src])  # this source's sample number
            sampler = self.sources[src]
            epoch, offset = divmod(c, sampler.num_windows)
            ids.append(int(self.offsets[src]) + int(sampler.epoch_permutation(epoch)[offset]))
        return ids

    def source_of(self, ids: list[int]) -> list[int]:
        """The source of each global id."""
        return (np.searchsorted(self.offsets, np.asarray(ids, dtype=np.int64), side="right") - 1).tolist()

    def source_epochs(self, step: int) -> list[float]:
        """Fractional epoch of each source at the start of ``step`` (its samples drawn / its windows)."""
        drawn = self.drawn_before(step * self.global_batch_size)
        return [float(d) / s.num_windows for d, s in zip(drawn, self.sources)]


class MixtureWindows:
    """Several :class:`TokenWindows` as one id space (source ``i``'s windows follow those of ``0..i-1``).

    With ``interleave`` (the validation set), id ``j`` instead walks the sources round robin, so the
    first ``K`` ids (the ones evaluation uses) come from every source.

    Args:
        windows: One dataset per source.
        interleave: Round-robin id order.
    """

    def __init__(self, windows: list[TokenWindows], interleave: bool = False) -> None:
        self.windows = windows
        self.lengths = np.asarray([len(w) for w in windows], dtype=np.int64)
        self.offsets = np.concatenate([[0], np.cumsum(self.lengths)[:-1]]).astype(np.int64)
        self.interleave = interleave
        self.seq_len = windows[0].seq_len

    def __len__(self) -> int:
        return int(self.lengths.sum())

    def num_targets(self, ids: list[int]) -> int:
        """Target tokens in windows ``ids``: ``seq_len`` each (every next token counts), known
        without reading."""
        return len(ids) * self.seq_len

    def _locate(self, j: int) -> tuple[int, int]:
        if not self.interleave:
            src = int(np.searchsorted(self.offsets, j, side="right") - 1)
            return src, j - int(self.offsets[src])
        left = self.lengths.copy()
        base = np.zeros_like(left)
        while True:  # rounds of every source that still has windows
            alive = np.flatnonzero(left > 0)
            depth = int(left[alive].min())
            if j < depth * len(alive):
                src = int(alive[j % len(alive)])
                return src, int(base[src]) + j // len(alive)
            j -= depth * len(alive)
            base[alive] += depth
            left[alive] -= depth

    def get(self, ids: list[int]) -> torch.Tensor:
        """Windows ``ids``, shape ``(len(ids), seq_len + 1)``, int64."""
        rows = []
        for j in ids:
            if not 0 <= j < len(self):
                raise IndexError(f"window id {j} out of range [0, {len(self)})")
            src, w = self._locate(int(j))
            rows.append(self.windows[src].get([w]))
        if not rows:
            return torch.empty((0, self.seq_len + 1), dtype=torch.int64)
        return torch.cat(rows)

    def document_starts(self, ids: list[int]) -> torch.Tensor | None:
        """Where recorded documents start in windows ``ids``: bool (len(ids), seq_len + 1); None when a source
        recorded none (see :meth:`TokenWindows.document_starts`)."""
        rows = [self.windows[src].document_starts([w]) for src, w in (self._locate(int(j)) for j in ids)]
        if any(r is None for r in rows):
            return None
        return torch.cat(rows) if rows else torch.zeros((0, self.seq_len + 1), dtype=torch.bool)


def source_names(sources: list[Any]) -> list[str]:
    """Each source's name: its ``name`` or ``source<i>``."""
    return [s.name or f"source{i}" for i, s in enumerate(sources)]


def is_mixture_prepared(out_dir: str, sources: list[Any]) -> bool:
    """True if ``out_dir`` holds a complete mixture of exactly these sources (names and paths)."""
    try:
        meta = load_meta(out_dir)
    except DataError:
        return False
    want = [{"name": n, "path": s.path} for n, s in zip(source_names(sources), sources)]
    if meta.get("format") != MIXTURE or meta.get("sources") != want:
        return False
    root = pathlib.Path(out_dir).expanduser()
    return (root / "tokenizer.json").is_file() and all(
        is_prepared(str(root / n)) for n in source_names(sources)
    )


def prepare_mixture(sources: list[Any], out_dir: str, tokenizer_path: str | None, vocab_size: int,
                    val_fraction: float, seed: int = 0, *, text_field: str = "text", workers: int = 1,
                    piece_bytes: int = 64 << 20, tokenizer_sample_bytes: int = 100_000_000,
                    sync: Sync | None = None, identity: dict[str, Any] | None = None) -> dict[str, Any]:
    """Prepare every source of a mixture under ``out_dir`` with one tokenizer (layout: module docstring).

    The tokenizer is the given one, or a byte-level BPE trained on a seeded sample of at most
    ``tokenizer_sample_bytes`` from every source, each source giving a share proportional to its
    weight. Each source is then :func:`shardlm.data.prepare_corpus` d (distributed, restartable) with
    that tokenizer: a given one is read where it lies, so that the sources and the mixture record its
    model's special ids (its directory's ``config.json`` / ``tokenizer_config.json``) and hold its config
    files, as one corpus does.

    Returns:
        The mixture meta (also ``meta.json``): ``format`` ("mixture"), ``sources`` ([{"name", "path"}]),
        ``dtype``, ``vocab_size``, ``tokenizer_vocab_size``, ``special_ids``, ``model_special_ids`` (the
        bos/eos/pad ids a model trained on it writes, as every source records them), ``train_tokens`` and
        ``val_tokens`` (sums), ``unigram_entropy_nats`` (of the first source), ``content_sha256`` (of
        all sources), ``identity`` (what it was made from, :func:`shardlm.data.identity.describe_mixture`;
        ``identity`` given: the caller's, taken before reading; None: rank 0 takes it).

    Raises:
        DataError: as :func:`shardlm.data.prepare_corpus`, for any source.
    """
    root = pathlib.Path(out_dir).expanduser()
    names = source_names(sources)
    rank = sync.rank if sync is not None else 0
    stage = staging_dir(root)
    plan = {"sources": [{"name": n, "path": s.path, "weight": s.weight} for n, s in zip(names, sources)],
            "tokenizer": tokenizer_path or "", "vocab_size": vocab_size, "seed": seed,
            "tokenizer_files": tokenizer_files(tokenizer_path) if tokenizer_path else None,
            "tokenizer_sample_bytes": tokenizer_sample_bytes}
    if rank == 0 and identity is None:
        identity = describe_mixture(sources, names, text_field, tokenizer_path, vocab_size, val_fraction,
                                    piece_bytes, tokenizer_sample_bytes)
    if rank == 0:
        try:
            same = json.loads((stage / "mixture.json").read_text()) == plan
        except (OSError, ValueError):
            same = False
        if stage.exists() and not same:
            shutil.rmtree(stage)
        stage.mkdir(parents=True, exist_ok=True)
        (stage / "mixture.json").write_text(json.dumps(plan))
    tok_file = stage / "tokenizer.json"
    opened = None
    if rank == 0:  # the given tokenizer read where it lies (its model's ids), as for one corpus
        if tokenizer_path:
            opened = open_tokenizer(tokenizer_path)
        elif not tok_file.is_file():
            total = sum(s.weight for s in sources)

            def sample() -> Any:
                for i, s in enumerate(sources):
                    pieces, _ = plan_pieces(s.path, text_field, piece_bytes)
                    yield from _sample_texts(pieces, text_field,
                                             int(tokenizer_sample_bytes * s.weight / total), seed + i)

            opened = open_tokenizer(tok_file, train_tokenizer(sample(), vocab_size))
        if not tok_file.is_file():
            assert opened is not None
            stage_tokenizer(opened, stage)  # the mixture's top level holds what one corpus holds
    if sync is not None:
        if rank == 0:
            sync.publish("mixture-tokenizer")
        else:
            sync.wait("mixture-tokenizer", "the mixture's tokenizer (rank 0)")
    opened = opened or open_tokenizer(tok_file)  # read once on each rank, handed to each source's preparation
    metas = []
    for name, source in zip(names, sources):
        sub_sync = sync.sub(name) if sync is not None else None
        metas.append(prepare_corpus(source.path, str(stage / name), tokenizer_path or str(tok_file),
                                    vocab_size, val_fraction, seed, text_field=text_field, workers=workers,
                                    piece_bytes=piece_bytes, tokenizer_sample_bytes=tokenizer_sample_bytes,
                                    sync=sub_sync, tokenizer=opened))
    first = metas[0]
    meta = {
        "format": MIXTURE,
        "sources": [{"name": n, "path": s.path} for n, s in zip(names, sources)],
        "dtype": first["dtype"],
        "vocab_size": int(vocab_size),
        "tokenizer_vocab_size": first["tokenizer_vocab_size"],
        "special_ids": first["special_ids"],
        "model_special_ids": first["model_special_ids"],
        "train_tokens": sum(m["train_tokens"] for m in metas),
        "val_tokens": sum(m["val_tokens"] for m in metas),
        "unigram_entropy_nats": first["unigram_entropy_nats"],
        "content_sha256": "".join(m["content_sha256"][:16] for m in metas),
        "seed": int(seed),
    }
    if sync is not None:  # every rank has seen its sources complete before rank 0 moves the directory
        sync.count("mixture-ranks")
        if rank == 0:
            sync.wait_count("mixture-ranks", sync.world_size, "the other ranks", lambda: "")
    if rank == 0:
        assert identity is not None
        if not tokenizer_path:
            identity = {**identity,
                        "tokenizer": {**identity["tokenizer"], "files": tokenizer_files(tok_file)}}
        meta["identity"] = identity
        (stage / "mixture.json").unlink()
        (stage / META_FILE).write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
        if root.exists():
            shutil.rmtree(root)
        os.replace(stage, root)
        if sync is not None:
            sync.publish("mixture-final")
    elif sync is not None:
        sync.wait("mixture-final", "rank 0 to write the mixture's meta.json")
    return meta
