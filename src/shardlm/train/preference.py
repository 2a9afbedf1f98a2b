"""Preference losses (DPO, IPO, hinge, SimPO, ORPO), the completions' log-probs, and the objective of a step.

Per pair, with ``logp`` the summed log-probability of a completion's scored tokens under the policy,
``ref`` the same under the reference, ``avg`` the per-token mean ``logp / n`` and Δ the chosen-minus-rejected
difference (c: chosen, r: rejected)::

    dpo     -(1-ε)·logσ(β·Δ(logp - ref)) - ε·logσ(-β·Δ(logp - ref))  Rafailov et al. 2023, Eq. 7; ε: Mitchell
                                                                     2023 (TRL DPOTrainer ``sigmoid`` at ε =
                                                                     0; with ε CPOTrainer's ``sigmoid`` on the
                                                                     log-ratios: TRL 1.16's DPOTrainer ignores
                                                                     ε there)
    ipo     (Δ((logp - ref) / n) - 1/(2β))²                          Azar et al. 2023, Eq. 17, per-token
                                                                     averaged as TRL's DPOTrainer (confirmed
                                                                     with the authors)
    hinge   max(0, 1 - β·Δ(logp - ref))                              SLiC-HF, Zhao et al. 2023 (TRL ``hinge``)
    simpo   -(1-ε)·logσ(β·Δavg - γ) - ε·logσ(-(β·Δavg - γ))          Meng et al. 2024, Eq. 6 (TRL CPOTrainer
                                                                     ``simpo``)
    orpo    -β·logσ(Δavg - Δlog(1 - exp(avg)))                       Hong et al. 2024, Eqs. 4-7 (TRL
                                                                     ORPOTrainer), λ=β
    + α·NLL   mean NLL of the chosen sequences' tokens (RPO, Pang et al. 2024; ORPO's L_SFT with weight
              1 + α), over ``preference.nll_tokens``: the completions' tokens (TRL's DPOTrainer ``sft``,
              CPOTrainer's ``cpo_alpha``, the ORPO paper's L_SFT) or every next-token target of prompt +
              completion (TRL 1.16's ORPOTrainer, whose ``concatenated_forward`` takes the cross-entropy of
              the chosen rows' ``input_ids`` where ``attention_mask`` is 1, shifted by one; ``auto``: this
              for orpo, the completions otherwise)

The step's loss is the mean of the per-pair losses over the pairs of the whole global batch plus the NLL
term's mean over the NLL tokens of the whole global batch; each micro-batch contributes its sums divided by
those global counts (known on the host), so N ranks equal one process. Rewards as TRL logs them: ``β·(logp -
ref)`` (dpo / ipo / hinge), ``β·avg`` (simpo / orpo); ``logps/*`` are ``logp`` (dpo / ipo / hinge) or ``avg``
(simpo / orpo), as the trainers return them; ``logits/*`` the mean over the completions' scored tokens of the
logits' mean over the vocabulary (DPOTrainer's definition, used for every loss here: TRL 1.16's CPOTrainer and
ORPOTrainer log the mean over every position of the padded chosen / rejected logits, prompt and padding
included, a figure that moves with the batch's padding; not reproduced).

Log-probs are computed from the final hidden states a chunk of ``train.loss_chunk_tokens`` scored tokens at a
time (:func:`completion_logps`): each chunk's logits are made, reduced to one log-prob per token and freed,
and are made again in the backward (``torch.utils.checkpoint``), so the whole logits never exist.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from shardlm.data.instruct import IGNORE_INDEX, split_batch
from shardlm.model.lora import LoRALinear

#: the losses that compare the policy with a reference model
NEEDS_REFERENCE = ("dpo", "ipo", "hinge")

#: per-micro-batch sums the step all-reduces, in this order (:meth:`PreferenceObjective.metrics` divides them)
STAT_NAMES = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
              "logps/rejected", "logits/chosen", "logits/rejected", "tokens/chosen", "tokens/rejected",
              "nll_loss", "tokens/nll")

#: ``preference.nll_tokens`` values, ``auto`` resolved by :func:`nll_token_set`
NLL_TOKEN_SETS = ("completion", "prompt_and_completion")


def _token_logps(llama: nn.Module, hidden: Tensor, targets: Tensor) -> tuple[Tensor, Tensor]:
    """Log-probability (c,) fp32 of each target under the model's output head on ``hidden`` (c, D), and the
    mean over the vocabulary of each row's logits (c,) fp32 (a metric, without gradient).

    ``lm_head.forward`` is called, not the module: under FSDP2 each call of a group's module registers one
    more post-backward (a reduce-scatter), and the number of chunks differs between ranks (their completions'
    lengths do); the output group is unsharded by the final norm's call (same group, never resharded after
    forward) and reduce-scattered once, after the norm's backward, when every chunk's gradient is in."""
    logits = llama.lm_head.forward(hidden)
    cap = llama.cfg.final_logit_softcap
    if cap:
        logits = torch.tanh(logits / cap) * cap
    logits = logits.float()
    logp = logits.gather(1, targets.unsqueeze(1)).squeeze(1) - torch.logsumexp(logits, dim=1)
    return logp, logits.detach().mean(1)


def head_logps(llama: nn.Module, hidden: Tensor, targets: Tensor, chunk_tokens: int,
               nll_targets: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """Per sequence: summed log-probs of the scored targets, the sum of their logits' vocabulary means, and
    summed log-probs of the NLL term's targets.

    Args:
        llama: the :class:`CausalLM` whose ``lm_head`` (any of its forms: plain, LoRA, NF4
            base) and ``final_logit_softcap`` make the logits, as its own forward does.
        hidden: (R, T, D) final-norm output, compute dtype; targets: (R, T) int64, ``IGNORE_INDEX``
        off-completion. chunk_tokens: scored tokens per chunk (0: one chunk of all). With gradients each chunk
        is checkpointed: its logits (chunk × V fp32) are freed after the forward and made again in the
        backward. nll_targets: (R, T) int64, ``IGNORE_INDEX`` off the NLL term's tokens, equal to
        ``targets`` wherever those are scored (a superset: the prompt's targets too), or None (the NLL term's
        tokens are the scored ones). Every token of either set is projected once.

    Returns ``(logps, logit_sums, nll_logps)``, each (R,) fp32: over ``targets``' scored tokens, and over
    ``nll_targets``' (``logps`` itself when None); ``logit_sums`` has no gradient.
    """
    r, t, d = hidden.shape
    flat_t = targets.reshape(-1)
    flat_all = flat_t if nll_targets is None else nll_targets.reshape(-1)
    rows = (flat_all != IGNORE_INDEX).nonzero().squeeze(1)  # only the scored tokens are projected
    h = hidden.reshape(-1, d).index_select(0, rows)
    tgt = flat_all.index_select(0, rows)
    n = h.shape[0]
    chunk = chunk_tokens or max(n, 1)
    logps, means = [], []
    for start in range(0, max(n, 1), chunk):
        # no scored token: one empty chunk (the head's weights get zero grads)
        h_c, t_c = h[start:start + chunk], tgt[start:start + chunk]
        if torch.is_grad_enabled() and chunk < n:
            lp, mean = checkpoint(_token_logps, llama, h_c, t_c, use_reentrant=False)
        else:
            lp, mean = _token_logps(llama, h_c, t_c)
        logps.append(lp)
        means.append(mean)
    seq = rows // t
    out = torch.zeros(r, dtype=torch.float32, device=hidden.device)
    lp, mean = torch.cat(logps), torch.cat(means)
    if nll_targets is None:
        summed = out.index_add(0, seq, lp)
        return summed, out.index_add(0, seq, mean), summed
    scored = flat_t.index_select(0, rows) != IGNORE_INDEX  # of the projected tokens, those of ``targets``
    zero = lp.new_zeros(())
    return (out.index_add(0, seq, torch.where(scored, lp, zero)),
            out.index_add(0, seq, torch.where(scored, mean, zero)), out.index_add(0, seq, lp))


def completion_logps(
    model: nn.Module, inputs: Tensor, targets: Tensor, chunk_tokens: int, nll_targets: Tensor | None = None
) -> tuple[Tensor, Tensor, Tensor]:
    """:func:`head_logps` of ``model`` (a Llama, FSDP-sharded or not) on ``inputs`` (R, T): one forward, the
    output head applied through the model's ``head`` argument (so FSDP's hooks of the root run as for the
    token loss)."""
    def head(llama: nn.Module, hidden: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        return head_logps(llama, hidden, targets, chunk_tokens, nll_targets)

    return model(inputs, head=head)


def nll_token_set(loss: str, nll_tokens: str) -> str:
    """``preference.nll_tokens`` with ``auto`` resolved: ``prompt_and_completion`` for ``orpo`` (TRL 1.16's
    ORPOTrainer), ``completion`` for the other losses (TRL's DPOTrainer ``sft``, CPOTrainer's
    ``cpo_alpha``).

    Raises:
        ValueError: ``nll_tokens`` is none of ``auto``, ``completion``, ``prompt_and_completion``.
    """
    if nll_tokens == "auto":
        return "prompt_and_completion" if loss == "orpo" else "completion"
    if nll_tokens not in NLL_TOKEN_SETS:
        raise ValueError(f"unknown nll_tokens {nll_tokens!r} (auto, {', '.join(NLL_TOKEN_SETS)})")
    return nll_tokens


def sequence_targets(batch: Tensor) -> Tensor:
    """(R, T) int64 next-token targets of every row's whole sequence, prompt and completion (TRL's
    ORPOTrainer: the row's ``input_ids`` where ``attention_mask`` is 1, shifted by one), ``IGNORE_INDEX`` on
    the right padding, for a batch (R, 2, T + 1) of :meth:`shardlm.data.preference.PreferencePairs.get`: a
    row's real tokens end where its completion (the last labelled token) ends; a row without a labelled token
    has no target."""
    tokens, labels = batch[:, 0, 1:], batch[:, 1, 1:]
    position = torch.arange(1, labels.shape[1] + 1, device=labels.device)
    # targets at positions < end: the labelled ones and every one before them
    end = (labels.ne(IGNORE_INDEX) * position).amax(1, keepdim=True)
    return torch.where(position <= end, tokens, IGNORE_INDEX)


@contextlib.contextmanager
def adapters_off(model: nn.Module) -> Iterator[None]:
    """Within the block every :class:`~shardlm.model.lora.LoRALinear` of ``model`` computes its base only (its
    ``adapters_enabled`` is False): the policy with its adapters switched off is the pretrained base.

    Raises:
        ValueError: ``model`` has no LoRA layer (nothing would be switched off).
    """
    layers = [m for m in model.modules() if isinstance(m, LoRALinear)]
    if not layers:
        raise ValueError("adapters_off: the model has no LoRA layers")
    for m in layers:
        m.adapters_enabled = False
    try:
        yield
    finally:
        for m in layers:
            m.adapters_enabled = True


@dataclass
class PairTerms:
    """One micro-batch's per-pair results, each (P,) fp32: ``losses`` (the per-pair loss), ``chosen_rewards``
    and ``rejected_rewards`` (TRL's), ``chosen_logps`` and ``rejected_logps`` (as TRL logs them)."""

    losses: Tensor
    chosen_rewards: Tensor
    rejected_rewards: Tensor
    chosen_logps: Tensor
    rejected_logps: Tensor


def pair_losses(loss: str, beta: float, label_smoothing: float, simpo_gamma: float, logps: Tensor,
                counts: Tensor, ref_logps: Tensor | None) -> PairTerms:
    """The per-pair losses and rewards of the module docstring.

    Args:
        loss: ``dpo``, ``ipo``, ``hinge``, ``simpo`` or ``orpo``. logps: (2P,) fp32 summed log-probs, the P
        chosen completions first, then the P rejected in the same order. counts: (2P,) scored tokens of each
        completion (>= 1 for simpo / orpo / ipo; clamped at 1 as TRL does). ref_logps: (2P,) the reference's,
        for dpo / ipo / hinge; None otherwise.

    Raises:
        ValueError: an unknown ``loss``, or a reference-based loss without ``ref_logps``.
    """
    p = logps.shape[0] // 2
    if loss in NEEDS_REFERENCE:
        if ref_logps is None:
            raise ValueError(f"loss {loss!r} needs the reference log-probs")
        ratios = logps - ref_logps
        c, r = ratios[:p], ratios[p:]
        if loss == "dpo":
            z = beta * (c - r)
            losses = -F.logsigmoid(z) * (1 - label_smoothing) - F.logsigmoid(-z) * label_smoothing
        elif loss == "hinge":
            losses = torch.relu(1 - beta * (c - r))
        else:  # ipo
            n = counts.clamp(min=1).to(ratios.dtype)
            losses = (c / n[:p] - r / n[p:] - 1 / (2 * beta)) ** 2
        return PairTerms(losses, beta * c.detach(), beta * r.detach(), logps[:p].detach(), logps[p:].detach())
    avg = logps / counts.clamp(min=1).to(logps.dtype)
    c, r = avg[:p], avg[p:]
    if loss == "simpo":
        z = beta * (c - r - simpo_gamma / beta)
        losses = -F.logsigmoid(z) * (1 - label_smoothing) - F.logsigmoid(-z) * label_smoothing
    elif loss == "orpo":  # log odds(y) = log p - log(1 - p), p = exp(avg): log1mexp(x) = log(-expm1(x))
        log_odds = (c - r) - (torch.log(-torch.expm1(c)) - torch.log(-torch.expm1(r)))
        losses = -beta * F.logsigmoid(log_odds)
    else:
        raise ValueError(f"unknown preference loss {loss!r} (dpo, ipo, hinge, simpo, orpo)")
    return PairTerms(losses, beta * c.detach(), beta * r.detach(), c.detach(), r.detach())


def nll_weight(loss: str, rpo_alpha: float) -> float:
    """Weight of the chosen completions' mean NLL in the loss: 1 + α for ORPO (its SFT term), α otherwise."""
    return (1.0 if loss == "orpo" else 0.0) + rpo_alpha


def pair_stats(terms: PairTerms, logit_sums: Tensor, counts: Tensor, nll_logps: Tensor,
               nll_counts: Tensor) -> Tensor:
    """The micro-batch's sums of :data:`STAT_NAMES`, (len(STAT_NAMES),) fp64 (no gradient).

    Args: terms: :func:`pair_losses`' P pairs. logit_sums, counts: (2P,) of :func:`head_logps` and the
    scored completion tokens of each row; nll_logps, nll_counts: (P,) the chosen rows' summed log-probs
    over the NLL term's tokens and their number."""
    p = terms.losses.shape[0]
    c, r = terms.chosen_rewards, terms.rejected_rewards
    return torch.stack([
        c.sum(), r.sum(), (c > r).float().sum(), (c - r).sum(), terms.chosen_logps.sum(),
        terms.rejected_logps.sum(), logit_sums[:p].sum(), logit_sums[p:].sum(), counts[:p].sum().float(),
        counts[p:].sum().float(), -nll_logps.detach().sum(), nll_counts.sum().float()]).double()


def metrics_of(sums: list[float], pairs: int) -> dict[str, float]:
    """TRL's metrics of a global batch from the all-reduced :func:`pair_stats` sums and its number
    of pairs."""
    s = dict(zip(STAT_NAMES, sums))
    out = {k: s[k] / pairs for k in STAT_NAMES[:6]}
    out["logits/chosen"] = s["logits/chosen"] / max(s["tokens/chosen"], 1.0)
    out["logits/rejected"] = s["logits/rejected"] / max(s["tokens/rejected"], 1.0)
    out["nll_loss"] = s["nll_loss"] / max(s["tokens/nll"], 1.0)
    return out


def micro_batch_loss(model: nn.Module, batch: Tensor, loss: str, beta: float, label_smoothing: float,
                     simpo_gamma: float, rpo_alpha: float, chunk_tokens: int, ref_logps: Tensor | None,
                     global_pairs: int, global_nll_tokens: int, nll_tokens: str = "auto"
                     ) -> tuple[Tensor, Tensor]:
    """One micro-batch's share of the global batch's preference loss, and its :func:`pair_stats`.

    Args:
        batch: (2P, 2, T + 1) int64 from :meth:`shardlm.data.preference.PreferencePairs.get` (chosen rows
        first). ref_logps: (2P,) the reference's summed log-probs of the same rows (dpo / ipo / hinge), else
        None. global_pairs, global_nll_tokens: the pairs and the NLL term's chosen tokens of the whole global
        batch (all ranks and micro-batches; :meth:`PreferencePairs.num_chosen_targets
        <shardlm.data.preference.PreferencePairs.num_chosen_targets>` with ``prompt`` for
        ``prompt_and_completion``): the divisors of the two means. nll_tokens: ``preference.nll_tokens``
        (``auto`` resolved by :func:`nll_token_set`).

    Returns ``(loss, stats)``: a 0-dim fp32 tensor with gradient (summed over the micro-batches and ranks it
    is the step's loss), and (len(STAT_NAMES),) fp64.
    """
    inputs, targets = split_batch(batch)
    p = batch.shape[0] // 2
    nll_targets = None
    if nll_token_set(loss, nll_tokens) == "prompt_and_completion":  # the chosen rows' whole sequences
        nll_targets = torch.cat([sequence_targets(batch[:p]), targets[p:]])
    logps, logit_sums, nll_logps = completion_logps(model, inputs, targets, chunk_tokens, nll_targets)
    counts = targets.ne(IGNORE_INDEX).sum(1)
    nll_counts = counts[:p] if nll_targets is None else nll_targets[:p].ne(IGNORE_INDEX).sum(1)
    terms = pair_losses(loss, beta, label_smoothing, simpo_gamma, logps, counts, ref_logps)
    total = terms.losses.sum() / global_pairs
    weight = nll_weight(loss, rpo_alpha)
    if weight:
        total = total + weight * (-nll_logps[:p].sum()) / max(global_nll_tokens, 1)
    return total, pair_stats(terms, logit_sums, counts, nll_logps[:p], nll_counts)
