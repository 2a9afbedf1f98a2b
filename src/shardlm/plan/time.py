"""Step time of a config: FLOPs over the device's peak, communication bytes over its bandwidth.

FLOPs per token (PaLM, Chowdhery et al. 2022, appendix B; the MFU definition torchtitan uses):
6·N + 12·L·H·Q·T, with N the parameters without the input embedding, L layers, H heads, Q the
head dimension, T the sequence length (under block-causal attention the attention context Σ n² / T of the
documents, :mod:`shardlm.plan.documents`). Full activation checkpointing recomputes the blocks'
forward: + (2·N_blocks + 4·L·H·Q·T) per token (one more forward of the blocks).

Communication per rank per step (ring collectives; Patarasuk & Yuan 2009 for the (N−1)/N factor):

    FSDP: (N−1)/N · [k·(1+r)·P·b_param + s·P·b_reduce]

with N the shard-group size, P parameters, k micro-batches, r = 1 when blocks are resharded after
forward (all-gathered again for backward), s = k when gradients are reduce-scattered on every
micro-batch and 1 when only on the last, b bytes per element of ``param_dtype``/``reduce_dtype``.
DDP all-reduces the gradients: 2·(N−1)/N · s·P·4. HSDP (R replicas of shard groups of S ranks)
adds the all-reduce of each gradient shard across replicas: 2·(R−1)/R · (P/S) · b_reduce.

Float8 (``train.float8``, :mod:`shardlm.parallel.float8`): the P8 parameters of the converted linear layers
all-gather at 1 byte each under ``tensorwise`` (P·b_param becomes (P − P8)·b_param + P8), and their GEMMs,
6·P8 FLOPs per token (8·P8 with full recomputation), run at the device's float8 peak on a device that has one
(:attr:`shardlm.devices.Device.peak_flops_fp8`), everything else at the compute precision's. MFU stays
stated against the bf16 peak, as torchtitan states it under float8 (its float8 runs "inflate mfu%": compare
tokens/s).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shardlm.config import Config, gradient_accumulation_steps
from shardlm.config.auto import with_fixed_defaults
from shardlm.metrics.flops import model_flops
from shardlm.parallel.dist import compute_precision, dp_mesh_shape
from shardlm.parallel.float8 import float8_layers
from shardlm.plan.devices import Device
from shardlm.plan.documents import attention_context
from shardlm.plan.memory import Settings
from shardlm.plan.param_groups import meta_model


def fsdp_comm_bytes(n: int, params: int, micro_batches: int, reshard_after_forward: bool,
                    grad_sync_every_micro_batch: bool, param_bytes: int, reduce_bytes: int,
                    float8_params: float = 0) -> float:
    """Bytes one rank sends (= receives) per step under FSDP: the formula in the module docstring.

    Args:
        n: shard-group size N (1 gives 0).
        params: P, parameters.
        micro_batches: k.
        reshard_after_forward: r = 1 if True.
        grad_sync_every_micro_batch: s = k if True, else 1.
        param_bytes, reduce_bytes: b_param, b_reduce.
        float8_params: P8, the parameters all-gathered in float8 (1 byte each) instead.
    """
    r = 1 if reshard_after_forward else 0
    s = micro_batches if grad_sync_every_micro_batch else 1
    gathered = (params - float8_params) * param_bytes + float8_params
    return (n - 1) / n * (micro_batches * (1 + r) * gathered + s * params * reduce_bytes)


def ddp_comm_bytes(n: int, params: int, syncs: int, grad_bytes: int = 4) -> float:
    """Bytes one rank sends per step under DDP: ring all-reduce, 2·(N−1)/N · syncs·P·b."""
    return 2 * (n - 1) / n * syncs * params * grad_bytes


def flops_per_token(cfg: Config, recompute: str = "none") -> float:
    """Training FLOPs per token: 6·N + 12·L·H·Q·T (:func:`shardlm.metrics.flops.model_flops`, per token),
    plus one more forward of the blocks (2·N_blocks + 4·L·H·Q·T) under full activation checkpointing. Under
    block-causal attention over documents T is the attention context Σ n² / T of the prepared data's
    samples (:func:`shardlm.plan.documents.attention_context`), ``train.seq_len`` otherwise."""
    m, t = cfg.model, cfg.train.seq_len
    context = attention_context(cfg)
    # per token: the trainer's formula at the mean Σ n² per sequence
    total = model_flops(m, t, t * context) / t
    if recompute == "full":
        q = m.head_dim
        kv = m.kv_heads * q
        block = 2 * m.dim * m.n_heads * q + 2 * m.dim * kv + 3 * m.dim * m.ffn_dim + 2 * m.dim
        total += 2 * m.n_layers * block + 4 * m.n_layers * m.n_heads * q * context
    return total


def hsdp_all_reduce_bytes(replicas: int, shard_group: int, params: int, reduce_bytes: int) -> float:
    """Bytes one rank sends per step in HSDP's cross-replica all-reduce of its gradient shard.

    Ring all-reduce of P/S elements over R replicas: 2·(R−1)/R · (P/S) · b_reduce (0 when R = 1).
    """
    return 2 * (replicas - 1) / replicas * params / shard_group * reduce_bytes


def tp_comm_bytes(
    tp: int, n_layers: int, tokens: int, dim: int, compute_bytes: int, recompute: bool = False
) -> float:
    """Bytes one rank sends per step in tensor parallel's activation collectives (``parallel/tp.py``).

    Per block forward two all-gathers (into attention and the MLP) and two reduce-scatters (out of o and down)
    of the (tokens, dim) activations, plus the embedding's reduce-scatter and the loss's all-gather of the
    hidden states; backward runs the dual of each (full checkpointing, ``recompute``, repeats the blocks'
    forward ones). A ring moves (T−1)/T of the buffer per rank: (T−1)/T · tokens·d·c · (4·L·(2 + recompute) +
    4). ``tokens``: per data-parallel rank per step (all micro-batches). The loss's per-chunk all-reduces (a
    few floats a token) are left out.
    """
    if tp == 1:
        return 0.0
    collectives = 4 * n_layers * (2 + int(recompute)) + 4
    return (tp - 1) / tp * tokens * dim * compute_bytes * collectives


@dataclass
class TimePlan:
    """Predicted step time, in seconds, and its inputs."""

    flops: float
    """FLOPs per rank per step."""
    comm_bytes: float
    """Bytes each rank sends per step."""
    compute_s: float
    """flops / the device's peak (an ideal lower bound: MFU = 100%)."""
    comm_s: float
    """comm_bytes / the device's bus bandwidth for this group size."""
    precision: str = "fp32"
    """The precision the matmuls run in (``bf16``, ``tf32`` or ``fp32``), whose peak ``compute_s`` uses."""
    peak_flops: float = 0.0
    """That peak, FLOP/s per rank."""
    float8_flops: float = 0.0
    """Of ``flops``, those of float8 GEMMs run at ``peak_flops_fp8`` (``train.float8``, a device with it)."""
    peak_flops_fp8: float = 0.0
    """The device's float8 peak, FLOP/s per rank (0: none, or float8 off)."""

    @property
    def overlapped_s(self) -> float:
        """Step time when communication hides completely behind compute: max of the two."""
        return max(self.compute_s, self.comm_s)

    @property
    def serial_s(self) -> float:
        """Step time when nothing overlaps: the sum."""
        return self.compute_s + self.comm_s


def plan_time(cfg: Config, world_size: int, device: Device, params: int) -> TimePlan:
    """Predict the step time of ``cfg`` at ``world_size`` ranks on ``device`` (P = ``params``).

    The compute time uses the device's peak in the precision that runs: bf16 with ``param_dtype =
    "bfloat16"``, else TF32 on a GPU unless ``parallel.tf32 = false``, else fp32
    (:func:`shardlm.parallel.dist.compute_precision`).
    """
    cfg = with_fixed_defaults(cfg)  # "auto" settings not chosen yet: their fixed defaults
    st = Settings.from_config(cfg)
    # context parallel: each rank computes 1/cp of a sequence's tokens (K/V traffic not counted)
    cp = cfg.parallel.cp
    tp = cfg.parallel.tp  # tensor parallel: each rank computes 1/T of its data-parallel rank's tokens' FLOPs
    k = gradient_accumulation_steps(cfg, world_size // (cp * tp))
    tokens = k * cfg.train.micro_batch_size * cfg.train.seq_len
    flops = flops_per_token(cfg, st.ac_mode) * tokens / (cp * tp)
    precision = compute_precision(torch.device("cpu" if device.name == "cpu" else "cuda"), cfg.parallel)
    peak = device.peak_flops(precision)
    p8 = float8_params(cfg)
    # the converted GEMMs at the float8 peak where the device has one (a CPU emulates: no faster)
    fp8_peak = device.peak_flops("fp8") if p8 else 0.0
    f8_flops = (8 if st.ac_mode == "full" else 6) * p8 * tokens / (cp * tp) if fp8_peak else 0.0
    compute_s = (flops - f8_flops) / peak + (f8_flops / fp8_peak if f8_flops else 0.0)
    gathered8 = p8 if cfg.train.float8 == "tensorwise" else 0  # torchao all-gathers float8 tensorwise only
    every = st.grad_sync != "last_micro_batch"  # reduce-scatter on every micro-batch
    if st.mode == "fsdp":
        replicas, shard = dp_mesh_shape(cfg.parallel, world_size, world_size)
        shard *= cp  # FSDP shards over dp_shard x cp
        local = params / tp  # FSDP shards each rank's tensor-parallel piece
        comm = fsdp_comm_bytes(shard, local, k, st.reshard_after_forward, every, st.param_bytes,
                               st.reduce_bytes, gathered8 / tp)
        comm += hsdp_all_reduce_bytes(replicas, shard, local, st.reduce_bytes)
        tp_bytes = tp_comm_bytes(tp, cfg.model.n_layers, tokens, cfg.model.dim, st.param_bytes,
                                 st.ac_mode == "full")
        if tp_bytes:  # on the tensor-parallel group's own (intra-node) links
            return TimePlan(flops, comm + tp_bytes, compute_s,
                            comm / device.bandwidth(world_size) + tp_bytes / device.bandwidth(tp), precision,
                            peak, f8_flops, fp8_peak)
    elif st.mode == "ddp":
        comm = ddp_comm_bytes(world_size, params, k if every else 1)
    else:
        comm = 0.0
    return TimePlan(flops, comm, compute_s, comm / device.bandwidth(world_size) if comm else 0.0,
                    precision, peak, f8_flops, fp8_peak)


def float8_params(cfg: Config) -> int:
    """P8: the weight elements of the linear layers ``train.float8`` converts (0 when it is off), counted on
    a meta-device model (:func:`shardlm.parallel.float8.float8_layers`: the blocks' aligned ``nn.Linear``
    layers, not ``lm_head``, routers or experts)."""
    if cfg.train.float8 == "none":
        return 0
    model = meta_model(cfg)  # as build_model makes it (float8 excludes LoRA: plain linears)
    return sum(model.get_submodule(name).weight.numel() for name in float8_layers(model, cfg.train.float8))
