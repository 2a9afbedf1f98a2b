"""The prepared data of a run's :class:`~shardlm.config.Config`: where it lives, whether it is current,
preparing it.

A prepared directory records what it was made from (``meta.json``'s ``identity``, see
:mod:`shardlm.data.identity`). :func:`prepare_data` compares that with what the config would prepare now
(the inputs' paths, sizes, modification times and sample hashes, the tokenizer's files, the text field,
the chat template, the settings that change the tokens) and then:

* uses it when nothing differs (nothing is read but the sampled blocks; the token files are untouched);
* prepares it again, printing each difference, when shardlm owns the directory: ``shardlm prepare``
  (its job is to make ``data.dir`` match the config) and a training run whose ``data.dir`` is the default
  ``data/<run name>``;
* refuses (:class:`~shardlm.errors.ConfigError` naming each difference) a training run whose ``data.dir``
  was set: a directory the user chose is not replaced behind their back; ``shardlm prepare`` with the same
  config prepares it again.

Data written by another program declares so in ``meta.json`` (``"identity": {"external": "what made it"}``):
it is used as it is, with a note, and never prepared again or refused (nothing to compare it with).
A directory written by a shardlm that kept no identity counts as different (prepared again, or refused,
by the same rule), and so does a mixture whose ``meta.json`` has no ``model_special_ids`` (older shardlm
prepared a mixture's sources with a copy of the tokenizer alone, recording made-up special ids instead of
those of the tokenizer's model: nothing is guessed from them). When the config's corpus cannot be read
here (prepared elsewhere, the corpus not mounted) but names the same corpus as the record, the directory is
used with a note. Under torchrun rank 0 decides and every rank acts on its decision, shared through the
store (never a collective).
"""

from __future__ import annotations

import functools
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from shardlm.config import Config
from shardlm.data.identity import describe_corpus, describe_instructions, describe_mixture, differences
from shardlm.data.instruct import prepare_instructions
from shardlm.data.meta import lacking_document_starts
from shardlm.data.mixture import MIXTURE, prepare_mixture, source_names
from shardlm.data.preference import PREFERENCE, describe_preferences, prepare_preferences
from shardlm.data.prepare import default_workers, is_prepared, load_meta, prepare_corpus
from shardlm.data.prompts import PROMPTS, describe_prompts, prepare_prompts
from shardlm.data.sync import StoreSync, default_store
from shardlm.errors import ConfigError, DataError
from shardlm.parallel.dist import DistInfo, run_on_main

__all__ = ["data_dir", "prepare_data", "verdict"]

_OLD_MIXTURE = ("it was prepared by an older shardlm that did not record the special ids of the tokenizer's "
                "model for a mixture (meta.json has no model_special_ids; its sources may record made-up "
                "ones, which an export would write)")
_CALLS: dict[str, int] = {}  # prepare_data calls per directory in this process: fresh store keys for each


def data_dir(cfg: Config) -> Path:
    """Where the prepared token ids of this config live: ``data.dir`` or ``data/<run name>``."""
    return Path(cfg.data.dir or f"data/{cfg.run.name}")


def _complete(out: Path) -> bool:
    """True if ``out`` holds a complete preparation of any format (a mixture: every source it lists)."""
    try:
        meta = load_meta(str(out))
    except DataError:
        return False
    if meta.get("format") == MIXTURE:
        names = [s.get("name") for s in meta.get("sources", [])]
        return (out / "tokenizer.json").is_file() and all(isinstance(n, str) and is_prepared(str(out / n))
                                                          for n in names)
    return is_prepared(str(out))


def verdict(out: Path, describe: Callable[[], dict[str, Any]], corpora: list[str], policy: str,
            documents: bool = False) -> dict[str, Any]:
    """What to do with ``out``: ``{"action": "use" | "prepare" | "refuse", "message": str, "identity": dict
    | None}``.

    Args:
        out: The data directory.
        describe: Returns what the config would prepare now (an identity, :mod:`shardlm.data.identity`).
        corpora: The config's corpus (or each source's path), to tell a corpus that is not readable here.
        policy: ``prepare`` (prepare a differing directory again) or ``refuse``.
        documents: text data: under ``prepare`` a directory that records no document starts (prepared before
            shardlm recorded them) is prepared again, so that ``model.attention = "auto"`` can train
            block-causal; under ``refuse`` it is used as it is (training then falls back to causal attention
            with a warning).

    Raises:
        DataError: the corpus cannot be read and the directory does not record the same corpus.
    """
    if not _complete(out):
        return {"action": "prepare", "message": "", "identity": None}
    meta = load_meta(str(out))
    recorded = meta.get("identity")
    if isinstance(recorded, dict) and "external" in recorded:
        return {"action": "use", "identity": None,
                "message": f"note: {out} was prepared outside shardlm ({recorded['external']}): used as it "
                           "is; what it was made from is not checked"}
    if meta.get("format") == MIXTURE and "model_special_ids" not in meta:  # never guessed: prepared again
        return _differs(out, [_OLD_MIXTURE], policy, None)
    try:
        expected = describe()
    except DataError as exc:
        if recorded is not None and [s.get("corpus") for s in recorded.get("sources", [])] == corpora:
            return {"action": "use", "identity": None,
                    "message": f"note: {exc}; using {out}, prepared from it, as it is (what it was made from "
                               "cannot be checked here)"}
        raise
    diffs = differences(recorded, expected)
    if documents and not diffs and policy == "prepare":
        diffs = [f"{d / 'meta.json'} records no document starts" for d in lacking_document_starts(out)]
    if not diffs:
        return {"action": "use", "identity": expected,
                "message": f"prepare: {out} is current (the same inputs, tokenizer and settings): kept as it "
                           "is"
                if policy == "prepare" else ""}
    return _differs(out, diffs, policy, expected)


def _differs(out: Path, diffs: list[str], policy: str, expected: dict[str, Any] | None) -> dict[str, Any]:
    """:func:`verdict`'s answer for a directory that differs from the config by ``diffs``."""
    if policy == "prepare":
        return {"action": "prepare", "identity": expected,
                "message": f"prepare: {out} is out of date: {'; '.join(diffs)}; preparing it again"}
    return {"action": "refuse", "identity": None,
            "message": f"data.dir {out} holds data prepared from other inputs or settings than this config "
                       f"describes: {'; '.join(diffs)}. Run `shardlm prepare` with this config to prepare it "
                       "again, or set data.dir to another directory"}


def _announce(decision: dict[str, Any]) -> None:
    if decision["action"] == "refuse":
        raise ConfigError(decision["message"])
    if decision["message"]:
        print(decision["message"], file=sys.stderr, flush=True)


def prepare_data(cfg: Config, info: DistInfo | None = None, on_stale: str = "") -> dict[str, Any]:
    """Tokenize the corpus (or every source of a mixture) into ``data_dir(cfg)`` unless a current preparation
    is there (see the module docstring for what current means and what happens otherwise).

    Under torchrun (``info`` with more than one rank) rank 0 checks the directory and every rank follows
    its decision; every rank takes its share of the pieces and the ranks wait for each other through the
    store, never in a collective (see :mod:`shardlm.data.sync`); instruction data is small and rank 0
    prepares it alone.

    Args:
        cfg: The config; its ``data`` section says what to prepare.
        info: The ranks, or None for one process.
        on_stale: ``prepare`` or ``refuse`` a directory that differs from the config; ``""``: ``prepare``
            when ``data.dir`` is the default, else ``refuse``.

    Returns:
        The ``meta.json`` of the prepared directory.

    Raises:
        DataError: bad corpus or tokenizer (see :func:`shardlm.data.prepare_corpus`).
        ConfigError: the directory differs from the config and ``on_stale`` resolves to ``refuse`` (the
            message names each difference: the config key, or the input file added, removed or changed).
    """
    out = data_dir(cfg)
    d = cfg.data
    policy = on_stale or ("refuse" if d.dir else "prepare")
    if policy not in ("prepare", "refuse"):
        raise ValueError(f"on_stale must be 'prepare' or 'refuse', got {on_stale!r}")
    distributed = info is not None and info.world_size > 1
    if d.format in ("instruct", PREFERENCE, PROMPTS):  # small: rank 0 prepares alone
        prepare, describe_one = {
            "instruct": (prepare_instructions, describe_instructions),
            PREFERENCE: (prepare_preferences, describe_preferences),
            PROMPTS: (functools.partial(prepare_prompts, max_prompt_length=cfg.rl.max_prompt_length),
                      functools.partial(describe_prompts, max_prompt_length=cfg.rl.max_prompt_length)),
        }[d.format]

        def instruct() -> None:
            if not d.tokenizer:  # its own clear error
                prepare(d.corpus, str(out), d.tokenizer, cfg.model.vocab_size, d.val_fraction)
            decision = verdict(out, lambda: describe_one(d.corpus, d.tokenizer, cfg.model.vocab_size,
                                                         d.val_fraction), [d.corpus], policy)
            _announce(decision)
            if decision["action"] == "prepare":
                prepare(d.corpus, str(out), d.tokenizer, cfg.model.vocab_size, d.val_fraction,
                        identity=decision["identity"])
        run_on_main(instruct, info) if distributed else instruct()
        return load_meta(str(out))
    sync = None
    if distributed:
        key = str(out.absolute())
        _CALLS[key] = _CALLS.get(key, 0) + 1
        sync = StoreSync(default_store(), info.rank, info.world_size, f"{key}#{_CALLS[key]}")
    options = dict(text_field=d.text_field, workers=d.workers or default_workers(), piece_bytes=d.piece_bytes,
                   tokenizer_sample_bytes=d.tokenizer_sample_bytes, sync=sync)
    vocab = d.tokenizer_vocab_size or cfg.model.vocab_size
    tokenizer = d.tokenizer or None
    if d.sources:
        names = source_names(d.sources)

        def describe() -> dict[str, Any]:
            return describe_mixture(d.sources, names, d.text_field, tokenizer, vocab, d.val_fraction,
                                    d.piece_bytes, d.tokenizer_sample_bytes)
        corpora = [s.path for s in d.sources]
    else:
        def describe() -> dict[str, Any]:
            return describe_corpus(d.corpus, d.text_field, tokenizer, vocab, d.val_fraction, d.piece_bytes,
                                   d.tokenizer_sample_bytes)
        corpora = [d.corpus]
    if sync is None or sync.rank == 0:
        try:
            decision = verdict(out, describe, corpora, policy, documents=True)
        except Exception as exc:
            if sync is not None:
                sync.fail(f"{type(exc).__name__}: {exc}")
            raise
        if sync is not None:
            sync.share("verdict", json.dumps({k: v for k, v in decision.items() if k != "identity"}))
        _announce(decision)
    else:
        decision = {**json.loads(sync.wait_value("verdict", "rank 0's check of the prepared data")),
                    "identity": None}
        if decision["action"] == "refuse":
            raise ConfigError(decision["message"])
    if decision["action"] == "prepare":
        if d.sources:
            prepare_mixture(d.sources, str(out), tokenizer, vocab, d.val_fraction, cfg.train.seed,
                            identity=decision["identity"], **options)
        else:
            prepare_corpus(d.corpus, str(out), tokenizer, vocab, d.val_fraction, seed=cfg.train.seed,
                           identity=decision["identity"], **options)
    return load_meta(str(out))
