"""The prepared data of a run's :class:`~shardlm.config.Config`: where it lives and preparing it when missing."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from shardlm.config import Config
from shardlm.data.instruct import prepare_instructions
from shardlm.data.prepare import is_prepared, load_meta, prepare_corpus


def data_dir(cfg: Config) -> Path:
    """Where the prepared token ids of this config live: ``data.dir`` or ``data/<run name>``."""
    return Path(cfg.data.dir or f"data/{cfg.run.name}")


def prepare_data(cfg: Config) -> dict[str, Any]:
    """Tokenize the corpus into ``data_dir(cfg)`` unless already there; return its ``meta.json``.

    Raises:
        DataError: bad corpus or tokenizer (see :func:`shardlm.data.prepare.prepare_corpus` and
            :func:`shardlm.data.instruct.prepare_instructions`).
    """
    out = data_dir(cfg)
    if cfg.data.format == "instruct":
        if not is_prepared(str(out)):
            prepare_instructions(cfg.data.corpus, str(out), cfg.data.tokenizer, cfg.model.vocab_size,
                                 cfg.data.val_fraction)
    elif not is_prepared(str(out)):
        prepare_corpus(
            cfg.data.corpus, str(out), cfg.data.tokenizer or None,
            cfg.data.tokenizer_vocab_size or cfg.model.vocab_size, cfg.data.val_fraction, seed=cfg.train.seed,
        )
    return load_meta(str(out))
