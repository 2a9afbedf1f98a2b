"""Building the model for training: meta device -> CPU kernel, AC, compile, FSDP/DDP -> materialise -> init
or load.

torchtitan keeps this next to its trainer: it composes the model (:mod:`shardlm.model`), the parallelisms
(:mod:`shardlm.parallel`) and pretrained loading (:mod:`shardlm.convert.hf_in`) in the order they must run.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.nn.parallel import DistributedDataParallel

from shardlm.config import Config
from shardlm.config.auto import with_fixed_defaults
from shardlm.config.layout import SPLIT_BACKWARD_SCHEDULES, check_ep, check_tp
from shardlm.convert.hf_in import load_pretrained_
from shardlm.errors import ConfigError
from shardlm.model.cpu_matmul import apply_fp32_matmul, use_fp32_matmul
from shardlm.model.decoder import CausalLM, num_params
from shardlm.model.freeze import apply_freeze
from shardlm.model.hf_backend import build_causal_lm
from shardlm.model.lora import (
    LoRASpec,
    apply_lora,
    lora_modules,
    quantize_base_meta_,
    set_fp32_matmul,
    set_from_full_,
)
from shardlm.model.qat import apply_qat
from shardlm.parallel.ac import apply_ac, apply_compile
from shardlm.parallel.all_gather import resolve_all_gather
from shardlm.parallel.cp import ContextParallel, apply_cp
from shardlm.parallel.dist import DistInfo, dp_submesh
from shardlm.parallel.ep import apply_ep, build_ep_mesh
from shardlm.parallel.float8 import apply_float8, use_byte_all_gather
from shardlm.parallel.fsdp import apply_fsdp
from shardlm.parallel.options import dtype_from_name, mixed_precision_policy, offload_policy
from shardlm.parallel.pp import apply_pp, stage_plan
from shardlm.parallel.reduce_scatter import resolve_reduce_scatter
from shardlm.parallel.shared_memory import check_shared_memory, shared_memory_agreed
from shardlm.parallel.tp import ASYNC_TP_COMPILE_OPTIONS, apply_tp


def build_model(cfg: Config, info: DistInfo, mesh: DeviceMesh | None,
                cp: ContextParallel | None = None) -> tuple[nn.Module, dict[str, Any] | None]:
    """:func:`build_model_parts` without the pipeline parts: ``(model, load_stats)``."""
    model, _, load_stats = build_model_parts(cfg, info, mesh, cp)
    return model, load_stats


def build_model_parts(cfg: Config, info: DistInfo, mesh: DeviceMesh | None, cp: ContextParallel | None = None
                      ) -> tuple[nn.Module, list[nn.Module], dict[str, Any] | None]:
    """Build the model on the meta device, wrap it for ``cfg.parallel.mode``, materialise, initialise.

    First the parameter-efficient set-up, on the meta device: ``train.trainable``/``train.frozen`` freeze
    parameters (:mod:`shardlm.model.freeze`), or ``[lora]`` replaces the targeted linear layers by
    :class:`~shardlm.model.lora.LoRALinear` (base frozen, stored fp32/bf16/NF4, adapters fp32; with NF4 every
    frozen weight matrix, the token embedding included, is NF4). Then ``train.float8`` (torchao's float8
    linears, :func:`~shardlm.parallel.float8.apply_float8`) or ``train.qat`` (fake-quantised linears,
    :func:`~shardlm.model.qat.apply_qat`). Then the CPU's bf16 matrix-multiply kernel
    (``cpu_bf16_matmul``, :mod:`shardlm.model.cpu_matmul`), tensor parallel (``parallel.tp``,
    :func:`~shardlm.parallel.tp.apply_tp` on ``mesh["tp"]``), activation checkpointing, compile, then
    :func:`apply_fsdp` over the data-parallel dimensions (or DDP), as torchtitan orders them. With a ``cp``
    group of more than one rank, every attention layer first runs through it
    (:func:`~shardlm.parallel.cp.apply_cp`).

    No rank ever holds the whole unsharded model: under ``fsdp`` only each rank's shards are
    allocated (``to_empty``) and filled by ``init_weights``, each rank drawing only its own shard's rows
    (:meth:`CausalLM.initial_rows`), or, with ``model.init_from``, by ``load_pretrained_``
    reading only the shard's rows. A randomly initialised base under ``[lora]`` (tests, benchmarks) is drawn
    one full tensor at a time on every rank (:func:`init_base_weights_`: an NF4 base is quantised from the
    whole value); the values are the same as ``init_weights``'.

    ``model.backend = "transformers"``: the model is transformers'
    (:class:`~shardlm.model.hf_backend.HFCausalLM`, always loaded from ``model.init_from``), and the same
    steps apply to its decoder layers.

    With pipeline stages (``parallel.pp`` > 1) the model is first cut to this rank's stages
    (:func:`~shardlm.parallel.pp.apply_pp`, on ``mesh["pp"]``'s coordinate), and activation checkpointing,
    compile and FSDP (over this stage's data-parallel ranks) apply to each stage's part.

    Returns ``(model, parts, load_stats)``: the ``CausalLM`` (FSDP-sharded or plain; under ``parallel.pp``
    this rank's stages only) or a ``DistributedDataParallel`` around it, the pipeline parts of this rank's
    stages (``[]`` without pipeline parallelism), and :func:`shardlm.convert.hf_in.load_pretrained_`'s byte
    counts (None for a random init).

    Raises:
        ConfigError: ``single`` mode with more than one rank; a model ``parallel.tp`` cannot split, or LoRA
            with tensor parallel (:func:`~shardlm.config.layout.check_tp`).
    """
    cfg = with_fixed_defaults(cfg)  # a setting still "auto" (nothing chose it: an export, a tool) reads fixed
    mode = cfg.parallel.mode
    if mode == "single" and info.world_size > 1:
        raise ConfigError(f"parallel.mode='single' runs one process, but the world size is {info.world_size}")
    pcfg = cfg.parallel
    check_tp(cfg.model, pcfg.tp, cfg.train.seq_len, cfg.lora.enabled, pcfg.cp)  # a model tp cannot split
    with torch.device("meta"):  # shardlm's decoder, or transformers' model of init_from (model/hf_backend.py)
        model = build_causal_lm(cfg.model)
    lora = cfg.lora
    if lora.enabled:  # adapters on the targeted layers, everything else frozen
        apply_lora(model, LoRASpec(lora.rank, lora.alpha, lora.dropout, lora.targets, lora.base_dtype))
        if lora.base_dtype == "nf4":
            compute = (
                dtype_from_name("parallel.param_dtype", pcfg.param_dtype) if mode == "fsdp" else torch.float32
            )
            quantize_base_meta_(model, "cpu" if pcfg.cpu_offload else info.device, compute)
    elif cfg.train.trainable or cfg.train.frozen:
        apply_freeze(model, cfg.train.trainable, cfg.train.frozen)
    if cfg.train.float8 != "none":  # torchao's float8 linears, before FSDP (emulated on a CPU)
        apply_float8(model, cfg.train.float8, info.device, fsdp=mode == "fsdp")
    if cfg.train.qat != "none":  # torchao's fake-quantised linears
        apply_qat(model, cfg.train.qat, cfg.train.qat_group_size)
    # a CPU kernel choice, names unchanged (not under TP: its custom operator has no DTensor sharding rule)
    if use_fp32_matmul(pcfg.cpu_bf16_matmul, info.device, pcfg.param_dtype) and pcfg.tp == 1:
        apply_fp32_matmul(model)
        set_fp32_matmul(model)
    parts, elsewhere = [], set()
    if pcfg.pp > 1:  # torchtitan's order: the pipeline cut first, then everything else per stage
        plan = stage_plan(cfg.model.n_layers, pcfg.pp, mesh["pp"].get_local_rank(), pcfg.pp_schedule,
                          pcfg.pp_layers_per_stage)
        whole = {name for name, _ in model.named_parameters()}
        parts = apply_pp(model, plan)
        elsewhere = whole - {name for name, _ in model.named_parameters()}  # the other stages' weights
    if pcfg.tp > 1:
        # torchtitan's order: TP, (CP's attention), AC, compile, FSDP over the data-parallel dimensions
        apply_tp(model, mesh["tp"])
    if cp is not None and cp.size > 1:  # attention across the sequence split (before AC wraps the blocks)
        apply_cp(model, cp)
    for part in parts or [model]:
        blocks = nn.ModuleList(layer for layer in part.model.layers if layer is not None)
        apply_ac(blocks, pcfg.activation_checkpoint, pcfg.activation_checkpoint_n)
        if pcfg.compile:
            # async TP (CUDA): TorchInductor pipelines the blocks' TP collectives with their multiplies
            apply_compile(blocks, ASYNC_TP_COMPILE_OPTIONS if pcfg.async_tp else None)
    check_ep(cfg.model.n_experts, pcfg.ep, info.world_size, mode, pcfg.dp_replicate)
    experts, expert_mesh = [], None
    fsdp_mesh = dp_submesh(mesh) if mode == "fsdp" else None  # FSDP over the data-parallel dimensions
    if pcfg.ep > 1:
        # experts split over ep ranks, then FSDP-sharded over the rest; all else FSDP over every rank
        ep_mesh = build_ep_mesh(info.device.type, info.world_size, pcfg.ep)
        experts, fsdp_mesh, expert_mesh = apply_ep(model, ep_mesh), ep_mesh["dp_shard"], ep_mesh["efsdp"]
    if mode == "fsdp":
        # the zero-bubble schedules differentiate the parameters the forward used, after the input backward
        split = pcfg.pp > 1 and pcfg.pp_schedule in SPLIT_BACKWARD_SCHEDULES
        # the "auto" collectives on CPU, taken by every rank alike (one collective, every rank calling)
        shm = info.device.type == "cpu" and shared_memory_agreed(num_params(model), info.world_size)
        check_shared_memory(pcfg.all_gather, pcfg.reduce_scatter, info.device.type)
        for part in parts or [model]:  # a pipeline stage: over its own data-parallel ranks
            reshard = False if split else pcfg.reshard_after_forward
            apply_fsdp(part, fsdp_mesh, mixed_precision_policy(pcfg), reshard,
                       offload=offload_policy(pcfg, info.device), forward_prefetch=pcfg.forward_prefetch,
                       backward_prefetch=pcfg.backward_prefetch, async_all_gather=pcfg.async_all_gather,
                       reduce_scatter=resolve_reduce_scatter(pcfg.reduce_scatter, info.device.type, shm),
                       all_gather=resolve_all_gather(pcfg.all_gather, info.device.type, shm),
                       blocks_per_group=pcfg.blocks_per_group, experts=experts, expert_mesh=expert_mesh)
        if cfg.train.float8 != "none" and info.backend == "gloo":  # gloo has no float8 all-gather
            use_byte_all_gather(model)
    # with CPU offload the shards live in CPU memory; buffers (rotary tables) still go to the device
    for part in [model, *parts]:  # a part's own rotary buffers too
        part.to_empty(device="cpu" if pcfg.cpu_offload else info.device)
    load_stats = None
    adapters = {f"{name}.{ab}.weight" for name, _ in lora_modules(model) for ab in ("lora_A", "lora_B")}
    if cfg.model.init_from:  # pretrained: each rank reads only its shards' rows (convert/hf_in.py)
        load_stats = load_pretrained_(model, cfg.model.init_from, skip=adapters, elsewhere=elsewhere)
    elif adapters:
        init_base_weights_(model, cfg.train.seed, skip=adapters)
    else:
        model.init_weights(cfg.train.seed)
    for part in parts:
        part.init_rotary()
    init_adapters_(model, cfg.train.seed)
    if pcfg.cpu_offload:
        for module in model.modules():
            for name, buf in list(module.named_buffers(recurse=False)):
                setattr(module, name, buf.to(info.device))
    if mode == "ddp":
        device_ids = [info.device.index] if info.device.type == "cuda" else None
        return DistributedDataParallel(model, device_ids=device_ids), parts, load_stats
    return model, parts, load_stats


@torch.no_grad()
def init_base_weights_(model: CausalLM, seed: int, skip: set[str]) -> None:
    """``CausalLM.init_weights`` for a model with adapters: every parameter not in ``skip`` from
    ``model.initial_value`` (an NF4 base is quantised from the whole value), then the rotary tables."""
    for name, param in model.named_parameters():
        if name not in skip:
            set_from_full_(param, model.initial_value(name, seed))
    model.init_rotary()


@torch.no_grad()
def init_adapters_(model: nn.Module, seed: int) -> None:
    """Set every LoRA adapter to its initial value (A random, B zero: the model equals its base)."""
    for name, module in lora_modules(model):
        a, b = module.initial_adapters(name, seed)
        set_from_full_(module.lora_A.weight, a)
        set_from_full_(module.lora_B.weight, b)


def unwrap(model: nn.Module) -> CausalLM:
    """The ``CausalLM`` inside a DDP wrapper (or the model itself)."""
    return model.module if isinstance(model, DistributedDataParallel) else model
