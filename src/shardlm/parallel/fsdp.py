"""Applying FSDP2 (``fully_shard``) to the model: the recipe, in one function.

FSDP2 (https://pytorch.org/docs/stable/distributed.fsdp.fully_shard.html) turns each parameter
into a DTensor sharded on dim 0 (``Shard(0)``) over the mesh. Each ``fully_shard`` call makes one
communication group: its parameters are all-gathered together before the group's forward,
freed (resharded) after it, all-gathered again for backward, and their gradients are
reduce-scattered (averaged over ranks) when backward leaves the group.
"""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.nn.parallel import DistributedDataParallel

from shardlm.config import Config, ConfigError
from shardlm.model import Llama
from shardlm.parallel.ac import apply_ac, apply_compile
from shardlm.parallel.cpu_matmul import apply_fp32_matmul, use_fp32_matmul
from shardlm.parallel.dist import DistInfo
from shardlm.parallel.options import (
    add_async_all_gather, check_reshard_after_forward, mixed_precision_policy, offload_policy, set_prefetch,
)


def apply_fsdp(model: Llama, mesh: DeviceMesh, mp_policy: MixedPrecisionPolicy | None = None,
               reshard_after_forward: bool | int = True, *, offload: OffloadPolicy | None = None,
               forward_prefetch: int = 0, backward_prefetch: int = 0, async_all_gather: bool = False) -> Llama:
    """Shard ``model`` in torchtitan's grouping: embedding, each block, final norm + output, root.

    1. the token embedding is one group (unless tied: then it stays with the output projection);
    2. each transformer block is one group, resharded after forward per ``reshard_after_forward``
       (true, false, or an N-way shard; see ``ParallelConfig``);
    3. the final norm and the output projection form one group, kept unsharded after forward
       since backward needs them at once;
    4. the root takes whatever is left (with tied embeddings: the shared embedding/output weight,
       the final norm) and drives the lazy initialisation and the prefetch order; it keeps
       FSDP's default of not resharding after forward.

    Every group uses ``mp_policy`` (compute/reduce dtypes) and ``offload`` (CPU offload); then the
    blocks get ``forward_prefetch``/``backward_prefetch`` explicit prefetch depths, and with
    ``async_all_gather`` each group issues the next group's all-gather with ``unshard(async_op=True)``.

    Returns the same object, now also an ``FSDPModule``.

    Raises:
        ConfigError: an integer ``reshard_after_forward`` that does not fit the mesh size.
    """
    # the shard group is the last mesh dimension (all ranks, or one HSDP row)
    reshard_after_forward = check_reshard_after_forward(reshard_after_forward, mesh.size(mesh.ndim - 1))
    common = dict(mesh=mesh, mp_policy=mp_policy or MixedPrecisionPolicy(), offload_policy=offload or OffloadPolicy())
    decoder = model.model
    if not model.cfg.tie_embeddings:
        fully_shard(decoder.embed_tokens, reshard_after_forward=reshard_after_forward, **common)
    for block in decoder.layers:
        fully_shard(block, reshard_after_forward=reshard_after_forward, **common)
    if not model.cfg.tie_embeddings:
        fully_shard([decoder.norm, model.lm_head], reshard_after_forward=False, **common)
    fully_shard(model, **common)
    blocks = list(decoder.layers)
    set_prefetch(blocks, forward_prefetch, backward_prefetch)
    if async_all_gather:
        groups = ([] if model.cfg.tie_embeddings else [decoder.embed_tokens]) + blocks
        add_async_all_gather(model, groups + ([] if model.cfg.tie_embeddings else [decoder.norm]))
    return model


def build_model(cfg: Config, info: DistInfo, mesh: DeviceMesh | None) -> torch.nn.Module:
    """Build the model on the meta device, wrap it for ``cfg.parallel.mode``, materialise, initialise.

    In order: the CPU's bf16 matrix-multiply kernel (``cpu_bf16_matmul``, :mod:`shardlm.parallel.cpu_matmul`),
    activation checkpointing, compile, then :func:`apply_fsdp` (or DDP), as torchtitan orders them.

    No rank ever holds the whole unsharded model: under ``fsdp`` only each rank's shards are
    allocated (``to_empty``) and filled by ``init_weights``, one full tensor at a time, or, with
    ``model.init_from``, by ``load_pretrained_`` reading only the shard's rows (its byte counts are
    left in ``model.pretrained_load_stats``).

    Returns the ``Llama`` (FSDP-sharded or plain) or a ``DistributedDataParallel`` around it.

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
    if cfg.model.init_from:  # pretrained: each rank reads only its shards' rows (checkpoint/hf_load.py)
        from shardlm.checkpoint.hf_load import load_pretrained_

        model.pretrained_load_stats = load_pretrained_(model, cfg.model.init_from)
    else:
        model.init_weights(cfg.train.seed)
    if pcfg.cpu_offload:
        for module in model.modules():
            for name, buf in list(module.named_buffers(recurse=False)):
                setattr(module, name, buf.to(info.device))
    if mode == "ddp":
        device_ids = [info.device.index] if info.device.type == "cuda" else None
        return DistributedDataParallel(model, device_ids=device_ids)
    return model


def unwrap(model: torch.nn.Module) -> Llama:
    """The ``Llama`` inside a DDP wrapper (or the model itself)."""
    return model.module if isinstance(model, DistributedDataParallel) else model
