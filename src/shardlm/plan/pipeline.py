"""The plan of a pipeline-parallel step (``parallel.pp`` > 1): each pipeline rank's peak memory, the
schedule's bubble and the bytes sent between stages.

A pipeline rank holds its stages' blocks (:func:`shardlm.parallel.pp.stage_plan`), the embedding on the first
stage, the final norm and output projection on the last, each FSDP-sharded over the world size / pp
data-parallel ranks of its stage (``shardlm/train/pipeline.py``). Its peak, per part of the breakdown:

- ``params``: its groups' fp32 shards plus every group unsharded in ``param_dtype``: the stage is its own FSDP
  root and PyTorch's stage defers resharding to the step's last backward, so after the first backward the
  stage's parameters stay gathered (an upper bound during a forward, which reshards blocks behind it under
  ``reshard_after_forward``);
- ``grads``: the unsharded gradients accumulated across the micro-batches (reduce-scattered once, at the last
  backward) in ``reduce_dtype``; ``optimizer``: AdamW's two fp32 moments of its shards and a step per tensor;
- ``activations``: what autograd saves per micro-batch (:mod:`shardlm.plan.activations`, the stage's blocks;
  the embedding's output on the first stage; on a stage before the last its output, kept by the stage for the
  backward unless a block counts it; on the last stage the final norm's and what the chunked loss keeps from
  its forward, :func:`shardlm.plan.loss.loss_events`), times the micro-batches in flight (:func:`in_flight`);
- ``buffers``: the RoPE tables and PyTorch's receive buffers: ``PipelineStage`` allocates, once, one
  activation buffer per micro-batch on every stage after the first and one gradient buffer per micro-batch on
  every stage before the last (``torch/distributed/pipelining/stage.py``, ``_setup_forward_recv_info`` and
  ``_create_grad_recv_info``), each ``micro_batch_size × seq_len × dim`` in ``param_dtype``;
- ``temporaries``: one block's backward high point (:func:`shardlm.plan.activations.block_backward_transient`;
  a fully checkpointed block's recomputed activations beside it) or, on the last stage, the loss's (chunk
  buffers, its backward).

Under tensor parallel (``parallel.tp`` > 1, the mesh ``pp × dp_shard × tp``) each group holds the rank's
tensor-parallel pieces (:func:`shardlm.plan.param_groups.tp_local_shape`: q/k/v, gate/up and the embedding
and output projection by rows, o/down by columns, norms whole), FSDP-sharded over the stage's world size /
(pp · tp) data-parallel ranks; the activations are sequence-parallel (:func:`shardlm.plan.activations.
block_saved_tp`: B / tp tokens between the blocks), a rank sends and receives its sequence shard (B × T / tp
× D per boundary per micro-batch, ``shardlm/train/pipeline.py``) and the last stage's loss is
vocabulary-parallel (:func:`shardlm.plan.loss.vocab_parallel_loss_events`).

The peak is the larger of two moments: the first backward (the in-flight micro-batches' activations, no
gradient yet) and, when the schedule runs a forward after a backward, the steady state (the same activations
and every gradient). Context and expert parallel and LoRA are refused with stages by
:func:`shardlm.config.layout.check_pp`; tensor parallel with selective or every-n checkpointing is not
modelled (refused by :func:`plan_pp_memory`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from shardlm.config import Config, ConfigError, gradient_accumulation_steps
from shardlm.config.auto import with_fixed_defaults
from shardlm.config.layout import VIRTUAL_STAGES, check_pp, check_tp
from shardlm.parallel.pp import stage_plan
from shardlm.plan import activations as act
from shardlm.plan.devices import get_device
from shardlm.plan.ledger import PARTS
from shardlm.plan.loss import vocab_parallel_loss_events
from shardlm.plan.memory import Settings
from shardlm.plan.param_groups import param_groups, planner_model
from shardlm.plan.time import fsdp_comm_bytes, plan_time, tp_comm_bytes


def in_flight(schedule: str, pp: int, micro_batches: int, rank: int) -> int:
    """The most (stage, micro-batch) forwards pipeline rank ``rank`` holds before their backward, under
    ``schedule`` at ``pp`` ranks and ``micro_batches`` per step; one unit is one of its stages' activations
    for one micro-batch.

    - ``gpipe``: every micro-batch (all forwards, then all backwards; Huang et al. 2019, GPipe);
    - ``1f1b``: ``min(m, pp - rank)`` (PipeDream-Flush, Narayanan et al. 2021 §2.2; PyTorch's
      ``Schedule1F1B`` warms up ``pp - rank`` forwards before its first backward);
    - ``interleaved_1f1b``: ``min(m·v, (v - 1)·r + 2·(pp - 1 - rank) + 1)`` with v = 2 stages per rank and
      r = m / max(1, m // pp) micro-batches per round (PyTorch's ``_get_warmup_ops`` plus the first 1F1B
      forward; Narayanan et al. 2021 §2.2 for the shape);
    - ``zbv``: ``2·pp`` on every rank; ``dualpipev``: ``2·pp``, ``2·pp + 1`` on the last rank.

    The last three are the action lists of torch 2.13's schedules counted (checked by
    tests/unit/test_plan_pipeline.py against ``_calculate_single_rank_operations``); of them, the last stage's
    are one at a time (its backward follows its forward), which :func:`plan_pp_memory` uses: a rank holding
    the last stage and another keeps the last stage's activations (the chunked loss's gradients among them)
    once and the other's for the rest.
    """
    m = micro_batches
    if schedule == "gpipe":
        return m
    if schedule == "1f1b":
        return min(m, pp - rank)
    v = VIRTUAL_STAGES[schedule]
    if schedule == "interleaved_1f1b":
        per_round = m // max(1, m // pp)
        return min(m * v, (v - 1) * per_round + 2 * (pp - 1 - rank) + 1)
    if schedule == "zbv":
        return min(m * v, 2 * pp)
    return min(m * v, 2 * pp + (rank == pp - 1))  # dualpipev


def bubble_fraction(schedule: str, pp: int, micro_batches: int) -> float:
    """The share of a step a pipeline rank idles, forward and backward of a stage taking equal time on every
    rank: ``(pp - 1) / (m + pp - 1)`` for ``gpipe`` and ``1f1b`` (Huang et al. 2019; Narayanan et al. 2021
    §2.2: bubble (pp - 1)·(t_f + t_b) against m·(t_f + t_b) of work), ``(pp - 1) / (v·m + pp - 1)`` with v = 2
    stages per rank for ``interleaved_1f1b`` (Narayanan et al. 2021 §2.2.1: the bubble shrinks by v). For
    ``zbv`` and ``dualpipev`` the same interleaved bound, an upper one: their split backward fills part of it
    with the weight gradients (Qi et al. 2024, zero bubble; DeepSeek-V3 report §3.2.1), which is not modelled.
    """
    v = VIRTUAL_STAGES[schedule]
    return (pp - 1) / (v * micro_batches + pp - 1)


@dataclass
class StageMemory:
    """One pipeline rank's predicted peak (bytes) and what it holds."""

    rank: int
    """Pipeline rank (the ``pp`` coordinate)."""
    stages: tuple[int, ...]
    layers: tuple[int, ...]
    """The blocks of its stages, in order."""
    params: int
    """Parameters it holds (whole, before FSDP sharding)."""
    in_flight: int
    """Micro-batch activations of its stages alive at most (:func:`in_flight`)."""
    peak: int
    breakdown: dict[str, int]
    phase: str
    sent_bytes: int
    """Bytes it sends to other pipeline ranks per step (activations forward, gradients backward)."""


def plan_pp_memory(cfg: Config, world_size: int, device: str = "cpu") -> list[StageMemory]:
    """Predict each pipeline rank's peak memory in one steady-state step of ``cfg`` (``parallel.pp`` > 1) at
    ``world_size`` ranks (see the module docstring for what is counted).

    Returns one :class:`StageMemory` per pipeline rank, first rank first (bytes; ranks of one stage are
    alike).

    Raises:
        ConfigError: a layout training refuses (:func:`shardlm.config.layout.check_pp`: stages that do not
            divide the blocks, too few micro-batches for the schedule, a setting not built with stages); HSDP
            (``parallel.dp_replicate`` != 1), not modelled with stages; tensor parallel that training refuses
            (:func:`shardlm.config.layout.check_tp`), on a world size pp · tp does not divide, or with
            selective or every-n checkpointing (not modelled).
    """
    cfg = with_fixed_defaults(cfg)
    p = cfg.parallel
    check_pp(cfg, world_size)
    if p.dp_replicate != 1:
        raise ConfigError(f"parallel.dp_replicate={p.dp_replicate} with parallel.pp={p.pp}: the pipeline "
                          "planner models each stage FSDP-sharded over all of its world size / pp ranks, "
                          "not HSDP")
    st = Settings.from_config(cfg)
    tp = p.tp
    check_tp(cfg.model, tp, cfg.train.seq_len, cfg.lora.enabled, p.cp)  # as training
    if tp > 1 and st.ac_mode not in act.TP_AC_MODES:
        raise ConfigError(f"parallel.tp={tp} with parallel.pp={p.pp}: the pipeline planner models tensor "
                          "parallel with parallel.activation_checkpoint none or full, not "
                          f"{st.ac_mode!r}")
    dp = stage_dp(world_size, p.pp, tp)
    k = gradient_accumulation_steps(cfg, dp)
    check_pp(cfg, world_size, k)
    pb, rb = st.param_bytes, st.reduce_bytes
    one = dataclasses.replace(cfg, parallel=dataclasses.replace(p, blocks_per_group=1))
    groups = {g.name: g for g in param_groups(one, dp, pb, tp)[0]}  # TP-local pieces over dp ranks
    model = planner_model(cfg)
    s = act.shape_of(cfg.model, cfg.train.micro_batch_size, cfg.train.seq_len, pb)
    bd = s.c * s.tokens // tp * s.d  # one hidden state sent or received: the rank's sequence shard
    fwd, bwd = vocab_parallel_loss_events(s.tokens, s.vocab, s.d, pb, cfg.train.loss_chunk_tokens, tp)
    loss_kept = sum(n for _, n, _ in fwd)  # what the loss keeps from its forward (chunked: gradients)
    alive, loss_high = 0, 0
    for _, n, _ in fwd + bwd:
        alive += n
        loss_high = max(loss_high, alive)
    out = []
    for rank in range(p.pp):
        plan = stage_plan(cfg.model.n_layers, p.pp, rank, p.pp_schedule, p.pp_layers_per_stage)
        layers = [i for sid in plan.stage_ids for i in plan.layers[sid]]
        names = [f"block{i}" for i in layers] + ["embed"] * plan.first + ["head"] * plan.last
        mine = [groups[n] for n in names]
        prefixes = tuple(f"model.layers.{i}." for i in layers) + ("model.embed_tokens.",) * plan.first + (
            "model.norm.", "lm_head.") * plan.last
        tensors = [q for n, q in model.named_parameters() if n.startswith(prefixes)]
        b = dict.fromkeys(PARTS, 0)
        b["params"] = sum(g.stored_shard_bytes + round(g.numel * pb * g.gather_factor) for g in mine)
        b["optimizer"] = sum(8 * g.grad_shard_numel for g in mine) + 4 * sum(q.requires_grad for q in tensors)
        receives = sum(sid > 0 for sid in plan.stage_ids)  # stages with an activation receive buffer
        sends = sum(sid < plan.n_stages - 1 for sid in plan.stage_ids)  # stages with a gradient one
        b["buffers"] = 2 * 4 * cfg.model.max_seq_len * s.hd + k * bd * (receives + sends)
        per_mb = []
        for sid in plan.stage_ids:
            saved = sum(act.block_saved_tp(s, tp, st.ac_mode) if tp > 1 else
                        act.block_saved(s, st.ac_mode, i, st.ac_every_n) for i in plan.layers[sid])
            if sid == 0:
                saved += act.embedding_saved(s, st.ac_mode) // tp  # on the local tokens under TP
            if sid == plan.n_stages - 1:
                saved += act.head_saved(s, st.ac_mode, tp) + loss_kept
            elif not (s.c == 4 and st.ac_mode == "none"):  # the output, unless its block saved it
                saved += bd
            per_mb.append(saved)
        flying = in_flight(p.pp_schedule, p.pp, k, rank)
        b["activations"] = flying * max(per_mb)
        if plan.last and len(per_mb) > 1:  # the last stage's backward follows its forward: one at a time
            b["activations"] = per_mb[-1 if plan.stage_ids[-1] == plan.n_stages - 1 else 0] + (flying - 1) * (
                max(x for x, sid in zip(per_mb, plan.stage_ids) if sid != plan.n_stages - 1))
        block_high = act.block_backward_transient_tp(s, tp) if tp > 1 else act.block_backward_transient(s)
        whole = act.block_saved_tp(s, tp, "none") if tp > 1 else act.block_saved_none(s)
        if any(act.fully_checkpointed(st.ac_mode, i, st.ac_every_n) for i in layers):  # its forward, again
            block_high += whole - s.c * s.tokens // tp * s.d  # beside the input it kept
        b["temporaries"] = max(block_high, loss_high - loss_kept if plan.last else 0)
        grads = sum(g.grad_numel for g in mine) * max(pb, rb)
        steady = k * len(plan.stage_ids) > flying  # a forward after a backward: every gradient exists
        first_grads = max(g.grad_numel for g in mine) * max(pb, rb)  # one group's, at the first backward
        b["grads"] = grads if steady else first_grads
        phase = "steady state: every gradient, the activations in flight" if steady else "first backward"
        sent = k * bd * (sends + receives)  # activations forward, their gradients back
        out.append(StageMemory(rank, plan.stage_ids, tuple(layers), sum(q.numel() for q in tensors), flying,
                               sum(b.values()), b, phase, sent))
    return out


def stage_dp(world_size: int, pp: int, tp: int) -> int:
    """The data-parallel (FSDP) ranks of one pipeline stage: ``world_size / (pp · tp)`` (the mesh
    ``pp × dp_shard × tp``, :func:`shardlm.parallel.dist.mesh_dims`).

    Raises:
        ConfigError: ``pp · tp`` does not divide ``world_size``.
    """
    if world_size % (pp * tp):
        raise ConfigError(f"parallel.pp={pp} x parallel.tp={tp} = {pp * tp} must divide the world size "
                          f"{world_size}")
    return world_size // (pp * tp)


def format_pp_plan(cfg: Config, world_size: int, device_name: str, headroom: float, model: str = "") -> str:
    """The report ``shardlm plan`` prints for a config with ``parallel.pp`` > 1: the layout, per pipeline rank
    its blocks, parameters, micro-batches in flight, peak and breakdown, the bubble, the bytes sent between
    stages, the step time (compute of the whole step spread over the ranks and stretched by the bubble;
    communication: FSDP's over each stage's data-parallel ranks and the stages' point-to-point sends), and the
    verdict."""
    cfg = with_fixed_defaults(cfg)
    device = get_device(device_name)
    p = cfg.parallel
    stages = plan_pp_memory(cfg, world_size, device_name)
    tp = p.tp
    dp = stage_dp(world_size, p.pp, tp)
    k = gradient_accumulation_steps(cfg, dp)
    bubble = bubble_fraction(p.pp_schedule, p.pp, k)
    budget = device.memory_bytes * (1 - headroom)
    gib = 1024**3
    total = sum(x.params for x in stages)
    flat = dataclasses.replace(cfg, parallel=dataclasses.replace(p, pp=1))
    t = plan_time(flat, world_size, device, total)  # compute per rank: the step's FLOPs over all ranks
    compute = t.compute_s / (1 - bubble)
    fsdp = max(t_stage_comm(cfg, dp, x.params / tp) for x in stages)  # each rank's TP pieces (P / tp)
    p2p = max(x.sent_bytes for x in stages)
    tokens = k * cfg.train.micro_batch_size * cfg.train.seq_len  # per data-parallel rank per step
    tp_bytes = max(tp_comm_bytes(tp, len(x.layers), tokens, cfg.model.dim,
                                 Settings.from_config(cfg).param_bytes,
                                 p.activation_checkpoint == "full") for x in stages)
    comm_s = fsdp / device.bandwidth(dp * tp) if dp > 1 else 0.0  # a stage's FSDP group: dp ranks tp apart
    comm_s += p2p / device.inter_node_bw + (tp_bytes / device.bandwidth(tp) if tp > 1 else 0.0)
    lines = [
        f"plan | {model + f' with the settings of {cfg.run.name}' if model else cfg.run.name}: {total:,} "
        f"parameters, fsdp x pipeline parallel at world size {world_size} on {device.name} "
        f"({device.memory_bytes / gib:.1f} GiB)",
        f"  layout     mesh pp {p.pp} x dp_shard {dp}{f' x tp {tp}' if tp > 1 else ''}: schedule "
        f"{p.pp_schedule}, "
        f"{len(stages[0].stages) * p.pp} stages, {k} micro-batches of {cfg.train.micro_batch_size} x "
        f"{cfg.train.seq_len} tokens per step; param_dtype {p.param_dtype or 'float32'}, activation "
        f"checkpointing {p.activation_checkpoint}",
        f"  bubble     {bubble:.1%} of the step idle ({bubble_rule(p.pp_schedule)})",
        "  per pipeline rank (GiB):",
        "    rank  stages  blocks     parameters  in flight   params    grads  optimizer  activations"
        "  buffers  temporaries     peak",
    ]
    shown = stages if len(stages) <= 8 else [*stages[:3], None, *stages[-3:]]  # the middle ranks are alike
    for x in shown:
        if x is None:
            lines.append(f"    {'...':>4}")
            continue
        b = x.breakdown
        blocks = f"{x.layers[0]}-{x.layers[-1]}" if len(x.stages) == 1 else f"{len(x.layers)} blocks"
        lines.append(f"    {x.rank:>4}  {','.join(map(str, x.stages)):>6}  {blocks:>6}  {x.params:>13,}  "
                     f"{x.in_flight:>9}  {b['params'] / gib:7.2f}  {b['grads'] / gib:7.2f}  "
                     f"{b['optimizer'] / gib:9.2f}  {b['activations'] / gib:11.2f}  "
                     f"{b['buffers'] / gib:7.2f}  "
                     f"{b['temporaries'] / gib:11.2f}  {x.peak / gib:7.2f}")
    worst = max(stages, key=lambda x: x.peak)
    lines += [
        f"  point-to-point: {p2p / gib:.2f} GiB sent per rank per step at most (each micro-batch's hidden "
        "states forward, their gradients back)",
        f"  step time: compute {compute:.3f} s ({t.compute_s:.3f} s of FLOPs at the {t.precision} peak, "
        f"stretched by the bubble), communication {comm_s:.3f} s (FSDP over {dp} rank(s) "
        f"{fsdp / gib:.2f} GiB, point-to-point at the inter-node bandwidth"
        f"{', tensor parallel' if tp > 1 else ''})",
        *([f"             tensor parallel {tp_bytes / gib:.2f} GiB per rank on its {tp} ranks' links "
            "(the blocks' all-gathers and reduce-scatters)"] if tp > 1 else []),
        f"             {max(compute, comm_s):.3f} s fully overlapped, {compute + comm_s:.3f} s serial "
        f"(lower bounds: 100% MFU); "
        + ("compute-bound: compute outlasts communication" if compute >= comm_s else
           "communication-bound: communication outlasts compute"),
    ]
    if p.pp_schedule in UNDER_PREDICTED:
        lines.append(f"  note: {UNDER_PREDICTED[p.pp_schedule]}")
    fits = worst.peak <= budget
    lines.append(f"  {'fits' if fits else 'does not fit'}: {worst.peak / gib:.1f} GiB on pipeline rank "
                 f"{worst.rank} ({worst.phase}) of {budget / gib:.1f} GiB usable ({headroom:.0%} kept for "
                 "fragmentation)")
    return "\n".join(lines)


#: the schedules whose measured peaks exceed this plan by more than its 10 % (bench/bench_pp.py, PP 4 and
#: PP 2 x FSDP 2 of 8 blocks, fp32, CPU), and what is missing
UNDER_PREDICTED = {
    "interleaved_1f1b": "measured up to 12% above this plan on the ranks after the first (bench/bench_pp.py)",
    "zbv": "measured up to 40% above this plan (bench/bench_pp.py, the first rank): the split backward keeps "
           "each micro-batch's output gradients from its input part to its weight part, not modelled",
    "dualpipev": "measured up to 32% above this plan (bench/bench_pp.py, the first rank): the split backward "
                 "keeps each micro-batch's output gradients from its input part to its weight part, not "
                 "modelled",
}


def bubble_rule(schedule: str) -> str:
    """The formula behind :func:`bubble_fraction` for ``schedule``, as the report names it."""
    if schedule in ("gpipe", "1f1b"):
        return "(pp - 1) / (m + pp - 1)"
    if schedule == "interleaved_1f1b":
        return "(pp - 1) / (2m + pp - 1), 2 stages per rank"
    return "at most (pp - 1) / (2m + pp - 1): the interleaved bound; the split backward fills part of it"


def t_stage_comm(cfg: Config, dp: int, params: int) -> float:
    """Bytes one rank sends per step in FSDP's collectives over its stage's ``dp`` ranks for ``params``
    parameters (:func:`shardlm.plan.time.fsdp_comm_bytes`), the gradients reduce-scattered once (deferred to
    the last backward). PyTorch's stage keeps the parameters gathered after each backward until the last: with
    ``reshard_after_forward`` they are all-gathered for each micro-batch's forward and again for its backward
    (at most, 2·k times), without it once a step."""
    st = Settings.from_config(cfg)
    k = gradient_accumulation_steps(cfg, dp) if st.reshard_after_forward else 1
    return fsdp_comm_bytes(dp, params, k, st.reshard_after_forward, False, st.param_bytes, st.reduce_bytes)
