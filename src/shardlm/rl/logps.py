"""The trainer's side of a rollout: its rows as the model reads them (:func:`trainer_batch`) and the per-token
log-probs of the completions under the policy (:func:`token_logps`), a chunk of tokens at a time.

Rows are right-padded: prompt, completion, then padding, so the plain causal forward (no padding mask) gives
every real token the logits it would get alone up to the last bits (padding comes after every real token).
Targets are the next tokens on the completion and ``IGNORE_INDEX`` (-100) on the prompt and the padding, as
instruction rows (:mod:`shardlm.data.instruct`) are, so row r scores its completion's tokens 0 .. n_r - 1 at
the positions before them.

What is exact, measured on this CPU (torch 2.13, MKL, AVX2; tests/unit/test_rollout.py):

- A forward of the same rows, in the same batch, at the same width, gives the same bits with and without
  gradients, and FSDP-sharded (per-group all-gathers) or inside :func:`~shardlm.parallel.fsdp.gathered`
  (tests/dist/test_rollout_ranks.py). So log-probs computed by :func:`token_logps` on a
  :func:`trainer_batch` of the same rollout rows equal, bit for bit, those of the training step's forward on
  that batch: the "old" log-probs the sampler hands the trainer, made this way after the rollout (inside the
  same :func:`~shardlm.parallel.fsdp.gathered` block, no collective), give an importance ratio of exactly 1
  at ``num_iterations`` 1 when the step uses the same micro-batches.
- Not exact: a row's logits depend in their last bits on the other rows and the width of its batch (MKL
  picks its blocking by the number of rows multiplied), and the decode's one-token forwards over the KV cache
  are another computation than the full forward (other matrix shapes, SDPA with a mask rather than
  ``is_causal``). Measured on tiny fp32 models: |decode log-prob - full-forward log-prob| up to about 2e-6,
  on about half the tokens. :func:`logprob_diff_max` reports it (``sampling/logprob_diff_max``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from shardlm.data.instruct import IGNORE_INDEX
from shardlm.rl.rollout import Rollout, sampling_mode


@dataclass
class RLBatch:
    """R rollout rows as the trainer's forward reads them (right-padded to the longest prompt + completion of
    the R rows, minus the last token).

    Attributes:
        inputs: (R, T) int64, each row's prompt and completion (but its last token), then ``pad_id``.
        targets: (R, T) int64, the next token where it is a completion token, ``IGNORE_INDEX`` elsewhere.
        real: (R, T) bool, True on prompt and completion tokens (``CausalLM.forward``'s ``real_tokens``).
        completion_mask: (R, Tc) bool, the rollout's mask of these rows: True where :func:`token_logps`
            returns a log-prob.
        rows: (R,) int64, the rollout rows, in order.
        scored: (R, Tc) bool, where :func:`token_logps` computes a log-prob when that is more than the
            completion tokens (the exact rollout's window: :func:`trainer_batch`); None = ``completion_mask``.
    """

    inputs: Tensor
    targets: Tensor
    real: Tensor
    completion_mask: Tensor
    rows: Tensor
    scored: Tensor | None = None


def trainer_batch(rollout: Rollout, rows: Sequence[int], pad_id: int = 0, window: int = 0) -> RLBatch:
    """The :class:`RLBatch` of ``rows`` of ``rollout`` (a micro-batch: the same rows give the same tensors,
    the condition of bit-equal log-probs).

    With ``window`` > 0 (the exact rollout, :mod:`shardlm.rl.exact`; ``window`` its
    ``max_completion_length``): the rows are as wide as the longest prompt of the rows + ``window`` - 1
    positions, each row's completion followed by ``pad_id`` (not cut before its last token), and every row
    is scored at its ``window`` positions from its prompt's end, whatever its completion's length (the
    padding's targets are ``pad_id``; ``completion_mask`` still marks the completion): the shapes the exact
    rollout drew each token with, known before any token was drawn.

    Raises:
        ValueError: no rows, a row index outside the rollout, or a window narrower than the rollout's
            completions.
    """
    rows = [int(r) for r in rows]
    n = rollout.completion_ids.shape[0]
    if not rows or not all(0 <= r < n for r in rows):
        raise ValueError(f"trainer_batch needs rollout rows in [0, {n}), got {rows}")
    if window and window != rollout.completion_ids.shape[1]:
        raise ValueError(f"a window of {window} positions needs a rollout of completions {window} wide, got "
                         f"{rollout.completion_ids.shape[1]}")
    lengths = rollout.lengths.tolist()
    seqs = [rollout.prompts[r] + rollout.completion_ids[r, :lengths[r]].tolist() for r in rows]
    if window:
        width = max(len(rollout.prompts[r]) for r in rows) + window - 1
    else:
        width = max(len(s) for s in seqs) - 1
    inputs = torch.full((len(rows), width), pad_id, dtype=torch.long)
    targets = torch.full((len(rows), width), IGNORE_INDEX, dtype=torch.long)
    real = torch.zeros((len(rows), width), dtype=torch.bool)
    for i, (r, seq) in enumerate(zip(rows, seqs)):
        start = len(rollout.prompts[r]) - 1  # the position whose next token is the completion's first
        if window:
            seq = seq[:width]  # a completion of the whole window: its last token is no input
            targets[i, start:start + window] = rollout.completion_ids[r]
            inputs[i, :len(seq)] = torch.tensor(seq)
            real[i, :len(seq)] = True
        else:
            inputs[i, :len(seq) - 1] = torch.tensor(seq[:-1])
            targets[i, start:start + lengths[r]] = torch.tensor(seq[start + 1:])
            real[i, :len(seq) - 1] = True
    index = torch.tensor(rows, dtype=torch.long)
    mask = rollout.completion_mask[index]
    return RLBatch(inputs, targets, real, mask, index, torch.ones_like(mask) if window else None)


def scaled_logits(llama: nn.Module, hidden: Tensor, temperature: float) -> Tensor:
    """``softcap(lm_head(hidden)) / temperature`` in fp32, (c, vocab), for ``hidden`` (c, D): the logits
    every log-prob of this module is of (:func:`token_logps`; the exact rollout draws its tokens from them).

    ``lm_head.forward`` is called, not the module, as in :func:`shardlm.train.preference.head_logps`: under
    FSDP2 each call of a group's module would register one more post-backward, and ranks run different
    numbers of chunks."""
    logits = llama.lm_head.forward(hidden)
    cap = llama.cfg.final_logit_softcap
    if cap:
        logits = torch.tanh(logits / cap) * cap
    return logits.float() / temperature


def _chunk_logps(llama: nn.Module, hidden: Tensor, targets: Tensor,
                 temperature: float) -> tuple[Tensor, Tensor]:
    """Log-prob (c,) fp32 of each target under ``log_softmax`` of :func:`scaled_logits`, and the entropy
    (c,) fp32 of that distribution, for ``hidden`` (c, D)."""
    z = scaled_logits(llama, hidden, temperature)
    lse = torch.logsumexp(z, dim=1)
    logp = z.gather(1, targets.unsqueeze(1)).squeeze(1) - lse
    entropy = lse - (torch.softmax(z, dim=1) * z).sum(1)
    return logp, entropy


def scored_rows(targets: Tensor) -> Tensor:
    """The flat indices (n,) int64 into ``targets.reshape(-1)`` of the scored positions (targets other than
    ``IGNORE_INDEX``), in row-major order: the hidden states :func:`token_logps` projects, ``chunk_tokens``
    at a time in this order."""
    return (targets.reshape(-1) != IGNORE_INDEX).nonzero().squeeze(1)


def token_logps(model: nn.Module, batch: RLBatch, temperature: float, chunk_tokens: int = 0,
                ) -> tuple[Tensor, Tensor]:
    """Per-token log-probs and entropies of the completions of ``batch`` under ``model``: one forward, the
    output head applied ``chunk_tokens`` scored tokens at a time through the model's ``head`` argument, so the
    whole (R, T, vocab) logits never exist; with gradients each chunk is checkpointed (its logits made again
    in the backward).

    Definition (TRL 1.16's ``add_fused_lm_head(temperature=...)``, which its GRPOTrainer uses for the policy,
    the old policy and the reference): ``log_softmax(z / temperature)[target]`` and the entropy
    ``-Σ p log p`` of ``softmax(z / temperature)``, z the logits after the final soft-cap, in fp32.

    Args:
        model: the :class:`~shardlm.model.decoder.CausalLM`, FSDP2-sharded or not (not tensor parallel).
        batch: :func:`trainer_batch`'s rows; temperature: > 0, the rollout's; chunk_tokens: scored tokens
            per chunk, 0 = one chunk.

    Returns ``(logps, entropies)``: each (R, Tc) fp32 aligned with ``batch.completion_mask`` (0 off
    ``batch.scored``, which is the completion mask but for the exact rollout's window);
    ``logps`` carries the gradient when enabled (``entropies`` too: detach it for a metric).

    Raises:
        ValueError: temperature <= 0 or a negative ``chunk_tokens``.
    """
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if chunk_tokens < 0:
        raise ValueError(f"chunk_tokens must be >= 0 (0 = one chunk), got {chunk_tokens}")
    mask = batch.completion_mask if batch.scored is None else batch.scored

    def head(llama: nn.Module, hidden: Tensor) -> tuple[Tensor, Tensor]:
        flat = batch.targets.reshape(-1).to(hidden.device)
        rows = scored_rows(flat)  # row-major: the order of the mask's True values
        h = hidden.reshape(-1, hidden.shape[-1]).index_select(0, rows)
        tgt = flat.index_select(0, rows)
        n = h.shape[0]
        chunk = chunk_tokens or max(n, 1)
        parts = []
        for start in range(0, max(n, 1), chunk):
            h_c, t_c = h[start:start + chunk], tgt[start:start + chunk]
            if torch.is_grad_enabled() and chunk < n:
                parts.append(checkpoint(_chunk_logps, llama, h_c, t_c, temperature, use_reentrant=False))
            else:
                parts.append(_chunk_logps(llama, h_c, t_c, temperature))
        lp = torch.cat([p[0] for p in parts])
        ent = torch.cat([p[1] for p in parts])
        m = mask.to(hidden.device)
        zero = torch.zeros(m.shape, dtype=torch.float32, device=hidden.device)
        return zero.masked_scatter(m, lp), zero.masked_scatter(m, ent)

    # the compute device (shardlm.rl.rollout.compute_device), through a DDP wrapper's module
    device = getattr(model, "module", model).model.rope_cos.device
    return model(batch.inputs.to(device), head=head, real_tokens=batch.real.to(device))


def logprob_diff_max(a: Tensor, b: Tensor, mask: Tensor) -> float:
    """max |a - b| over ``mask`` (0.0 when it is empty): ``sampling/logprob_diff_max``, the decode's log-probs
    (``Rollout.logps``) against the trainer's (:func:`token_logps`), (B, Tc) each."""
    if not bool(mask.any()):
        return 0.0
    return float((a.float() - b.float()).abs()[mask].max())


@torch.no_grad()
def score_rollout(model: nn.Module, rollout: Rollout, micro_batches: Sequence[Sequence[int]],
                  temperature: float, chunk_tokens: int = 0, pad_id: int = 0) -> Tensor:
    """The trainer's log-probs of every rollout row, (B, Tc) fp32 (0 off the mask), computed micro-batch by
    micro-batch with :func:`token_logps` on :func:`trainer_batch` rows, without gradients, inside
    :func:`~shardlm.parallel.fsdp.gathered` (no collective per forward; every rank must call it). With the
    training step's micro-batches (the same row lists, ``chunk_tokens`` and ``pad_id``) these are bit for
    bit the log-probs its forward computes: the old log-probs of ``num_iterations`` > 1, and at 1 the proof
    that the importance ratio is exactly 1. Rows in no micro-batch stay 0."""
    out = torch.zeros(rollout.logps.shape, dtype=torch.float32)
    with sampling_mode(model):
        for rows in micro_batches:
            batch = trainer_batch(rollout, rows, pad_id)
            out[batch.rows] = token_logps(model, batch, temperature, chunk_tokens)[0].cpu()
    return out
