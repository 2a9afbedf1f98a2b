"""What a resume does with each setting that differs from the checkpoint's: it takes effect, or it is refused.

At resume the checkpoint's config (``manifest.json``'s ``config``) is compared with the new one, field by
field; every changed field is printed as ``old -> new``. Each field has one rule in :data:`RULES`:

- ``takes effect`` from the resumed step: the LR schedule is rebuilt from the new config at the resumed
  step (``train.lr``, ``min_lr``, ``warmup_steps``, ``steps``), AdamW's ``betas``, ``eps`` and
  ``weight_decay`` are set in its parameter groups (:func:`shardlm.train.optim.apply_train_config`), and
  everything read at each step (clipping, intervals, parallelism, micro-batch size...) simply applies;
- ``refused``: the resume stops with a message naming the field and why: the model's shape (the tensors
  in the checkpoint have it), and whatever the data order or the meaning of a token id depends on
  (corpus, tokenizer, seq_len, global batch size, seed), because the run must continue at exactly the
  next sample it has not trained on.

Besides the fields, the prepared data itself is compared (:func:`data_problems`): the checkpoint records
the data directory's ``meta.json`` and the SHA-256 of its ``tokenizer.json``, so another data directory
with other content is refused even when only ``data.dir`` changed.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

TAKES_EFFECT, REFUSED = "takes effect", "refused"

_SHAPE = "the model's shape and initialisation are fixed by the checkpoint's tensors"
_ORDER = "the run would skip or repeat samples"
_DATA = "the prepared data (token ids and their meaning) would change"
_SCHEDULE = "the LR schedule is rebuilt from the new config at the resumed step"
_ADAMW = "set in AdamW's parameter groups at the resumed step (its moments are kept)"

#: dotted config key (or ``section.*``) -> (rule, why); the first match wins, keys before wildcards
_QAT = "the fake quantisation a run trains through, and the quantised model it exports, are fixed"
RULES: dict[str, tuple[str, str]] = {
    "model.attention": (REFUSED, "a run continues with the attention pattern it was trained with"),
    "model.attention_backend": (TAKES_EFFECT,
                                "another kernel of the same attention (equal within fp32 rounding)"),
    "model.*": (REFUSED, _SHAPE),
    "data.corpus": (REFUSED, _DATA),
    "data.tokenizer": (REFUSED, _DATA),
    "data.tokenizer_vocab_size": (REFUSED, _DATA),
    "data.val_fraction": (REFUSED, "it sets the train split: " + _ORDER),
    "data.format": (REFUSED, _DATA),
    "data.pack": (REFUSED, "packing makes the samples: " + _ORDER),
    "data.sources": (REFUSED, "the mixture's sources and weights decide every sample: " + _ORDER),
    "data.text_field": (REFUSED, _DATA),
    "data.tokenizer_sample_bytes": (REFUSED, _DATA),
    "data.piece_bytes": (TAKES_EFFECT, "only how preparation cuts its work; the prepared data is compared"),
    "data.workers": (TAKES_EFFECT, "only how many processes prepare the data"),
    "data.pad_multiple": (TAKES_EFFECT, "only how much padding a micro-batch computes (the same samples; "
                                        "losses equal up to summation order)"),
    "data.group_by_length_steps": (REFUSED, "it decides which samples share a step: " + _ORDER),
    "data.dir": (TAKES_EFFECT,
                 "allowed when the data there is the same (meta.json and tokenizer.json SHA-256 "
                               "are compared)"),
    "train.steps": (TAKES_EFFECT, _SCHEDULE),
    "train.lr": (TAKES_EFFECT, _SCHEDULE),
    "train.min_lr": (TAKES_EFFECT, _SCHEDULE),
    "train.warmup_steps": (TAKES_EFFECT, _SCHEDULE),
    "train.betas": (TAKES_EFFECT, _ADAMW),
    "train.eps": (TAKES_EFFECT, _ADAMW),
    "train.weight_decay": (TAKES_EFFECT, _ADAMW),
    "train.decay_norms_and_embeddings": (REFUSED, "it changes AdamW's parameter groups, whose state the "
                                                  "checkpoint holds"),
    "train.seq_len": (REFUSED, "samples are windows of seq_len + 1 tokens: " + _ORDER),
    "train.global_batch_size": (REFUSED, "step b takes samples [b·G, (b+1)·G): " + _ORDER),
    "train.seed": (REFUSED, "it seeds the data order: " + _ORDER),
    "train.micro_batch_size": (TAKES_EFFECT, "the same global batch, split otherwise"),
    "train.loss_chunk_tokens": (TAKES_EFFECT,
                                "the same loss, computed a chunk of tokens at a time (equal up to "
                                              "rounding)"),
    "train.grad_clip": (TAKES_EFFECT, "read at every step"),
    "train.eval_interval": (TAKES_EFFECT, "read at every step"),
    "train.eval_tokens": (TAKES_EFFECT, "read at every evaluation"),
    "train.log_interval": (TAKES_EFFECT, "read at every step"),
    "train.log_per_rank": (TAKES_EFFECT, "read at every logged step"),
    "train.log_moe_layers": (TAKES_EFFECT, "read at every logged step"),
    "train.peak_flops": (TAKES_EFFECT, "only the MFU that is logged"),
    "train.trainable": (REFUSED,
                        "the checkpoint holds exactly the trainable parameters and their AdamW state"),
    "train.frozen": (REFUSED, "the checkpoint holds exactly the trainable parameters and their AdamW state"),
    "lora.merge_into": (TAKES_EFFECT, "only which base the merged export adds the adapters to"),
    "lora.*": (REFUSED, "the adapters' shapes and the base they were trained on are fixed by the checkpoint"),
    "preference.precompute_reference": (TAKES_EFFECT,
                                        "the same reference log-probs, computed once before training "
                                                      "or at every step"),
    "preference.*": (REFUSED, "the objective (loss, its parameters, the reference) a run optimises is fixed"),
    "distill.*": (REFUSED, "the objective (the teacher, the divergence and its weights) a run optimises is "
                           "fixed"),
    "rl.*": (REFUSED, "the objective (sampling, rewards, the loss and its parameters) a run optimises is "
                      "fixed, and the completions of a resumed step must be the uninterrupted run's"),
    "train.float8": (TAKES_EFFECT, "the weights are saved in full precision under the same names: only how "
                                   "the linear layers compute from here"),
    "train.qat": (REFUSED, _QAT),
    "train.qat_group_size": (REFUSED, _QAT),
    "parallel.pp": (TAKES_EFFECT, "each stage saves and loads its own parameters under the whole model's "
                    "names: a checkpoint resumes at any number of stages, or none"),
    "parallel.pp_schedule": (TAKES_EFFECT, "the schedule orders the micro-batches of a step, not what is "
                             "saved"),
    "parallel.pp_layers_per_stage": (TAKES_EFFECT, "the cut between stages does not change the names saved"),
    "parallel.*": (TAKES_EFFECT, "the checkpoint does not depend on the world size or the sharding"),
    "run.*": (TAKES_EFFECT, "where and under which name the run writes"),
    "checkpoint.*": (TAKES_EFFECT, "read at every step"),
    "metrics.*": (TAKES_EFFECT, "where the records go besides metrics.jsonl (the tracker runs are kept when "
                                "the tracker stays on)"),
}


def rule(key: str) -> tuple[str, str]:
    """(``takes effect`` | ``refused``, why) for dotted config key ``key`` (see :data:`RULES`).

    Raises:
        KeyError: no rule covers ``key`` (a config field added without deciding its rule).
    """
    if key in RULES:
        return RULES[key]
    wildcard = key.split(".", 1)[0] + ".*"
    if wildcard in RULES:
        return RULES[wildcard]
    raise KeyError(f"no resume rule for config field {key}")


@dataclass(frozen=True)
class Change:
    """One config field that differs between the checkpoint and the new config."""

    key: str
    old: Any
    new: Any
    rule: str
    why: str

    def line(self) -> str:
        """``train.lr: 0.001 -> 0.0005 (takes effect: ...)``."""
        return f"{self.key}: {_show(self.old)} -> {_show(self.new)} ({self.rule}: {self.why})"


_MISSING = object()


def _show(value: Any) -> str:
    return "(not recorded)" if value is _MISSING else json.dumps(value)


def flatten(config: dict[str, Any]) -> dict[str, Any]:
    """``{"train": {"lr": 0.001}}`` -> ``{"train.lr": 0.001}`` (one level of sections, as in ``Config``)."""
    return {f"{section}.{key}": value for section, table in config.items() if isinstance(table, dict)
            for key, value in table.items()}


#: fields that say how this attempt starts, not how the run trains: never listed as changes
NOT_COMPARED = ("checkpoint.resume",)

#: fields whose value in a checkpoint written before they existed is known (what every such run trained with):
#: compared as that value, so a default that changes later cannot switch an old run without a word
BEFORE_RECORDED: dict[str, Any] = {"model.attention": "causal", "data.pack": False,
                                   "data.group_by_length_steps": 0}


#: settings whose ``"auto"`` on resume means "the run's own choice": the checkpoint's value is kept
#: (shardlm/config/auto.py, shardlm/train/defaults.py), so an ``"auto"`` there is no change
KEPT_WHEN_AUTO = frozenset({"parallel.reshard_after_forward", "parallel.blocks_per_group",
                            "parallel.activation_checkpoint", "train.loss_chunk_tokens"})


#: RL's generation batch set either way (one gives the other, shardlm/config/checks.py): a change from one
#: to the other naming the same number of steps per generation is no change
GENERATION_KEYS = ("rl.generation_batch_size", "rl.steps_per_generation")


def _steps_per_generation(flat: dict[str, Any]) -> Any:
    """The steps per generation batch a flattened config trains with (``None`` when it has no RL section)."""
    if "rl.steps_per_generation" not in flat:
        return None
    batch = flat.get("rl.generation_batch_size") or 0
    return batch // flat["train.global_batch_size"] if batch else flat["rl.steps_per_generation"]


def config_changes(old: dict[str, Any], new: dict[str, Any]) -> list[Change]:
    """Every field of ``new`` (``Config.to_dict()``) whose value differs in ``old`` (the checkpoint's),
    in order.

    A field the checkpoint did not record (written by an older shardlm) counts as changed and takes effect,
    except those of :data:`BEFORE_RECORDED`, compared as the value they had then. The fields of
    :data:`NOT_COMPARED` (``checkpoint.resume``: every resume sets it) are left out, and so are
    :data:`GENERATION_KEYS` when both configs name the same steps per generation at the same global batch.
    """
    before, after = {**BEFORE_RECORDED, **flatten(old)}, flatten(new)
    same_generation = _steps_per_generation(before) == _steps_per_generation(after) is not None
    changes = []
    for key, value in after.items():
        previous = before.get(key, _MISSING)
        if previous == value or key in NOT_COMPARED or (value == "auto" and key in KEPT_WHEN_AUTO):
            continue
        if key in GENERATION_KEYS and same_generation and before.get("train.global_batch_size") == \
                after.get("train.global_batch_size"):
            continue
        what, why = rule(key) if previous is not _MISSING else (TAKES_EFFECT,
                                                                "not recorded in the checkpoint")
        changes.append(Change(key, previous, value, what, why))
    return changes


def data_problems(
    manifest: dict[str, Any], meta: dict[str, Any] | None, tokenizer_sha256: str | None
) -> list[str]:
    """Why the prepared data differs from the one the checkpoint was trained on (empty when the same).

    Compares the checkpoint's ``data`` record (the data directory's ``meta.json``) with ``meta``, and its
    ``tokenizer.json`` checksum with ``tokenizer_sha256``. Missing records (older checkpoints) are skipped,
    and so is ``meta.json``'s ``identity`` (what the data was made from: modification times change when
    identical data is prepared again; the tokens themselves are compared through ``content_sha256``), and
    ``document_starts`` and ``model_special_ids`` when the checkpoint's record predates them (the same tokens
    prepared again now record where documents start, and a mixture its tokenizer's model's special ids: the
    run exports those from then on).
    """
    problems = []
    stored_tok = manifest.get("files", {}).get("tokenizer.json", {}).get("sha256")
    if stored_tok and tokenizer_sha256 and stored_tok != tokenizer_sha256:
        problems.append(f"the tokenizer differs (tokenizer.json SHA-256 {stored_tok[:12]}... in the "
                        f"checkpoint, {tokenizer_sha256[:12]}... in the data directory): token ids would "
                        "mean other tokens")
    stored_meta = manifest.get("data")
    if isinstance(stored_meta, dict) and meta is not None:
        differ = [
            f"{k} {json.dumps(stored_meta.get(k))} -> {json.dumps(meta.get(k))}"
            for k in sorted(set(stored_meta) | set(meta))
            if k != "identity"
            and stored_meta.get(k) != meta.get(k)
            and not (k in ("document_starts", "model_special_ids") and k not in stored_meta)
        ]
        if differ:
            problems.append(
                "the prepared data differs from the checkpoint's (meta.json: " + ", ".join(differ) + ")"
            )
    return problems
