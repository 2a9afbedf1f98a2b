"""Byte-level BPE tokenizer training and loading (HuggingFace ``tokenizers``).

Tokenizers trained here reserve ids 0, 1, 2 for :data:`BOS`, :data:`EOS` and
:data:`EOD`. Encoding never adds special tokens by itself; callers insert the ids
from :func:`special_token_ids` explicitly.
"""

from __future__ import annotations

import itertools
import pathlib
from collections.abc import Iterable

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from shardlm.errors import DataError

__all__ = [
    "BOS",
    "EOS",
    "EOD",
    "SPECIAL_TOKENS",
    "MIN_VOCAB_SIZE",
    "train_tokenizer",
    "load_tokenizer",
    "special_token_ids",
]

BOS = "<|begin_of_text|>"
"""Beginning-of-stream token (id 0 in tokenizers trained here)."""
EOS = "<|end_of_text|>"
"""End-of-text token (id 1 in tokenizers trained here)."""
EOD = "<|end_of_document|>"
"""End-of-document token placed between documents (id 2 in tokenizers trained here)."""

SPECIAL_TOKENS: tuple[str, str, str] = (BOS, EOS, EOD)

MIN_VOCAB_SIZE = len(SPECIAL_TOKENS) + 256
"""Smallest trainable vocabulary: the 3 special tokens plus the 256 byte symbols."""

_EOS_FALLBACKS = ("</s>", "<|endoftext|>", "<|im_end|>", "<|eot_id|>", "<eos>", "[SEP]")
_BOS_FALLBACKS = ("<s>", "<bos>", "[CLS]")


def train_tokenizer(documents: Iterable[str], vocab_size: int) -> Tokenizer:
    """Train a deterministic byte-level BPE tokenizer.

    Uses a ByteLevel pre-tokenizer (``add_prefix_space=False``) and decoder, so any
    UTF-8 text round-trips: ``tok.decode(tok.encode(x).ids) == x``. The special
    tokens :data:`BOS`, :data:`EOS`, :data:`EOD` get ids 0, 1, 2; no post-processor
    is set, so ``encode`` never adds them automatically.

    Args:
        documents: Training texts (any iterable; read once, not held in memory by this function).
        vocab_size: Target vocabulary size (number of token ids, including the special
            tokens and 256 byte symbols). The result may be smaller when the corpus
            has too few distinct merges.

    Returns:
        The trained tokenizer; ``get_vocab_size() <= vocab_size``.

    Raises:
        DataError: ``vocab_size < MIN_VOCAB_SIZE`` (259) or ``documents`` is empty.
    """
    if vocab_size < MIN_VOCAB_SIZE:
        raise DataError(
            f"vocab_size={vocab_size} is too small for a byte-level BPE tokenizer "
            f"(needs at least {MIN_VOCAB_SIZE}: 3 special tokens + 256 bytes)"
        )
    texts = iter(documents)
    first = next(texts, None)
    if first is None:
        raise DataError("cannot train a tokenizer on an empty list of documents")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        show_progress=False,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(itertools.chain([first], texts), trainer=trainer)
    return tok


def load_tokenizer(path: str) -> Tokenizer:
    """Load a ``tokenizer.json`` (HuggingFace ``tokenizers`` format).

    Args:
        path: Path of the JSON file.

    Returns:
        The tokenizer.

    Raises:
        DataError: the file does not exist or cannot be parsed as a tokenizer.
    """
    p = pathlib.Path(path).expanduser()
    if not p.is_file():
        raise DataError(f"tokenizer file does not exist: {path}")
    try:
        return Tokenizer.from_file(str(p))
    except Exception as exc:  # tokenizers raises a bare Exception on bad files
        raise DataError(f"{path}: not a valid tokenizer.json ({exc})") from exc


def _first_id(tok: Tokenizer, names: tuple[str, ...]) -> int | None:
    for name in names:
        idx = tok.token_to_id(name)
        if idx is not None:
            return int(idx)
    return None


def special_token_ids(tok: Tokenizer) -> dict[str, int | None]:
    """Ids of the special tokens used when building token streams.

    For foreign tokenizers some tokens may be absent: ``eos`` falls back to common
    names (``</s>``, ``<|endoftext|>``, ``<|im_end|>``, ...), ``bos`` to ``<s>`` /
    ``<bos>``, and ``eod`` falls back to the ``eos`` id.

    Args:
        tok: Any tokenizer.

    Returns:
        ``{"bos": int | None, "eos": int | None, "eod": int | None}``.
    """
    bos = _first_id(tok, (BOS, *_BOS_FALLBACKS))
    eos = _first_id(tok, (EOS, *_EOS_FALLBACKS))
    eod = _first_id(tok, (EOD,))
    if eod is None:
        eod = eos
    return {"bos": bos, "eos": eos, "eod": eod}
