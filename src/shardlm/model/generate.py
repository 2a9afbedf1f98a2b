"""Sampling text from a trained model (one process, no distributed code), with a key-value cache.

Batched prompts are left-padded to a common length; the :class:`~shardlm.model.kv_cache.KVCache` masks
the padding and gives each row positions from 0, so a row's tokens do not depend on the others.
Sampling: temperature scaling, then top-k, then top-p (nucleus, Holtzman et al. 2020) filtering; the token
is drawn from one generator (:func:`decode_steps`), or by the caller (its ``choose`` argument; the rollout of
:mod:`shardlm.rl.rollout` draws each row from its own stream with :func:`inverse_cdf`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch

from shardlm.model.decoder import CausalLM
from shardlm.model.kv_cache import KVCache


@dataclass(frozen=True)
class SamplingConfig:
    """How the next token is chosen from the logits.

    Attributes:
        temperature: logits are divided by it; 0 means greedy (argmax).
        top_k: keep the k most likely tokens (0 = all).
        top_p: keep the smallest set of most likely tokens whose probability reaches top_p (1 = all).
        seed: seed of the torch.Generator that draws the samples.
    """

    temperature: float = 0.8
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0

    def check(self) -> None:
        """Raise ValueError on a negative temperature, negative top_k or top_p outside (0, 1]."""
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")


def filter_logits(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Set to -inf every logit outside the top-k and outside the top-p nucleus; (batch, vocab) float."""
    if top_k > 0:
        kth = torch.topk(logits, min(top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # drop a token when the tokens before it already reach top_p (the most likely one always stays)
        drop = (probs.cumsum(-1) - probs) >= top_p
        logits = logits.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    return logits


def check_prompts(prompts: list[list[int]], max_seq_len: int) -> None:
    """Raise ValueError on an empty prompt list, an empty prompt, or one that leaves no room in
    the context."""
    if not prompts:
        raise ValueError("no prompts given")
    for i, p in enumerate(prompts):
        if not p:
            raise ValueError(f"prompt {i} is empty")
        if len(p) >= max_seq_len:
            raise ValueError(f"prompt {i} has {len(p)} tokens; the model's context is {max_seq_len} tokens, "
                             "so nothing can be generated after it")


def inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Draw one id per row by inverting its cumulative distribution: the first id whose running sum of
    ``probs`` exceeds ``u · total`` (Devroye, "Non-Uniform Random Variate Generation", 1986, §III.2).

    Args:
        probs: (batch, vocab) float, non-negative (zeros for filtered ids), each row with a positive sum
            (need not be exactly 1).
        u: (batch,) uniforms in [0, 1), one per row (the caller's random streams).

    Returns (batch,) int64 ids, never one of probability 0. A row's draw depends only on its own
    probabilities and ``u`` (a sequential sum along the row), not on the other rows of the batch.
    """
    cdf = probs.cumsum(-1)
    ids = torch.searchsorted(cdf, (u.to(cdf.dtype) * cdf[:, -1]).unsqueeze(1), right=True).squeeze(1)
    # u · total may round up to total: take the last id of positive probability then
    last = probs.shape[-1] - 1 - (probs > 0).flip(-1).int().argmax(-1)
    return torch.minimum(ids, last)


@torch.no_grad()
def decode_steps(model: CausalLM, prompts: list[list[int]], max_new_tokens: int, sampling: SamplingConfig,
                 use_cache: bool = True,
                 choose: Callable[[torch.Tensor], torch.Tensor] | None = None,
                 ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Yield ``(logits, next_ids)`` per step: (batch, vocab) float32 logits of the last position,
    (batch,) int64.

    ``choose(logits)`` -> (batch,) int64, when given, picks the next ids instead of the draw from
    ``sampling`` (whose settings are then only checked): the caller's own random streams.

    With ``use_cache`` the prompts are run once (prefill) and each step then feeds one token per row.
    Without it each step runs the whole sequence through the training code path (``cache=None``);
    that path has no padding mask, so all prompts must then have the same length. Generation stops
    after ``max_new_tokens`` or when the context (``max_seq_len``) is full. The caller decides when
    rows are finished (EOS); rows keep being fed so the batch stays rectangular.

    Raises:
        ValueError: bad prompts (see :func:`check_prompts`), bad sampling settings, or unequal
            prompt lengths without a cache.
    """
    sampling.check()
    check_prompts(prompts, model.cfg.max_seq_len)
    device = next(model.parameters()).device
    lengths = [len(p) for p in prompts]
    width = max(lengths)
    if not use_cache and len(set(lengths)) > 1:
        raise ValueError("generation without a KV cache needs prompts of equal length")
    pad = torch.tensor([width - n for n in lengths], dtype=torch.long)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts], dtype=torch.long, device=device)
    gen = torch.Generator(device=device).manual_seed(sampling.seed)
    steps = min(max_new_tokens, model.cfg.max_seq_len - width)
    # the cache holds what this call can reach (prompt + new tokens), not the whole context
    cache = KVCache(model.cfg, pad, model.lm_head.weight.dtype, device, width + steps) if use_cache else None
    feed = ids
    for _ in range(steps):
        logits = (model(feed, cache=cache) if use_cache else model(ids))[:, -1].float()
        if choose is not None:
            nxt = choose(logits)
        elif sampling.temperature == 0:
            nxt = logits.argmax(-1)
        else:
            probs = torch.softmax(
                filter_logits(logits / sampling.temperature, sampling.top_k, sampling.top_p), -1
            )
            nxt = torch.multinomial(probs, 1, generator=gen).squeeze(1)
        yield logits, nxt
        ids = torch.cat([ids, nxt.unsqueeze(1)], dim=1)
        feed = nxt.unsqueeze(1)


def generate(model: CausalLM, prompts: list[list[int]], max_new_tokens: int, sampling: SamplingConfig,
             eos_id: int | Sequence[int] | None = None, use_cache: bool = True,
             on_token: Callable[[int, int], None] | None = None,
             stop: Callable[[int, list[int]], bool] | None = None) -> list[list[int]]:
    """Extend each prompt (a list of token ids) by up to ``max_new_tokens`` new ids; return only the new ids.

    A row stops at any id of ``eos_id`` (one id or several, e.g. a model's ``eos_token_id`` list; not
    included in its output), or when ``stop(row, new_ids)`` returns True after a token was added
    (stop strings; that token stays in the output). ``on_token(row, token_id)`` is called for each
    new token as soon as it is chosen (for streaming). Raises ValueError as :func:`decode_steps`.
    """
    eos = set() if eos_id is None else {eos_id} if isinstance(eos_id, int) else set(eos_id)
    out: list[list[int]] = [[] for _ in prompts]
    done = [False] * len(prompts)
    for _, nxt in decode_steps(model, prompts, max_new_tokens, sampling, use_cache):
        for row, tok in enumerate(nxt.tolist()):
            if done[row]:
                continue
            if tok in eos:
                done[row] = True
                continue
            out[row].append(tok)
            if on_token is not None:
                on_token(row, tok)
            if stop is not None and stop(row, out[row]):
                done[row] = True
        if all(done):
            break
    return out


def sample(model: CausalLM, prompt_ids: list[int], max_new_tokens: int, temperature: float = 0.8,
           top_k: int = 0, eos_id: int | None = None, seed: int = 0) -> list[int]:
    """One prompt: :func:`generate` with a KV cache; returns the new ids. Raises ValueError on bad input."""
    return generate(model, [prompt_ids], max_new_tokens, SamplingConfig(temperature, top_k, 1.0, seed),
                    eos_id)[0]
