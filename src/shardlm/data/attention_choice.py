"""The attention a new run trains with when ``model.attention = "auto"`` (the default), read from its data.

The rule (one place, used by the trainer and by ``shardlm plan`` / ``tune``):

* **pre-training text** (one corpus or a mixture) whose preparation recorded where documents start
  (``meta.json``'s ``document_starts``): ``block_causal``, so that no token attends to, or predicts, another
  document (Llama 3's document mask; torchtitan's default);
* **packed instruction data** (``data.pack = true``): ``block_causal`` (the examples of a row must not see
  each other);
* **unpacked instruction data** (one example per sample), **preference pairs** and **prompts** (RL: a
  prompt and its completion per row): ``causal``. A sample holds
  one example and then padding; block-causal attention would give the example's tokens exactly the same
  outputs (the padding comes after them and is never a target), only at the cost of a mask;
* text data prepared **before document starts were recorded** (or by another program): ``causal``, with one
  warning line naming the missing file and the fix (``shardlm prepare`` again): never a silent change.

A resumed run keeps its checkpoint's value instead (:func:`shardlm.train.datasets.resolve_attention`). A text
directory not prepared yet counts as recording its starts: this shardlm's preparation writes them.
"""

from __future__ import annotations

from dataclasses import dataclass

from shardlm.config import Config
from shardlm.data.build import data_dir
from shardlm.data.encode import DOCUMENT_STARTS
from shardlm.data.meta import lacking_document_starts

AUTO = "auto"
"""``model.attention``'s default: resolved once at set-up (:func:`choose_attention`)."""


@dataclass(frozen=True)
class AttentionChoice:
    """The attention of a run and why."""

    attention: str
    """``causal`` or ``block_causal``: what the run trains with (recorded in its checkpoints)."""
    why: str
    """Why, for the start-up summary and the planner's report."""
    warning: str = ""
    """One line to print when text data falls back to causal attention (empty otherwise)."""


def choose_attention(cfg: Config) -> AttentionChoice:
    """``cfg``'s attention: ``model.attention`` when set, else the module docstring's rule for its data
    (``data.format``, ``data.pack``, and the prepared ``meta.json`` of a text corpus or of each
    mixture source)."""
    if cfg.model.attention != AUTO:
        return AttentionChoice(cfg.model.attention, "set in model.attention")
    d = cfg.data
    if d.format == "preference":
        return AttentionChoice("causal", "auto: preference pairs are one sequence per row")
    if d.format == "prompts":
        return AttentionChoice("causal", "auto: each prompt and completion is one sequence per row")
    if d.format == "instruct":
        if d.pack:
            return AttentionChoice("block_causal", "auto: packed instruction examples (data.pack)")
        return AttentionChoice("causal",
                               "auto: one instruction example per sample (block-causal would give the "
                                         "same outputs, at the cost of a mask)")
    missing = lacking_document_starts(data_dir(cfg))
    if missing:
        names = ", ".join(str(p / DOCUMENT_STARTS) for p in missing)
        return AttentionChoice("causal", f"auto: the data records no document starts ({names} missing)",
                               f"warning: {names} missing (the data was prepared before shardlm recorded "
                               "where documents start): training with causal attention across documents; run "
                               "`shardlm prepare` with this config again to train block-causal (or set "
                               "model.attention)")
    return AttentionChoice("block_causal", "auto: pre-training data with recorded document starts")


def may_be_block_causal(cfg: Config) -> bool:
    """Whether ``cfg`` can train block-causal, known from the config alone (before the data is prepared): set
    so, or ``auto`` on text data or packed instruction data."""
    a, d = cfg.model.attention, cfg.data
    return a == "block_causal" or (a == AUTO and (d.format == "text" or (d.format == "instruct" and d.pack)))
