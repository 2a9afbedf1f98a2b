"""Cutting a corpus into *pieces*, the unit of work that preparation shares between ranks and reuses after a
restart (see :mod:`shardlm.data.prepare`): finding its inputs (files, directories, globs, ``datasets``
directories, ``hf:NAME``), and the cut, which depends only on the files and ``piece_bytes``, never on the
number of workers or ranks (the cut per format: :mod:`shardlm.data.readers`). Reading a piece's bytes is
:mod:`shardlm.data.streams`, its text :mod:`shardlm.data.readers`.

Every bad input is one :class:`DataError` naming the file.
"""

from __future__ import annotations

import dataclasses
import functools
import glob
import importlib
import json
import os
import pathlib
from typing import Any

from shardlm.data.corpus import SHAKESPEARE, DataError, shakespeare_dir

DATA_EXTRA_HINT = "install the data extra: pip install 'shardlm[data]'"

_TEXT_KINDS = {".txt": "text", ".md": "markdown", ".jsonl": "jsonl"}
_COMPRESSIONS = {".gz": "gz", ".zst": "zst"}
_HF_MARKERS = ("dataset_info.json", "state.json")
READ_BLOCK = 1 << 20
"""Bytes read from a file at a time (by the piece cuts, the byte streams and the Parquet reader)."""
SOFT_BYTES = frozenset(range(0x21, 0x7F))
"""Bytes that are never whitespace nor part of a multi-byte character: a newline between two is a safe cut."""


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


def optional_module(module: str, what: str) -> Any:
    """The module ``module``, imported; DataError naming what reading ``what`` needs and the extra
    when missing."""
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
    """``(DIR, SPLIT)`` when ``spec`` is ``DIR:SPLIT`` naming a split of an existing datasets directory,
    else None."""
    head, sep, split = spec.rpartition(":")
    if not sep or not head or not split or spec.startswith("hf:") or "/" in split:
        return None
    base = pathlib.Path(head).expanduser()
    return (str(base), split) if base.is_dir() and _is_hf_dir(base) else None


def expand_corpus(corpus: str) -> tuple[list[pathlib.Path | str], list[str]]:
    """The inputs of ``corpus`` in reading order (files, datasets directories, ``DIR:SPLIT`` and ``hf:`` specs
    as strings), and the files of a directory that are not read.

    Raises:
        DataError: as :func:`plan_pieces` (a path that does not exist, an unreadable file type, an
        empty glob).
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
            (found if readable_kind(f) else skipped).append(
                f if readable_kind(f) else str(f.relative_to(root))
            )
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
            window = f.read(READ_BLOCK + 1)
            first = window.find(b"\n") + 1
            if first == 0:  # a line longer than the window: look on after it
                target += READ_BLOCK
                continue
            if target - 1 + first >= size:
                break
            cut = first
            i = window.find(b"\n", 1)
            while 0 < i < len(window) - 1:
                if window[i - 1] in SOFT_BYTES and window[i + 1] in SOFT_BYTES:
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
    datasets = optional_module("datasets", "Hugging Face datasets")
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
    """The directory of the one dataset a ``save_to_disk`` directory or ``DIR:SPLIT`` names (a
    DatasetDict's split).

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
    """True for a dataset saved with 0 rows: ``datasets`` writes no data file then (and cannot load
    it back)."""
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
    and the splits left out, with how to name one; None otherwise (a single dataset, a named split,
    one split)."""
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
        return [Piece("hf", spec, "", a, min(rows, a + per_piece),
                      int(nbytes * (min(rows, a + per_piece) - a) / rows))
                for a in range(0, rows, per_piece)]
    kind, compression = readable_kind(item)  # type: ignore[misc]
    stamp = _stamp(item)
    size = stamp[0]
    if kind == "parquet":
        pq = optional_module("pyarrow.parquet", "Parquet files")
        try:
            meta = pq.ParquetFile(item).metadata
        except Exception as exc:
            raise DataError(f"{item}: not a readable Parquet file ({exc})") from None
        names = meta.schema.names
        if text_field not in names:
            raise DataError(f"{item}: no column {text_field!r} (columns: {', '.join(names)}); set "
                            "data.text_field")
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


def plan_pieces(
    corpus: str, text_field: str = "text", piece_bytes: int = 64 << 20
) -> tuple[list[Piece], list[str]]:
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
        raise DataError(f"empty corpus: {corpus} holds nothing readable ({held}; readable: .txt, .md, "
                        ".jsonl, each also .gz/.zst; .parquet; datasets directories)")
    pieces = [p for item in inputs for p in _plan_file(item, text_field, piece_bytes)]
    if not pieces:
        empty = [
            str(i)
            for i in inputs
            if (isinstance(i, str) or i.is_dir())
            and (
                not str(i).startswith("hf:")
                and _saved_empty(_saved_root(str(i)))
                or len(_hf_dataset(str(i))) == 0
            )
        ]
        if empty:
            raise DataError(
                f"empty corpus: {corpus} has 0 rows" + (f" ({', '.join(empty)})" if empty != [corpus] else "")
            )
    return pieces, skipped
