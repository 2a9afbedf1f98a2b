"""Per-rank peak memory of one training step, predicted by replaying the step's allocations.

The planner walks one optimizer step in the order :meth:`shardlm.train.trainer.Trainer.train_step` runs
it (micro-batch forward group by group, loss, backward group by group, clip, AdamW) and keeps a
ledger of the bytes alive in each category: parameters (sharded fp32 masters + unsharded copies),
gradients, optimizer state, all-gather and reduce-scatter buffers (DDP: its all-reduce buckets),
activations (what autograd saves, :mod:`shardlm.plan.activations`; with block-causal attention the dense
mask, :func:`shardlm.plan.documents.document_mask_bytes`) and temporaries (the loss's, by
``train.loss_chunk_tokens``, :mod:`shardlm.plan.loss`: the whole logits, their fp32 copy, log-softmax and
gradients, or one chunk's logits and the fp32 output-weight gradient). The peak is the largest total; the
breakdown is the ledger at that moment.

FSDP2 behaviour modelled (``torch.distributed.fsdp``, torch 2.13): one all-gather buffer per group
(N × padded local shard, the input is a slice of it) copied out into unsharded parameters in
``param_dtype``; blocks and the embedding are resharded after forward when ``reshard_after_forward``,
the final-norm+output group and the root never are; gradients are reduce-scattered in
``reduce_dtype`` from a flat buffer into the sharded fp32 gradient; with gradient sync off
(all but the last micro-batch) the unsharded gradients are kept (in ``reduce_dtype``) until the
last micro-batch. Each parameter's shard is ``ceil(rows / N)`` rows (dim-0 padding).

Frozen parameters (``train.trainable``/``train.frozen``, or LoRA's base) have no gradient, no reduce-scatter
and no AdamW state; a LoRA base is stored in ``lora.base_dtype`` (fp32 or bf16: the targeted layers' weights;
NF4: every frozen weight matrix, the token embedding and output projection included, at ~0.52 bytes per value,
all-gathered as such and dequantised one layer at a time, a transient not modelled; norms stay fp32).

Preference tuning and online RL (:mod:`shardlm.plan.preference`): the reference's bytes are the
``reference`` part; a frozen reference model's no-grad forward is replayed at the start of each micro-batch,
LoRA's base (the policy with its adapters off) as the policy's own no-grad forward. Online RL's rollout is
replayed before the first micro-batch (:mod:`shardlm.plan.rollout`: the ``rollout`` part).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import torch

from shardlm.config import Config, ConfigError, gradient_accumulation_steps
from shardlm.config.auto import with_fixed_defaults
from shardlm.config.layout import check_ep, check_tp
from shardlm.model.cpu_matmul import use_fp32_matmul
from shardlm.parallel.cp import padded_length
from shardlm.parallel.options import dtype_from_name
from shardlm.parallel.reduce_scatter import resolve_reduce_scatter
from shardlm.parallel.shared_memory import shared_memory_fits
from shardlm.plan import activations as act
from shardlm.plan.context_parallel import (
    cp_backward_transient,
    cp_block_extra_saved,
    cp_forward_saved,
    cp_is_blockwise,
    tp_local_heads,
)
from shardlm.plan.documents import document_mask_bytes, has_documents
from shardlm.plan.ledger import PARTS, Ledger, MemoryPlan
from shardlm.plan.loss import rl_head_events, vocab_parallel_loss_events
from shardlm.plan.moe import all_to_all_transient, moe_layer_saved
from shardlm.plan.param_groups import Group, block_group_name, meta_model, param_groups, planner_model
from shardlm.plan.preference import (
    distill_loss_bytes,
    frozen_forward,
    frozen_model_config,
    no_grad_block_bytes,
    no_grad_head_bytes,
    reference_memory,
)
from shardlm.plan.rollout import replay_rollout

__all__ = ["PARTS", "Group", "MemoryPlan", "Settings", "meta_model", "param_groups", "plan_memory"]

@dataclass
class Settings:
    """The parallel settings the memory depends on, read from ``cfg.parallel`` with defaults."""

    mode: str
    param_bytes: int
    reduce_bytes: int
    reshard_after_forward: bool
    cpu_offload: bool
    ac_mode: str
    ac_every_n: int
    grad_sync: str

    @classmethod
    def from_config(cls, cfg: Config) -> Settings:
        """Read the fields (absent ones take FSDP2's defaults: fp32, reshard, no offload, no AC)."""
        p = cfg.parallel
        param_bytes = dtype_from_name("parallel.param_dtype", p.param_dtype).itemsize
        reduce_bytes = dtype_from_name("parallel.reduce_dtype", p.reduce_dtype).itemsize
        if not isinstance(p.reshard_after_forward, bool):
            raise ConfigError(f"parallel.reshard_after_forward={p.reshard_after_forward}: the planner models "
                              "true and false, not an N-way reshard; plan with either (N-way lies between "
                              "them)")
        return cls(p.mode, param_bytes, reduce_bytes, p.reshard_after_forward, p.cpu_offload,
                   p.activation_checkpoint, p.activation_checkpoint_n, p.grad_sync)


def plan_memory(cfg: Config, world_size: int, device: str = "cpu") -> MemoryPlan:
    """Predict this config's per-rank peak memory for one steady-state step at ``world_size`` ranks.

    Args:
        cfg: the run's configuration (model, micro-batch, sequence length, parallel settings); preference data
            (``data.format = "preference"``) with its batch sizes in rows,
            :func:`shardlm.plan.preference.preference_rows`: then the reference is in the peak (its
            ``reference`` part) and the log-probs' head projects the completions' tokens only.
        world_size: N, ranks in the shard group (FSDP) or replicas (DDP); must be 1 for ``single``. Under
            ``parallel.cp`` the shard group is all N ranks and N / cp of them are data-parallel; each rank's
            activations are those of its ``T_pad / cp`` tokens (:mod:`shardlm.plan.context_parallel`).
        device: ``cpu`` or a GPU name; only decides whether CPU offload moves state off the device.

    Returns:
        A :class:`MemoryPlan` (bytes).

    Raises:
        ConfigError: bad world size (or one ``parallel.cp`` does not divide), global batch not divisible,
            unknown dtype or AC mode; an expert- or tensor-parallel layout the trainer refuses
            (:func:`shardlm.config.layout.check_ep`, :func:`~shardlm.config.layout.check_tp`); tensor parallel
            on a world size it does not divide or with selective / every-n checkpointing (not modelled).
    """
    cfg = with_fixed_defaults(cfg)  # "auto" settings not chosen yet: their fixed defaults
    st = Settings.from_config(cfg)
    tp = cfg.parallel.tp
    check_tp(cfg.model, tp, cfg.train.seq_len, cfg.lora.enabled, cfg.parallel.cp)  # as training
    if tp > 1 and (world_size % tp or st.ac_mode not in act.TP_AC_MODES):
        raise ConfigError(f"parallel.tp={tp}: the memory planner models tensor parallel on a world size it "
                          f"divides (got {world_size}) with parallel.activation_checkpoint none or full (got "
                          f"{st.ac_mode!r})")
    if world_size < 1:
        raise ConfigError(f"--world-size must be >= 1, got {world_size}")
    if st.mode == "single" and world_size != 1:
        raise ConfigError(f"parallel.mode='single' runs one process, but the world size is {world_size}")
    # context parallel: a sequence over cp ranks, each with t_l = T_pad / cp of its tokens
    cp = cfg.parallel.cp
    if world_size % (cp * tp):
        inner = f"parallel.cp={cp} × parallel.tp={tp} = {cp * tp}" if tp > 1 else f"parallel.cp={cp}"
        raise ConfigError(f"{inner} must divide the world size {world_size}")
    k = gradient_accumulation_steps(cfg, world_size // (cp * tp))
    fsdp = st.mode == "fsdp"
    n = world_size // tp if fsdp else 1  # FSDP's shard group: the data-parallel ranks
    pb = st.param_bytes if fsdp else 4
    groups, p_total, _ = param_groups(cfg, n, pb, tp)
    train_local = sum(g.grad_shard_numel for g in groups)
    train_frac = sum(g.grad_numel for g in groups) / p_total  # for the unsharded (DDP, one process) gradients
    rb = st.reduce_bytes if fsdp else 4
    shm = shared_memory_fits(p_total, n)  # then the reduce-scatter's input is a /dev/shm slot, not allocated
    reduce_scatter = resolve_reduce_scatter(cfg.parallel.reduce_scatter, "cpu" if device == "cpu" else "cuda",
                                            shm) if fsdp and n > 1 else "native"
    all_to_all = reduce_scatter == "all_to_all"
    rs_input_bytes = 0 if reduce_scatter == "shared_memory" else n * rb
    t_pad = padded_length(cfg.train.seq_len, cp)
    s = act.shape_of(cfg.model, cfg.train.micro_batch_size, t_pad // cp, pb)
    windows = {cfg.model.sliding_window if cfg.model.is_local(i) else 0 for i in range(s.n_layers)}
    # CP's masked path (documents or a window shorter than the sequence), else its causal one
    # (plan/context_parallel.py)
    cp_dense = has_documents(cfg) or any(0 < w < cfg.train.seq_len for w in windows)
    cp_blockwise, cp_docs = cp_is_blockwise(device), has_documents(cfg)
    s_cp = tp_local_heads(s, tp)  # CP's attention on a TP rank's heads, over the CP share's tokens
    cp_block = cp_block_extra_saved(s_cp, t_pad, cp_dense, cp_blockwise) if cp > 1 else 0
    cp_windows = len(windows) if cp_dense else 0
    cp_forward = cp_forward_saved(s_cp, t_pad, cp_windows, cp_blockwise, cp_docs) if cp > 1 else 0
    cp_transient = cp_backward_transient(s_cp, t_pad, cp_blockwise) if cp > 1 else 0
    # a MoE layer's router, sorted token copies and, under EP, all-to-all buffers (plan/moe.py)
    ep = getattr(cfg.parallel, "ep", 1)
    check_ep(cfg.model.n_experts, ep, world_size, st.mode, cfg.parallel.dp_replicate)  # as training refuses
    is_moe = [cfg.model.is_moe_layer(i) for i in range(s.n_layers)]
    moe_saved = [moe_layer_saved(s, cfg.model, ep) if m else 0 for m in is_moe]
    moe_a2a = [all_to_all_transient(s, cfg.model, ep) if m else 0 for m in is_moe]
    softcap = cfg.model.final_logit_softcap > 0
    fp32_matmul = pb == 2 and device == "cpu" and use_fp32_matmul(cfg.parallel.cpu_bf16_matmul,
                                                                  torch.device("cpu"),
                                                                  cfg.parallel.param_dtype)
    head_trains = meta_model(cfg).lm_head.weight.requires_grad
    # block-causal: sdpa's dense mask, forward to backward (under CP its own masks are in cp_forward)
    mask_bytes = document_mask_bytes(cfg, pb, device) if cp == 1 else 0
    bd = s.tokens * s.d
    # the embedding output the first block keeps (fp32, no checkpointing): on the local tokens under TP
    embed_saved = act.embedding_saved(s, st.ac_mode) // tp
    offload = st.cpu_offload and fsdp and device != "cpu"
    led = Ledger({"host"})
    state_part = "host" if offload else None
    # ---- persistent state at step start ------------------------------------------------------
    n_tensors = sum(1 for p in planner_model(cfg).parameters() if p.requires_grad)
    stored = sum(g.stored_shard_bytes for g in groups)
    led.add(state_part or "params", stored, "step start")
    # exp_avg, exp_avg_sq, step
    led.add(state_part or "optimizer", 2 * 4 * train_local + 4 * n_tensors, "step start")
    led.add("buffers", 2 * 4 * cfg.model.max_seq_len * s.hd, "step start")  # rotary cos, sin tables
    if st.mode == "ddp":
        led.add("reduce_scatter", round(4 * p_total * train_frac), "step start")  # DDP's all-reduce buckets
    # ---- preference tuning's reference (plan/preference.py): a frozen model's shards, and the groups FSDP2
    # leaves unsharded after its no-grad forward (the root's, the final norm + output's; every group without
    # resharding) --
    ref = reference_memory(cfg)
    ref_groups: list[Group] = []
    ref_stored = 0
    if ref.live_model:
        ref_cfg = frozen_model_config(cfg)  # the reference's, or the distillation teacher's
        ref_groups = param_groups(ref_cfg, n, pb, tp)[0]
        ref_s = act.shape_of(ref_cfg.model, cfg.train.micro_batch_size, t_pad // cp, pb)
        ref_stored = sum(g.stored_shard_bytes for g in ref_groups)
        # built with the policy's offload
        led.add("host" if offload else "reference", ref_stored, "step start")
        # its own RoPE tables
        led.add("reference", 2 * 4 * ref_cfg.model.max_seq_len * ref_s.hd, "step start")
        if fsdp:
            led.add("reference", sum(round(g.numel * pb * g.gather_factor) for g in ref_groups
                                     if g.name in ("root", "head") or not st.reshard_after_forward),
                    "step start")
    led.add("reference", ref.table_bytes, "step start")
    if cfg.data.format == "prompts":  # online RL: the rollout, before the micro-batches (plan/rollout.py)
        replay_rollout(led, cfg, world_size, groups, n, fsdp)

    unsharded: dict[str, bool] = {}
    prefetched: dict[str, int] = {}  # group -> bytes of its all-gather buffer awaiting copy-out
    accumulated: dict[str, bool] = {}
    # group -> its fp32 gradient shard exists (after its first reduce-scatter)
    sharded_grad: dict[str, bool] = {}
    retained_rs = [0]  # the last reduce-scatter input, kept alive until the next one (FSDP2 keeps 1)

    def all_gather(g: Group, phase: str) -> None:
        """Issue the group's all-gather: the flat output buffer (the input is a slice of it)."""
        if offload:
            led.add("all_gather", 4 * g.shard_numel, phase)  # host-to-device copy of the shard
        led.add("all_gather", round(n * g.shard_numel * pb * g.gather_factor), phase)
        prefetched[g.name] = round(n * g.shard_numel * pb * g.gather_factor) + (
            4 * g.shard_numel if offload else 0
        )

    def unshard(g: Group, phase: str) -> None:
        """All-gather (unless prefetched), copy out into unsharded parameters, free the buffer."""
        if not fsdp or unsharded.get(g.name):
            return
        if g.name not in prefetched:
            all_gather(g, phase)
        led.add("params", round(g.numel * pb * g.gather_factor), phase)
        led.free("all_gather", prefetched.pop(g.name))
        unsharded[g.name] = True

    def prefetch(g: Group | None, phase: str) -> None:
        """FSDP2's implicit backward prefetch: the next group's all-gather, copied out when it is used."""
        if fsdp and g is not None and not unsharded.get(g.name) and g.name not in prefetched:
            all_gather(g, phase)

    def reshard(g: Group) -> None:
        if fsdp and unsharded.get(g.name):
            led.free("params", round(g.numel * pb * g.gather_factor))
            unsharded[g.name] = False

    arrived: dict[str, int] = defaultdict(int)  # group -> trainable gradient elements produced this backward

    def grads_arrive(g: Group, phase: str, numel: int | None = None) -> None:
        """``numel`` (default: all not yet produced) of the group's gradients are produced in the param
        dtype; if a kept gradient exists they are added into it in place and freed."""
        left = g.grad_numel - arrived[g.name]
        numel = left if numel is None else min(left, round(numel * g.grad_numel / g.numel))  # trainable share
        arrived[g.name] += numel
        led.add("grads", numel * pb, phase)
        if accumulated.get(g.name):
            led.free("grads", numel * pb)

    def post_backward(g: Group, sync: bool, phase: str) -> None:
        """FSDP2's post-backward: reshard, then keep the gradient or reduce-scatter it."""
        had = accumulated.get(g.name, False)
        arrived[g.name] = 0
        reshard(g)
        if not g.grad_numel:  # every parameter frozen: nothing to keep or reduce-scatter
            return
        numel, shard_numel = g.grad_numel, g.grad_shard_numel
        if not sync:
            if not had and rb != pb:
                led.add("grads", numel * rb, phase)  # FSDP keeps them in reduce_dtype
                led.free("grads", numel * pb)
            accumulated[g.name] = True
            return
        kept = numel * (rb if had and rb != pb else pb)
        led.free("reduce_scatter", retained_rs[0])  # the previous group's input is released first
        led.add("reduce_scatter", rs_input_bytes * shard_numel, phase)  # flat input, copied in
        led.add("reduce_scatter", shard_numel * rb, phase)  # output
        if all_to_all:
            # gloo's reduce-scatter: the all-to-all's receive buffer, freed once summed into the output
            led.add("reduce_scatter", n * shard_numel * rb, phase)
            led.free("reduce_scatter", n * shard_numel * rb)
        led.free("grads", kept)
        where = "host" if offload else "grads"
        if rb != 4:
            led.add(where, 4 * shard_numel, phase)  # cast to the fp32 shard
            led.free("reduce_scatter", shard_numel * rb)
        else:
            led.free("reduce_scatter", shard_numel * rb)  # the output becomes the sharded gradient
            led.add(where, 4 * shard_numel, phase)
        if sharded_grad.get(g.name):  # a later micro-batch: added into the existing fp32 shard, then freed
            led.free(where, 4 * shard_numel)
        sharded_grad[g.name] = True
        retained_rs[0] = rs_input_bytes * shard_numel
        accumulated[g.name] = False

    by_name = {g.name: g for g in groups}
    # the group of each block, and whether the block is its group's first / last in forward order
    per_group = cfg.parallel.blocks_per_group
    blocks = [by_name[block_group_name(i, per_group, s.n_layers)] for i in range(s.n_layers)] if fsdp else []
    first_in_group = [i % per_group == 0 for i in range(s.n_layers)]
    last_in_group = [i % per_group == per_group - 1 or i == s.n_layers - 1 for i in range(s.n_layers)]
    sync_every = st.grad_sync != "last_micro_batch"  # reduce-scatter on every micro-batch
    for i in range(k):
        mb = f"micro-batch {i + 1}/{k}"
        sync = sync_every or i == k - 1
        if ref.live_model:  # ---- the reference model's forward, no grad: group by group, nothing saved ----
            phase = f"{mb} reference forward"
            led.add("reference", pb * ref_s.tokens * ref_s.d, phase)  # the hidden states
            retained = frozen_forward(led, ref_groups, n, pb, fsdp and st.reshard_after_forward,
                                      no_grad_block_bytes(ref_s.tokens, ref_s.d, ref_s.f, pb), phase)
            # the reference's log-probs, or the teacher's weight copy and hidden states, kept for the loss
            work = ref.head_bytes(ref_s, pb, cfg.train.loss_chunk_tokens)
            led.add("reference", work, f"{mb} reference head")
            led.free("reference", retained)  # the root's post-forward frees the last all-gather buffer
            kept = work + pb * ref_s.tokens * ref_s.d if ref.kind == "teacher" else 0
            led.free("reference", work + pb * ref_s.tokens * ref_s.d - kept)
        elif ref.policy_forward:  # ---- the policy's own forward with its adapters off, no grad ----
            phase = f"{mb} reference forward (adapters off)"
            led.add("temporaries", pb * bd, phase)
            for g in groups if fsdp else []:
                unshard(g, phase)
                work = no_grad_block_bytes(s.tokens, s.d, s.f, pb) if g.name.startswith("block") else 0
                led.add("temporaries", work, phase)
                led.free("temporaries", work)
                if st.reshard_after_forward and g.name not in ("root", "head"):
                    reshard(g)
            work = no_grad_head_bytes(ref.loss_tokens(s.tokens, s.b), s.vocab, s.d, pb,
                                      cfg.train.loss_chunk_tokens)
            led.add("temporaries", work, phase)
            led.free("temporaries", work + pb * bd)
        # ---- forward ----
        for g in groups if fsdp else []:
            if g.name.startswith("block"):
                continue
            if g.name in ("root", "embed"):
                unshard(g, f"{mb} forward")
        if fsdp and "embed" in by_name and st.reshard_after_forward:
            reshard(by_name["embed"])
        led.add("activations", embed_saved + mask_bytes + cp_forward, f"{mb} forward")
        saved = [
            act.block_saved_tp(s, tp, st.ac_mode)
            if tp > 1
            else act.block_saved(s, st.ac_mode, layer, st.ac_every_n)
            for layer in range(s.n_layers)
        ]
        # a fully checkpointed block keeps only its input (CP's attention comes back in its recompute)
        saved = [n if act.fully_checkpointed(st.ac_mode, layer, st.ac_every_n)
                 else n + cp_block + moe_saved[layer] for layer, n in enumerate(saved)]
        for layer in range(s.n_layers):
            if fsdp:
                unshard(blocks[layer], f"{mb} forward block {layer}")
            led.add("activations", saved[layer], f"{mb} forward block {layer}")
            led.add("temporaries", moe_a2a[layer], f"{mb} forward block {layer} all-to-all")
            led.free("temporaries", moe_a2a[layer])
            if fsdp and st.reshard_after_forward and last_in_group[layer]:
                reshard(blocks[layer])
        if fsdp and "head" in by_name:
            unshard(by_name["head"], f"{mb} forward output")
        head_acts = act.head_saved(s, st.ac_mode, tp)  # under TP on the local tokens
        led.add("activations", head_acts, f"{mb} forward output")
        # ---- loss and its backward (plan/loss.py: plain on whole logits, or chunked; under TP vocabulary-
        # parallel: the vocabulary's local rows, every token, the hidden states all-gathered; RL: its own) --
        chunk = cfg.train.loss_chunk_tokens or (s.tokens if tp > 1 else 0)
        scored = ref.loss_tokens(s.tokens, s.b)  # preference: only the completions' tokens are projected
        fwd_events, bwd_events = (
            rl_head_events(scored, s.vocab // tp, s.d, pb, chunk, softcap, head_trains)  # RL: its own head
            if cfg.data.format == "prompts" else vocab_parallel_loss_events(
                scored, s.vocab, s.d, pb, chunk, tp, s.tokens, softcap=softcap, fp32_matmul=fp32_matmul,
                weight_grad=head_trains, cuda=device != "cpu"))
        if ref.kind:
            # preference: the scored tokens' hidden states, selected (kept for the output's backward)
            extra = distill_loss_bytes(ref, scored, s.vocab, ref_s.d if ref.live_model else 0, pb, chunk)
            fwd_events = [("temporaries", pb * scored * s.d, "log-probs: hidden states selected"),
                          ("temporaries", extra, "distillation loss"), *fwd_events,
                          ("temporaries", -extra, "loss")]
            bwd_events = [*bwd_events, ("temporaries", -pb * scored * s.d, "output backward")]
        for _part, nbytes, what in fwd_events:
            if nbytes > 0:
                led.add("temporaries", nbytes, f"{mb} {what}")
            else:
                led.free("temporaries", -nbytes)
        head_numel = s.vocab * s.d + s.d  # output projection and final norm weights
        if not any(part == "grads" for part, _, _ in bwd_events):
            bwd_events.append(("grads", 0, "output backward"))  # the final norm's, whatever the output's
        for part, nbytes, what in bwd_events:
            if part == "prefetch":  # the last block's all-gather, issued before the head's backward (RL)
                prefetch(blocks[-1] if blocks else None, f"{mb} {what}")
            elif part != "grads" and nbytes > 0:
                # temporaries, the hidden state's gradient (freed after the blocks)
                led.add("temporaries", nbytes, f"{mb} {what}")
            elif part != "grads":
                led.free("temporaries", -nbytes)
            elif fsdp:  # tied: the shared weight's gradient arrives here and stays until the root's turn
                prefetch(blocks[-1], f"{mb} output backward")
                grads_arrive(by_name.get("head") or by_name["root"], f"{mb} output backward")
            else:  # one process: kept at the first micro-batch, added into it (and freed) at the later ones
                led.add("grads", round(4 * head_numel * train_frac), f"{mb} output backward")
                led.free("grads", round(4 * head_numel * train_frac) if i else 0)
        led.free("activations", head_acts)
        led.free("reference", kept if ref.kind == "teacher" else 0)  # the teacher's hidden states and weight
        if fsdp and "head" in by_name:
            post_backward(by_name["head"], sync, f"{mb} output reduce-scatter")
        for layer in reversed(range(s.n_layers)):
            phase = f"{mb} backward block {layer}"
            mlp_down = s.d * s.f  # down_proj's weight gradient exists at the high point
            first = layer - layer % per_group  # the group's first block: the one before it is the next group
            if fsdp:
                unshard(blocks[layer], phase)
                prefetch(blocks[first - 1] if first else by_name.get("embed"), phase)
                grads_arrive(blocks[layer], phase, mlp_down)
            whole = (act.block_saved_tp(s, tp, "none") if tp > 1 else act.block_saved_none(s)) + cp_block
            whole += moe_saved[layer]
            recompute = whole - saved[layer] if saved[layer] < whole else 0
            led.add("activations", recompute, phase)
            transient = act.block_backward_transient_tp(s, tp) if tp > 1 else act.block_backward_transient(s)
            transient += cp_transient
            led.add("temporaries", transient, phase)
            led.free("temporaries", transient)
            if fsdp:  # the rest of this block's gradients (all that is left, at the group's first block)
                block_numel = blocks[layer].numel // (min(first + per_group, s.n_layers) - first)
                grads_arrive(blocks[layer], phase, None if first_in_group[layer] else block_numel - mlp_down)
            led.free("activations", saved[layer] + recompute)
            if fsdp and first_in_group[layer]:
                post_backward(blocks[layer], sync, f"{mb} block {layer} reduce-scatter")
        led.free("activations", embed_saved + mask_bytes + cp_forward)
        led.free("temporaries", pb * bd)
        if fsdp and "embed" in by_name:
            unshard(by_name["embed"], f"{mb} backward embedding")
            grads_arrive(by_name["embed"], f"{mb} backward embedding")
            post_backward(by_name["embed"], sync, f"{mb} embedding reduce-scatter")
        elif fsdp:  # tied: the embedding's gradient is added into the shared weight's, then reduced
            tied_grad = 2 * s.vocab * s.d * pb if by_name["root"].grad_numel else 0  # none when frozen
            led.add("grads", tied_grad, f"{mb} backward embedding")  # new grad, and the sum
            led.free("grads", tied_grad)  # AccumulateGrad adds out of place; old and new freed
            post_backward(by_name["root"], sync, f"{mb} root reduce-scatter")
        if fsdp:  # the root's end-of-backward callback waits for the last reduce-scatter
            led.free("reduce_scatter", retained_rs[0])
            retained_rs[0] = 0
        else:
            rest = round(4 * (p_total - head_numel) * train_frac)
            led.add("grads", rest, f"{mb} backward")
            if i > 0:
                led.free("grads", rest)
    # clip_grad_norm_ and fused AdamW work in place (a few scalars)
    led.add("temporaries", 0, "clip and optimizer step")
    breakdown = dict(led.at)
    host = stored + 3 * 4 * train_local + 4 * n_tensors + ref_stored if offload else 0
    return MemoryPlan(led.peak, breakdown, led.phase, host, p_total, k, highs=led.highs)
