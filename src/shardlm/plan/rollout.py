"""What online RL's rollout (``data.format = "prompts"``, the ``[rl]`` section) adds to ``shardlm plan``: its
memory at the start of each step, and its time beside the update's.

The rollout (:func:`shardlm.rl.rollout.rollout`, called by the GRPO objective's ``prepare_step`` before the
step's first micro-batch) samples all of this rank's rows at once: B = ``train.global_batch_size`` / N
completions (the rank's prompts × G, N the data-parallel ranks; the generation batch is the global batch).
Notation: W the prompt positions (the batch is left-padded to its longest prompt): the prepared training
prompts' longest when the data is prepared, else ``rl.max_prompt_length`` (a bound; :func:`prompt_width`),
C = ``rl.max_completion_length`` (at most ``model.max_seq_len`` − W steps), L layers, H heads, H_kv key-value
heads, Q the head width, D the model width, V the vocabulary, c bytes per value of the compute dtype
(``parallel.param_dtype`` under FSDP, 4 otherwise), P the parameters.

Memory (bytes per rank), alive together on top of the step-start state (shards, AdamW state, a frozen
reference's shards):

* **the sampler's gathered weights** (FSDP only): :func:`shardlm.parallel.fsdp.gathered` calls each FSDP
  module's ``unshard()`` once on entry, outside forward: every group is all-gathered into a flat buffer
  (N × its padded shard), copied out into its unsharded parameters and the buffer freed (FSDP2 keeps the
  buffer for overlap only in forward); the unsharded parameters stay through every decode step and are freed
  on exit. So the whole model in the compute dtype, Σ_groups numel · c (NF4 LoRA bases at their gathered
  size), plus one group's all-gather buffer while gathering. Without FSDP the sampler reads the model itself:
  nothing extra.
* **the KV cache** (:class:`shardlm.model.kv_cache.KVCache`, allocated whole for the batch):
  L · 2 · B · H_kv · (W + C) · Q · c (:func:`kv_cache_bytes`).
* **the prefill's transients** (the prompts' forward under ``torch.no_grad``): the hidden states and their
  normed copy, 2 · c · B · W · D, the logits of every prompt position, c · B · W · V (twice with a final
  soft-cap: ``tanh(z / s) · s``), and the last position's fp32 copy, 4 · B · V (:func:`prefill_bytes`).

The exact rollout (``rl.rollout = "exact"``, :mod:`shardlm.rl.exact`) has no KV cache and no prefill: it
decodes one micro-batch of B_μ = ``train.micro_batch_size`` rows at a time, each token a no-grad forward of
the rows at W + C − 1 positions with the output head on the step's chunks of the B_μ·C scored positions
(:func:`exact_forward_bytes`), beside the gathered weights; its time is C such forwards per micro-batch,
C · B · (W + C − 1) · (2·N + 4·L·H·Q·(W + C − 1)) FLOPs at the compute peak (or the weights read once per
forward over the bandwidth, when longer).

The reference (``rl.beta`` > 0, :func:`shardlm.train.objectives.grpo.rl_reference_kind`) is counted as
preference tuning's (:mod:`shardlm.plan.preference`): a frozen copy's fp32 shards, its root and output groups
unsharded after its first forward, its no-grad forward in each micro-batch; the base with LoRA's adapters off
as the policy's own no-grad forward; nothing at β = 0.

Time (per rank, lower bounds; Pope et al., "Efficiently Scaling Transformer Inference", 2022, for decoding
being memory-bound): the prefill, B · W · (2·N + 4·L·H·Q·W) FLOPs (N the parameters without the input
embedding, PaLM's forward FLOPs, a third of :mod:`shardlm.plan.time`'s training count), at the compute peak;
then C − 1 one-token steps, step s reading the weights once, R = c · N bytes (the untied input embedding is a
lookup of B rows, left out), and the cache of W + s positions, K · (W + s) bytes with K = L · 2 · B · H_kv · Q
· c: in all (C − 1) · R + K · ((C − 1) · W + C · (C − 1) / 2) bytes over the memory bandwidth
(:attr:`shardlm.devices.Device.memory_bandwidth`), or the steps' FLOPs, (C − 1) · B · 2 · N + 4 · L · H · Q ·
B · ((C − 1) · W + C · (C − 1) / 2), over the peak when that is longer.

Measured (tests/unit/test_rollout_plan.py, one process, the rollout the step's peak): -0.9 % against the
measured peak. At 2 FSDP ranks (gloo) a rollout alone measures 1,397,572 bytes against the planned high point
1,364,628 (-2.4 %, W one token over the ranks' longest), but the step's peak there is the update's backward,
at the RL head's (:func:`shardlm.plan.loss.rl_head_events`; tests/dist/test_planner_measured_peak.py: -1.0 %
and -3.5 % at global batch 16 and 32 in micro-batches of 4; -19 % to -27 % when the head was planned as a
cross-entropy). The KV cache is freed when the rollout ends (no reference cycle keeps it:
:class:`shardlm.model.kv_cache.LayerKVCache`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from shardlm.config import Config
from shardlm.config.auto import with_fixed_defaults
from shardlm.data.build import data_dir
from shardlm.data.prepare import is_prepared, load_meta
from shardlm.data.prompts import PROMPTS
from shardlm.devices import Device
from shardlm.metrics.flops import flops_params
from shardlm.metrics.memory import format_bytes
from shardlm.parallel.dist import compute_precision
from shardlm.parallel.options import dtype_from_name
from shardlm.plan.ledger import Ledger
from shardlm.plan.param_groups import Group, param_groups
from shardlm.plan.preference import frozen_model_config
from shardlm.train.objectives.grpo import rl_reference_kind


def kv_cache_bytes(layers: int, kv_heads: int, head_dim: int, rows: int, tokens: int, c: int) -> int:
    """Bytes of a KV cache of ``rows`` sequences of ``tokens`` positions: L · 2 (keys and values) · B · H_kv ·
    tokens · Q · c (c bytes per value)."""
    return layers * 2 * rows * kv_heads * tokens * head_dim * c


def prefill_bytes(rows: int, prompt: int, dim: int, vocab: int, c: int, softcap: bool) -> int:
    """The high point of the prefill's transients (bytes): hidden states and their normed copy (2·c·B·W·D),
    the logits of all B·W prompt positions (c·B·W·V, twice under a final soft-cap) and the last position's
    fp32 copy (4·B·V)."""
    return c * rows * prompt * (2 * dim + vocab * (2 if softcap else 1)) + 4 * rows * vocab


def decode_read_bytes(weights: int, per_position: int, prompt: int, completion: int) -> int:
    """Bytes the C − 1 one-token decode steps read: each the weights (``weights`` bytes) and the cache so far,
    ``per_position`` bytes per cached position, W + s positions at step s = 1 .. C − 1:
    (C − 1) · R + K · ((C − 1) · W + C · (C − 1) / 2)."""
    steps = max(completion - 1, 0)
    return steps * weights + per_position * (steps * prompt + completion * steps // 2)


def exact_forward_bytes(rows: int, width: int, completion: int, dim: int, vocab: int, c: int, chunk: int,
                        softcap: bool) -> int:
    """The high point of one forward of the exact rollout (:mod:`shardlm.rl.exact`; bytes): a micro-batch of
    B_μ = ``rows`` rows at W + C − 1 = ``width`` positions, its hidden states and their normed copy
    (2·c·B_μ·(W + C − 1)·D), the B_μ·C scored positions' hidden states selected (c·B_μ·C·D), the output head
    on one chunk of k = ``chunk`` of them (all when 0 or more) with h bytes per logit at its high point
    (h = 3c under a final soft-cap, its tanh's two temporaries beside the logits, else c; at least c + 4
    (the fp32 copy when c < 4) + 4 (z = copy / temperature), and 8: z and logsumexp's temporary) and the B_μ
    rows of logits drawn from, selected and joined (2·4·B_μ·V). Measured (tests/unit/test_rollout_plan.py,
    the allocator, 3 rows of 30 + 40 positions, V = 4,000, D = 32): fp32 and bf16, one chunk and chunks of
    64, with and without a soft-cap, +0.15 % to +0.9 % over the measured."""
    scored = rows * completion
    k = chunk if 0 < chunk < scored else scored
    per_logit = max(3 * c if softcap else c, c + (4 if c < 4 else 0) + 4, 8)
    return 2 * c * rows * width * dim + c * scored * dim + per_logit * k * vocab + 2 * 4 * rows * vocab


@dataclass(frozen=True)
class RolloutPlan:
    """The rollout of one step on one rank (module docstring): sizes in bytes, times in seconds."""

    rows: int
    """B: completions sampled together on this rank."""
    prompt: int
    """W: prompt positions (:func:`prompt_width`)."""
    completion: int
    """C: decode steps (new tokens per completion at most)."""
    gathered_bytes: int
    """The sampler's unsharded weights (0 without FSDP)."""
    kv_bytes: int
    """The KV cache."""
    prefill_bytes: int
    """The prefill's transients' high point."""
    weight_read_bytes: int
    """R: weights read per one-token step."""
    decode_bytes: int
    """Bytes read over the decode steps (weights and cache)."""
    prefill_flops: float
    decode_flops: float
    prefill_s: float
    """max(prefill FLOPs / peak, R / bandwidth)."""
    decode_s: float
    """max(decode bytes / bandwidth, decode FLOPs / peak)."""
    reference: str
    """``none``, ``model`` or ``lora_base``."""
    reference_flops: float
    """The reference's no-grad forwards over the step's rows (0 at β = 0)."""
    reference_s: float
    exact: bool = False
    """``rl.rollout = "exact"``: no KV cache or prefill; ``prefill_bytes`` is one forward's high point
    (:func:`exact_forward_bytes`) and the decode C forwards of each micro-batch at W + C − 1 positions."""
    micro_rows: int = 0
    """B_μ: the rows the exact rollout decodes together (``train.micro_batch_size``)."""
    prompt_from: str = "rl.max_prompt_length"
    """Where W comes from, for the report: ``rl.max_prompt_length`` or the prepared prompts' longest."""


def rollout_rows(cfg: Config, world_size: int) -> int:
    """B: completions this rank samples per step, ``train.global_batch_size`` over the data-parallel ranks."""
    dp = max(world_size // (cfg.parallel.cp * cfg.parallel.tp), 1)
    return cfg.train.global_batch_size // dp


def prompt_width(cfg: Config) -> int:
    """W: the longest training prompt of the prepared data (tokens, from its ``train.idx``), at most
    ``rl.max_prompt_length``; ``rl.max_prompt_length`` when the data is not prepared yet (or not prompts)."""
    return prompt_width_from(cfg)[0]


def prompt_width_from(cfg: Config) -> tuple[int, str]:
    """:func:`prompt_width` and where it comes from, in words for the plan's report."""
    out = str(data_dir(cfg))
    longest = _longest_prompt(out, (Path(out) / "meta.json").stat().st_mtime_ns) if is_prepared(out) else 0
    if not 0 < longest < cfg.rl.max_prompt_length:
        return cfg.rl.max_prompt_length, "rl.max_prompt_length"
    return longest, f"the longest prompt prepared in {out}"


@functools.lru_cache(maxsize=8)
def _longest_prompt(out: str, version: int) -> int:
    """The longest train prompt of a prepared prompts directory, read once per ``version`` (``meta.json``'s
    mtime); 0 for other prepared data or no prompts."""
    if load_meta(out).get("format") != PROMPTS:
        return 0
    idx = np.fromfile(Path(out) / "train.idx", dtype=np.int64).reshape(-1, 3)  # (start, length, line)
    return int(idx[:, 1].max()) if len(idx) else 0


def compute_bytes(cfg: Config) -> int:
    """c: bytes per value the sampler computes and caches in: ``parallel.param_dtype``'s under FSDP (the
    gathered weights' dtype, which the cache takes from ``lm_head``), fp32 otherwise."""
    if cfg.parallel.mode != "fsdp":
        return 4
    return dtype_from_name("parallel.param_dtype", cfg.parallel.param_dtype).itemsize


def replay_rollout(led: Ledger, cfg: Config, world_size: int, groups: list[Group], n: int,
                   fsdp: bool) -> None:
    """Replay the rollout into ``led`` before the step's first micro-batch (module docstring): under FSDP each
    group all-gathered (``all_gather``) and copied out (``params``), then the KV cache and the prefill's
    transients (``rollout``); all freed again at its end. The high point is marked ``rollout``
    (:attr:`shardlm.plan.ledger.MemoryPlan.highs`).

    Args:
        groups: the policy's FSDP groups (:func:`shardlm.plan.param_groups.param_groups`); n: ranks in the
            shard group; fsdp: the run is FSDP (else nothing is gathered).
    """
    c = compute_bytes(cfg)
    m, rl = cfg.model, cfg.rl
    rows, prompt = rollout_rows(cfg, world_size), prompt_width(cfg)
    steps = max(min(rl.max_completion_length, m.max_seq_len - prompt), 0)
    held = 0
    for g in groups if fsdp else []:
        buffer = round(n * g.shard_numel * c * g.gather_factor)
        led.add("all_gather", buffer, "rollout all-gather")
        led.add("params", round(g.numel * c * g.gather_factor), "rollout all-gather")
        led.mark("rollout")
        led.free("all_gather", buffer)
        held += round(g.numel * c * g.gather_factor)
    if rl.rollout == "exact":  # one micro-batch's forward at a time, no cache
        kv = 0
        work = exact_forward_bytes(min(cfg.train.micro_batch_size, rows), prompt + steps - 1, steps, m.dim,
                                   m.vocab_size, c, cfg.train.loss_chunk_tokens, m.final_logit_softcap > 0)
        led.add("rollout", work, "rollout exact forward")
    else:
        kv = kv_cache_bytes(m.n_layers, m.kv_heads, m.head_dim, rows, prompt + steps, c)
        work = prefill_bytes(rows, prompt, m.dim, m.vocab_size, c, m.final_logit_softcap > 0)
        led.add("rollout", kv, "rollout KV cache")
        led.add("rollout", work, "rollout prefill")
    led.mark("rollout")
    led.free("rollout", kv + work)
    led.free("params", held)


def plan_rollout(cfg: Config, world_size: int, device: Device) -> RolloutPlan:
    """The rollout's sizes and times of ``cfg`` at ``world_size`` ranks on ``device`` (module docstring).

    Raises:
        ConfigError: ``rl.beta`` > 0 with ``rl.reference_from`` that has no readable ``config.json``.
    """
    cfg = with_fixed_defaults(cfg)
    m, rl = cfg.model, cfg.rl
    c = compute_bytes(cfg)
    rows, (prompt, prompt_from) = rollout_rows(cfg, world_size), prompt_width_from(cfg)
    steps = max(min(rl.max_completion_length, m.max_seq_len - prompt), 0)
    n_params = flops_params(m)  # N: every parameter but the input embedding
    weights = c * n_params
    per_position = kv_cache_bytes(m.n_layers, m.kv_heads, m.head_dim, rows, 1, c)
    attention = 4 * m.n_layers * m.n_heads * m.head_dim
    contexts = max(steps - 1, 0) * prompt + steps * max(steps - 1, 0) // 2  # Σ_s (W + s), s = 1 .. C - 1
    prefill_flops = rows * prompt * (2 * n_params + attention * prompt)
    decode_flops = max(steps - 1, 0) * rows * 2 * n_params + attention * rows * contexts
    decode_bytes = decode_read_bytes(weights, per_position, prompt, steps)
    peak = device.peak_flops(compute_precision(torch.device("cpu" if device.name == "cpu" else "cuda"),
                                               cfg.parallel))
    bw = device.memory_bandwidth
    kind = rl_reference_kind(cfg)
    ref_flops = 0.0
    if kind != "none":
        ref = frozen_model_config(cfg).model if kind == "model" else m
        t = cfg.train.seq_len
        ref_flops = rows * t * (2 * flops_params(ref) + 4 * ref.n_layers * ref.n_heads * ref.head_dim * t)
    fsdp = cfg.parallel.mode == "fsdp"
    groups = param_groups(cfg, world_size // cfg.parallel.tp, c, cfg.parallel.tp)[0] if fsdp else []
    gathered_bytes = sum(round(g.numel * c * g.gather_factor) for g in groups)
    if rl.rollout == "exact":
        # C forwards per micro-batch of B_μ rows at W + C − 1 positions, each reading the weights once
        micro = min(cfg.train.micro_batch_size, rows)
        width = prompt + steps - 1
        forwards = steps * -(-rows // micro)
        flops = steps * rows * width * (2 * n_params + attention * width)
        return RolloutPlan(
            rows, prompt, steps, gathered_bytes, 0,
            exact_forward_bytes(micro, width, steps, m.dim, m.vocab_size, c, cfg.train.loss_chunk_tokens,
                                m.final_logit_softcap > 0),
            weights, forwards * weights, 0.0, flops, 0.0, max(forwards * weights / bw, flops / peak),
            kind, ref_flops, ref_flops / peak, exact=True, micro_rows=micro, prompt_from=prompt_from)
    return RolloutPlan(
        rows, prompt, steps, gathered_bytes,
        kv_cache_bytes(m.n_layers, m.kv_heads, m.head_dim, rows, prompt + steps, c),
        prefill_bytes(rows, prompt, m.dim, m.vocab_size, c, m.final_logit_softcap > 0), weights, decode_bytes,
        prefill_flops, decode_flops, max(prefill_flops / peak, weights / bw), max(decode_bytes / bw,
                                                                                  decode_flops / peak),
        kind, ref_flops, ref_flops / peak, prompt_from=prompt_from)


def format_rollout(plan: RolloutPlan, update_s: float, high: int, peak: int) -> list[str]:
    """The plan report's lines on the rollout: its memory (in the peak's ``rollout`` and ``params`` rows when
    the peak is the rollout's), its high point ``high`` beside the step's ``peak`` (bytes), and its time
    beside the update's compute time ``update_s``."""
    ref = {"none": "none (rl.beta = 0)", "model": "a frozen copy (its shards in the reference row)",
           "lora_base": "the base with the LoRA adapters off (no second copy)"}[plan.reference]
    total = plan.prefill_s + plan.decode_s
    if plan.exact:
        work = f"exact rollout's forward {format_bytes(plan.prefill_bytes)} (no KV cache)"
        timing = (f"  rollout time (exact): {plan.decode_s:.4f} s ({plan.completion} forwards of each "
                  f"micro-batch of {plan.micro_rows} rows at {plan.prompt + plan.completion - 1} positions, "
                  f"{plan.decode_flops:.3e} FLOPs at the compute peak)")
    else:
        work = (f"KV cache {format_bytes(plan.kv_bytes)}, prefill transients "
                f"{format_bytes(plan.prefill_bytes)}")
        timing = (f"  rollout time: prefill {plan.prefill_s:.4f} s ({plan.prefill_flops:.3e} FLOPs), decode "
                  f"{plan.decode_s:.4f} s ({plan.completion - 1 if plan.completion else 0} one-token steps "
                  f"reading {format_bytes(plan.decode_bytes)}: weights and KV cache at the memory bandwidth)")
    return [
        f"  rollout: {plan.rows} completions per rank of <= {plan.prompt} prompt ({plan.prompt_from}) + "
        f"{plan.completion} new tokens; sampler's gathered weights {format_bytes(plan.gathered_bytes)}, "
        f"{work}; "
        f"reference: {ref}; the rollout's high point {high / 1024**3:.3f} GiB per rank ("
        + ("the step's peak)" if high >= peak else f"the update's {peak / 1024**3:.3f} GiB is the peak)"),
        f"{timing}, "
        f"{plan.rows * plan.completion / total if total else 0:,.0f} tokens/s per rank; update compute "
        f"{update_s + plan.reference_s:.4f} s"
        + (f" (reference forward {plan.reference_s:.4f} s of it)" if plan.reference_s else "")
        + " (lower bounds)",
    ]
