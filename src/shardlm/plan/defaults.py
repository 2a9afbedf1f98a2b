"""The planner's choice of the settings a new run leaves ``"auto"`` (:mod:`shardlm.config.auto`), made once at
start-up by ``shardlm train`` (:func:`choose_defaults`, the chooser of :mod:`shardlm.train.defaults`) and
shown before launch by ``shardlm plan``, which plans the run with them.

The rule: the fastest setting whose planned step (:func:`shardlm.plan.memory.plan_memory`, the prepared
data's documents and the run's parallel layout included) fits the memory per rank, less 20% headroom
(:func:`shardlm.plan.tune_candidates.memory_budget`: the GPU's memory, or on a CPU the RAM available now over
the ranks), decided in this order, each with the earlier ones fixed:

1. ``parallel.activation_checkpoint``: ``none``, else ``selective``, else ``full`` (least recomputation);
2. ``parallel.reshard_after_forward`` (FSDP over more than one rank): ``false`` (no backward all-gather)
   when it fits, else ``true``;
3. ``parallel.blocks_per_group`` (FSDP over more than one rank): blocks grouped until a group holds about
   :data:`GROUP_BYTES` of parameters in the compute dtype (fewer, larger collectives: each has a fixed
   cost), halved until it fits;
4. ``train.loss_chunk_tokens``: one chunk of a micro-batch's tokens (rows × ``seq_len``) when its whole fp32
   logits are at most :data:`ONE_CHUNK_LOGITS_BYTES` and it fits, else 256. Either way the fused loss: the
   gradients are made in the forward, so neither the log-softmax nor the logits' gradient (each the size of
   the logits) is written, as the plain loss writes them; one chunk keeps its matrix products whole.

A run the planner cannot model keeps the fixed defaults, saying so. What was chosen and why is printed in the
run summary; a resumed run keeps its checkpoint's values; a value the user sets is never changed.
"""

from __future__ import annotations

import copy
import math
from typing import Any

import torch

from shardlm.config import Config, ConfigError
from shardlm.config.auto import FIXED, put
from shardlm.parallel.options import dtype_from_name
from shardlm.plan.memory import plan_memory
from shardlm.plan.param_groups import planner_model
from shardlm.plan.preference import preference_rows
from shardlm.plan.tune_candidates import memory_budget, size

#: a block group's parameters (compute dtype) past which grouping more blocks saves little: 64 MiB
GROUP_BYTES = 64 << 20
#: a micro-batch's whole fp32 logits at most this (64 MiB) make one chunk of the fused loss
ONE_CHUNK_LOGITS_BYTES = 64 << 20
#: the fraction of the memory per rank kept free
HEADROOM = 0.2


def choose_defaults(cfg: Config, keys: list[str], info: Any, budget_bytes: float | None = None,
                    device_name: str | None = None) -> dict[str, tuple[Any, str]]:
    """The values of ``keys`` (dotted, each ``"auto"`` in ``cfg``) for a new run on ``info``'s world size
    and device, with the reason of each (module docstring); ``cfg`` is not changed.

    Args:
        cfg: the run's config, data prepared (the planner reads its documents).
        keys: the fields to choose (a subset of :data:`shardlm.config.auto.FIXED`).
        info: a :class:`~shardlm.parallel.dist.DistInfo` (``world_size``, ``device``).
        budget_bytes: the usable memory per rank; None measures it (:func:`memory_budget`, 20% headroom).
        device_name: the planner's name of the device (:data:`shardlm.plan.devices.DEVICES`, ``cpu``), as
            ``shardlm plan --device`` gives it: its memory (a CPU's: the RAM available now over the ranks)
            instead of the memory of ``info``'s device; None: ``info``'s device (a GPU by its CUDA name).

    Raises:
        ConfigError: an unknown ``device_name``.
    """
    world, device = info.world_size, info.device.type
    if budget_bytes is None and device_name is not None:
        budget = memory_budget(device_name, world, HEADROOM, None)
        budget_bytes, plan_device = budget.bytes, budget.device
    elif budget_bytes is None:
        cuda = device == "cuda"
        budget = memory_budget("auto", world, HEADROOM, None,
                               torch.cuda.get_device_name(info.device) if cuda else None,
                               torch.cuda.get_device_properties(info.device).total_memory if cuda else 0)
        budget_bytes, plan_device = budget.bytes, budget.device
    else:
        plan_device = device_name or ("cpu" if device == "cpu" else "h100")
    trial = copy.deepcopy(cfg)
    for key in keys:
        put(trial, key, FIXED[key])
    p = trial.parallel
    sharded = p.mode == "fsdp" and world > 1

    def peak(c: Config) -> float | None:
        try:
            return plan_memory(preference_rows(c), world, plan_device).peak
        except ConfigError:
            return None

    base = peak(trial)
    if base is None:
        return {k: (FIXED[k], "auto: the fixed default (the planner cannot model this run)") for k in keys}
    of = f"of {size(budget_bytes)} per rank"
    out: dict[str, tuple[Any, str]] = {}

    def fits(key: str, value: Any) -> float | None:
        """The planned peak with ``key = value`` (kept in ``trial``) when it fits, else None (undone)."""
        before = getattr(getattr(trial, key.split(".")[0]), key.split(".")[1])
        put(trial, key, value)
        planned = peak(trial)
        if planned is not None and planned <= budget_bytes:
            return planned
        put(trial, key, before)
        return None

    if "parallel.activation_checkpoint" in keys:
        for mode in ("none", "selective", "full"):
            planned = fits("parallel.activation_checkpoint", mode)
            if planned is not None:
                out["parallel.activation_checkpoint"] = (
                    mode, f"auto: the least recomputation that fits (planned peak {size(planned)} {of})")
                break
        else:
            out["parallel.activation_checkpoint"] = ("full", f"auto: nothing fits {of}; full recomputes most")
            put(trial, "parallel.activation_checkpoint", "full")
    if "parallel.reshard_after_forward" in keys:
        planned = fits("parallel.reshard_after_forward", False) if sharded else None
        out["parallel.reshard_after_forward"] = (
            (False, f"auto: weights kept from forward to backward, no backward all-gather (planned peak "
                    f"{size(planned)} {of})") if planned is not None else
            (True, "auto: one rank or not FSDP, nothing to keep" if not sharded else
             f"auto: keeping the weights after forward does not fit {of}"))
    if "parallel.blocks_per_group" in keys:
        value, why = 1, "auto: one rank or not FSDP, grouping changes nothing"
        if sharded:
            layers = planner_model(trial).model.layers
            per_block = sum(q.numel() for q in layers.parameters()) / max(len(layers), 1)
            block_bytes = per_block * dtype_from_name("parallel.param_dtype", p.param_dtype).itemsize
            k = max(1, min(len(layers), math.ceil(GROUP_BYTES / max(block_bytes, 1))))
            while k > 1 and fits("parallel.blocks_per_group", k) is None:
                k //= 2
            value = k
            why = (f"auto: {k} of {len(layers)} blocks per FSDP group, {size(k * block_bytes)} of parameters "
                   f"per all-gather (grouped up to about {size(GROUP_BYTES)}: fewer, larger collectives)")
        put(trial, "parallel.blocks_per_group", value)
        out["parallel.blocks_per_group"] = (value, why)
    if "train.loss_chunk_tokens" in keys:
        tokens = preference_rows(trial).train.micro_batch_size * trial.train.seq_len
        logits = tokens * trial.model.vocab_size * 4
        planned = fits("train.loss_chunk_tokens", tokens) if logits <= ONE_CHUNK_LOGITS_BYTES else None
        out["train.loss_chunk_tokens"] = (
            (tokens, f"auto: one chunk, a micro-batch's {tokens:,} tokens (their fp32 logits {size(logits)}, "
                     f"at most {size(ONE_CHUNK_LOGITS_BYTES)})") if planned is not None else
            (256, f"auto: chunks of 256 tokens, a micro-batch's whole fp32 logits would be {size(logits)}"))
    return out
