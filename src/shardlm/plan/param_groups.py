"""The model's parameters as the planner counts them: the FSDP groups ``apply_fsdp`` builds, in forward
order, with each group's full and per-rank (padded) element counts, its trainable share and the bytes of its
stored shards.

Shapes come from the model built on the meta device (no memory, no compute) with the run's LoRA adapters or
frozen parameters applied. Each parameter's shard is ``ceil(rows / N)`` rows (dim-0 padding, as FSDP2's
``Shard(0)``); under tensor parallel a group holds this rank's tensor-parallel pieces (``parallel/tp.py``'s
plan), under expert parallel only its ep rank's experts are all-gathered (``parallel/ep.py``). A LoRA base is
stored in ``lora.base_dtype`` (fp32 or bf16: the targeted layers' weights; NF4: every frozen weight matrix,
the token embedding and output projection included, at ~0.52 bytes per value, all-gathered as such; norms
stay fp32).
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass

import torch

from shardlm.config import Config
from shardlm.config.auto import with_fixed_defaults
from shardlm.model.decoder import CausalLM
from shardlm.model.freeze import apply_freeze
from shardlm.model.hf_backend import build_causal_lm
from shardlm.model.lora import NF4_BLOCK, LoRALinear, LoRASpec, apply_lora, nf4_scaler_block


@dataclass
class Group:
    """One FSDP communication group: its parameters' full and padded per-rank element counts."""

    name: str
    numel: int
    shard_numel: int
    grad_numel: int = 0
    """Elements that get a gradient (trainable), and their padded per-rank count."""
    grad_shard_numel: int = 0
    stored_shard_bytes: int = 0
    """Bytes of this rank's stored shards (fp32 masters; a LoRA base in its storage dtype)."""
    gather_factor: float = 1.0
    """Bytes all-gathered and held unsharded, relative to every value in the compute dtype (< 1 with NF4)."""


def meta_model(cfg: Config) -> CausalLM:
    """The model on the meta device with the run's LoRA adapters or frozen parameters applied
    (as build_model)."""
    with torch.device("meta"):
        model = build_causal_lm(cfg.model)  # transformers' model under its backend: counted from it
    lora = cfg.lora
    if lora.enabled:
        apply_lora(model, LoRASpec(lora.rank, lora.alpha, lora.dropout, lora.targets, lora.base_dtype))
    elif cfg.train.trainable or cfg.train.frozen:
        apply_freeze(model, cfg.train.trainable, cfg.train.frozen)
    return model


_META_CACHE: dict[str, CausalLM] = {}


def planner_model(cfg: Config) -> CausalLM:
    """:func:`meta_model`, built once per shape (model, LoRA and freezing settings) and shared by the
    planner's own read-only uses: ``shardlm plan``'s search plans one shape under many parallel settings."""
    key = repr((cfg.model, cfg.lora, cfg.train.trainable, cfg.train.frozen))
    if key not in _META_CACHE:
        if len(_META_CACHE) >= 4:
            _META_CACHE.clear()
        _META_CACHE[key] = meta_model(cfg)
    return _META_CACHE[key]


def nf4_bytes(numel: int) -> float:
    """Bytes of an NF4 tensor of ``numel`` values: 4-bit codes, an int8 scale per 64 values, a bf16 factor per
    scaler block (torchao's layout)."""
    return numel / 2 + numel / NF4_BLOCK + 2 * numel / NF4_BLOCK / nf4_scaler_block(numel)


def block_group_name(layer: int, blocks_per_group: int, n_layers: int) -> str:
    """The name of the FSDP group holding block ``layer``: ``block3`` (one block per group), ``blocks0-2``."""
    first = layer - layer % blocks_per_group
    last = min(first + blocks_per_group, n_layers) - 1
    return f"block{first}" if first == last else f"blocks{first}-{last}"


def tp_local_shape(name: str, shape: torch.Size, tp: int) -> tuple[int, int]:
    """(rows, elements) of this rank's tensor-parallel piece of parameter ``name`` (``parallel/tp.py``'s
    plan): norm weights are replicated; o_proj and down_proj are split by input columns (rows kept); every
    other weight and bias (q/k/v, gate/up, the embedding and output projection) by rows."""
    numel = math.prod(shape)
    if tp == 1 or name.endswith("norm.weight"):
        return shape[0], numel
    if name.endswith(("o_proj.weight", "down_proj.weight")):
        return shape[0], numel // tp
    return shape[0] // tp, numel // tp


def param_groups(
    cfg: Config, world_size: int, param_bytes: int = 4, tp: int = 1
) -> tuple[list[Group], int, int]:
    """FSDP groups in forward order as ``apply_fsdp`` builds them, and (P, padded local numel).

    Shapes come from the model built on the meta device (no memory, no compute); frozen parameters and a LoRA
    base's storage dtype are taken from :func:`meta_model`. With tensor parallel (``tp`` > 1) a group's sizes
    are this rank's tensor-parallel pieces (:func:`tp_local_shape`), which FSDP shards over ``world_size``
    ranks; P stays the whole model's count.
    """
    cfg = with_fixed_defaults(cfg)  # "auto" settings not chosen yet: their fixed defaults
    model = planner_model(cfg)
    nf4 = cfg.lora.enabled and cfg.lora.base_dtype == "nf4"
    base_bytes = {"float32": 4, "bfloat16": 2, "nf4": 2}[cfg.lora.base_dtype]
    lora_bases = {f"{n}.weight" for n, m in model.named_modules() if isinstance(m, LoRALinear)}
    if nf4:
        # QLoRA: every frozen matrix, the token embedding (and a tied output) included (quantize_base_meta_)
        lora_bases = {n for n, p in model.named_parameters() if not p.requires_grad and p.ndim == 2}
    groups: dict[str, Group] = {}
    gathered: dict[str, float] = defaultdict(float)
    total, local = 0, 0
    ep = getattr(cfg.parallel, "ep", 1)
    for name, p in model.named_parameters():
        rows, numel = tp_local_shape(name, p.shape, tp)
        shard = math.ceil(rows / world_size) * (numel // rows)
        # expert parallelism: a rank all-gathers only its ep rank's n_experts / ep experts (parallel/ep.py)
        gathered_numel = numel // ep if ".mlp.experts." in name else numel
        if name.startswith("model.layers."):
            key = block_group_name(int(name.split(".")[2]), cfg.parallel.blocks_per_group, cfg.model.n_layers)
        elif cfg.model.tie_embeddings:
            key = "root"
        elif name.startswith("model.embed_tokens"):
            key = "embed"
        else:
            key = "head"
        g = groups.setdefault(key, Group(key, 0, 0))
        g.numel += gathered_numel
        g.shard_numel += shard
        if p.requires_grad:
            g.grad_numel += gathered_numel
            g.grad_shard_numel += shard
        if name in lora_bases and nf4:
            g.stored_shard_bytes += round(nf4_bytes(numel) * shard / numel)
            gathered[key] += nf4_bytes(numel)
        else:
            g.stored_shard_bytes += shard * (base_bytes if name in lora_bases else 4)
            gathered[key] += gathered_numel * param_bytes
        total += p.numel()
        local += shard
    for key, g in groups.items():
        g.gather_factor = gathered[key] / (g.numel * param_bytes)
    n_layers, per_group = cfg.model.n_layers, cfg.parallel.blocks_per_group
    order = (
        ["root", "embed"]
        + [block_group_name(i, per_group, n_layers) for i in range(0, n_layers, per_group)]
        + ["head"]
    )
    return [groups[k] for k in order if k in groups], total, local
