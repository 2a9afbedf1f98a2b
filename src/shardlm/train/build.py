"""Building the model for training: meta device -> CPU kernel, AC, compile, FSDP/DDP -> materialise -> init or load.

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
from shardlm.convert.hf_in import load_pretrained_
from shardlm.errors import ConfigError
from shardlm.model.cpu_matmul import apply_fp32_matmul, use_fp32_matmul
from shardlm.model.llama import Llama
from shardlm.parallel.ac import apply_ac, apply_compile
from shardlm.parallel.dist import DistInfo
from shardlm.parallel.fsdp import apply_fsdp
from shardlm.parallel.options import mixed_precision_policy, offload_policy


def build_model(cfg: Config, info: DistInfo, mesh: DeviceMesh | None) -> tuple[nn.Module, dict[str, Any] | None]:
    """Build the model on the meta device, wrap it for ``cfg.parallel.mode``, materialise, initialise.

    In order: the CPU's bf16 matrix-multiply kernel (``cpu_bf16_matmul``, :mod:`shardlm.model.cpu_matmul`),
    activation checkpointing, compile, then :func:`apply_fsdp` (or DDP), as torchtitan orders them.

    No rank ever holds the whole unsharded model: under ``fsdp`` only each rank's shards are
    allocated (``to_empty``) and filled by ``init_weights``, one full tensor at a time, or, with
    ``model.init_from``, by ``load_pretrained_`` reading only the shard's rows.

    Returns ``(model, load_stats)``: the ``Llama`` (FSDP-sharded or plain) or a ``DistributedDataParallel``
    around it, and :func:`shardlm.convert.hf_in.load_pretrained_`'s byte counts (None for a random init).

    Raises:
        ConfigError: ``single`` mode with more than one rank.
    """
    mode = cfg.parallel.mode
    if mode == "single" and info.world_size > 1:
        raise ConfigError(f"parallel.mode='single' runs one process, but the world size is {info.world_size}")
    pcfg = cfg.parallel
    with torch.device("meta"):
        model = Llama(cfg.model)
    if use_fp32_matmul(pcfg.cpu_bf16_matmul, info.device, pcfg.param_dtype):  # a CPU kernel choice, names unchanged
        apply_fp32_matmul(model)
    apply_ac(model.model.layers, pcfg.activation_checkpoint, pcfg.activation_checkpoint_n)  # torchtitan's order:
    if pcfg.compile:                                                                        # AC, compile, FSDP
        apply_compile(model.model.layers)
    if mode == "fsdp":
        apply_fsdp(model, mesh, mixed_precision_policy(pcfg), pcfg.reshard_after_forward,
                   offload=offload_policy(pcfg, info.device), forward_prefetch=pcfg.forward_prefetch,
                   backward_prefetch=pcfg.backward_prefetch, async_all_gather=pcfg.async_all_gather)
    # with CPU offload the shards live in CPU memory; buffers (rotary tables) still go to the device
    model.to_empty(device="cpu" if pcfg.cpu_offload else info.device)
    load_stats = None
    if cfg.model.init_from:  # pretrained: each rank reads only its shards' rows (convert/hf_in.py)
        load_stats = load_pretrained_(model, cfg.model.init_from)
    else:
        model.init_weights(cfg.train.seed)
    if pcfg.cpu_offload:
        for module in model.modules():
            for name, buf in list(module.named_buffers(recurse=False)):
                setattr(module, name, buf.to(info.device))
    if mode == "ddp":
        device_ids = [info.device.index] if info.device.type == "cuda" else None
        return DistributedDataParallel(model, device_ids=device_ids), load_stats
    return model, load_stats


def unwrap(model: nn.Module) -> Llama:
    """The ``Llama`` inside a DDP wrapper (or the model itself)."""
    return model.module if isinstance(model, DistributedDataParallel) else model
