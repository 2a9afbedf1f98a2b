"""The exact rollout (``rl.rollout = "exact"``): every token drawn from the logits of the trainer's own
forward of the micro-batch it will be trained in, so the sampler's log-probs are the trainer's, bit for bit.

The key-value cache's rollout (:mod:`shardlm.rl.rollout`) computes each token's logits with one-token
forwards over the cache: other matrix shapes and another attention than the training step's forward of the
whole rows, so its log-probs differ from the trainer's in their last bits (``sampling/logprob_diff_max``,
2e-6 to 4e-5 measured in fp32) and its tokens are drawn from a distribution that is slightly off the one the
loss takes as the sampler's. Here a micro-batch's rows are decoded together, and each step runs them at the
width the training step will (:func:`~shardlm.rl.logps.trainer_batch` with ``window``: the longest prompt of
the rows + ``max_completion_length`` - 1 positions, every row scored at its ``max_completion_length``
positions from its prompt's end, whatever its length turns out to be), the output head on the same chunks of
scored positions (:func:`~shardlm.rl.logps.scaled_logits`), and row r's token t is drawn from the logits at
its position t. The training step's forward then computes, for every completion token, the same operations
on the same shapes with the same inputs at that position and before it: tokens after it (padding at
sampling, later tokens in training) reach no earlier position under causal attention (their scores are
masked to -inf, exp gives exactly 0), and no matrix multiply or normalisation mixes rows. So its log-probs
and the sampler's are equal bit for bit (``torch.equal``, tests/unit/test_rl_exact.py; the run's
``sampling/logprob_diff_max`` is 0), and because the micro-batches hold the same completions at any world
size (:class:`~shardlm.data.prompts.CompletionSampler`), so are the tokens.

Conditions, checked by the config (:func:`shardlm.config.checks.validate_rl`): no mixture of experts (an
expert's matrix multiply holds the tokens routed to it, later ones too), no ``parallel.compile`` (the
compiled training graph is another computation than the eager sampling forward), no tensorwise float8 (one
activation scale from the whole tensor: measured 1e-3 apart) nor mxfp8 (not checked), no LoRA dropout (the
training forward drops units). Tested in fp32; bf16 compute, rowwise float8 and int8 QAT measured 0 apart.

Cost: one forward of the micro-batch at full width per token position (``max_completion_length`` forwards at
most; a micro-batch stops when all its rows have met a stop id) instead of one prefill and one-token steps,
and no key-value cache: about ``max_completion_length`` / 3 training steps' compute, measured by
``bench/bench_rl.py``. For short completions, or to check what the key-value cache's rollout gives.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial

import torch
from torch import Tensor, nn

from shardlm.data.instruct import IGNORE_INDEX
from shardlm.model.generate import SamplingConfig, filter_logits, inverse_cdf
from shardlm.rl.logps import scaled_logits, scored_rows
from shardlm.rl.rollout import (
    Rollout,
    check_rollout_args,
    completion_uniforms,
    compute_device,
    sampling_mode,
)


def _wanted_logits(llama: nn.Module, hidden: Tensor, scored: Tensor, wanted: list[int], chunk: int,
                   temperature: float) -> tuple[Tensor, Tensor]:
    """The forward's ``head``: of the scored positions ``scored`` (flat indices into ``hidden`` (b, T, D)),
    the :func:`~shardlm.rl.logps.scaled_logits` (len(wanted), vocab) and their log-sum-exp (len(wanted),) at
    the indices ``wanted`` among them, each computed on its whole chunk of ``chunk`` scored positions, as the
    training step's :func:`~shardlm.rl.logps.token_logps` computes it."""
    h = hidden.reshape(-1, hidden.shape[-1]).index_select(0, scored)
    z_rows, lse_rows = [], []
    for c in sorted({i // chunk for i in wanted}):
        z = scaled_logits(llama, h[c * chunk:(c + 1) * chunk], temperature)
        lse = torch.logsumexp(z, dim=1)
        here = [i - c * chunk for i in wanted if i // chunk == c]
        z_rows.append(z[here])
        lse_rows.append(lse[here])
        del z, lse  # before the next chunk's
    return torch.cat(z_rows), torch.cat(lse_rows)


@torch.no_grad()
def sample_micro_batch(model: nn.Module, prompts: list[list[int]], uniforms: Tensor, sampling: SamplingConfig,
                       window: int, stop_ids: set[int], pad_id: int, chunk_tokens: int = 0,
                       ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Extend each of a micro-batch's prompts by up to ``window`` tokens, token t of row r drawn with
    ``uniforms[r, t]`` from the logits of the forward of all the rows at the training width (module
    docstring); stops when every row has met a stop id.

    Args:
        prompts: b prompts (token ids), the micro-batch's rows in order; uniforms: (b, window) float32;
        window: ``max_completion_length``; stop_ids: ids that end a row (kept in it); chunk_tokens: the
        training step's ``train.loss_chunk_tokens`` (the output head's chunks), 0 = one chunk.

    Returns ``(ids, logps, lengths, truncated)``: (b, window) int64 (``pad_id`` after a row's end), (b,
    window) float32 (0 there), (b,) int64, (b,) bool.
    """
    b = len(prompts)
    device = compute_device(model)
    starts = [len(p) - 1 for p in prompts]  # the position whose logits draw the completion's first token
    width = max(starts) + window
    inputs = torch.full((b, width), pad_id, dtype=torch.long)
    real = torch.zeros((b, width), dtype=torch.bool)
    targets = torch.full((b, width), IGNORE_INDEX, dtype=torch.long)
    for r, p in enumerate(prompts):
        inputs[r, :len(p)] = torch.tensor(p)
        real[r, :len(p)] = True
        targets[r, starts[r]:starts[r] + window] = pad_id  # the positions the training step scores
    scored = scored_rows(targets).to(device)  # b × window, row-major
    chunk = chunk_tokens or b * window
    stop = torch.tensor(sorted(stop_ids), dtype=torch.long)
    ids = torch.full((b, window), pad_id, dtype=torch.long)
    logps = torch.zeros((b, window))
    stopped = torch.zeros(b, dtype=torch.bool)
    lengths = torch.zeros(b, dtype=torch.long)
    for t in range(window):
        wanted = [r * window + t for r in range(b)]  # row r's position t among the scored ones
        head = partial(_wanted_logits, scored=scored, wanted=wanted, chunk=chunk,
                       temperature=sampling.temperature)
        z, lse = model(inputs.to(device), head=head, real_tokens=real.to(device))
        probs = torch.softmax(filter_logits(z, sampling.top_k, sampling.top_p), -1)
        nxt = inverse_cdf(probs, uniforms[:, t].to(device))
        lp = (z.gather(1, nxt.unsqueeze(1)).squeeze(1) - lse).cpu()  # the training step's formula
        nxt = nxt.cpu()
        active = ~stopped
        ids[:, t] = torch.where(active, nxt, pad_id)
        logps[:, t] = torch.where(active, lp, 0.0)
        lengths += active
        stopped |= active & torch.isin(nxt, stop)
        for r in active.nonzero().squeeze(1).tolist():  # the token is the next position's input
            if starts[r] + 1 + t < width:
                inputs[r, starts[r] + 1 + t] = nxt[r]
                real[r, starts[r] + 1 + t] = True
        if bool(stopped.all()):
            break
    return ids, logps, lengths, ~stopped


def exact_rollout(model: nn.Module, prompts: list[list[int]], prompt_ids: list[int], num_generations: int,
                  micro_batches: Sequence[Sequence[int]], *, max_completion_length: int, stop_ids: list[int],
                  seed: int, step: int, temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0,
                  pad_id: int = 0, chunk_tokens: int = 0) -> Rollout:
    """:func:`shardlm.rl.rollout.rollout`'s completions drawn exactly (module docstring): the same random
    streams, arguments and result, but the rows decoded micro-batch by micro-batch and the completions
    ``max_completion_length`` wide (``Rollout.logps`` the training step's log-probs, bit for bit, when it
    runs these micro-batches through :func:`~shardlm.rl.logps.trainer_batch` with ``window =
    max_completion_length`` and the same ``chunk_tokens``).

    Args:
        micro_batches: the training step's micro-batches as lists of rollout rows (row ``i·G + g`` is
            completion g of prompt i); every row in exactly one.
        chunk_tokens: ``train.loss_chunk_tokens``. The rest as :func:`shardlm.rl.rollout.rollout`.

    Raises:
        ValueError: bad arguments (:func:`~shardlm.rl.rollout.check_rollout_args`), or micro-batches that
            are not a partition of the rows.
    """
    sampling = SamplingConfig(temperature, top_k, top_p, seed)
    check_rollout_args(prompts, prompt_ids, num_generations, max_completion_length, model.cfg.max_seq_len,
                       sampling, 0)
    n = len(prompts) * num_generations
    if sorted(r for rows in micro_batches for r in rows) != list(range(n)):
        raise ValueError(f"the micro-batches must hold each of the {n} rollout rows once")
    uniforms = completion_uniforms(seed, step, prompt_ids, num_generations, max_completion_length)
    ids = torch.full((n, max_completion_length), pad_id, dtype=torch.long)
    logps = torch.zeros((n, max_completion_length))
    lengths = torch.zeros(n, dtype=torch.long)
    truncated = torch.zeros(n, dtype=torch.bool)
    row_prompts = [prompts[r // num_generations] for r in range(n)]
    with sampling_mode(model):
        for rows in micro_batches:
            index = torch.tensor(list(rows), dtype=torch.long)
            ids[index], logps[index], lengths[index], truncated[index] = sample_micro_batch(
                model, [row_prompts[r] for r in rows], uniforms[index], sampling, max_completion_length,
                set(stop_ids), pad_id, chunk_tokens)
    return Rollout(
        prompts=row_prompts, completion_ids=ids,
        completion_mask=torch.arange(max_completion_length).unsqueeze(0) < lengths.unsqueeze(1),
        lengths=lengths, truncated=truncated, logps=logps,
        prompt_index=torch.tensor([prompt_ids[r // num_generations] for r in range(n)], dtype=torch.long),
        generation_index=torch.tensor([r % num_generations for r in range(n)], dtype=torch.long),
    )
