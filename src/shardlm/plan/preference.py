"""What preference tuning (``data.format = "preference"``) adds to a step's memory: both rows of a pair, and
the reference (:mod:`shardlm.train.reference`); and what distillation's teacher adds
(:mod:`shardlm.train.teacher`).

* **Rows**: a micro-batch of P pairs runs 2P sequences (chosen and rejected) through one forward:
  :func:`preference_rows` is the config the planner plans, its batch sizes counted in rows.
* **A frozen reference model** (``reference = "model"``, not precomputed): built as the policy is (same mesh
  and FSDP groups, no LoRA or freezing, no activation checkpointing), so per rank it stores the fp32 shards of
  every parameter and has no gradient or AdamW state. Its forward runs under ``torch.no_grad`` on the
  micro-batch's rows before the policy's: each group is all-gathered, used and resharded after forward (per
  ``parallel.reshard_after_forward``; FSDP2 frees a group's all-gather buffer only at the next group's
  copy-out, :func:`frozen_forward`), and nothing is saved for backward. FSDP2 never reshards the final-norm
  + output group (``reshard_after_forward=False``) nor the root group (the root does not reshard after
  forward), and without a backward nothing reshards them later: after its first forward the reference keeps
  those two groups unsharded for the rest of the run (``torch.distributed.fsdp._fully_shard``, torch
  2.13; measured).
* **The base with LoRA's adapters off** (``lora_base``): the policy's own forward under ``torch.no_grad``:
  only that forward's transients, at a moment when the policy holds no activations (the step's peak
  is elsewhere).
* **A distillation teacher** (``distill.teacher_from``, kind ``teacher``): stored and run as a frozen
  reference model, in its own shape (:func:`shardlm.train.teacher.teacher_config`); instead of log-probs
  its forward keeps its final hidden states (c·N·D_t) and a copy of its output weight (c·V·D_t) until the
  student's loss, which holds a few more ``chunk × vocab`` fp32 buffers than the cross-entropy
  (:func:`distill_loss_bytes`).
* **Online RL** (``data.format = "prompts"``, ``rl.beta`` > 0): the same kinds, by
  :func:`shardlm.train.objectives.grpo.rl_reference_kind`, never precomputed; its log-probs' head projects at
  most ``rl.max_completion_length`` tokens per row (:mod:`shardlm.plan.rollout` counts the rollout).
* **Precomputed** (``precompute_reference``): the (pairs, 2) fp64 table of every training pair on each rank;
  the reference model is freed before step 1.
"""

from __future__ import annotations

import copy
import functools
import math
from dataclasses import dataclass
from pathlib import Path

from shardlm.config import Config
from shardlm.data.build import data_dir
from shardlm.data.preference import PREFERENCE, PreferencePairs
from shardlm.data.prepare import is_prepared, load_meta
from shardlm.plan.activations import Shape
from shardlm.plan.ledger import Ledger
from shardlm.plan.param_groups import Group
from shardlm.train.objectives.grpo import rl_reference_kind
from shardlm.train.reference import reference_config, reference_kind
from shardlm.train.teacher import teacher_config

#: the kind of :class:`ReferenceMemory` of a distillation teacher
TEACHER = "teacher"


def preference_rows(cfg: Config) -> Config:
    """The config the planner plans: for preference data a copy with ``train.micro_batch_size`` and
    ``train.global_batch_size`` counted in rows (2 per pair), else ``cfg`` itself."""
    if cfg.data.format != "preference":
        return cfg
    rows = copy.deepcopy(cfg)
    rows.train.micro_batch_size *= 2
    rows.train.global_batch_size *= 2
    return rows


@dataclass(frozen=True)
class ReferenceMemory:
    """What the reference takes on each rank (bytes), for :func:`shardlm.plan.memory.plan_memory`."""

    kind: str
    """``model``, ``lora_base``, ``none``, ``teacher`` (distillation), or ``""`` (neither)."""
    live_model: bool
    """A frozen model runs a forward in every micro-batch (kind ``model``, not precomputed, or
    ``teacher``)."""
    table_bytes: int
    """The precomputed table: 16 bytes per training pair (0 when not precomputed or the data is
    not prepared)."""
    policy_forward: bool
    """The policy runs a no-grad forward with its adapters off in every micro-batch (``lora_base``, not
    precomputed)."""
    scored_per_row: float = 0.0
    """Mean scored (completion) tokens per row of the prepared training pairs (chosen and rejected alike); 0
    when not preference data or not prepared (then every token counts: an upper bound)."""

    loss_buffers: int = 0
    """Distillation: fp32 buffers of ``chunk × vocab`` values one chunk of the distillation loss holds at its
    high point beyond the cross-entropy's (:mod:`shardlm.train.distill_loss`: both models' scaled logits and
    log-probs, the divergence's terms and their gradients; counted from the code: 6 for the KLs, 10 for the
    JSD, whose mixture adds its log and both sides' probabilities)."""

    def head_bytes(self, shape: Shape, c: int, chunk: int) -> int:
        """The high point of the frozen model's output head on a micro-batch of ``shape`` (compute dtype of
        ``c`` bytes): the reference's log-probs (:func:`no_grad_head_bytes`), or the teacher's copy of its
        output weight (V × D, kept for the student's loss: :func:`shardlm.train.teacher.teacher_outputs`)."""
        if self.kind == TEACHER:
            return c * shape.vocab * shape.d
        return no_grad_head_bytes(self.loss_tokens(shape.tokens, shape.b), shape.vocab, shape.d, c, chunk)

    def loss_tokens(self, tokens: int, rows: int) -> int:
        """Tokens the log-probs' head projects in a micro-batch of ``rows`` rows and ``tokens`` tokens: only
        the scored ones (:func:`shardlm.train.preference.head_logps`), their mean count when known."""
        return min(tokens, math.ceil(self.scored_per_row * rows)) if self.scored_per_row else tokens


def reference_memory(cfg: Config) -> ReferenceMemory:
    """The reference of ``cfg`` as the planner counts it (see the module docstring); the kind is
    :func:`shardlm.train.reference.reference_kind`'s, or ``teacher`` under distillation."""
    if cfg.distill.teacher_from:
        return ReferenceMemory(TEACHER, True, 0, False, loss_buffers=10 if cfg.distill.loss == "jsd" else 6)
    if cfg.data.format == "prompts":  # online RL: at most max_completion_length scored tokens per row
        kind = rl_reference_kind(cfg)
        return ReferenceMemory(kind, kind == "model", 0, kind == "lora_base",
                               float(cfg.rl.max_completion_length))
    if cfg.data.format != "preference":
        return ReferenceMemory("", False, 0, False)
    kind = reference_kind(cfg)
    pre = kind in ("model", "lora_base") and cfg.preference.precompute_reference
    out = str(data_dir(cfg))
    pairs, scored = (_train_pairs(out, cfg.train.seq_len, (Path(out) / "meta.json").stat().st_mtime_ns)
                     if is_prepared(out) else (0, 0.0))
    return ReferenceMemory(kind, kind == "model" and not pre, 16 * pairs if pre else 0,
                           kind == "lora_base" and not pre, scored)


def frozen_model_config(cfg: Config) -> Config:
    """The config of the frozen model that runs beside the trained one: the distillation teacher's
    (:func:`~shardlm.train.teacher.teacher_config`) or the reference's
    (:func:`~shardlm.train.reference.reference_config`; online RL's from ``rl.reference_from``)."""
    if cfg.distill.teacher_from:
        return teacher_config(cfg)
    return reference_config(cfg, cfg.rl.reference_from if cfg.data.format == "prompts" else None)


def distill_loss_bytes(ref: ReferenceMemory, scored: int, vocab: int, teacher_dim: int, c: int,
                       chunk: int) -> int:
    """What one chunk of the distillation loss holds beyond the chunked cross-entropy (bytes): the
    teacher's scored hidden states, selected (c·n·D_t), and :attr:`ReferenceMemory.loss_buffers` fp32
    ``k × V`` buffers (k = min(chunk, scored); chunk 0: every scored token); 0 without distillation."""
    if ref.kind != TEACHER:
        return 0
    k = min(chunk, scored) if chunk else scored
    return c * scored * teacher_dim + ref.loss_buffers * 4 * k * vocab


@functools.lru_cache(maxsize=8)
def _train_pairs(out: str, seq_len: int, version: int) -> tuple[int, float]:
    """(pairs, mean scored tokens per row) of a prepared preference directory's train split, read once per
    ``version`` (``meta.json``'s mtime: data prepared again is read again; ``shardlm plan``'s search asks
    often); (0, 0.0) for other prepared data."""
    if load_meta(out).get("format") != PREFERENCE:
        return 0, 0.0
    train = PreferencePairs(out, "train", seq_len)
    return len(train), float(train.chosen_counts.mean() + train.rejected_counts.mean()) / 2


def frozen_forward(led: Ledger, groups: list[Group], n: int, c: int, reshard: bool, block_work: int,
                   phase: str) -> int:
    """Replay a frozen model's no-grad forward, group by group in forward order, into ``led``'s ``reference``
    part; returns the bytes of the last all-gather buffer, which the caller frees after the output head (the
    root's post-forward frees it).

    Args:
        groups: the frozen model's FSDP groups (:func:`shardlm.plan.param_groups.param_groups`). n: ranks in
            the shard group. c: bytes per value of the compute dtype. reshard: FSDP with
            ``reshard_after_forward`` (False: every group stays unsharded after the first step, nothing is
            all-gathered). block_work: a block's own high point (:func:`no_grad_block_bytes`).

    In a steady-state step only the block groups are all-gathered (the root and the output group stay
    unsharded, see the module docstring). Each is all-gathered into a flat buffer (n × its padded shard)
    and copied out into its unsharded parameters; in forward with a synchronous all-gather and ``n > 1``,
    FSDP2 keeps that buffer until the next group's copy-out, to overlap it with the next all-gather
    (``FSDPParamGroup.wait_for_unshard``, torch 2.13), and the root's post-forward frees the last one. So
    while a block runs its unsharded parameters, its all-gather buffer and the block's transients are alive,
    and at a block's copy-out the previous block's buffer too.
    """
    retained = 0
    for g in groups:
        held = round(g.numel * c * g.gather_factor) if reshard and g.name not in ("root", "head") else 0
        buffer = round(n * g.shard_numel * c * g.gather_factor) if held else 0
        led.add("reference", buffer + held, phase)  # all-gathered, copied out
        led.free("reference", retained if held else 0)  # the previous group's buffer, after this copy-out
        if held:
            retained = buffer if n > 1 else 0
            led.free("reference", buffer - retained)
        work = block_work if g.name.startswith("block") else 0
        led.add("reference", work, phase)
        led.free("reference", work + held)  # resharded after forward
    return retained


def no_grad_block_bytes(tokens: int, dim: int, ffn: int, c: int) -> int:
    """The high point of one decoder block's forward under ``torch.no_grad`` (bytes, compute dtype of ``c``
    bytes): the block's input and its normed copy (2·N·D), the MLP's gate, up and activated gate (3·N·F);
    nothing is saved, each intermediate is freed once used."""
    return c * (2 * tokens * dim + 3 * tokens * ffn)


def no_grad_head_bytes(scored: int, vocab: int, dim: int, c: int, chunk: int) -> int:
    """The high point of the log-probs' head under ``torch.no_grad``
    (:func:`shardlm.train.preference.head_logps`) on ``scored`` tokens, ``chunk`` at a time (0: all): the
    selected hidden states (c·n·D), a chunk's logits (c·k·V), their fp32 copy when c < 4, and logsumexp's fp32
    temporary (4·k·V)."""
    k = min(chunk, scored) if chunk else scored
    return c * scored * dim + c * k * vocab + (4 * k * vocab if c < 4 else 0) + 4 * k * vocab
