"""The policy losses of the GRPO family, per token, as TRL 1.16's ``GRPOTrainer._compute_loss`` defines them,
split into per-micro-batch sums and one global denominator so that N ranks equal one process.

Per completion token t of completion i, with ``logp`` the policy's log-prob (with gradient), ``old`` the
log-prob the completion was sampled with (``logp.detach()`` when there is none: num_iterations = 1), ``A[i]``
the advantage, ``m`` the completion mask::

    r        = exp(logp - old)                                   importance_sampling_level "token"
             = exp(Σ_t m·(logp - old) / max(Σ_t m, 1))           "sequence" (GSPO), one value per completion
    grpo, dr_grpo, dapo:
      l      = -min(min(r, δ)·A, clip(r, 1 - ε, 1 + ε_high)·A)   (min(r, δ) only when delta > 0)
    cispo:
      l      = -sg(min(r, ε_high))·A·logp                        sg: stop-gradient
    sapo:
      l      = -(4 / τ)·σ(τ·(r - 1))·A                          τ = τ_pos where A > 0, else τ_neg
    + β·kl,  kl = exp(ref - logp) - (ref - logp) - 1 (k3)        times r when use_bias_correction_kl

The loss of a global batch (all ranks, all micro-batches), with S_i = Σ_t m·l the sum over i's tokens::

    grpo, sapo      (1 / n_seq) · Σ_i S_i / max(Σ_t m, 1)
    dr_grpo         Σ_i S_i / (n_seq · max_completion_length)
    dapo, cispo     Σ_i S_i / max(Σ_i Σ_t m, 1)

:func:`policy_loss_sum` returns a micro-batch's numerator (the Σ over its rows); :func:`loss_denominator`
gives the denominator of the whole global batch from the completion lengths, known on the host before the
step. Σ over micro-batches and ranks of the numerators, divided by the denominator, is TRL's loss of the
whole batch (TRL's own ``bnpo``, normalised over its local batch, is ``dapo`` over the global batch: not
offered). With several optimizer steps per generation batch (``steps_per_generation`` S > 1), each step's
grpo, dr_grpo and sapo denominators are its own global batch's, and dapo and cispo divide by the generation
batch's completion tokens / S, as TRL's ``num_items_in_batch`` × accumulation / steps_per_generation.

The metrics (:class:`PolicyLossTerms`) are TRL's: sums and counts to all-reduce (SUM) and divide, and the
per-sequence extremes to reduce with MIN / MAX.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import Tensor

if TYPE_CHECKING:
    from shardlm.config.sections import RLConfig

#: loss types (TRL's names) offered
LOSS_TYPES = ("grpo", "dr_grpo", "dapo", "cispo", "sapo")
#: the loss types whose sequences weigh equally (each sequence's sum divided by its length)
PER_SEQUENCE_MEAN = ("grpo", "sapo")
#: the loss types with a hard clip of the ratio (TRL's clip_ratio/* metrics)
CLIPPED = ("grpo", "dr_grpo", "dapo")


def loss_denominator(loss_type: str, completion_lengths: Tensor | list[int], max_completion_length: int,
                     steps_per_generation: int = 1) -> float:
    """The global denominator of one optimizer step's loss: the numerators of every micro-batch of every rank
    of the step, summed and divided by this, give the loss of the step's global batch (host arithmetic, no
    collective).

    Args:
        loss_type: one of :data:`LOSS_TYPES`.
        completion_lengths: (n_seq,) the masked completion tokens Σ_t m of each sequence of the whole
            GENERATION batch (all ranks; after ``mask_truncated_completions``: a masked completion counts 0
            tokens, but still counts as a sequence).
        max_completion_length: ``rl.max_completion_length`` (tokens).
        steps_per_generation: S, the optimizer steps the generation batch is split into (equal global
            batches of n_seq / S sequences).

    Returns:
        n_seq / S (grpo, sapo: the step's sequences); n_seq / S × max_completion_length (dr_grpo);
        max(Σ lengths, 1) / S (dapo, cispo: TRL 1.16's ``num_items_in_batch`` of the generation batch ×
        gradient_accumulation_steps / steps_per_generation, summed over processes, so a step is normalised
        by the generation batch's average tokens per step, not by its own).

    Raises:
        ValueError: an unknown loss type, an empty batch, or n_seq not a multiple of S.
    """
    lengths = torch.as_tensor(completion_lengths)
    n_seq = lengths.numel()
    if n_seq == 0:
        raise ValueError("the global batch has no sequences")
    if steps_per_generation < 1 or n_seq % steps_per_generation:
        raise ValueError(f"{n_seq} sequences cannot be split into steps_per_generation="
                         f"{steps_per_generation} equal global batches")
    per_step = n_seq // steps_per_generation
    if loss_type in PER_SEQUENCE_MEAN:
        return float(per_step)
    if loss_type == "dr_grpo":
        return float(per_step * max_completion_length)
    if loss_type in ("dapo", "cispo"):
        return float(max(int(lengths.sum().item()), 1)) / steps_per_generation
    raise ValueError(f"unknown loss_type {loss_type!r}; one of {LOSS_TYPES}")


@dataclass
class PolicyLossTerms:
    """One micro-batch's share of the loss and of its metrics."""

    loss_sum: Tensor
    """0-d float32 with gradient: the micro-batch's numerator (divide by :func:`loss_denominator`)."""
    sums: dict[str, Tensor] = field(default_factory=dict)
    """TRL metric name -> (2,) float32 detached [sum, count]: all-reduce SUM over micro-batches and ranks, the
    metric is sum / max(count, 1). ``kl`` (β > 0), ``entropy`` (entropies given), ``clip_ratio/low_mean``,
    ``clip_ratio/high_mean``, ``clip_ratio/region_mean`` (grpo, dr_grpo, dapo), ``cispo_clip_ratio``
    (cispo). At the sequence level the clip ratios count sequences (every row), else masked tokens."""
    mins: dict[str, Tensor] = field(default_factory=dict)
    """Name -> 0-d float32: reduce with MIN (``clip_ratio/low_min``: the least per-sequence fraction of
    low-clipped tokens; +inf when no sequence has a token)."""
    maxs: dict[str, Tensor] = field(default_factory=dict)
    """Name -> 0-d float32: reduce with MAX (``clip_ratio/high_max``; -inf when no sequence has a token)."""


def _importance_log_weights(log_ratio: Tensor, mask: Tensor, level: str) -> Tensor:
    """(B, T) at the token level, (B, 1) at the sequence level (the masked mean of the log-ratio)."""
    if level == "token":
        return log_ratio
    if level == "sequence":
        return ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    raise ValueError(f"unknown importance_sampling_level {level!r}; 'token' or 'sequence'")


def _masked_sum_count(x: Tensor, mask: Tensor) -> Tensor:
    """[Σ x·m, Σ m] for (B, T) x; [Σ x, B] for one value per sequence (B, 1) (TRL's global_masked_mean)."""
    x = x.detach().float()
    if x.shape[1] == 1:
        return torch.stack([x.sum(), torch.tensor(float(x.shape[0]), device=x.device)])
    return torch.stack([(x * mask).sum(), mask.sum()])


def _per_sequence_mean(x: Tensor, mask: Tensor) -> Tensor:
    """(B,) each sequence's masked mean (NaN for a sequence without tokens), or x itself at sequence level."""
    x = x.detach().float()
    if x.shape[1] == 1:
        return x.squeeze(1)
    return (x * mask).sum(-1) / mask.sum(-1)


def policy_loss_sum(rl: RLConfig, logps: Tensor, advantages: Tensor, mask: Tensor, *,
                    old_logps: Tensor | None = None, ref_logps: Tensor | None = None,
                    entropies: Tensor | None = None) -> PolicyLossTerms:
    """One micro-batch's numerator of the loss (module docstring) and its metric sums.

    Args:
        rl: the ``[rl]`` settings read: loss_type, importance_sampling_level, epsilon, epsilon_high, delta,
            beta, use_bias_correction_kl, sapo_temperature_pos / _neg.
        logps: (B, T) float32 with gradient: the policy's log-prob of each completion token (from logits
            divided by ``rl.temperature``); any value at masked positions.
        advantages: (B,) float32, this micro-batch's rows of :func:`~shardlm.rl.advantages.group_advantages`.
        mask: (B, T) 0/1 (any dtype): the completion tokens that count (truncated completions zeroed by the
            caller under ``mask_truncated_completions``).
        old_logps: (B, T) float32, no gradient: the log-probs the completions were sampled with (the old
            policy); None means ``logps.detach()`` (ratio 1, on-policy).
        ref_logps: (B, T) float32, the reference's log-probs; needed when ``rl.beta`` != 0.
        entropies: (B, T) float32 per-token entropies of the policy, for the ``entropy`` metric only (the
            step computes them from its logits chunks); None leaves the metric out.

    Returns:
        :class:`PolicyLossTerms`; its ``loss_sum`` carries the gradient to ``logps`` exactly as TRL's loss
        does (× the denominator).

    Raises:
        ValueError: an unknown loss type or level, or ``ref_logps`` missing with β != 0.
    """
    mask = mask.to(logps.dtype)
    adv = advantages.to(logps.dtype).unsqueeze(1)
    old = logps.detach() if old_logps is None else old_logps
    eps_low = rl.epsilon
    eps_high = rl.epsilon_high or rl.epsilon
    log_ratio = logps - old
    ratio = torch.exp(_importance_log_weights(log_ratio, mask, rl.importance_sampling_level))
    kl = None
    if rl.beta != 0.0:
        if ref_logps is None:
            raise ValueError("rl.beta != 0 needs the reference's log-probs (ref_logps)")
        diff = ref_logps - logps
        kl = torch.exp(diff) - diff - 1
        if rl.use_bias_correction_kl:
            kl = kl * ratio
    lt = rl.loss_type
    if lt == "cispo":
        per_token = -torch.clamp(ratio, max=eps_high).detach() * adv * logps
    elif lt in CLIPPED:
        clipped = torch.clamp(ratio, 1 - eps_low, 1 + eps_high)
        if rl.delta:  # TRL caps the ratio after the clip's bounds are taken, and its metrics see the cap
            ratio = torch.clamp(ratio, max=rl.delta)
        per_token = -torch.min(ratio * adv, clipped * adv)
    elif lt == "sapo":
        tau = torch.where(adv > 0, rl.sapo_temperature_pos, rl.sapo_temperature_neg)
        per_token = -torch.sigmoid(tau * (ratio - 1)) * 4 / tau * adv
    else:
        raise ValueError(f"unknown loss_type {lt!r}; one of {LOSS_TYPES}")
    if kl is not None:
        per_token = per_token + rl.beta * kl
    masked = per_token * mask
    if lt in PER_SEQUENCE_MEAN:
        loss_sum = (masked.sum(-1) / mask.sum(-1).clamp(min=1.0)).sum()
    else:
        loss_sum = masked.sum()
    terms = PolicyLossTerms(loss_sum=loss_sum)
    if kl is not None:
        terms.sums["kl"] = _masked_sum_count(kl, mask)
    if entropies is not None:
        terms.sums["entropy"] = _masked_sum_count(entropies, mask)
    if lt in CLIPPED:
        low = ((ratio < 1 - eps_low) & (adv < 0)).float()
        high = ((ratio > 1 + eps_high) & (adv > 0)).float()
        terms.sums["clip_ratio/low_mean"] = _masked_sum_count(low, mask)
        terms.sums["clip_ratio/high_mean"] = _masked_sum_count(high, mask)
        terms.sums["clip_ratio/region_mean"] = _masked_sum_count(torch.maximum(low, high), mask)
        low_seq, high_seq = _per_sequence_mean(low, mask), _per_sequence_mean(high, mask)
        inf = torch.tensor(float("inf"), device=logps.device)
        terms.mins["clip_ratio/low_min"] = torch.where(low_seq.isnan(), inf, low_seq).min() \
            if low_seq.numel() else inf
        terms.maxs["clip_ratio/high_max"] = torch.where(high_seq.isnan(), -inf, high_seq).max() \
            if high_seq.numel() else -inf
    elif lt == "cispo":
        terms.sums["cispo_clip_ratio"] = _masked_sum_count(((ratio > eps_high) & (adv > 0)).float(), mask)
    return terms


def metrics_from(sums: dict[str, Tensor], mins: dict[str, Tensor] | None = None,
                 maxs: dict[str, Tensor] | None = None) -> dict[str, float]:
    """The metric values from reduced :class:`PolicyLossTerms` fields: sum / max(count, 1) for each of
    ``sums``, and the reduced extremes as they are (a ±inf extreme, no sequence with a token, becomes NaN
    as TRL's nanmin / nanmax of an all-NaN tensor)."""
    out = {name: (v[0] / v[1].clamp(min=1.0)).item() for name, v in sums.items()}
    for extremes in (mins or {}, maxs or {}):
        for name, v in extremes.items():
            out[name] = v.item() if torch.isfinite(v) else float("nan")
    return out
