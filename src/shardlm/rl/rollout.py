"""The rollout: G completions per prompt sampled by the policy itself, inside the training processes, with
the key-value cache of :func:`shardlm.model.generate.decode_steps`.

Each rank samples its own prompts. The model may be FSDP2-sharded: the whole generation runs inside
:func:`shardlm.parallel.fsdp.gathered`, which all-gathers every group once on entry, keeps the gathered
weights through every decode step and frees them on exit. No decode step runs a collective, so ranks may
stop after different numbers of steps (completions of different lengths, different numbers of prompts)
without a hang; the only collectives are the entry's all-gathers, the same on every rank, so every rank
calls :func:`rollout` once per generation (with zero prompts too). The price is memory: the whole model in
the compute dtype on every rank during the rollout, beside the KV cache. The alternative, FSDP's own
all-gather before each group's forward at every decode step, needs every rank to run the same number of
decode steps and was 3.2x slower (``bench/bench_rl.py``, 2 ranks, gloo, a 4-layer dim-128 fp32 model, 8
prompts x 4 completions x 64 tokens: 1350 against 419 generated tokens/s; the same tokens).

Determinism: completion ``g`` of the prompt with id ``p`` draws its tokens from its own stream, a
``torch.Generator`` seeded by :func:`stream_seed` (seed, step, p, g): its t-th uniform picks its t-th token
by inverting the filtered distribution's cumulative sum (:func:`~shardlm.model.generate.inverse_cdf`). No
completion reads another's stream, so the tokens do not depend on the world size, on which rank holds a
prompt, on the order of the prompts or on the generation batch size, and a run resumed at a step draws what
the uninterrupted run drew. What can still differ is the last bits of the logits: CPU matrix multiplies
(MKL) give a row results that depend on the number of rows multiplied with it (measured on a tiny fp32
model: log-probs differ by up to 2e-6 between generation batch sizes), so a token can change only when its
uniform falls that close to a boundary of the cumulative sum. Measured: 256 completions (11,765 tokens) at
generation batch sizes 1, 3, 16 and 100 against all rows at once: no token changed (tests/unit/test_rollout.py
counts them on a smaller case).

Log-probs (TRL 1.16's definition, ``GRPOTrainer._get_per_token_logps_and_entropies`` through
``add_fused_lm_head(temperature=...)``): ``log_softmax(logits / temperature)`` of the sampled token, the
logits after the model's final soft-cap, before top-k / top-p filtering, in fp32. The trainer's
recomputation (:func:`shardlm.rl.logps.token_logps`) uses the same definition. The decode's log-probs
(``Rollout.logps``) come from one-token forwards over the cache; they are not the full forward's bit for
bit (see :mod:`shardlm.rl.logps` for what is exact and the measured difference).
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from shardlm.model.generate import SamplingConfig, check_prompts, decode_steps, filter_logits, inverse_cdf
from shardlm.parallel.fsdp import gathered


def stream_seed(seed: int, step: int, prompt_id: int, generation: int) -> int:
    """The seed (in [0, 2^63)) of one completion's random stream: the first 8 bytes, little-endian, of the
    BLAKE2b digest of the four integers packed as signed 64-bit little-endian values. Any two keys differ in
    seed except with probability 2^-63; the value does not depend on the platform or on Python's hash seed.

    Raises:
        ValueError: a key outside the signed 64-bit range.
    """
    try:
        packed = struct.pack("<4q", seed, step, prompt_id, generation)
    except struct.error as e:
        raise ValueError(f"rollout stream key ({seed}, {step}, {prompt_id}, {generation}) must be four "
                         "64-bit integers") from e
    return int.from_bytes(hashlib.blake2b(packed, digest_size=8).digest(), "little") >> 1


def stream_uniforms(seed: int, step: int, prompt_id: int, generation: int, n: int) -> Tensor:
    """The first ``n`` uniforms in [0, 1), (n,) float32 on CPU, of completion ``generation`` of prompt
    ``prompt_id``'s stream at ``step``: ``torch.rand`` from a CPU ``torch.Generator`` seeded by
    :func:`stream_seed` (CPU whatever the device, so the draws do not depend on it)."""
    gen = torch.Generator().manual_seed(stream_seed(seed, step, prompt_id, generation))
    return torch.rand(n, generator=gen)


def completion_uniforms(seed: int, step: int, prompt_ids: list[int], num_generations: int, n: int) -> Tensor:
    """(B, n) float32, B = len(prompt_ids) × G: row ``i·G + g`` holds the first ``n`` uniforms of completion
    ``g`` of prompt ``prompt_ids[i]`` (:func:`stream_uniforms`), the t-th drawing its t-th token."""
    if not prompt_ids:
        return torch.zeros(0, n)
    return torch.stack([stream_uniforms(seed, step, p, g, n)
                        for p in prompt_ids for g in range(num_generations)])


@contextmanager
def sampling_mode(model: nn.Module) -> Iterator[None]:
    """``model`` in eval mode (no LoRA dropout) inside :func:`~shardlm.parallel.fsdp.gathered` (one all-gather
    per FSDP group on entry, on every rank; no collective inside), its training mode restored on exit."""
    training = model.training
    model.eval()
    try:
        with gathered(model):
            yield
    finally:
        model.train(training)


@dataclass
class Rollout:
    """The completions of one rollout on one rank: B = prompts × G rows, prompt i's completions in rows
    i·G .. i·G + G - 1 in generation order, Tc the longest completion (<= ``max_completion_length``).

    Attributes:
        prompts: B prompts as token-id lists (each prompt once per completion; the lists are shared).
        completion_ids: (B, Tc) int64, each row's completion then ``pad_id``; a completion that stopped
            ends with its stop id (included, as TRL's completions hold their EOS).
        completion_mask: (B, Tc) bool, True on each row's completion tokens (its stop id included).
        lengths: (B,) int64 completion lengths in tokens (the stop id counted).
        truncated: (B,) bool, True where no stop id came within ``max_completion_length`` (TRL's
            ``mask_truncated_completions`` drops these rows).
        logps: (B, Tc) float32, the decode's log-probability of each sampled token, ``log_softmax(logits /
            temperature)`` before top-k / top-p (TRL's definition); 0 off the mask.
        prompt_index: (B,) int64, the caller's prompt id of each row.
        generation_index: (B,) int64, each row's index among its prompt's G completions.
    """

    prompts: list[list[int]]
    completion_ids: Tensor
    completion_mask: Tensor
    lengths: Tensor
    truncated: Tensor
    logps: Tensor
    prompt_index: Tensor
    generation_index: Tensor

    def completions(self) -> list[list[int]]:
        """Each row's completion as a list of ids (its stop id included)."""
        return [row[:n].tolist() for row, n in zip(self.completion_ids, self.lengths.tolist())]


def compute_device(model: nn.Module) -> torch.device:
    """Where ``model`` computes: the device of its rotary tables (under CPU offload the shards stay on the CPU
    while the buffers move to the device, ``shardlm/train/build.py``)."""
    return model.model.rope_cos.device


def check_rollout_args(prompts: list[list[int]], prompt_ids: list[int], num_generations: int,
                       max_completion_length: int, max_seq_len: int, sampling: SamplingConfig,
                       batch_size: int) -> None:
    """Raise ValueError on bad rollout arguments: prompts and ids of different counts, a repeated prompt id
    (two prompts would share streams), G < 1, ``max_completion_length`` < 1, a temperature <= 0 (the
    log-probs are of ``logits / temperature``), other bad sampling settings, a negative batch size, an empty
    prompt, or a prompt with no room for ``max_completion_length`` tokens within ``max_seq_len``."""
    if len(prompts) != len(prompt_ids):
        raise ValueError(f"{len(prompts)} prompts but {len(prompt_ids)} prompt ids")
    if len(set(prompt_ids)) != len(prompt_ids):
        raise ValueError("prompt ids repeat: each prompt needs its own id (it keys the completions' random "
                         "streams)")
    if num_generations < 1:
        raise ValueError(f"num_generations must be >= 1, got {num_generations}")
    if max_completion_length < 1:
        raise ValueError(f"max_completion_length must be >= 1, got {max_completion_length}")
    if not sampling.temperature > 0:
        raise ValueError(f"rollout temperature must be > 0 (log-probs are of logits / temperature), got "
                         f"{sampling.temperature}")
    sampling.check()
    if batch_size < 0:
        raise ValueError(f"generation batch size must be >= 0 (0 = all rows at once), got {batch_size}")
    if prompts:
        check_prompts(prompts, max_seq_len)
    for i, p in enumerate(prompts):
        if len(p) + max_completion_length > max_seq_len:
            raise ValueError(f"prompt {prompt_ids[i]} has {len(p)} tokens: with max_completion_length="
                             f"{max_completion_length} that exceeds the model's context of {max_seq_len}")


@torch.no_grad()
def sample_rows(model: nn.Module, prompts: list[list[int]], uniforms: Tensor, sampling: SamplingConfig,
                max_new: int, stop_ids: set[int], pad_id: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """One generation batch: each prompt row extended by up to ``max_new`` tokens with the KV cache, row r's
    t-th token drawn with ``uniforms[r, t]``; the batch stops when every row has met a stop id.

    Args:
        prompts: b prompts (token ids); uniforms: (b, max_new) float32; stop_ids: ids that end a row (kept in
            it).

    Returns ``(ids, logps, lengths, truncated)``: (b, n) int64 (``pad_id`` after a row's end), (b, n) float32
    (0 there), (b,) int64, (b,) bool; n <= ``max_new`` the steps run.
    """
    b = len(prompts)
    device = compute_device(model)
    u = uniforms.to(device)
    stop = torch.tensor(sorted(stop_ids), dtype=torch.long, device=device)
    stopped = torch.zeros(b, dtype=torch.bool, device=device)
    lengths = torch.zeros(b, dtype=torch.long, device=device)
    ids: list[Tensor] = []
    logps: list[Tensor] = []

    def choose(logits: Tensor) -> Tensor:
        scaled = logits / sampling.temperature
        probs = torch.softmax(filter_logits(scaled, sampling.top_k, sampling.top_p), -1)
        nxt = inverse_cdf(probs, u[:, len(ids)])
        logps.append(torch.log_softmax(scaled, -1).gather(1, nxt.unsqueeze(1)).squeeze(1))
        return nxt

    for _, nxt in decode_steps(model, prompts, max_new, sampling, choose=choose):
        active = ~stopped  # rows still running when this token was drawn
        ids.append(torch.where(active, nxt, pad_id))
        logps[-1] = logps[-1].masked_fill(stopped, 0.0)
        lengths += active
        stopped |= active & torch.isin(nxt, stop)
        if bool(stopped.all()):
            break
    return torch.stack(ids, 1).cpu(), torch.stack(logps, 1).cpu(), lengths.cpu(), (~stopped).cpu()


def rollout(model: nn.Module, prompts: list[list[int]], prompt_ids: list[int], num_generations: int, *,
            max_completion_length: int, stop_ids: list[int], seed: int, step: int, temperature: float = 1.0,
            top_p: float = 1.0, top_k: int = 0, batch_size: int = 0, pad_id: int = 0) -> Rollout:
    """Sample ``num_generations`` completions of each prompt with the policy ``model``, in generation
    batches of ``batch_size`` rows, inside :func:`~shardlm.parallel.fsdp.gathered` (so every rank must call
    it, with any number of prompts; see the module's docstring), in eval mode (no LoRA dropout), without
    gradients.

    Args:
        model: the :class:`~shardlm.model.decoder.CausalLM`, FSDP2-sharded or not (a DDP wrapper's
            ``.module``); not tensor parallel.
        prompts: this rank's prompts, token ids (the chat template's generation prompt already added).
        prompt_ids: one id per prompt, unique (its index in the prepared prompts): keys its streams.
        num_generations: G completions per prompt.
        max_completion_length: new tokens per completion at most (TRL's ``max_completion_length``).
        stop_ids: the ids that end a completion (the model's end-of-turn and EOS ids), kept in it.
        seed, step: the run's seed and the step (generation) number: with the prompt id and the
            completion's index they key its random stream (:func:`stream_seed`).
        temperature, top_p, top_k: as :class:`~shardlm.model.generate.SamplingConfig` (temperature > 0).
        batch_size: completions decoded together (TRL's generation batch, per rank); 0 = all at once. It
            changes the speed and the memory (KV cache: batch × (prompt + completion) tokens × layers × 2 ×
            kv heads × head width, compute dtype), not the tokens.
        pad_id: the id written after each completion's end.

    Returns a :class:`Rollout` of B = len(prompts) × G rows, on the CPU.

    Raises:
        ValueError: bad arguments (:func:`check_rollout_args`).
    """
    sampling = SamplingConfig(temperature, top_k, top_p, seed)
    check_rollout_args(prompts, prompt_ids, num_generations, max_completion_length, model.cfg.max_seq_len,
                       sampling, batch_size)
    rows = [(i, g) for i in range(len(prompts)) for g in range(num_generations)]
    uniforms = completion_uniforms(seed, step, prompt_ids, num_generations, max_completion_length)
    step_batch = batch_size or max(len(rows), 1)
    pieces = []
    with sampling_mode(model):  # one all-gather per group on every rank, then steps without collectives
        for start in range(0, len(rows), step_batch):
            part = rows[start:start + step_batch]
            pieces.append(sample_rows(model, [prompts[i] for i, _ in part], uniforms[start:start + len(part)],
                                      sampling, max_completion_length, set(stop_ids), pad_id))
    width = max((p[0].shape[1] for p in pieces), default=0)

    def widen(t: Tensor, fill: float | int) -> Tensor:
        return torch.nn.functional.pad(t, (0, width - t.shape[1]), value=fill)

    ids = torch.cat([widen(p[0], pad_id) for p in pieces]) if pieces else torch.zeros(0, 0, dtype=torch.long)
    logps = torch.cat([widen(p[1], 0.0) for p in pieces]) if pieces else torch.zeros(0, 0)
    lengths = torch.cat([p[2] for p in pieces]) if pieces else torch.zeros(0, dtype=torch.long)
    truncated = torch.cat([p[3] for p in pieces]) if pieces else torch.zeros(0, dtype=torch.bool)
    return Rollout(
        prompts=[prompts[i] for i, _ in rows], completion_ids=ids,
        completion_mask=torch.arange(width).unsqueeze(0) < lengths.unsqueeze(1), lengths=lengths,
        truncated=truncated, logps=logps,
        prompt_index=torch.tensor([prompt_ids[i] for i, _ in rows], dtype=torch.long),
        generation_index=torch.tensor([g for _, g in rows], dtype=torch.long),
    )
