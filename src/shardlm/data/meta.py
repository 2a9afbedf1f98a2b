"""What a prepared data directory is, for everything that reads one: its ``meta.json`` (:func:`load_meta`),
the token dtype, and whether the directory is complete (:func:`is_prepared`). Writing one is
:mod:`shardlm.data.prepare`; reading these needs none of it (no tokenizer, no pipeline)."""

from __future__ import annotations

import pathlib
from typing import Any

import numpy as np

from shardlm.errors import DataError
from shardlm.json_file import read_json

META_FILE = "meta.json"
FORMAT = "shards"
"""``meta["format"]`` of a directory written by :func:`shardlm.data.prepare.prepare_corpus`."""
_LEGACY_FILES = ("train.bin", "val.bin", "tokenizer.json", META_FILE)


def token_dtype(vocab_size: int) -> np.dtype:
    """Smallest unsigned dtype that holds every id of a ``vocab_size`` vocabulary.

    Returns:
        ``np.dtype("uint16")`` if ``vocab_size <= 65536`` else ``np.dtype("uint32")``.
    """
    return np.dtype(np.uint16 if vocab_size <= 65536 else np.uint32)


def load_meta(out_dir: str) -> dict[str, Any]:
    """Read ``<out_dir>/meta.json`` written by :func:`shardlm.data.prepare.prepare_corpus`.

    Returns:
        The meta dict.

    Raises:
        DataError: the file is missing, not JSON, or lacks ``dtype``/``train_tokens``
            /``val_tokens``/``vocab_size``.
    """
    path = pathlib.Path(out_dir).expanduser() / META_FILE
    if not path.is_file():
        raise DataError(f"{path} not found: run data preparation first (shardlm prepare)")
    meta = read_json(path, DataError)
    for key in ("dtype", "vocab_size", "train_tokens", "val_tokens"):
        if key not in meta:
            raise DataError(f"{path}: missing field {key!r}")
    return meta


def is_prepared(out_dir: str) -> bool:
    """True if ``out_dir`` holds a complete prepared dataset: a readable ``meta.json``, the tokenizer,
    and token files whose sizes match the counts the meta records (shards, or ``train.bin``/``val.bin``)."""
    root = pathlib.Path(out_dir).expanduser()
    try:
        meta = load_meta(out_dir)
        itemsize = np.dtype(meta["dtype"]).itemsize
        if not (root / "tokenizer.json").is_file():
            return False
        if meta.get("format") == FORMAT:
            shards = meta["shards"]
            if sum(int(s["tokens"]) for s in shards) != int(meta["train_tokens"]) + int(meta["val_tokens"]):
                return False
            return all(
                (root / s["file"]).is_file()
                and (root / s["file"]).stat().st_size == int(s["tokens"]) * itemsize
                for s in shards
            )
    except (DataError, TypeError, KeyError, ValueError, OSError):
        return False
    if not all((root / name).is_file() for name in _LEGACY_FILES):
        return False
    return (
        (root / "train.bin").stat().st_size == int(meta["train_tokens"]) * itemsize
        and (root / "val.bin").stat().st_size == int(meta["val_tokens"]) * itemsize
    )


def lacking_document_starts(out_dir: str | pathlib.Path) -> list[pathlib.Path]:
    """The prepared text directories of ``out_dir`` (itself, or each source a mixture's ``meta.json`` lists)
    whose ``meta.json`` records no document starts (``document_starts``: written since 2026-12-01; legacy and
    external data have none); directories not (completely) prepared are not listed."""
    root = pathlib.Path(out_dir).expanduser()
    try:
        meta = read_json(root / META_FILE, DataError)
    except DataError:
        return []
    mixture = meta.get("format") == "mixture"  # shardlm.data.mixture.MIXTURE (which imports this module)
    dirs = [root / str(s.get("name")) for s in meta.get("sources", [])] if mixture else [root]

    def records(d: pathlib.Path) -> bool:
        m = load_meta(str(d))
        return m.get("format") == FORMAT and isinstance(m.get("document_starts"), dict)
    return [d for d in dirs if is_prepared(str(d)) and not records(d)]
