"""FSDP2 knobs from ``[parallel]``: mixed precision, offload, reshard policy, prefetch, gradient sync.

Each function turns one config field into the PyTorch object or call that implements it
(https://pytorch.org/docs/stable/distributed.fsdp.fully_shard.html); :func:`shardlm.parallel.fsdp.apply_fsdp`
applies them in one place.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy
from torch.nn.parallel import DistributedDataParallel

from shardlm.config import ParallelConfig
from shardlm.config.auto import AUTO, FIXED
from shardlm.errors import ConfigError
from shardlm.parallel.all_gather import resolve_all_gather
from shardlm.parallel.reduce_scatter import resolve_reduce_scatter

DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def dtype_from_name(key: str, name: str) -> torch.dtype:
    """``"float32"`` -> ``torch.float32``, ``"bfloat16"`` -> ``torch.bfloat16``.

    Raises:
        ConfigError: any other name, naming the option ``key``.
    """
    if name not in DTYPES:
        raise ConfigError(f"{key}: unknown dtype {name!r} (known: {', '.join(DTYPES)})")
    return DTYPES[name]


def mixed_precision_policy(pcfg: ParallelConfig) -> MixedPrecisionPolicy:
    """``MixedPrecisionPolicy(param_dtype, reduce_dtype)`` from the config; fp32/fp32 is full precision.

    Shards (and so the optimizer) stay fp32; all-gathered weights are cast to ``param_dtype`` for
    compute; gradients are reduce-scattered in ``reduce_dtype`` and accumulated in fp32 shards.
    """
    return MixedPrecisionPolicy(param_dtype=dtype_from_name("parallel.param_dtype", pcfg.param_dtype),
                                reduce_dtype=dtype_from_name("parallel.reduce_dtype", pcfg.reduce_dtype))


def offload_policy(pcfg: ParallelConfig, device: torch.device) -> OffloadPolicy:
    """``CPUOffloadPolicy`` when ``cpu_offload``, else no offload.

    Pinned host memory needs an accelerator (``pin_memory=True`` fails on a CPU-only machine with
    "Cannot access accelerator device"), so it is pinned only when training on CUDA.
    """
    if not pcfg.cpu_offload:
        return OffloadPolicy()
    return CPUOffloadPolicy(pin_memory=device.type == "cuda")


def check_reshard_after_forward(value: bool | int, shard_size: int) -> bool | int:
    """Validate ``reshard_after_forward`` against the shard group size; return it for ``fully_shard``.

    An integer N keeps an N-way shard after forward: N must satisfy 1 < N < shard_size and divide it.

    Raises:
        ConfigError: an integer that does not fit the group, naming ``parallel.reshard_after_forward``.
    """
    if isinstance(value, bool):
        return value
    if not 1 < value < shard_size or shard_size % value:
        raise ConfigError(f"parallel.reshard_after_forward={value} must satisfy 1 < N < {shard_size} (the "
                          f"shard group size) and divide it; use true, false or such an N")
    return value


def set_prefetch(blocks: list[FSDPModule], forward_depth: int, backward_depth: int) -> None:
    """Explicit prefetch on top of FSDP's implicit one: block group i all-gathers the next k groups early.

    ``blocks`` holds one module per block group, in forward order (a group of several blocks shares one
    FSDP state, so any of its modules stands for it). Forward: group i's pre-forward issues the
    all-gathers of groups i+1..i+forward_depth (``set_modules_to_forward_prefetch``). Backward runs the
    groups in reverse, so group i's pre-backward issues groups i-1..i-backward_depth
    (``set_modules_to_backward_prefetch``). A depth of 0 leaves FSDP's default (no forward prefetch
    list; one group in backward).
    """
    for i, block in enumerate(blocks):
        if forward_depth > 0:
            block.set_modules_to_forward_prefetch(blocks[i + 1:i + 1 + forward_depth])
        if backward_depth > 0:
            block.set_modules_to_backward_prefetch(blocks[max(0, i - backward_depth):i][::-1])


def add_async_all_gather(root: nn.Module, groups: list[FSDPModule]) -> None:
    """Before group i's forward, issue group i+1's all-gather with ``unshard(async_op=True)``.

    FSDP waits on the returned work just before group i+1 runs (its own pre-forward unshard is
    then a no-op). Only the forward of the root issues them: the recomputation of checkpointed
    blocks in backward runs their forward hooks again, and must not all-gather the next block.
    """
    state = {"in_forward": False}

    def root_pre(module, args):
        state["in_forward"] = True

    def root_post(module, args, output):
        state["in_forward"] = False

    root.register_forward_pre_hook(root_pre)
    root.register_forward_hook(root_post, always_call=True)
    for current, nxt in zip(groups[:-1], groups[1:]):
        def pre(module, args, nxt=nxt):
            if state["in_forward"] and torch.is_grad_enabled():
                nxt.unshard(async_op=True)
        current.register_forward_pre_hook(pre)


def describe(pcfg: ParallelConfig, device_type: str, shared_memory: bool = False) -> str:
    """The speed-relevant ``[parallel]`` settings in one line, for the start-up summary.

    ``device_type`` (``"cpu"``, ``"cuda"``) resolves ``reduce_scatter`` and ``all_gather = "auto"`` to what
    runs. FSDP's own settings (reshard, prefetch, blocks per group, dtypes, reduce-scatter, all-gather) are
    named under ``fsdp`` only.
    A setting still ``"auto"`` (not chosen yet) is named by its fixed default (:mod:`shardlm.config.auto`).
    """
    fixed = {name: FIXED[f"parallel.{name}"] for name in ("activation_checkpoint", "reshard_after_forward",
                                                           "blocks_per_group")}
    ac, reshard, blocks = (fixed[n] if getattr(pcfg, n) == AUTO else getattr(pcfg, n) for n in fixed)
    common = f"activation checkpointing {ac}, compile {str(pcfg.compile).lower()}"
    if pcfg.mode != "fsdp":
        return common
    return (f"reshard after forward {str(reshard).lower() if isinstance(reshard, bool) else reshard}, "
            f"prefetch {pcfg.forward_prefetch}/{pcfg.backward_prefetch}, {blocks} block(s) "
            f"per group, {pcfg.param_dtype} compute / {pcfg.reduce_dtype} reduce, reduce-scatter "
            f"{resolve_reduce_scatter(pcfg.reduce_scatter, device_type, shared_memory)}, all-gather "
            f"{resolve_all_gather(pcfg.all_gather, device_type, shared_memory)}, {common}")


GRAD_SYNC_POLICIES = ("every_micro_batch", "last_micro_batch", "reduce_scatter_every_all_reduce_last")


def set_gradient_sync(model: nn.Module, last_micro_batch: bool, policy: str = "every_micro_batch") -> None:
    """Set how the next backward reduces gradients, for micro-batch accumulation.

    * ``every_micro_batch``: FSDP reduce-scatters after every micro-batch and accumulates sharded
      gradients (least memory, k times the reduce-scatters); DDP all-reduces every micro-batch.
    * ``last_micro_batch``: gradients accumulate unsharded and are reduced on the last micro-batch
      only (least communication): FSDP ``set_requires_gradient_sync``, DDP ``require_backward_grad_sync``.
    * ``reduce_scatter_every_all_reduce_last``: FSDP reduce-scatters every micro-batch but runs the
      cross-replica all-reduce of HSDP (a replicate mesh dimension) on the last only
      (``set_requires_all_reduce``); on a 1-D shard mesh it equals ``every_micro_batch``. DDP has
      only the all-reduce, so for DDP it equals ``last_micro_batch``.

    One process without a wrapper: nothing to do.

    Raises:
        ConfigError: unknown policy, naming ``parallel.grad_sync``.
    """
    if policy not in GRAD_SYNC_POLICIES:
        raise ConfigError(f"parallel.grad_sync: {policy!r} is not one of {list(GRAD_SYNC_POLICIES)}")
    if isinstance(model, FSDPModule):
        model.set_requires_gradient_sync(last_micro_batch or policy != "last_micro_batch")
        model.set_requires_all_reduce(last_micro_batch or policy == "every_micro_batch")
    elif isinstance(model, DistributedDataParallel):
        model.require_backward_grad_sync = last_micro_batch or policy == "every_micro_batch"
