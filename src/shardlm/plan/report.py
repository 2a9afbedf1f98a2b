"""The report ``shardlm plan`` prints: memory breakdown, fit, what fits when it does not (:mod:`.search`),
step time."""

from __future__ import annotations

import copy

from shardlm.config import Config
from shardlm.config.auto import with_fixed_defaults
from shardlm.metrics.memory import format_bytes
from shardlm.model.moe import inactive_expert_params
from shardlm.parallel.cp import padded_length
from shardlm.parallel.dist import mesh_dims
from shardlm.plan.devices import get_device
from shardlm.plan.documents import document_mask_bytes, document_shape, has_documents
from shardlm.plan.ledger import PARTS, MemoryPlan
from shardlm.plan.memory import Settings, plan_memory
from shardlm.plan.param_groups import meta_model
from shardlm.plan.rollout import format_rollout, plan_rollout
from shardlm.plan.search import format_fits, search
from shardlm.plan.time import TimePlan, plan_time
from shardlm.train.defaults import DefaultChoice, describe_defaults

GIB = 1024**3
LABELS = {
    "params": "parameters (sharded fp32 + unsharded copies)",
    "grads": "gradients",
    "optimizer": "optimizer state (AdamW)",
    "all_gather": "all-gather buffers",
    "reduce_scatter": "reduce-scatter buffers (DDP: buckets)",
    "activations": "activations (saved for backward)",
    "temporaries": "temporaries (loss, backward transients)",  # the loss's part: loss_label()
    "buffers": "buffers (RoPE tables)",
    "reference": "preference reference (frozen model / table)",
    "rollout": "rollout (KV cache and prefill, or the exact forward)",
}
#: the ``reference`` part's label under online RL
RL_REFERENCE_LABEL = "RL reference (frozen model)"
#: the ``reference`` part's label under distillation
TEACHER_LABEL = "distillation teacher (frozen model)"


def loss_label(chunk_tokens: int) -> str:
    """The temporaries row's label for ``train.loss_chunk_tokens``: what the loss's part of it holds
    (:mod:`shardlm.plan.loss`)."""
    if chunk_tokens == 0:
        return "temporaries (whole logits, log-softmax, grads)"
    return f"temporaries (loss in {chunk_tokens}-token chunks, backward)"


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


def document_lines(cfg: Config, world_size: int, device_name: str, step_flops: float) -> list[str]:
    """The report's lines on packing and block-causal attention (:mod:`shardlm.plan.documents`): the tokens of
    a step that are not padding, its trained tokens, the attention context the FLOPs count, the
    mask's memory."""
    if not (cfg.data.format == "instruct" or has_documents(cfg)):
        return []
    shape = document_shape(cfg)
    t = cfg.train
    row = t.seq_len + 1
    lines = [f"  data ({shape.source}): {t.global_batch_size * row * shape.fill:,.0f} of "
             f"{t.global_batch_size * row:,} tokens per step are examples' or documents' (fill "
             f"{100 * shape.fill:.1f}%), {t.global_batch_size * shape.targets:,.0f} trained"
             + ("; data.pack = true would put several examples in a row" if cfg.data.format == "instruct"
                and not cfg.data.pack and shape.samples else "")]
    if has_documents(cfg):
        causal = _variant(cfg, model__attention="causal")
        ratio = step_flops / plan_time(causal, world_size, get_device(device_name), 0).flops
        pb = Settings.from_config(cfg).param_bytes if cfg.parallel.mode == "fsdp" else 4  # as plan_memory
        mask = document_mask_bytes(cfg, pb, device_name)
        lines.append(f"  block-causal attention: context {shape.context:,.1f} of {t.seq_len} tokens per "
                     f"sequence (Σ n² / T), step FLOPs {ratio:.3f}x causal's; dense mask "
                     f"{format_bytes(mask)} per micro-batch (in activations)")
    return lines


def part_applies(cfg: Config, part: str) -> bool:
    """Whether the breakdown's ``part`` (:data:`shardlm.plan.ledger.PARTS`) exists in a run of ``cfg``: the
    all-gather buffers under FSDP, the reduce-scatter buffers (DDP's buckets) with more than one process,
    the reference with preference tuning; the rest always."""
    needs = {"all_gather": cfg.parallel.mode == "fsdp", "reduce_scatter": cfg.parallel.mode != "single",
             "reference": cfg.data.format == "preference", "rollout": cfg.data.format == "prompts"}
    return needs.get(part, True)


def format_plan(cfg: Config, world_size: int, device_name: str, headroom: float, model: str = "",
                notes: list[str] | None = None, auto: list[DefaultChoice] | None = None) -> str:
    """The report ``shardlm plan`` prints: what is planned, the memory breakdown (the rows that apply to the
    run, :func:`part_applies`; a 0 in one says the part holds nothing at the peak's moment), the gradient-sync
    choices, the data, the step time, ``notes`` (lines), and last the verdict (fits / does not fit) followed,
    when it does not fit, by the combinations that do.

    ``model``: the name of the model shape planned when it is not the config's own (``--model-preset NAME``,
    ``--model-config FILE``); the first line then names it and the config whose settings it runs under.
    ``auto``: the settings a new run would choose for those left ``"auto"`` (already resolved in ``cfg``),
    printed after the settings line as the run's summary prints them; the combinations that fit carry them
    as flags (unless a combination sets one itself), so that passed back they plan as printed instead of
    being chosen again.
    """
    cfg = with_fixed_defaults(cfg)  # "auto" settings not chosen yet: their fixed defaults
    device = get_device(device_name)
    plan: MemoryPlan = plan_memory(cfg, world_size, device_name)
    times = plan_time(cfg, world_size, device, plan.params)
    budget = device.memory_bytes * (1 - headroom)
    st = cfg.parallel
    active = plan.params - inactive_expert_params(meta_model(cfg))  # a mixture of experts: k of E per token
    lines = [
        f"plan | {model + f' with the settings of {cfg.run.name}' if model else cfg.run.name}: "
        f"{plan.params:,} parameters"
        + (
            f" ({active:,} active per token, expert parallel {getattr(st, 'ep', 1)})"
            if active != plan.params
            else ""
        )
        + f", {st.mode} at world size {world_size} on "
        f"{device.name} ({device.memory_bytes / GIB:.1f} GiB)",
        f"  micro-batch {cfg.train.micro_batch_size} x {cfg.train.seq_len} tokens, {plan.micro_batches} "
        f"micro-batch(es)/step; param_dtype {getattr(st, 'param_dtype', None) or 'float32'}, reduce_dtype "
        f"{getattr(st, 'reduce_dtype', None) or 'param_dtype'}; activation checkpointing "
        f"{getattr(st, 'activation_checkpoint', None) or 'none'}; CPU offload "
        f"{'on' if getattr(st, 'cpu_offload', False) else 'off'}"
        + (
            f"; reshard_after_forward {str(st.reshard_after_forward).lower()}, {st.blocks_per_group} "
            "block(s) per FSDP group"
            if st.mode == "fsdp"
            else ""
        )
        + (
            f"; context parallel {st.cp}: each sequence split over {st.cp} ranks, "
            f"{padded_length(cfg.train.seq_len, st.cp) // st.cp:,} tokens per rank"
            if st.cp > 1
            else ""
        )
        + (
            f" ({padded_length(cfg.train.seq_len, st.cp) // (st.cp * st.tp):,} between the blocks: sequence "
            f"parallel over tp {st.tp})"
            if st.cp > 1 and st.tp > 1
            else ""
        ),
        *[f"  auto       {line}" for line in describe_defaults(auto or [])],
        f"  per-rank peak memory (at {plan.phase}):",
    ]
    if st.mode == "fsdp" and st.tp > 1:  # the mesh, outermost first (parallel/dist.py's mesh_dims)
        dims = mesh_dims(st, world_size, world_size)
        lines.insert(
            2,
            "  layout     mesh " + " x ".join(f"{name} {size}" for name, size in dims) + f": tensor "
            f"parallel {st.tp} (q/k/v, gate/up by columns, o/down by rows, vocabulary-parallel embedding, "
            "output and loss, sequence-parallel norms), FSDP over the data-parallel dimensions",
        )
    for part in PARTS:
        label = loss_label(cfg.train.loss_chunk_tokens) if part == "temporaries" else LABELS[part]
        if part == "reference" and (cfg.distill.teacher_from or cfg.data.format == "prompts"):
            label = TEACHER_LABEL if cfg.distill.teacher_from else RL_REFERENCE_LABEL
        if part_applies(cfg, part) or plan.breakdown.get(part, 0):  # a row with bytes always
            lines.append(f"    {label:<48} {plan.breakdown.get(part, 0) / GIB:9.3f} GiB")
    lines.append(f"    {'total':<48} {plan.peak / GIB:9.3f} GiB")
    if cfg.model.backend == "transformers":  # parameters counted from its model; activations are not
        lines.append("    (model.backend = 'transformers': parameters counted from its model; activations an "
                     "estimate, the native decoder's formula at its width, layers and heads)")
    if plan.host_bytes:
        lines.append(f"    (in host memory, CPU offload: {plan.host_bytes / GIB:.3f} GiB)")
    if plan.micro_batches > 1 and st.mode != "single":
        lines.extend(grad_sync_choices(cfg, world_size, device_name, budget))
    lines += document_lines(cfg, world_size, device_name, times.flops)
    lines += [
        f"  step time: compute {times.compute_s:.3f} s ({times.flops:.3e} FLOPs at the {times.precision} "
        f"peak, {times.peak_flops / 1e12:.0f} TFLOP/s{float8_part(times)}), communication "
        f"{times.comm_s:.3f} s ({times.comm_bytes / GIB:.2f} GiB per rank)",
        f"             {times.overlapped_s:.3f} s fully overlapped, {times.serial_s:.3f} s serial (lower "
        "bounds: 100% MFU)",
        *(format_rollout(plan_rollout(cfg, world_size, device), times.compute_s, plan.highs.get("rollout", 0),
                         plan.peak)
          if cfg.data.format == "prompts" else []),
        *(notes or []),
    ]
    fits = plan.peak <= budget  # the verdict last, where the reader ends, then what to change
    lines.append(f"  {'fits' if fits else 'does not fit'}: {plan.peak / GIB:.1f} GiB of "
                 f"{budget / GIB:.1f} GiB usable ({headroom:.0%} kept for fragmentation)")
    if not fits:
        found = search(cfg, world_size, device_name, budget)
        for f in found:  # the auto settings as planned, pinned
            given = {flag.split("=")[0] for flag in " ".join(f.flags).split()}
            f.flags += [flag for flag in auto_flags(auto or []) if flag.split("=")[0] not in given]
        lines.extend(format_fits(found))
    return "\n".join(lines)




def auto_flags(choices: list[DefaultChoice]) -> list[str]:
    """``--key=value`` for each setting chosen for ``"auto"`` (booleans in TOML's lower case)."""
    return [f"--{c.key}={str(c.value).lower() if isinstance(c.value, bool) else c.value}" for c in choices]


def float8_part(times: TimePlan) -> str:
    """The float8 share of a step's compute, for the step-time line: ``; 1.2e12 of them float8 GEMMs at 1979
    TFLOP/s`` (empty without float8 GEMMs)."""
    if not times.float8_flops:
        return ""
    return (f"; {times.float8_flops:.3e} of them float8 GEMMs at {times.peak_flops_fp8 / 1e12:.0f} TFLOP/s, "
            "MFU still stated against the bf16 peak as torchtitan does")
