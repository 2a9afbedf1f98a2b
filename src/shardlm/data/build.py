"""The prepared data of a run's :class:`~shardlm.config.Config`: where it lives and preparing it when missing."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from shardlm.config import Config
from shardlm.data.instruct import prepare_instructions
from shardlm.data.mixture import is_mixture_prepared, prepare_mixture
from shardlm.data.prepare import default_workers, is_prepared, load_meta, prepare_corpus
from shardlm.data.sync import StoreSync, default_store
from shardlm.parallel.dist import DistInfo, run_on_main


def data_dir(cfg: Config) -> Path:
    """Where the prepared token ids of this config live: ``data.dir`` or ``data/<run name>``."""
    return Path(cfg.data.dir or f"data/{cfg.run.name}")


def prepare_data(cfg: Config, info: DistInfo | None = None) -> dict[str, Any]:
    """Tokenize the corpus (or every source of a mixture) into ``data_dir(cfg)`` unless already there.

    Under torchrun (``info`` with more than one rank) every rank takes its share of the pieces and
    the ranks wait for each other through the store, never in a collective (see
    :mod:`shardlm.data.sync`); instruction data is small and rank 0 prepares it alone.

    Returns:
        The ``meta.json`` of the prepared directory.

    Raises:
        DataError: bad corpus or tokenizer (see :func:`shardlm.data.prepare_corpus`).
    """
    out = data_dir(cfg)
    d = cfg.data
    distributed = info is not None and info.world_size > 1
    if d.format == "instruct":
        def instruct() -> None:
            if not is_prepared(str(out)):
                prepare_instructions(d.corpus, str(out), d.tokenizer, cfg.model.vocab_size, d.val_fraction)
        run_on_main(instruct, info) if distributed else instruct()
        return load_meta(str(out))
    sync = StoreSync(default_store(), info.rank, info.world_size, str(out.absolute())) if distributed else None
    options = dict(text_field=d.text_field, workers=d.workers or default_workers(), piece_bytes=d.piece_bytes,
                   tokenizer_sample_bytes=d.tokenizer_sample_bytes, sync=sync)
    vocab = d.tokenizer_vocab_size or cfg.model.vocab_size
    if d.sources:
        if not is_mixture_prepared(str(out), d.sources):
            prepare_mixture(d.sources, str(out), d.tokenizer or None, vocab, d.val_fraction, cfg.train.seed,
                            **options)
    elif not is_prepared(str(out)):
        prepare_corpus(d.corpus, str(out), d.tokenizer or None, vocab, d.val_fraction, seed=cfg.train.seed,
                       **options)
    return load_meta(str(out))
