"""Tokenize a corpus of any size into token shard files: streaming, parallel, distributed, restartable.

Layout of a prepared directory::

    out_dir/
        tokens/000000.bin  raw little-endian uint16 (or uint32) token ids of piece 0, no header
        tokens/000000.ends int64 positions in piece 0 just after each document that ends there
        tokens/000000.json {"tokens", "documents", "sha256"} of piece 0
        ...
        document_starts.bin int64 stream positions where each document starts (meta ``document_starts``)
        tokenizer.json     the tokenizer used, with its tokenizer_config.json (and chat_template.jinja)
        meta.json          see :func:`prepare_corpus`; ``shards`` lists the files in stream order

The token stream is the shards back to back: ``BOS doc0 EOD doc1 EOD ...``; its first
``train_tokens`` tokens are the train split and the rest (the tail) the validation split. The
loader (:mod:`shardlm.data.loader`) memory-maps the shards. Directories written before shards
existed (``train.bin`` and ``val.bin``) are still read.

How it runs (:func:`prepare_corpus`):

1. every rank cuts the corpus into the same pieces (:func:`shardlm.data.readers.plan_pieces`);
2. rank 0 trains the tokenizer on a bounded, seeded sample of the pieces (or copies the given one)
   into a staging directory ``.<out_dir name>.partial`` beside ``out_dir``; the other ranks wait
   for it through the :class:`~shardlm.data.sync.Sync` (the TCP store, never a collective);
3. rank ``r`` of ``W`` encodes the pieces ``i`` with ``i % W == r`` that are not finished yet, with
   ``workers`` processes (:func:`shardlm.data.encode.encode_pieces`);
4. rank 0 waits until every piece is finished, writes ``meta.json`` and renames the staging
   directory to ``out_dir`` in one step; the other ranks wait for that.

A piece's bytes depend only on the piece and the tokenizer, so the result is byte-identical for
any number of workers and ranks. A run that is killed leaves the staging directory; the next run
with the same inputs and settings keeps its finished pieces (and its tokenizer) and encodes the
rest. ``out_dir`` never holds a half-written dataset: it appears (or is replaced) only complete.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import pathlib
import random
import shutil
import socket
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import numpy as np

from shardlm.data.encode import DOCUMENT_STARTS, encode_pieces, piece_done, shard_name, write_document_starts
from shardlm.data.identity import describe_corpus, tokenizer_files
from shardlm.data.meta import FORMAT, META_FILE, is_prepared, load_meta, token_dtype
from shardlm.data.readers import Piece, dataset_dict_note, plan_pieces, read_piece
from shardlm.data.tokenizer import load_tokenizer, special_token_ids, train_tokenizer
from shardlm.data.tokenizer_files import model_special_ids, open_tokenizer, stage_tokenizer
from shardlm.errors import DataError

if TYPE_CHECKING:
    from shardlm.data.sync import Sync
    from shardlm.data.tokenizer_files import OpenedTokenizer

__all__ = [  # with the prepared-data names of meta.py, importable from here as before
    "META_FILE",
    "FORMAT",
    "prepare_corpus",
    "load_meta",
    "is_prepared",
    "token_dtype",
    "default_workers",
    "unigram_entropy",
    "staging_dir",
]

_FINGERPRINT = "plan.json"
_VERSION = 3  # bump when the bytes a piece encodes to change
_SAMPLE_CAP = 1 << 20  # bytes of text a tokenizer sample takes from a piece at least


def default_workers() -> int:
    """Encoding processes by default: the cores this process may use, shared among the ranks of its node."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        cores = os.cpu_count() or 1
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    return max(1, cores // max(1, local))


def unigram_entropy(tokens: np.ndarray) -> float:
    """-Σ p·ln p over the token frequencies of ``tokens`` (nats): the loss of a model that learned
    only them."""
    return _entropy(np.bincount(tokens.astype(np.int64)))


def _entropy(counts: np.ndarray) -> float:
    counts = counts[counts > 0].astype(np.float64)
    p = counts / counts.sum()
    return float(-(p * np.log(p)).sum())


def staging_dir(out_dir: str | os.PathLike) -> pathlib.Path:
    """The directory a preparation of ``out_dir`` builds in (kept after a kill, reused by the next run)."""
    out = pathlib.Path(out_dir).expanduser()
    return out.parent / f".{out.name}.partial"


def _sample_texts(pieces: list[Piece], text_field: str, budget: int, seed: int) -> Iterator[str]:
    """Texts for tokenizer training: pieces in a seeded order, each up to a cap, ``budget`` bytes in all.

    When the whole corpus fits the budget every piece is read whole, so a small corpus trains on all
    of it. Otherwise each piece gives at most ``max(1 MiB, budget / pieces)``.
    """
    total = sum(p.size for p in pieces)
    order = list(range(len(pieces)))
    random.Random(seed).shuffle(order)
    cap = total if total <= budget else max(_SAMPLE_CAP, budget // max(1, len(pieces)))
    taken = 0
    for i in order:
        if taken >= budget:
            return
        got = 0
        for chunk in read_piece(pieces[i], text_field):
            if chunk.text.strip():
                yield chunk.text
            n = len(chunk.text.encode("utf-8"))
            got += n
            taken += n
            if got >= cap or taken >= budget:
                break


def _fingerprint(pieces: list[Piece], tokenizer_path: str | None, vocab_size: int, text_field: str,
                 seed: int, sample_bytes: int) -> dict[str, Any]:
    tok: Any = "train"
    if tokenizer_path:  # every file of it: a staged tokenizer_config.json must not outlive an edit
        tok = tokenizer_files(tokenizer_path)
    return {"version": _VERSION, "tokenizer": tok, "vocab_size": vocab_size, "text_field": text_field,
            "seed": seed if not tokenizer_path else None,
            "tokenizer_sample_bytes": sample_bytes if not tokenizer_path else None,
            "pieces": [p.to_json() for p in pieces]}


def _write_json(path: pathlib.Path, obj: Any) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2) + "\n", encoding="utf-8")
    os.replace(tmp, path)


def _stage(corpus: str, stage: pathlib.Path, fingerprint: dict[str, Any], pieces: list[Piece],
           tokenizer_path: str | None, vocab_size: int, text_field: str, seed: int, sample_bytes: int,
           log: Callable[[str], None], opened: OpenedTokenizer | None = None) -> OpenedTokenizer:
    """Rank 0: make the staging directory hold this plan and its tokenizer (kept when the plan is unchanged).
    Returns the tokenizer opened once: the given one, one trained here, or an earlier run's from the stage."""
    old = stage / _FINGERPRINT
    if stage.exists():
        try:
            same = json.loads(old.read_text()) == json.loads(json.dumps(fingerprint))
        except (OSError, ValueError):
            same = False
        if not same:
            shutil.rmtree(stage)
    (stage / "tokens").mkdir(parents=True, exist_ok=True)
    staged = stage / "tokenizer.json"
    if tokenizer_path:
        opened = opened or open_tokenizer(tokenizer_path)
    if not staged.is_file():
        if not tokenizer_path:
            t0 = time.perf_counter()
            texts = _sample_texts(pieces, text_field, sample_bytes, seed)
            first = next(texts, None)
            if first is None:
                raise DataError(f"empty corpus: {corpus!r} contains no non-whitespace text")
            tok = train_tokenizer(itertools.chain([first], texts), vocab_size)
            log(f"prepare: trained a {tok.get_vocab_size()}-token BPE on a sample of at most "
                f"{sample_bytes / 1e6:.0f} MB in {time.perf_counter() - t0:.1f} s")
            opened = open_tokenizer(staged, tok)  # in memory, not read back; its files are made for it
        assert opened is not None
        stage_tokenizer(opened, stage)  # its tokenizer_config.json (the source's, or one made), then itself
    elif not tokenizer_path:
        opened = open_tokenizer(staged)  # trained by an earlier run of this plan
    _write_json(old, fingerprint)
    return opened


def _move_into_place(stage: pathlib.Path, out: pathlib.Path) -> None:
    """Rename the finished staging directory to ``out``, replacing an old ``out`` only once it is complete."""
    old = None
    if out.exists():
        old = pathlib.Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
        os.replace(out, old / out.name)
    try:
        os.replace(stage, out)
    except BaseException:
        if old is not None and not out.exists():
            os.replace(old / out.name, out)
        raise
    finally:
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)


def _train_counts(stage: pathlib.Path, shards: list[dict[str, Any]], dtype: np.dtype, n_train: int,
                  vocab: int) -> np.ndarray:
    """Token frequencies of the first ``n_train`` tokens, read in 16M-token blocks (no memory map)."""
    counts = np.zeros(vocab, dtype=np.int64)
    left = n_train
    for shard in shards:
        if left <= 0:
            break
        with open(stage / shard["file"], "rb") as f:
            remaining = min(left, shard["tokens"])
            while remaining > 0:
                block = np.fromfile(f, dtype=dtype, count=min(remaining, 1 << 24))
                counts += np.bincount(block, minlength=vocab)[:vocab]
                remaining -= block.size
        left -= shard["tokens"]
    return counts


def _finalize(stage: pathlib.Path, pieces: list[Piece], records: list[dict[str, Any]], corpus: str,
              dtype: np.dtype, vocab_size: int, tok_vocab: int, special: dict[str, int | None],
              val_fraction: float, seed: int, text_field: str, skipped: list[str]) -> dict[str, Any]:
    if not sum(int(r["documents"]) for r in records):
        raise DataError(f"empty corpus: {corpus!r} contains no non-whitespace text")
    total = sum(int(r["tokens"]) for r in records)
    n_val = int(round(total * val_fraction))
    n_train = total - n_val
    if n_val <= 0 or n_train <= 0:
        raise DataError(
            f"corpus {corpus!r} has {total} tokens; val_fraction={val_fraction} gives "
            f"{n_train} train and {n_val} val tokens, and neither split may be empty"
        )
    shards = [{"file": shard_name(i), "tokens": int(r["tokens"])} for i, r in enumerate(records)]
    counts = _train_counts(stage, shards, dtype, n_train, max(vocab_size, tok_vocab))
    content = hashlib.sha256()
    content.update(hashlib.sha256((stage / "tokenizer.json").read_bytes()).digest())
    for r in records:
        content.update(bytes.fromhex(r["sha256"]))
    content.update(f"{dtype.name}:{n_train}:{n_val}".encode())
    return {
        "format": FORMAT,
        "dtype": dtype.name,
        "vocab_size": int(vocab_size),
        "tokenizer_vocab_size": tok_vocab,
        "train_tokens": int(n_train),
        "val_tokens": int(n_val),
        "corpus": corpus,
        "text_field": text_field,
        "special_ids": special,
        "unigram_entropy_nats": _entropy(counts),
        "seed": int(seed),
        "documents": sum(int(r["documents"]) for r in records),
        "input_bytes": sum(p.size for p in pieces),
        "skipped_files": {"count": len(skipped), "first": skipped[:10]},
        "content_sha256": content.hexdigest(),
        "shards": shards,
        "document_starts": {"file": DOCUMENT_STARTS, "count": write_document_starts(stage, records)},
    }


def _stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def prepare_corpus(
    corpus: str,
    out_dir: str,
    tokenizer_path: str | None,
    vocab_size: int,
    val_fraction: float,
    seed: int = 0,
    *,
    text_field: str = "text",
    workers: int = 1,
    piece_bytes: int = 64 << 20,
    tokenizer_sample_bytes: int = 100_000_000,
    sync: Sync | None = None,
    log: Callable[[str], None] | None = None,
    identity: dict[str, Any] | None = None,
    tokenizer: OpenedTokenizer | None = None,
) -> dict[str, Any]:
    """Tokenize ``corpus`` into token shards under ``out_dir`` (see the module docstring).

    The token stream is ``BOS doc0 EOD doc1 EOD ... docN EOD`` (BOS omitted if the tokenizer has
    none; EOD falls back to EOS, and is omitted if neither exists). The last ``val_fraction`` of the
    stream (cut at a token position, so a single-document corpus still gets both splits) is the
    validation split. Memory is bounded by ``workers`` × a batch (about 1 MiB of text) plus one
    document, whatever the corpus size.

    Args:
        corpus: Anything :func:`shardlm.data.readers.plan_pieces` accepts.
        out_dir: Output directory (created; parents too); an existing one is replaced when done.
        tokenizer_path: A ``tokenizer.json`` to use, or ``None``/``""`` to train a byte-level BPE
            with ``vocab_size`` ids on a sample of at most ``tokenizer_sample_bytes`` of the corpus,
            chosen with ``seed`` (the same corpus and seed give the same tokenizer).
        vocab_size: Model vocabulary size (number of embedding rows); decides the file dtype
            (uint16 if ``<= 65536`` else uint32).
        val_fraction: Fraction of tokens in the validation split, in (0, 1).
        seed: Seed of the tokenizer sample; recorded in ``meta.json``.
        text_field: JSONL field / Parquet and dataset column holding the text.
        workers: Encoding processes of this rank (>= 1).
        piece_bytes: Input bytes per piece, the unit shared between ranks and reused on restart.
        tokenizer_sample_bytes: Most text the tokenizer is trained on, in bytes.
        sync: How the ranks wait for each other under torchrun; None for one process.
        log: Where progress lines go (default: stderr on rank 0).
        identity: What the data is made from (:func:`shardlm.data.identity.describe_corpus` of these
            arguments, taken before reading), when the caller has it already; None: rank 0 takes it.
        tokenizer: ``tokenizer_path`` already opened (a mixture's, for each source); None: each rank opens
            it once (rank 0 the given one or trains it, the others the staged copy) and hands it down.

    Returns:
        The meta dict, also written to ``meta.json``: ``format`` ("shards"), ``dtype`` (str),
        ``vocab_size``, ``tokenizer_vocab_size``, ``train_tokens``, ``val_tokens`` (token counts),
        ``corpus``, ``text_field``, ``special_ids`` ({"bos","eos","eod"} -> id or None),
        ``unigram_entropy_nats`` (entropy of the train unigram distribution, natural log),
        ``seed``, ``documents``, ``input_bytes``, ``skipped_files`` ({"count", "first"}: files of a
        directory that were not read), ``content_sha256`` (over the tokenizer and every shard),
        ``shards`` ([{"file", "tokens"}] in stream order), ``document_starts`` ({"file", "count"}: where
        each document starts, for block-causal attention), ``model_special_ids`` (the bos/eos/pad ids
        a model trained on it writes, see :func:`shardlm.data.tokenizer_files.model_special_ids`),
        ``identity`` (what it was made from: the inputs, tokenizer files, text field and settings, see
        :mod:`shardlm.data.identity`).

    Raises:
        DataError: any reader error (naming the file and line or row), a tokenizer error;
            ``val_fraction`` not in (0, 1); the tokenizer has more ids than ``vocab_size``; either
            split would be empty; ``out_dir`` is a file; another rank failed. ``out_dir`` is then
            left as it was.
    """
    if not (0.0 < val_fraction < 1.0):
        raise DataError(f"val_fraction must be in (0, 1), got {val_fraction}")
    if vocab_size < 1:
        raise DataError(f"vocab_size must be positive, got {vocab_size}")
    if workers < 1:
        raise DataError(f"workers must be >= 1, got {workers}")
    rank, world = (sync.rank, sync.world_size) if sync is not None else (0, 1)
    say = log or (_stderr if rank == 0 else (lambda _m: None))
    out = pathlib.Path(out_dir).expanduser()
    if out.exists() and not out.is_dir():
        raise DataError(f"output path exists and is not a directory: {out_dir}")
    for ancestor in out.absolute().parents:
        if ancestor.exists():
            if not ancestor.is_dir():
                raise DataError(f"cannot create {out_dir}: a parent is a file: {ancestor}")
            break
    stage = staging_dir(out)
    try:
        pieces, skipped = plan_pieces(corpus, text_field, piece_bytes)
        dtype = token_dtype(vocab_size)
        if rank == 0:
            if identity is None:  # before reading: a change made while preparing shows next time
                identity = describe_corpus(corpus, text_field, tokenizer_path, vocab_size, val_fraction,
                                           piece_bytes, tokenizer_sample_bytes)
            for spec in dict.fromkeys(p.path for p in pieces if p.kind == "hf"):
                note = dataset_dict_note(spec)
                if note:
                    say(note)
            stage.parent.mkdir(parents=True, exist_ok=True)
            fingerprint = _fingerprint(pieces, tokenizer_path, vocab_size, text_field, seed,
                                       tokenizer_sample_bytes)
            tokenizer = _stage(corpus, stage, fingerprint, pieces, tokenizer_path, vocab_size, text_field,
                               seed, tokenizer_sample_bytes, say, tokenizer)
            if sync is not None:
                sync.publish("staged")
        elif sync is not None:
            sync.wait("staged", "the tokenizer (rank 0)")
        tok = tokenizer.tokenizer if tokenizer is not None else load_tokenizer(str(stage / "tokenizer.json"))
        tok_vocab = int(tok.get_vocab_size())
        if tok_vocab > vocab_size:
            raise DataError(
                f"tokenizer has {tok_vocab} tokens but vocab_size is {vocab_size}: "
                f"the model's vocab must hold every token id (set vocab_size >= {tok_vocab})"
            )
        special = special_token_ids(tok)
        itemsize = dtype.itemsize
        mine = [(i, p) for i, p in enumerate(pieces) if i % world == rank]
        todo = [(i, p) for i, p in mine if piece_done(stage, i, itemsize) is None]
        reused = len(mine) - len(todo)
        if sync is not None and reused:
            sync.count("pieces", reused)
        t0 = time.perf_counter()
        todo_bytes = sum(p.size for _, p in todo)
        say(
            f"prepare: {len(pieces)} piece{'s' * (len(pieces) != 1)} "
            f"({sum(p.size for p in pieces) / 1e6:.1f} MB) from {corpus}"
            + (f"; {len(skipped)} files not read (e.g. {', '.join(skipped[:3])})" if skipped else "")
            + f"; rank {rank}/{world}: {len(todo)} to encode, {reused} finished before, {workers} "
            f"worker{'s' * (workers != 1)}"
        )
        last = [time.perf_counter()]
        done_bytes = [0]

        def on_piece(index: int, _rec: dict[str, Any]) -> None:
            done_bytes[0] += pieces[index].size
            if sync is not None:
                sync.count("pieces")
            now = time.perf_counter()
            if now - last[0] >= 10:
                last[0] = now
                say(f"prepare: rank {rank}: {done_bytes[0] / 1e6:.1f} / {todo_bytes / 1e6:.1f} MB, "
                    f"{done_bytes[0] / 1e6 / (now - t0):.2f} MB/s")

        encode_pieces(stage, todo, tok.to_str(), dtype, special["bos"], special["eod"], text_field, workers,
                      on_piece)
        if sync is not None:
            sync.count("ranks")
        if rank != 0:
            assert sync is not None
            sync.wait("final", "rank 0 to write meta.json")
            if not is_prepared(str(out)):
                raise DataError(f"rank {rank} on {socket.gethostname()} does not see the prepared data at "
                                f"{out} that rank 0 wrote: data.dir must be on a file system every node "
                                "shares")
            return load_meta(str(out))
        if sync is not None:
            sync.wait_count("ranks", world, "the other ranks' pieces",
                            lambda: f"{sync.count('pieces', 0)}/{len(pieces)} pieces")
        records = []
        for i in range(len(pieces)):
            rec = piece_done(stage, i, itemsize)
            if rec is None:
                raise DataError(f"piece {i} of {stage} is missing after every rank finished: is "
                                f"{stage.parent} on a file system every node shares?")
            records.append(rec)
        meta = _finalize(stage, pieces, records, corpus, dtype, vocab_size, tok_vocab, special, val_fraction,
                         seed, text_field, skipped)
        meta["model_special_ids"] = model_special_ids(tokenizer)
        assert identity is not None
        if not tokenizer_path:  # a trained tokenizer: its files as written
            identity = {**identity, "tokenizer": {**identity["tokenizer"],
                                                  "files": tokenizer_files(stage / "tokenizer.json")}}
        meta["identity"] = identity
        _write_json(stage / META_FILE, meta)
        (stage / _FINGERPRINT).unlink()
        _move_into_place(stage, out)
        elapsed = time.perf_counter() - t0
        say(f"prepare: wrote {out}: {meta['train_tokens'] + meta['val_tokens']:,} tokens from "
            f"{meta['documents']:,} documents; encoded {todo_bytes / 1e6:.1f} MB in {elapsed:.1f} s")
        if sync is not None:
            sync.publish("final")
        return meta
    except BaseException as exc:
        if sync is not None and isinstance(exc, Exception):
            sync.fail(f"{type(exc).__name__}: {exc}")
        raise
