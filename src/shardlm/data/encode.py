"""Encoding pieces into token shard files, in this process or in worker processes.

The process that prepares reads each piece (:func:`shardlm.data.readers.read_piece`), groups its
chunks into batches of about ``batch_chars`` characters and hands them to ``workers`` encoding
processes (``spawn``: no copy of a torch or gloo state, each worker imports only ``tokenizers`` and
numpy). A worker runs ``Tokenizer.encode_batch_fast`` on the batch with one thread and returns one
numpy array of token ids (the binding gives a list per document, turned into the array at once; no
per-token objects outlive a batch). Results come back in submission order, at most
``2 × workers`` batches in flight, and are appended to the piece's shard file as they arrive: memory
is bounded by workers × batch, not by the corpus. With ``workers == 1`` the batches are encoded in
this process (also single-threaded), which gives the same bytes.

Shard file of piece ``i``: ``tokens/<i:06d>.bin``, raw little-endian token ids; piece 0 starts with
BOS, each document ends with EOD (when the tokenizer has them). It is written as ``.bin.tmp`` and
renamed when complete, beside ``tokens/<i:06d>.ends`` (int64, little-endian: the position within the piece
just after each document that ends in it, its EOD included; where documents start, kept whether or not the
tokenizer has an EOD); then ``tokens/<i:06d>.json`` records ``tokens``, ``documents`` and the token file's
``sha256``. A piece is finished exactly when that record exists and matches both files' sizes.
"""

from __future__ import annotations

import collections
import concurrent.futures
import hashlib
import json
import multiprocessing
import os
import pathlib
import signal
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import numpy as np
from tokenizers import Tokenizer

from shardlm.data.readers import Chunk, Piece, read_piece

__all__ = ["encode_pieces", "piece_done", "shard_name", "write_document_starts", "PieceRecord",
           "DOCUMENT_STARTS"]

DOCUMENT_STARTS = "document_starts.bin"
"""File of a prepared directory: int64 stream positions where each document starts (see
:func:`write_document_starts`)."""

_tok: Tokenizer | None = None
_dtype: np.dtype | None = None
_eod: int | None = None

PieceRecord = dict[str, Any]
"""``{"tokens": int, "documents": int, "sha256": str}`` of one finished piece."""


def shard_name(index: int) -> str:
    """File name of piece ``index``'s token shard, relative to the dataset directory."""
    return f"tokens/{index:06d}.bin"


def _init(tokenizer_json: str, dtype: str, eod: int | None) -> None:
    """Load the tokenizer (one thread: parallelism comes from processes)."""
    global _tok, _dtype, _eod
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _tok = Tokenizer.from_str(tokenizer_json)
    _dtype = np.dtype(dtype)
    _eod = eod


def _init_worker(tokenizer_json: str, dtype: str, eod: int | None) -> None:
    """A pool worker's :func:`_init`, ignoring SIGINT: a Ctrl-C reaches the whole process group, and only the
    parent is to take it (it stops the pool and reports one line; each worker printed its own traceback).
    The worker was started with SIGINT blocked (:func:`_submit`), so none arrives before this."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    _init(tokenizer_json, dtype, eod)


def _submit(pool: concurrent.futures.ProcessPoolExecutor, *args: Any) -> concurrent.futures.Future:
    """``pool.submit(encode_batch, *args)`` with SIGINT blocked in this thread: a worker the pool starts here
    inherits the mask through exec, until :func:`_init_worker` ignores SIGINT. A Ctrl-C meanwhile stays
    pending for this process (or goes to another of its threads), never lost."""
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        return pool.submit(encode_batch, *args)
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


def encode_batch(texts: list[str], ends: list[bool]) -> tuple[np.ndarray, np.ndarray]:
    """Token ids of ``texts`` concatenated, EOD after each text whose ``ends`` is True.

    Returns:
        1-D array of the worker's dtype (uint16 or uint32), and int64 positions in it just after each
        document that ends (one per True of ``ends``; its EOD, when there is one, before that position).
    """
    assert _tok is not None and _dtype is not None
    encodings = _tok.encode_batch_fast(texts, add_special_tokens=False)
    lengths = [len(e.ids) for e in encodings]
    n_eod = sum(ends) if _eod is not None else 0
    out = np.empty(sum(lengths) + n_eod, dtype=_dtype)
    doc_ends = np.empty(sum(ends), dtype=np.int64)
    pos = k = 0
    for enc, n, end in zip(encodings, lengths, ends):
        out[pos : pos + n] = enc.ids
        pos += n
        if end and _eod is not None:
            out[pos] = _eod
            pos += 1
        if end:
            doc_ends[k] = pos
            k += 1
    return out, doc_ends


def piece_done(root: pathlib.Path, index: int, itemsize: int) -> PieceRecord | None:
    """The record of a finished piece under ``root``, or None when it is missing or does not match
    its file."""
    rec_path = root / shard_name(index).replace(".bin", ".json")
    bin_path = root / shard_name(index)
    try:
        rec = json.loads(rec_path.read_text())
        if (bin_path.stat().st_size == int(rec["tokens"]) * itemsize
                and bin_path.with_suffix(".ends").stat().st_size == int(rec["documents"]) * 8):
            return rec
    except (OSError, ValueError, KeyError, TypeError):
        pass
    return None


class _Writer:
    """Appends one piece's token arrays to ``<shard>.bin.tmp``; :meth:`finish` renames it and writes
    the record."""

    def __init__(self, root: pathlib.Path, index: int, first: np.ndarray | None) -> None:
        self.root, self.index = root, index
        self.path = root / shard_name(index)
        self.tmp = self.path.with_suffix(".bin.tmp")
        self.file = open(self.tmp, "wb")
        self.ends_path = self.path.with_suffix(".ends")
        self.ends_tmp = self.path.with_suffix(".ends.tmp")
        self.ends_file = open(self.ends_tmp, "wb")
        self.sha = hashlib.sha256()
        self.tokens = 0
        self.documents = 0
        if first is not None:
            self.write((first, np.empty(0, dtype=np.int64)))

    def write(self, encoded: tuple[np.ndarray, np.ndarray]) -> None:
        ids, doc_ends = encoded
        data = ids.tobytes()
        self.file.write(data)
        self.sha.update(data)
        self.ends_file.write((doc_ends + self.tokens).astype("<i8").tobytes())
        self.tokens += int(ids.size)
        self.documents += int(doc_ends.size)

    def finish(self) -> PieceRecord:
        self.file.close()
        self.ends_file.close()
        os.replace(self.ends_tmp, self.ends_path)
        os.replace(self.tmp, self.path)
        rec = {"tokens": self.tokens, "documents": self.documents, "sha256": self.sha.hexdigest()}
        rec_path = self.path.with_suffix(".json")
        tmp = rec_path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(rec) + "\n")
        os.replace(tmp, rec_path)
        return rec

    def abort(self) -> None:
        self.file.close()
        self.ends_file.close()


class _Ready:
    """A finished result with the ``Future.result`` interface (the in-process path)."""

    def __init__(self, value: tuple[np.ndarray, np.ndarray]) -> None:
        self.value = value

    def result(self) -> tuple[np.ndarray, np.ndarray]:
        return self.value


def _batches(chunks: Iterable[Chunk], batch_chars: int) -> Iterator[tuple[list[str], list[bool]]]:
    texts: list[str] = []
    ends: list[bool] = []
    size = 0
    for chunk in chunks:
        texts.append(chunk.text)
        ends.append(chunk.ends_document)
        size += len(chunk.text)
        if size >= batch_chars:
            yield texts, ends
            texts, ends, size = [], [], 0
    if texts:
        yield texts, ends


def encode_pieces(
    root: pathlib.Path,
    todo: list[tuple[int, Piece]],
    tokenizer_json: str,
    dtype: np.dtype,
    bos: int | None,
    eod: int | None,
    text_field: str,
    workers: int,
    on_piece: Callable[[int, PieceRecord], None] | None = None,
    batch_chars: int = 1 << 20,
) -> None:
    """Encode each ``(index, piece)`` of ``todo`` into ``root/tokens/<index>.bin`` (see the module docstring).

    Args:
        root: Dataset (staging) directory; ``tokens/`` is created.
        todo: The pieces to encode with their global indices, in the order to encode them.
        tokenizer_json: The tokenizer, serialised (``Tokenizer.to_str()``).
        dtype: Token dtype of the shard files.
        bos: Id written first in piece 0, or None.
        eod: Id written after each document, or None.
        text_field: JSONL field / column of the text.
        workers: Encoding processes; 1 encodes in this process.
        on_piece: Called with ``(index, record)`` as each piece is finished.
        batch_chars: Characters per batch handed to a worker.

    Raises:
        DataError: from the readers (bad input); the unfinished piece keeps only a ``.bin.tmp``.
    """
    (root / "tokens").mkdir(parents=True, exist_ok=True)
    pool = None
    if workers > 1:
        pool = concurrent.futures.ProcessPoolExecutor(workers,
                                                      mp_context=multiprocessing.get_context("spawn"),
                                                      initializer=_init_worker,
                                                      initargs=(tokenizer_json, dtype.name, eod))
    else:
        saved = os.environ.get("TOKENIZERS_PARALLELISM")
        _init(tokenizer_json, dtype.name, eod)
    inflight: collections.deque[tuple[_Writer, Any]] = collections.deque()
    limit = 2 * max(1, workers)
    writers: list[_Writer] = []

    def drain_one() -> None:
        writer, result = inflight.popleft()
        if result is None:
            rec = writer.finish()
            writers.remove(writer)
            if on_piece is not None:
                on_piece(writer.index, rec)
        else:
            writer.write(result.result())

    try:
        for index, piece in todo:
            first = np.array([bos], dtype=dtype) if index == 0 and bos is not None else None
            writer = _Writer(root, index, first)
            writers.append(writer)
            for texts, ends in _batches(read_piece(piece, text_field), batch_chars):
                if pool is not None:
                    result: Any = _submit(pool, texts, ends)
                else:
                    result = _Ready(encode_batch(texts, ends))
                inflight.append((writer, result))
                while len(inflight) >= limit:
                    drain_one()
            inflight.append((writer, None))
        while inflight:
            drain_one()
    finally:
        for writer in writers:
            writer.abort()
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
        elif saved is None:
            os.environ.pop("TOKENIZERS_PARALLELISM", None)
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = saved


def write_document_starts(root: pathlib.Path, records: list[PieceRecord]) -> int:
    """Write ``root/document_starts.bin``: int64 little-endian, the stream position where each document starts
    (0 first; then just after each document's end, except the stream's end), from the pieces' ``.ends`` files.

    Returns:
        The number of starts written (the documents of the stream).
    """
    total = sum(int(r["tokens"]) for r in records)
    tmp = root / (DOCUMENT_STARTS + ".tmp")
    count, offset = 1, 0
    with open(tmp, "wb") as f:
        f.write(np.zeros(1, dtype="<i8").tobytes())
        for i, rec in enumerate(records):
            ends = np.fromfile(root / shard_name(i).replace(".bin", ".ends"), dtype="<i8") + offset
            ends = ends[ends < total]
            f.write(ends.tobytes())
            count += int(ends.size)
            offset += int(rec["tokens"])
    os.replace(tmp, root / DOCUMENT_STARTS)
    return count
