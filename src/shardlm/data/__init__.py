"""Data: read corpora (``pieces.py`` cuts them, ``streams.py`` reads bytes, ``readers.py`` formats,
``corpus.py``), train/load tokenizers (``tokenizer.py``), encode and write token shards (``prepare.py``,
``encode.py``, ranks agreeing through ``sync.py``), what a prepared directory is for its readers
(``meta.py``), instruction data (``instruct.py``), what prepared data was made from (``identity.py``), a
config's prepared data (``build.py``), sample batches and mixtures (``loader.py``, ``mixture.py``).

Names are imported on first use (PEP 562), so the encoding worker processes, which import
:mod:`shardlm.data.encode`, load neither torch nor the loader.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "DataError": "corpus", "SHAKESPEARE": "corpus", "shakespeare_dir": "corpus", "strip_markdown": "corpus",
    "read_documents": "readers", "plan_pieces": "pieces", "read_piece": "readers",
    "GlobalBatchSampler": "loader", "TokenStream": "loader", "TokenWindows": "loader",
    "eval_windows": "loader", "MixtureSampler": "mixture", "MixtureWindows": "mixture",
    "is_prepared": "meta", "load_meta": "meta", "prepare_corpus": "prepare", "token_dtype": "meta",
    "BOS": "tokenizer", "EOD": "tokenizer", "EOS": "tokenizer", "SPECIAL_TOKENS": "tokenizer",
    "load_tokenizer": "tokenizer", "special_token_ids": "tokenizer", "train_tokenizer": "tokenizer",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'shardlm.data' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"shardlm.data.{module}"), name)
    globals()[name] = value
    return value
