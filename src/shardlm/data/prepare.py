"""Tokenize a corpus once into flat binary token files.

Layout of a prepared directory::

    out_dir/
        train.bin       raw little-endian uint16 (or uint32) token ids, no header
        val.bin         same, the tail of the token stream
        tokenizer.json  the tokenizer used
        meta.json       see :func:`prepare_corpus`
"""

from __future__ import annotations

import json
import pathlib
import shutil
from typing import Any

import numpy as np

from shardlm.atomic import atomic_directory
from shardlm.data.corpus import read_documents
from shardlm.data.tokenizer import load_tokenizer, special_token_ids, train_tokenizer
from shardlm.errors import DataError
from shardlm.metrics.progress import progress

__all__ = ["META_FILE", "prepare_corpus", "load_meta", "is_prepared", "token_dtype"]

META_FILE = "meta.json"
_FILES = ("train.bin", "val.bin", "tokenizer.json", META_FILE)
_BATCH_DOCS = 256


def token_dtype(vocab_size: int) -> np.dtype:
    """Smallest unsigned dtype that holds every id of a ``vocab_size`` vocabulary.

    Returns:
        ``np.dtype("uint16")`` if ``vocab_size <= 65536`` else ``np.dtype("uint32")``.
    """
    return np.dtype(np.uint16 if vocab_size <= 65536 else np.uint32)


def _encode_all(tok: Any, documents: list[str]) -> list[list[int]]:
    bar = progress(len(documents), "tokenizing", "doc")
    out: list[list[int]] = []
    for start in range(0, len(documents), _BATCH_DOCS):
        batch = documents[start : start + _BATCH_DOCS]
        out.extend(enc.ids for enc in tok.encode_batch(batch, add_special_tokens=False))
        bar.update(len(batch))
    bar.close()
    return out


def unigram_entropy(tokens: np.ndarray) -> float:
    """-Σ p·ln p over the token frequencies of ``tokens`` (nats): the loss of a model that learned only them."""
    counts = np.bincount(tokens.astype(np.int64))
    counts = counts[counts > 0].astype(np.float64)
    p = counts / counts.sum()
    return float(-(p * np.log(p)).sum())


def prepare_corpus(
    corpus: str,
    out_dir: str,
    tokenizer_path: str | None,
    vocab_size: int,
    val_fraction: float,
    seed: int = 0,
) -> dict[str, Any]:
    """Tokenize ``corpus`` into ``train.bin`` / ``val.bin`` under ``out_dir``.

    The token stream is ``BOS doc0 EOD doc1 EOD ... docN EOD`` (BOS omitted if the
    tokenizer has none; EOD falls back to EOS, and is omitted if neither exists).
    The last ``val_fraction`` of the stream (cut at a token position, so a
    single-document corpus still gets both splits) is the validation split.
    Everything is written to a temporary directory beside ``out_dir`` and moved into
    place only on success; an existing ``out_dir`` is replaced.

    Args:
        corpus: Anything :func:`shardlm.data.read_documents` accepts.
        out_dir: Output directory (created; parents too).
        tokenizer_path: A ``tokenizer.json`` to use, or ``None``/``""`` to train a
            byte-level BPE tokenizer on the corpus with ``vocab_size`` ids.
        vocab_size: Model vocabulary size (number of embedding rows); decides the
            file dtype (uint16 if ``<= 65536`` else uint32).
        val_fraction: Fraction of tokens in the validation split, in (0, 1).
        seed: Recorded in ``meta.json``; the split itself is deterministic.

    Returns:
        The meta dict, also written to ``meta.json``: ``dtype`` (str),
        ``vocab_size``, ``tokenizer_vocab_size``, ``train_tokens``, ``val_tokens``
        (token counts), ``corpus``, ``special_ids`` ({"bos","eos","eod"} -> id or
        None), ``unigram_entropy_nats`` (entropy of the train unigram distribution,
        natural log: the loss of a model that learned only token frequencies),
        ``seed``.

    Raises:
        DataError: any error of :func:`read_documents` / :func:`load_tokenizer`;
            ``val_fraction`` not in (0, 1); the tokenizer has more ids than
            ``vocab_size``; either split would be empty; ``out_dir`` is a file.
    """
    if not (0.0 < val_fraction < 1.0):
        raise DataError(f"val_fraction must be in (0, 1), got {val_fraction}")
    if vocab_size < 1:
        raise DataError(f"vocab_size must be positive, got {vocab_size}")
    out = pathlib.Path(out_dir).expanduser()
    if out.exists() and not out.is_dir():
        raise DataError(f"output path exists and is not a directory: {out_dir}")

    documents = read_documents(corpus)
    if tokenizer_path:
        tok = load_tokenizer(tokenizer_path)
    else:
        tok = train_tokenizer(documents, vocab_size)
    tok_vocab = int(tok.get_vocab_size())
    if tok_vocab > vocab_size:
        raise DataError(
            f"tokenizer has {tok_vocab} tokens but vocab_size is {vocab_size}: "
            f"the model's vocab must hold every token id (set vocab_size >= {tok_vocab})"
        )
    special = special_token_ids(tok)

    encoded = _encode_all(tok, documents)
    dtype = token_dtype(vocab_size)
    total = sum(len(ids) for ids in encoded) + len(encoded) * (special["eod"] is not None)
    total += special["bos"] is not None
    stream = np.empty(total, dtype=dtype)
    pos = 0
    if special["bos"] is not None:
        stream[0] = special["bos"]
        pos = 1
    for ids in encoded:
        stream[pos : pos + len(ids)] = ids
        pos += len(ids)
        if special["eod"] is not None:
            stream[pos] = special["eod"]
            pos += 1
    assert pos == total

    n_val = int(round(total * val_fraction))
    n_train = total - n_val
    if n_val <= 0 or n_train <= 0:
        raise DataError(
            f"corpus {corpus!r} has {total} tokens; val_fraction={val_fraction} gives "
            f"{n_train} train and {n_val} val tokens, and neither split may be empty"
        )
    train, val = stream[:n_train], stream[n_train:]

    meta: dict[str, Any] = {
        "dtype": dtype.name,
        "vocab_size": int(vocab_size),
        "tokenizer_vocab_size": tok_vocab,
        "train_tokens": int(n_train),
        "val_tokens": int(n_val),
        "corpus": corpus,
        "special_ids": special,
        "unigram_entropy_nats": unigram_entropy(train),
        "seed": int(seed),
    }

    with atomic_directory(out) as tmp:  # a failure never leaves a half-written out_dir
        train.tofile(tmp / "train.bin")
        val.tofile(tmp / "val.bin")
        if tokenizer_path:
            shutil.copyfile(pathlib.Path(tokenizer_path).expanduser(), tmp / "tokenizer.json")
        else:
            tok.save(str(tmp / "tokenizer.json"))
        (tmp / META_FILE).write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
    return meta


def load_meta(out_dir: str) -> dict[str, Any]:
    """Read ``<out_dir>/meta.json`` written by :func:`prepare_corpus`.

    Returns:
        The meta dict.

    Raises:
        DataError: the file is missing, not JSON, or lacks ``dtype``/``train_tokens``
            /``val_tokens``/``vocab_size``.
    """
    path = pathlib.Path(out_dir).expanduser() / META_FILE
    if not path.is_file():
        raise DataError(f"{path} not found: run data preparation first (prepare_corpus)")
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise DataError(f"{path}: cannot read meta ({exc})") from exc
    if not isinstance(meta, dict):
        raise DataError(f"{path}: expected a JSON object")
    for key in ("dtype", "vocab_size", "train_tokens", "val_tokens"):
        if key not in meta:
            raise DataError(f"{path}: missing field {key!r}")
    return meta


def is_prepared(out_dir: str) -> bool:
    """True if ``out_dir`` holds a complete prepared dataset (all four files and a
    readable ``meta.json`` whose token counts match the ``.bin`` file sizes)."""
    root = pathlib.Path(out_dir).expanduser()
    if not all((root / name).is_file() for name in _FILES):
        return False
    try:
        meta = load_meta(out_dir)
        itemsize = np.dtype(meta["dtype"]).itemsize
    except (DataError, TypeError):
        return False
    return (
        (root / "train.bin").stat().st_size == int(meta["train_tokens"]) * itemsize
        and (root / "val.bin").stat().st_size == int(meta["val_tokens"]) * itemsize
    )
