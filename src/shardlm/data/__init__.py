"""Data: read corpora (``corpus.py``), train/load tokenizers (``tokenizer.py``), write token files (``prepare.py``,
instruction data in ``instruct.py``), a config's prepared data (``build.py``), sample batches (``loader.py``)."""

from shardlm.data.corpus import SHAKESPEARE, DataError, read_documents, shakespeare_dir, strip_markdown
from shardlm.data.loader import GlobalBatchSampler, TokenWindows, eval_windows
from shardlm.data.prepare import is_prepared, load_meta, prepare_corpus, token_dtype
from shardlm.data.tokenizer import (
    BOS,
    EOD,
    EOS,
    SPECIAL_TOKENS,
    load_tokenizer,
    special_token_ids,
    train_tokenizer,
)

__all__ = [
    "BOS",
    "EOD",
    "EOS",
    "SHAKESPEARE",
    "SPECIAL_TOKENS",
    "DataError",
    "GlobalBatchSampler",
    "TokenWindows",
    "eval_windows",
    "is_prepared",
    "load_meta",
    "load_tokenizer",
    "prepare_corpus",
    "read_documents",
    "shakespeare_dir",
    "special_token_ids",
    "strip_markdown",
    "token_dtype",
    "train_tokenizer",
]
