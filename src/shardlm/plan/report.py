"""The report ``shardlm plan`` prints: memory breakdown, fit, what fits when it does not (:mod:`.search`), step time."""

from __future__ import annotations

import copy

from shardlm.config import Config
from shardlm.model.moe import inactive_expert_params
from shardlm.plan.devices import get_device
from shardlm.plan.memory import PARTS, MemoryPlan, meta_model, plan_memory
from shardlm.plan.search import format_fits, search
from shardlm.plan.time import plan_time

GIB = 1024**3
LABELS = {
    "params": "parameters (sharded fp32 + unsharded copies)",
    "grads": "gradients",
    "optimizer": "optimizer state (AdamW)",
    "all_gather": "all-gather buffers",
    "reduce_scatter": "reduce-scatter buffers (DDP: buckets)",
    "activations": "activations (saved for backward)",
    "temporaries": "temporaries (logits, fp32 log-softmax, grads)",
    "buffers": "buffers (RoPE tables)",
}


def _variant(cfg: Config, **changes: object) -> Config:
    out = copy.deepcopy(cfg)
    for dotted, value in changes.items():
        section, key = dotted.split("__")
        setattr(getattr(out, section), key, value)
    return out


def grad_sync_choices(cfg: Config, world_size: int, device_name: str, budget: float) -> list[str]:
    """Lines comparing the gradient-sync choices under accumulation: peak memory and communication of each.

    ``every_micro_batch`` keeps only gradient shards between micro-batches (k reduce-scatters per step);
    ``last_micro_batch`` keeps unsharded full-size gradients until the last micro-batch (one
    reduce-scatter); with HSDP (``dp_replicate`` != 1) ``reduce_scatter_every_all_reduce_last`` is shown too.
    The current setting is marked ``*``.
    """
    device = get_device(device_name)
    policies = ["every_micro_batch", "last_micro_batch"]
    if cfg.parallel.dp_replicate != 1 and cfg.parallel.mode == "fsdp":
        policies.append("reduce_scatter_every_all_reduce_last")
    lines = ["  gradient sync under accumulation (parallel.grad_sync):"]
    for policy in policies:
        variant = _variant(cfg, parallel__grad_sync=policy)
        mem = plan_memory(variant, world_size, device_name)
        t = plan_time(variant, world_size, device, mem.params)
        mark = "*" if policy == cfg.parallel.grad_sync else " "
        lines.append(f"   {mark}{policy:<37} peak {mem.peak / GIB:7.1f} GiB "
                     f"({'fits' if mem.peak <= budget else 'does not fit'}), communication "
                     f"{t.comm_bytes / GIB:8.2f} GiB/rank/step, {t.comm_s:.3f} s")
    return lines


def format_plan(cfg: Config, world_size: int, device_name: str, headroom: float) -> str:
    """The report ``shardlm plan`` prints."""
    device = get_device(device_name)
    plan: MemoryPlan = plan_memory(cfg, world_size, device_name)
    times = plan_time(cfg, world_size, device, plan.params)
    budget = device.memory_bytes * (1 - headroom)
    st = cfg.parallel
    active = plan.params - inactive_expert_params(meta_model(cfg))  # a mixture of experts: k of E per token
    lines = [
        f"plan | {cfg.run.name}: {plan.params:,} parameters"
        + (f" ({active:,} active per token, expert parallel {getattr(st, 'ep', 1)})" if active != plan.params else "")
        + f", {st.mode} at world size {world_size} on "
        f"{device.name} ({device.memory_bytes / GIB:.1f} GiB)",
        f"  micro-batch {cfg.train.micro_batch_size} x {cfg.train.seq_len} tokens, {plan.micro_batches} "
        f"micro-batch(es)/step; param_dtype {getattr(st, 'param_dtype', None) or 'float32'}, reduce_dtype "
        f"{getattr(st, 'reduce_dtype', None) or 'param_dtype'}; activation checkpointing "
        f"{getattr(st, 'activation_checkpoint', None) or 'none'}; cpu_offload {getattr(st, 'cpu_offload', False)}"
        + (f"; reshard_after_forward {str(st.reshard_after_forward).lower()}, {st.blocks_per_group} block(s) per "
           "FSDP group" if st.mode == "fsdp" else ""),
        f"  per-rank peak memory (at {plan.phase}):",
    ]
    for part in PARTS:
        lines.append(f"    {LABELS[part]:<48} {plan.breakdown.get(part, 0) / GIB:9.3f} GiB")
    lines.append(f"    {'total':<48} {plan.peak / GIB:9.3f} GiB")
    if plan.host_bytes:
        lines.append(f"    (in host memory, CPU offload: {plan.host_bytes / GIB:.3f} GiB)")
    fits = plan.peak <= budget
    lines.append(f"  {'fits' if fits else 'does not fit'}: {plan.peak / GIB:.1f} GiB of "
                 f"{budget / GIB:.1f} GiB usable ({headroom:.0%} kept for fragmentation)")
    if not fits:
        lines.extend(format_fits(search(cfg, world_size, device_name, budget)))
    if plan.micro_batches > 1 and st.mode != "single":
        lines.extend(grad_sync_choices(cfg, world_size, device_name, budget))
    lines += [
        f"  step time: compute {times.compute_s:.3f} s ({times.flops:.3e} FLOPs at the {times.precision} peak, "
        f"{times.peak_flops / 1e12:.0f} TFLOP/s), communication "
        f"{times.comm_s:.3f} s ({times.comm_bytes / GIB:.2f} GiB per rank)",
        f"             {times.overlapped_s:.3f} s fully overlapped, {times.serial_s:.3f} s serial (lower bounds: "
        "100% MFU)",
    ]
    return "\n".join(lines)


