"""Streaming corpus readers: one bounded piece of text at a time, never a whole file.

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
"""

from __future__ import annotations

import dataclasses
import functools
import glob
import gzip
import importlib
import io
import json
import os
import pathlib
import zlib
from collections.abc import Iterator
from typing import Any

from shardlm.data.corpus import SHAKESPEARE, DataError, shakespeare_dir, strip_markdown

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

DATA_EXTRA_HINT = "install the data extra: pip install 'shardlm[data]'"

_TEXT_KINDS = {".txt": "text", ".md": "markdown", ".jsonl": "jsonl"}
_COMPRESSIONS = {".gz": "gz", ".zst": "zst"}
_HF_MARKERS = ("dataset_info.json", "state.json")
_READ_BLOCK = 1 << 20  # bytes read from a file at a time
CHUNK_CHARS = 1 << 14
"""Default longest chunk in characters. HF ``tokenizers`` encodes long strings more slowly per byte
(measured here on one thread, the same text cut at line ends: 16 KiB 3.96-4.00 MB/s, 32 KiB 3.73,
64 KiB 2.88, 1 MiB 1.4-2.3); 16 KiB is as fast as documents of 4 KB, and keeps a worker's encodings small."""
_SOFT = frozenset(range(0x21, 0x7F))  # bytes that are never whitespace nor part of a multi-byte character


@dataclasses.dataclass(frozen=True)
class Chunk:
    """A bounded piece of one document's text.

    Attributes:
        text: The text (``str``, at most about ``chunk_chars`` characters).
        ends_document: True on the last chunk of a document (an end-of-document token follows it).
    """

    text: str
    ends_document: bool


@dataclasses.dataclass(frozen=True)
class Piece:
    """One unit of preparation work: a byte range, a whole compressed file, row groups or rows.

    Attributes:
        kind: ``text`` | ``markdown`` | ``jsonl`` | ``parquet`` | ``hf``.
        path: The file (or dataset directory, or ``hf:NAME[:SPLIT]``).
        compression: ``""``, ``gz`` or ``zst``.
        start, end: Byte range ``[start, end)`` (text kinds, uncompressed; ``end`` -1 for a whole
            compressed file), row-group range (parquet) or row range (hf).
        size: Input bytes this piece covers (on disk; uncompressed for parquet), for balancing and logs.
        stamp: ``(file size, mtime in ns)`` of the file, so a restart can tell a changed input.
    """

    kind: str
    path: str
    compression: str
    start: int
    end: int
    size: int
    stamp: tuple[int, int] = (0, 0)

    def to_json(self) -> dict[str, Any]:
        """The piece as a JSON-able dict."""
        return dataclasses.asdict(self)


# --------------------------------------------------------------------------- discovery


def readable_kind(path: pathlib.Path) -> tuple[str, str] | None:
    """``(kind, compression)`` for a file this module reads, else None.

    ``x.jsonl.zst`` -> ``("jsonl", "zst")``, ``x.parquet`` -> ``("parquet", "")``; names are matched
    case-insensitively.
    """
    suffixes = [s.lower() for s in path.suffixes[-2:]]
    compression = ""
    if suffixes and suffixes[-1] in _COMPRESSIONS:
        compression = _COMPRESSIONS[suffixes[-1]]
        suffixes = suffixes[:-1]
    if not suffixes:
        return None
    ext = suffixes[-1]
    if ext in _TEXT_KINDS:
        return _TEXT_KINDS[ext], compression
    if ext == ".parquet" and not compression:
        return "parquet", ""
    return None


def _is_hf_dir(path: pathlib.Path) -> bool:
    return all((path / m).is_file() for m in _HF_MARKERS) or (path / "dataset_dict.json").is_file()


def _optional(module: str, what: str) -> Any:
    try:
        return importlib.import_module(module)
    except ImportError:
        raise DataError(f"reading {what} needs the '{module}' package; {DATA_EXTRA_HINT}") from None


def _expand(corpus: str) -> tuple[list[pathlib.Path | str], list[str]]:
    """The inputs of ``corpus`` in a fixed order, and the files of a directory that are not read."""
    if corpus == SHAKESPEARE:
        return sorted(shakespeare_dir().rglob("*.md")), []
    if corpus.startswith("hf:"):
        return [corpus], []
    if any(ch in corpus for ch in "*?["):
        matches = sorted(glob.glob(os.path.expanduser(corpus), recursive=True))
        if not matches:
            raise DataError(f"corpus glob matches nothing: {corpus}")
        inputs: list[pathlib.Path | str] = []
        skipped: list[str] = []
        for m in matches:
            p = pathlib.Path(m)
            if p.is_dir():
                sub, sub_skipped = _walk(p)
                inputs += sub
                skipped += sub_skipped
            elif readable_kind(p):
                inputs.append(p)
            else:
                skipped.append(str(p))
        return inputs, skipped
    p = pathlib.Path(corpus).expanduser()
    if not p.exists() and _split_spec(corpus) is not None:
        return [corpus], []  # DIR:SPLIT, a split of a saved DatasetDict
    if not p.exists():
        raise DataError(f"corpus path does not exist: {corpus}")
    if p.is_dir():
        return _walk(p)
    if readable_kind(p) is None:
        raise DataError(
            f"{p}: unsupported file extension (readable: .txt, .md, .jsonl, each also .gz/.zst; .parquet; "
            "a datasets save_to_disk directory; hf:NAME)"
        )
    return [p], []


def _split_spec(spec: str) -> tuple[str, str] | None:
    """``(DIR, SPLIT)`` when ``spec`` is ``DIR:SPLIT`` naming a split of an existing datasets directory, else None."""
    head, sep, split = spec.rpartition(":")
    if not sep or not head or not split or spec.startswith("hf:") or "/" in split:
        return None
    base = pathlib.Path(head).expanduser()
    return (str(base), split) if base.is_dir() and _is_hf_dir(base) else None


def expand_corpus(corpus: str) -> tuple[list[pathlib.Path | str], list[str]]:
    """The inputs of ``corpus`` in reading order (files, datasets directories, ``DIR:SPLIT`` and ``hf:`` specs as
    strings), and the files of a directory that are not read.

    Raises:
        DataError: as :func:`plan_pieces` (a path that does not exist, an unreadable file type, an empty glob).
    """
    return _expand(corpus)


def _walk(root: pathlib.Path) -> tuple[list[pathlib.Path | str], list[str]]:
    """Readable files (and HF dataset directories) below ``root`` sorted by relative path; the rest."""
    if _is_hf_dir(root):
        return [root], []
    found: list[pathlib.Path | str] = []
    skipped: list[str] = []
    for dirpath, dirnames, filenames in os.walk(root):
        d = pathlib.Path(dirpath)
        for name in list(dirnames):
            if _is_hf_dir(d / name):
                found.append(d / name)
                dirnames.remove(name)
        dirnames.sort()
        for name in filenames:
            f = d / name
            (found if readable_kind(f) else skipped).append(f if readable_kind(f) else str(f.relative_to(root)))
    found.sort(key=lambda f: pathlib.Path(f).relative_to(root).as_posix())
    skipped.sort()
    return found, skipped


# --------------------------------------------------------------------------- planning


def _stamp(path: pathlib.Path) -> tuple[int, int]:
    st = path.stat()
    return st.st_size, st.st_mtime_ns


def _line_cuts(path: pathlib.Path, size: int, piece_bytes: int) -> list[int]:
    """Offsets ``0 = c0 < c1 < ... < size`` of line starts about ``piece_bytes`` apart.

    Each cut is the first line start at or after its target whose newline has a printable ASCII
    byte on both sides (a cut the tokenizer cannot see, as in :func:`_cut`) within 1 MiB, else the
    first line start after the target (however far: a long line moves the cut, never ends the cutting).
    """
    cuts = [0]
    with open(path, "rb") as f:
        target = piece_bytes
        while target < size:
            f.seek(target - 1)
            window = f.read(_READ_BLOCK + 1)
            first = window.find(b"\n") + 1
            if first == 0:  # a line longer than the window: look on after it
                target += _READ_BLOCK
                continue
            if target - 1 + first >= size:
                break
            cut = first
            i = window.find(b"\n", 1)
            while 0 < i < len(window) - 1:
                if window[i - 1] in _SOFT and window[i + 1] in _SOFT:
                    cut = i + 1
                    break
                i = window.find(b"\n", i + 1)
            pos = target - 1 + cut
            cuts.append(pos)
            target = pos + piece_bytes
    cuts.append(size)
    return cuts


@functools.lru_cache(maxsize=4)
def _hf_dataset(spec: str) -> Any:
    """Open a ``save_to_disk`` directory or ``hf:NAME[:SPLIT]`` from the local cache (offline; memory-mapped,
    so an open dataset costs little memory; the last few are kept open)."""
    if spec.startswith("hf:"):  # no downloads at run time: offline before datasets reads its settings
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    datasets = _optional("datasets", "Hugging Face datasets")
    if spec.startswith("hf:"):
        name, _, split = spec[3:].partition(":")
        datasets.config.HF_HUB_OFFLINE = True  # also when datasets was imported before
        try:
            return datasets.load_dataset(name, split=split or "train")
        except Exception as exc:  # datasets raises many types for a missing cache entry
            raise DataError(f"{spec}: cannot load the dataset from the local Hugging Face cache "
                            f"(offline): {exc}") from None
    root = _saved_root(spec)
    if _saved_empty(root):
        raise DataError(f"empty corpus: {spec} has 0 rows")
    try:
        return datasets.load_from_disk(str(root))
    except Exception as exc:
        raise DataError(f"{root}: cannot read the datasets directory ({exc})") from None


def _saved_root(spec: str) -> pathlib.Path:
    """The directory of the one dataset a ``save_to_disk`` directory or ``DIR:SPLIT`` names (a DatasetDict's split).

    Raises:
        DataError: a split the DatasetDict lacks, no ``train`` split when none is named, a split named on a
            single dataset.
    """
    named = _split_spec(spec) if not pathlib.Path(spec).expanduser().exists() else None
    path, split = named if named is not None else (spec, "")
    root = pathlib.Path(path).expanduser()
    splits = _dict_splits(root)
    if splits is not None:  # a DatasetDict: read only the split it needs
        if split and split not in splits:
            raise DataError(f"{spec}: the DatasetDict has no split {split!r} (splits: {', '.join(splits)})")
        if not split and "train" not in splits:
            raise DataError(f"{spec}: a DatasetDict without a 'train' split (splits: {', '.join(splits)}); "
                            f"name one as {spec}:SPLIT")
        return root / (split or "train")
    if split:
        raise DataError(f"{spec}: {path} is a single dataset, not a DatasetDict with splits: drop ':{split}'")
    return root


def _saved_empty(root: pathlib.Path) -> bool:
    """True for a dataset saved with 0 rows: ``datasets`` writes no data file then (and cannot load it back)."""
    try:
        state = json.loads((root / "state.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(state, dict) and state.get("_data_files") == []


def _dict_splits(path: pathlib.Path) -> list[str] | None:
    """The splits a saved ``DatasetDict`` lists in its ``dataset_dict.json``; None for anything else."""
    try:
        splits = json.loads((path / "dataset_dict.json").read_text(encoding="utf-8"))["splits"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return [str(x) for x in splits] if isinstance(splits, list) else None


def hf_dataset(spec: str) -> Any:
    """The dataset a ``save_to_disk`` directory, ``DIR:SPLIT`` or ``hf:NAME[:SPLIT]`` names (offline, cached).

    A ``DatasetDict`` directory without a split gives its ``train`` split (see :func:`dataset_dict_note`).

    Raises:
        DataError: unreadable directory, a missing split (the message lists the splits), a split named on
            a single dataset, ``hf:NAME`` not in the local cache, the ``datasets`` package missing.
    """
    return _hf_dataset(spec)


def dataset_dict_note(spec: str) -> str | None:
    """A note when ``spec`` is a saved ``DatasetDict`` read without naming a split: the split read (``train``)
    and the splits left out, with how to name one; None otherwise (a single dataset, a named split, one split)."""
    splits = None if spec.startswith("hf:") else _dict_splits(pathlib.Path(spec).expanduser())
    if not splits:
        return None
    others = [s for s in splits if s != "train"]
    if not others:
        return None
    return (f"note: {spec} is a DatasetDict with splits {', '.join(splits)}: read 'train', not read "
            f"{', '.join(repr(s) for s in others)} (name a split as {spec}:SPLIT)")


def _plan_file(item: pathlib.Path | str, text_field: str, piece_bytes: int) -> list[Piece]:
    if isinstance(item, str) or item.is_dir():  # a datasets directory or hf:NAME
        spec = str(item)
        if not spec.startswith("hf:") and _saved_empty(_saved_root(spec)):
            return []  # 0 rows (an error only when the whole corpus is empty: see plan_pieces)
        ds = _hf_dataset(spec)
        if text_field not in ds.column_names:
            raise DataError(f"{spec}: no column {text_field!r} (columns: {', '.join(ds.column_names)}); "
                            "set data.text_field")
        rows = len(ds)
        nbytes = max(1, int(ds.data.nbytes))
        per_piece = max(1, int(rows * piece_bytes / nbytes))
        return [Piece("hf", spec, "", a, min(rows, a + per_piece), int(nbytes * (min(rows, a + per_piece) - a) / rows))
                for a in range(0, rows, per_piece)]
    kind, compression = readable_kind(item)  # type: ignore[misc]
    stamp = _stamp(item)
    size = stamp[0]
    if kind == "parquet":
        pq = _optional("pyarrow.parquet", "Parquet files")
        try:
            meta = pq.ParquetFile(item).metadata
        except Exception as exc:
            raise DataError(f"{item}: not a readable Parquet file ({exc})") from None
        names = meta.schema.names
        if text_field not in names:
            raise DataError(f"{item}: no column {text_field!r} (columns: {', '.join(names)}); set data.text_field")
        pieces, start, acc = [], 0, 0
        for g in range(meta.num_row_groups):
            acc += meta.row_group(g).total_byte_size
            if acc >= piece_bytes or g == meta.num_row_groups - 1:
                pieces.append(Piece(kind, str(item), "", start, g + 1, acc, stamp))
                start, acc = g + 1, 0
        return pieces
    if compression:
        return [Piece(kind, str(item), compression, 0, -1, size, stamp)]
    if size == 0:
        return []
    cuts = _line_cuts(item, size, piece_bytes)
    return [Piece(kind, str(item), "", a, b, b - a, stamp) for a, b in zip(cuts, cuts[1:])]


def plan_pieces(corpus: str, text_field: str = "text", piece_bytes: int = 64 << 20) -> tuple[list[Piece], list[str]]:
    """Cut ``corpus`` into pieces, in a fixed order that depends only on the inputs.

    Args:
        corpus: ``shakespeare``; a file (``.txt``, ``.md``, ``.jsonl``, each also ``.gz``/``.zst``;
            ``.parquet``); a ``datasets`` ``save_to_disk`` directory (``DIR:SPLIT`` names a split of a
            ``DatasetDict``, ``train`` by default); ``hf:NAME`` or
            ``hf:NAME:SPLIT`` (a dataset in the local Hugging Face cache, offline; split ``train`` by
            default); a directory (read recursively, sorted by relative path); or a glob
            (``data/**/*.jsonl.zst``).
        text_field: Field of a JSONL object / column of Parquet and datasets that holds the text.
        piece_bytes: Target input bytes per piece (> 0).

    Returns:
        ``(pieces, skipped)``: the pieces, and the files of a directory that are not read
        (relative paths, sorted).

    Raises:
        DataError: the path does not exist; a file type is not readable; a glob matches nothing; a
            directory holds nothing readable (the message names what it holds); a Parquet file or
            dataset lacks ``text_field``; a format library is missing (names the extra); a split that
            the DatasetDict lacks (the splits listed); every dataset of the corpus has 0 rows ("0 rows").
    """
    if piece_bytes <= 0:
        raise DataError(f"piece_bytes must be positive, got {piece_bytes}")
    inputs, skipped = _expand(corpus)
    if not inputs:
        held = f"{len(skipped)} files, e.g. {', '.join(skipped[:5])}" if skipped else "no files"
        raise DataError(f"empty corpus: {corpus} holds nothing readable ({held}; readable: .txt, .md, .jsonl, each also "
                        ".gz/.zst; .parquet; datasets directories)")
    pieces = [p for item in inputs for p in _plan_file(item, text_field, piece_bytes)]
    if not pieces:
        empty = [str(i) for i in inputs if (isinstance(i, str) or i.is_dir())
                 and (not str(i).startswith("hf:") and _saved_empty(_saved_root(str(i))) or len(_hf_dataset(str(i))) == 0)]
        if empty:
            raise DataError(f"empty corpus: {corpus} has 0 rows" + (f" ({', '.join(empty)})" if empty != [corpus] else ""))
    return pieces, skipped


# --------------------------------------------------------------------------- reading


def _open_binary(piece: Piece) -> io.BufferedIOBase:
    """The piece's bytes as a stream: a seeked file (positioned at ``start``) or a decompressor."""
    raw = open(piece.path, "rb")
    if piece.compression == "gz":
        return gzip.GzipFile(fileobj=raw, mode="rb")  # type: ignore[return-value]
    if piece.compression == "zst":
        return io.BufferedReader(_ZstdStream(raw), buffer_size=_READ_BLOCK)  # type: ignore[return-value]
    raw.seek(piece.start)
    return raw  # type: ignore[return-value]


class _ZstdStream(io.RawIOBase):
    """Decompresses a ``.zst`` file frame after frame; a file that ends inside a frame is an error.

    (``zstandard``'s ``stream_reader`` returns a truncated stream's data and then a clean end of file.)
    """

    def __init__(self, raw: io.BufferedReader) -> None:
        self.zstd = _optional("zstandard", ".zst files")
        self.raw = raw
        self.dobj = self.zstd.ZstdDecompressor().decompressobj()
        self.in_frame = False
        self.pending = b""

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        while not self.pending:
            data = self.raw.read(_READ_BLOCK)
            if not data:
                if self.in_frame:
                    raise EOFError("the file ends inside a zstd frame (truncated)")
                return 0
            while data:
                self.in_frame = True
                self.pending += self.dobj.decompress(data)
                data = b""
                if self.dobj.eof:  # frame complete: the rest starts a new frame
                    data = self.dobj.unused_data
                    self.dobj = self.zstd.ZstdDecompressor().decompressobj()
                    self.in_frame = False
        n = min(len(buffer), len(self.pending))
        buffer[:n] = self.pending[:n]
        self.pending = self.pending[n:]
        return n

    def close(self) -> None:
        self.raw.close()
        super().close()


def _stream_errors(piece: Piece) -> tuple[type[BaseException], ...]:
    errors: list[type[BaseException]] = [OSError, EOFError, zlib.error]
    if piece.compression == "zst":
        errors.append(_optional("zstandard", ".zst files").ZstdError)
    return tuple(errors)


def _line_of(path: str, offset: int) -> int:
    """1-based line number of byte ``offset`` of an uncompressed file (counted only on an error path)."""
    n = 1
    with open(path, "rb") as f:
        left = offset
        while left > 0:
            block = f.read(min(_READ_BLOCK, left))
            if not block:
                break
            n += block.count(b"\n")
            left -= len(block)
    return n


def _blocks(piece: Piece) -> Iterator[bytes]:
    """The piece's bytes in blocks of about 1 MiB, each ending at a line end (or the piece end)."""
    errors = _stream_errors(piece)
    remaining = piece.end - piece.start if piece.end >= 0 else -1
    carry = b""
    try:
        with _open_binary(piece) as f:
            while True:
                want = _READ_BLOCK if remaining < 0 else min(_READ_BLOCK, remaining)
                block = f.read(want) if want else b""
                if remaining >= 0:
                    remaining -= len(block)
                if not block:
                    break
                data = carry + block
                cut = data.rfind(b"\n") + 1
                if cut == 0 and len(data) < 4 * _READ_BLOCK:
                    carry = data  # one long line: keep reading (up to 4 MiB, then cut anywhere)
                    continue
                if cut == 0:
                    cut = len(data)
                    while cut > 0 and 0x80 <= data[cut - 1] < 0xC0:
                        cut -= 1  # not inside a UTF-8 character
                    if cut > 0 and data[cut - 1] >= 0xC0:
                        cut -= 1
                    cut = cut or len(data)
                carry = data[cut:]
                yield data[:cut]
    except errors as exc:
        raise DataError(f"{piece.path}: cannot read ({piece.compression or 'file'} stream is corrupt or "
                        f"truncated: {exc})") from None
    if carry:
        yield carry


def _decode(data: bytes, piece: Piece, offset: int, lineno: int | None) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        if lineno is None:  # uncompressed: count the lines before the bad byte
            lineno = _line_of(piece.path, offset + exc.start)
        else:
            lineno += data[: exc.start].count(b"\n")
        raise DataError(f"{piece.path}:{lineno}: not valid UTF-8 text ({exc.reason} at byte "
                        f"{offset + exc.start})") from None


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


def _split_text(text: str, chunk_chars: int, final: bool = True, spaces: bool = True) -> tuple[list[str], str]:
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
    blocks = _blocks(piece)
    while True:
        block = next(blocks, None)
        if block is not None:
            text = _decode(block, piece, offset, lineno)
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
            base = _line_of(piece.path, piece.start)
        return f"{piece.path}:{base + rel}"

    for block in _blocks(piece):
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
                    raise DataError(f"{where()}: field {text_field!r} must be a string, got {type(text).__name__}")
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
    pq = _optional("pyarrow.parquet", "Parquet files")
    try:
        pf = pq.ParquetFile(piece.path, buffer_size=_READ_BLOCK, pre_buffer=False)
    except Exception as exc:
        raise DataError(f"{piece.path}: not a readable Parquet file ({exc})") from None
    if text_field not in pf.schema_arrow.names:
        raise DataError(f"{piece.path}: no column {text_field!r} (columns: {', '.join(pf.schema_arrow.names)}); "
                        "set data.text_field")
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
    ds = _hf_dataset(piece.path).select_columns([text_field]).with_format("arrow")
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
