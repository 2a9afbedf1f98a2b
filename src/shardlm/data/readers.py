"""Streaming corpus readers: one bounded piece of text at a time, never a whole file (the format readers, and
the names of :mod:`shardlm.data.pieces` that importers of this module use).

A corpus is cut into *pieces*, the unit of work that preparation shares between ranks and reuses
after a restart (see :mod:`shardlm.data.prepare`). The cut depends only on the files and
``piece_bytes``, never on the number of workers or ranks, so every way of running gives the same
pieces:

* ``.txt`` / ``.md`` / ``.jsonl``: byte ranges of about ``piece_bytes``, each cut at a line start
  (found by seeking, no scan of the file);
* the same compressed (``.gz``, ``.zst``): one piece per file (a compressed stream cannot be
  entered in the middle); public corpora ship many such files, which is where the parallelism is;
* Parquet: consecutive row groups of about ``piece_bytes`` (uncompressed, from the footer);
* a Hugging Face ``datasets`` directory (``save_to_disk``; a ``DatasetDict``'s split as ``DIR:SPLIT``, its
  ``train`` split by default) or a cached dataset by name (``hf:NAME`` or ``hf:NAME:SPLIT``, offline): row
  ranges of about ``piece_bytes``.

Reading a piece yields :class:`Chunk` s of at most ``chunk_chars`` characters. A *document* is a
``.txt`` / ``.md`` file, one JSONL line, one Parquet or dataset row; a document longer than a chunk
is cut at line boundaries (so no string holds a large file) and only its last chunk carries
``ends_document``. Cuts prefer a newline, then a space, between two non-whitespace characters (piece
boundaries of a large file: such a newline), where byte-level BPE tokenizers split anyway: there the
chunks encode to exactly the tokens of the whole document. Text is never altered except ``.md`` (light
Markdown stripped, see :func:`strip_markdown`); whitespace-only documents are skipped.

Every bad input is one :class:`DataError` naming the file and, where it applies, the line or row.

Files: :mod:`shardlm.data.pieces` finds the inputs and cuts the pieces, :mod:`shardlm.data.streams` reads a
piece's bytes (decompressed) and decodes them, this module turns them into chunks per format.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from typing import Any

from shardlm.data import pieces, streams
from shardlm.data.corpus import DataError, strip_markdown
from shardlm.data.pieces import (
    DATA_EXTRA_HINT,
    Piece,
    dataset_dict_note,
    expand_corpus,
    hf_dataset,
    optional_module,
    plan_pieces,
    readable_kind,
)

__all__ = [
    "Chunk",
    "Piece",
    "DATA_EXTRA_HINT",
    "dataset_dict_note",
    "expand_corpus",
    "hf_dataset",
    "plan_pieces",
    "read_documents",
    "read_piece",
    "readable_kind",
]

CHUNK_CHARS = 1 << 14
"""Default longest chunk in characters. HF ``tokenizers`` encodes long strings more slowly per byte
(measured here on one thread, the same text cut at line ends: 16 KiB 3.96-4.00 MB/s, 32 KiB 3.73,
64 KiB 2.88, 1 MiB 1.4-2.3); 16 KiB is as fast as documents of 4 KB, and keeps a worker's encodings small."""


@dataclasses.dataclass(frozen=True)
class Chunk:
    """A bounded piece of one document's text.

    Attributes:
        text: The text (``str``, at most about ``chunk_chars`` characters).
        ends_document: True on the last chunk of a document (an end-of-document token follows it).
    """

    text: str
    ends_document: bool


def _cut(text: str, start: int, end: int, spaces: bool = True) -> int:
    """Where a chunk that starts at ``start`` and may reach ``end`` (``end < len(text)``) ends.

    Preferably just after a newline with a non-whitespace character on both sides, else just before a space
    with a non-whitespace character on both sides (the space begins the next chunk): byte-level BPE
    pre-tokenizers (GPT-2, Llama 3, Qwen, SmolLM and shardlm's own) split there anyway, so such a cut leaves
    the tokens exactly as encoding the whole document would. Otherwise after the last newline, otherwise at
    ``end`` (moved back one character so as not to split a ``\r\n``). Without ``spaces`` (Markdown, which is
    stripped line by line) no cut falls inside a line when a newline exists.
    """
    for sep, after in (("\n", 1), (" ", 0)) if spaces else (("\n", 1),):
        i = text.rfind(sep, start, end)
        while i > start:
            if not text[i - 1].isspace() and not text[i + 1].isspace():
                return i + after
            i = text.rfind(sep, start, i)
    last_newline = text.rfind("\n", start, end)
    if last_newline >= start:
        return last_newline + 1
    return end - 1 if text[end - 1] == "\r" and end - 1 > start else end


def _split_text(
    text: str, chunk_chars: int, final: bool = True, spaces: bool = True
) -> tuple[list[str], str]:
    """``text`` cut into parts of at most ``chunk_chars`` characters (see :func:`_cut`, with ``spaces``).

    Returns:
        ``(parts, rest)``: with ``final`` the last part is in ``parts`` and ``rest`` is ``""``;
        without it the last, shorter part is returned as ``rest`` for the caller to put before the
        text that follows, so the end of ``text`` is not a forced cut.
    """
    parts, start = [], 0
    while len(text) - start > chunk_chars:
        cut = _cut(text, start, start + chunk_chars, spaces)
        parts.append(text[start:cut])
        start = cut
    rest = text[start:]
    if final and rest:
        parts.append(rest)
        rest = ""
    return parts, rest


def _read_text(piece: Piece, chunk_chars: int) -> Iterator[Chunk]:
    """A .txt/.md file (one document) or its byte range: line-cut chunks; the file's end ends it.

    Leading whitespace-only chunks of a file are skipped, so a whitespace-only file gives nothing.
    """
    whole_end = piece.end < 0 or piece.end >= piece.stamp[0]
    begun = piece.start > 0  # the document started in an earlier piece
    first = piece.start == 0
    offset = piece.start
    lineno = 1 if piece.compression else None
    pending: str | None = None  # one chunk held back, so the last one can carry ends_document
    rest = ""  # the text after the last cut, read on with the next block
    spaces = piece.kind != "markdown"
    blocks = streams.blocks(piece)
    while True:
        block = next(blocks, None)
        if block is not None:
            text = streams.decode(block, piece, offset, lineno)
            offset += len(block)
            if lineno is not None:
                lineno += block.count(b"\n")
            parts, rest = _split_text(rest + text, chunk_chars, final=False, spaces=spaces)
        else:
            parts, rest = _split_text(rest, chunk_chars, spaces=spaces)
        for part in parts:
            if pending is not None:
                out = _clean(pending, piece.kind, first, last=False)
                first = False
                begun = begun or bool(out.strip())
                if begun and out:
                    yield Chunk(out, False)
            pending = part
        if block is None:
            break
    if pending is not None:
        out = _clean(pending, piece.kind, first, last=whole_end)
        if begun or out.strip():
            yield Chunk(out, whole_end)


def _clean(text: str, kind: str, first: bool, last: bool) -> str:
    """Markdown stripped (per chunk; lines are never joined), blank lines trimmed at the file's ends."""
    if kind != "markdown":
        return text
    text = strip_markdown(text, strip_ends=False)
    if first:
        text = text.lstrip("\n")
    if last:
        text = text.rstrip("\n")
    return text


def _document(text: str, chunk_chars: int) -> Iterator[Chunk]:
    parts, _ = _split_text(text, chunk_chars)
    for i, part in enumerate(parts):
        yield Chunk(part, i == len(parts) - 1)


def _read_jsonl(piece: Piece, text_field: str, chunk_chars: int) -> Iterator[Chunk]:
    base: int | None = 1 if piece.compression else None  # line number of the piece's first line
    rel = 0  # lines of this piece before the current one

    def where() -> str:
        nonlocal base
        if base is None:  # counted only for an error message
            base = streams.line_of(piece.path, piece.start)
        return f"{piece.path}:{base + rel}"

    for block in streams.blocks(piece):
        lines = block.split(b"\n")
        if lines and not lines[-1]:
            lines.pop()  # the block ends with a newline
        for raw in lines:
            if raw.strip():
                try:
                    record = json.loads(raw)
                except UnicodeDecodeError as exc:
                    raise DataError(f"{where()}: not valid UTF-8 text ({exc.reason})") from None
                except json.JSONDecodeError as exc:
                    if not _is_utf8(raw):
                        raise DataError(f"{where()}: not valid UTF-8 text") from None
                    raise DataError(f"{where()}: invalid JSON ({exc.msg})") from None
                if not isinstance(record, dict):
                    raise DataError(f"{where()}: expected a JSON object with a {text_field!r} field")
                if text_field not in record:
                    raise DataError(f"{where()}: missing field {text_field!r} (set data.text_field)")
                text = record[text_field]
                if not isinstance(text, str):
                    raise DataError(f"{where()}: field {text_field!r} must be a string, got "
                                    f"{type(text).__name__}")
                if text.strip():
                    yield from _document(text, chunk_chars)
            rel += 1


def _is_utf8(raw: bytes) -> bool:
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def _column_texts(values: list[Any], path: str, first_row: int, text_field: str,
                  chunk_chars: int) -> Iterator[Chunk]:
    for i, text in enumerate(values):
        if not isinstance(text, str):
            got = "null" if text is None else type(text).__name__
            raise DataError(f"{path}: row {first_row + i}: column {text_field!r} must be a string, got {got}")
        if text.strip():
            yield from _document(text, chunk_chars)


def _read_parquet(piece: Piece, text_field: str, chunk_chars: int) -> Iterator[Chunk]:
    pq = optional_module("pyarrow.parquet", "Parquet files")
    try:
        pf = pq.ParquetFile(piece.path, buffer_size=pieces.READ_BLOCK, pre_buffer=False)
    except Exception as exc:
        raise DataError(f"{piece.path}: not a readable Parquet file ({exc})") from None
    if text_field not in pf.schema_arrow.names:
        raise DataError(f"{piece.path}: no column {text_field!r} (columns: "
                        f"{', '.join(pf.schema_arrow.names)}); set data.text_field")
    row = sum(pf.metadata.row_group(g).num_rows for g in range(piece.start))
    batches = pf.iter_batches(batch_size=256, row_groups=list(range(piece.start, piece.end)),
                              columns=[text_field], use_threads=False)
    while True:
        try:
            batch = next(batches)
        except StopIteration:
            break
        except Exception as exc:  # pyarrow raises ArrowInvalid/OSError for corrupt pages
            raise DataError(f"{piece.path}: cannot read rows from {row} ({exc})") from None
        values = batch.column(0).to_pylist()
        yield from _column_texts(values, piece.path, row, text_field, chunk_chars)
        row += len(values)


def _read_hf(piece: Piece, text_field: str, chunk_chars: int) -> Iterator[Chunk]:
    ds = hf_dataset(piece.path).select_columns([text_field]).with_format("arrow")
    for a in range(piece.start, piece.end, 256):
        b = min(piece.end, a + 256)
        values = ds[a:b][text_field].to_pylist()
        yield from _column_texts(values, piece.path, a, text_field, chunk_chars)


def read_piece(piece: Piece, text_field: str = "text", chunk_chars: int = CHUNK_CHARS) -> Iterator[Chunk]:
    """The chunks of one piece, in order (see the module docstring).

    Args:
        piece: From :func:`plan_pieces`.
        text_field: JSONL field / column holding the text.
        chunk_chars: Longest chunk in characters (a longer document is cut at line ends).

    Yields:
        :class:`Chunk` s; memory is bounded by about 4 MiB of input plus one document.

    Raises:
        DataError: naming the file and line (text, JSONL) or row (Parquet, datasets): not UTF-8;
            invalid JSON, not an object, a missing or non-string field; a corrupt or truncated
            ``.gz``/``.zst``; an unreadable Parquet file or one without the column.
    """
    if piece.kind in ("text", "markdown"):
        return _read_text(piece, chunk_chars)
    if piece.kind == "jsonl":
        return _read_jsonl(piece, text_field, chunk_chars)
    if piece.kind == "parquet":
        return _read_parquet(piece, text_field, chunk_chars)
    if piece.kind == "hf":
        return _read_hf(piece, text_field, chunk_chars)
    raise DataError(f"unknown piece kind {piece.kind!r}")  # pragma: no cover


def read_documents(corpus: str, text_field: str = "text") -> list[str]:
    """Every document of ``corpus`` as one string (small corpora only: all of it is held in memory).

    Args:
        corpus: Anything :func:`plan_pieces` accepts.
        text_field: JSONL field / column holding the text.

    Returns:
        The documents in the order preparation encodes them; whitespace-only documents are dropped.

    Raises:
        DataError: any error of :func:`plan_pieces` / :func:`read_piece`, or no non-whitespace text
            at all ("empty corpus").
    """
    docs: list[str] = []
    parts: list[str] = []
    pieces, _ = plan_pieces(corpus, text_field)
    for piece in pieces:
        for chunk in read_piece(piece, text_field):
            parts.append(chunk.text)
            if chunk.ends_document:
                doc = "".join(parts)
                parts = []
                if doc.strip():
                    docs.append(doc)
    if not docs:
        raise DataError(f"empty corpus: {corpus!r} contains no non-whitespace text")
    return docs
