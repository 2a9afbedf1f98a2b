"""AdamW with parameter groups, the learning-rate schedule (linear warm-up, cosine decay), and gradient
clipping by the global norm."""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.optim.lr_scheduler import LambdaLR

from shardlm.config import TrainConfig
from shardlm.parallel.float8 import after_optimizer_step, has_fsdp_float8_weights


def param_groups(model: nn.Module, weight_decay: float, decay_norms_and_embeddings: bool) -> list[dict]:
    """Split parameters into a decayed and a non-decayed AdamW group.

    Weight matrices of the blocks and the (untied) output projection are decayed; norm weights
    (1-D) and the token embedding are not, unless ``decay_norms_and_embeddings``.
    Names are the model's own (``model.embed_tokens.weight``...), with any wrapper prefix ignored.
    """
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        exempt = p.ndim < 2 or name.endswith("embed_tokens.weight")
        (no_decay if exempt and not decay_norms_and_embeddings else decay).append(p)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def build_optimizer(model: nn.Module, tcfg: TrainConfig, device: torch.device) -> torch.optim.AdamW:
    """AdamW (Loshchilov & Hutter, 2019) over ``model``'s (possibly sharded) parameters.

    The fused kernel is used where PyTorch supports it for the device (CUDA and CPU in torch 2.13);
    it works on DTensor shards, so each rank updates only its own shard. With float8 all-gathers
    (``train.float8 = "tensorwise"`` under FSDP) every ``step()`` ends with
    :func:`shardlm.parallel.float8.after_optimizer_step` (a post-step hook; a collective, as the step is).
    """
    fused = device.type in ("cuda", "cpu")
    optimizer = torch.optim.AdamW(
        param_groups(model, tcfg.weight_decay, tcfg.decay_norms_and_embeddings),
        lr=tcfg.lr, betas=tcfg.betas, eps=tcfg.eps, fused=fused,
    )
    if has_fsdp_float8_weights(model):  # float8 all-gathers: the next scales in one all-reduce per step
        optimizer.register_step_post_hook(lambda *_: after_optimizer_step(model))
    return optimizer


def lr_at(step: int, tcfg: TrainConfig) -> float:
    """Learning rate for 0-based optimizer step ``step``.

    Linear warm-up: lr·(step+1)/warmup_steps for step < warmup_steps; then cosine decay from ``lr``
    to ``min_lr`` over the remaining steps (Loshchilov & Hutter, SGDR, 2017):
    min_lr + (lr − min_lr)·(1 + cos(π·progress))/2, progress in [0, 1].
    """
    if step < tcfg.warmup_steps:
        return tcfg.lr * (step + 1) / tcfg.warmup_steps
    decay_steps = max(1, tcfg.steps - tcfg.warmup_steps - 1)
    progress = min(1.0, (step - tcfg.warmup_steps) / decay_steps)
    return tcfg.min_lr + (tcfg.lr - tcfg.min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_scheduler(optimizer: torch.optim.Optimizer, tcfg: TrainConfig) -> LambdaLR:
    """A ``LambdaLR`` that sets each group's lr to :func:`lr_at` (the optimizer's base lr is ``tcfg.lr``)."""
    return LambdaLR(optimizer, lambda step: lr_at(step, tcfg) / tcfg.lr)


def apply_train_config(
    optimizer: torch.optim.Optimizer, scheduler: LambdaLR, tcfg: TrainConfig, step: int
) -> None:
    """After a resume at ``step``: AdamW's settings and the LR schedule from ``tcfg``, not the checkpoint's.

    Loading restores the old run's ``betas``, ``eps``, ``weight_decay`` and base learning rate with the
    optimizer and scheduler state; here they are set from the new config (the AdamW moments are kept), and
    the next step's learning rate is the new schedule's value at ``step``, computed as ``LambdaLR`` does
    (base lr × lambda(step)), so an unchanged config continues bit-identically.
    """
    groups = optimizer.param_groups
    for i, group in enumerate(groups):
        group["betas"] = tuple(tcfg.betas)
        group["eps"] = tcfg.eps
        group["weight_decay"] = tcfg.weight_decay if i == 0 else 0.0  # param_groups: decayed group first
        group["initial_lr"] = tcfg.lr
    scheduler.base_lrs = [tcfg.lr for _ in groups]
    scheduler.last_epoch = step
    lrs = [base * fn(step) for fn, base in zip(scheduler.lr_lambdas, scheduler.base_lrs)]
    for group, lr in zip(groups, lrs):
        group["lr"] = lr
    scheduler._last_lr = lrs  # what get_last_lr() reports for the next step


#: elements upcast to fp64 at a time when summing squares (32 MiB of fp64): memory stays bounded
FP64_CHUNK = 1 << 22


def rebuild_optimizer(model: nn.Module, old: torch.optim.Optimizer, tcfg: TrainConfig,
                      device: torch.device, step: int) -> tuple[torch.optim.AdamW, LambdaLR]:
    """AdamW over ``model``'s parameters that train now, and its LR schedule advanced to ``step`` (optimizer
    steps taken), after the trainable set changed: each parameter that had AdamW state in ``old`` keeps it
    (the same tensors, not copies); a newly trainable one starts without."""
    optimizer = build_optimizer(model, tcfg, device)
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p in old.state:
                optimizer.state[p] = old.state[p]
    scheduler = build_scheduler(optimizer, tcfg)
    for _ in range(step):
        scheduler.step()
    return optimizer, scheduler


def sum_of_squares_fp64(t: torch.Tensor) -> torch.Tensor:
    """Sum of the squares of ``t``'s values, accumulated in fp64; a 0-dim float64 tensor on ``t``'s device.

    Upcasts :data:`FP64_CHUNK` elements at a time, so the temporary memory is bounded whatever ``t``'s size.
    """
    flat = t.reshape(-1)
    total = torch.zeros((), dtype=torch.float64, device=t.device)
    for chunk in flat.split(FP64_CHUNK):
        total += chunk.double().square().sum()
    return total


def _world_sum_of_squares(
    grads: list[DTensor], local: list[torch.Tensor], extras: torch.Tensor | None
) -> torch.Tensor:
    """The global fp64 sum of squares when every gradient's mesh spans all ranks (FSDP, HSDP, FSDP × TP), in
    one all-reduce over the world that also carries ``extras``: each rank adds its local values of a gradient
    only when its coordinate is 0 on every mesh dimension where that gradient is ``Replicate`` (the other
    coordinates hold copies), so each value is counted exactly once."""
    total = torch.zeros((), dtype=torch.float64, device=local[0].device)
    for g, t in zip(grads, local):
        coordinate = g.device_mesh.get_coordinate()
        if all(c == 0 for c, p in zip(coordinate, g.placements) if p.is_replicate()):
            # (FSDP × TP: _StridedShard,
            # not a Shard subclass, on the dp dimension)
            total += sum_of_squares_fp64(t).to(total.device)
    buf = total.reshape(1) if extras is None else torch.cat([total.reshape(1), extras.to(total.device)])
    dist.all_reduce(buf)
    if extras is not None:
        extras.copy_(buf[1:])
    return buf[0]


def _grouped_sum_of_squares(grads: list[torch.Tensor], local: list[torch.Tensor], extras: torch.Tensor | None,
                            world: int) -> torch.Tensor:
    """The global fp64 sum of squares otherwise (DDP, one process, meshes not spanning every rank): one
    all-reduce per (mesh, sharded dimension) group, ``extras`` packed into one spanning every rank, else
    all-reduced alone."""
    squares: dict[tuple, torch.Tensor] = {}  # (mesh, sharded mesh dims) -> fp64 sum of squares on this rank
    for g, t in zip(grads, local):
        key = (g.device_mesh, tuple(i for i, p in enumerate(g.placements) if not p.is_replicate())) \
            if isinstance(g, DTensor) else (None, ())
        sq = sum_of_squares_fp64(t)
        squares[key] = squares[key] + sq if key in squares else sq
    total = torch.zeros((), dtype=torch.float64, device=local[0].device)
    packed = extras is None or world == 1
    for (mesh, dims), sq in squares.items():
        for dim in dims:  # sum the pieces the other ranks of this dimension hold
            group = mesh.get_group(dim)
            if not packed and dist.get_world_size(group) == world:  # this all-reduce spans every rank
                buf = torch.cat([sq.reshape(1), extras.to(sq.device)])
                dist.all_reduce(buf, group=group)
                sq = buf[0]
                extras.copy_(buf[1:])
                packed = True
            else:
                dist.all_reduce(sq, group=group)
        total += sq.to(total.device)
    if not packed:
        dist.all_reduce(extras)
    return total


@torch.no_grad()
def clip_grad_norm_(parameters: Iterable[nn.Parameter], max_norm: float,
                    extras: torch.Tensor | None = None, across: dist.ProcessGroup | None = None
                    ) -> torch.Tensor:
    """Clip gradients in place by their global L2 norm; return that norm, computed so that it does not depend
    on how the gradients are sharded.

    Each rank sums the squares of its local gradient values in fp64 (for a DTensor gradient, its local
    shard). When every gradient is a DTensor on a mesh of all ranks (FSDP, HSDP, FSDP × TP), one all-reduce
    over the world sums them, each rank counting a gradient only where its mesh coordinate is 0 on the
    dimensions that gradient is replicated on (a norm weight under TP, the replicas of HSDP), so every value
    is counted once. Otherwise (DDP, one process, meshes of part of the ranks) one all-reduce per group of
    gradients with the same mesh sums over the dimensions on which they are sharded. Summing fp64 squares
    makes the result independent of the partition to ~1e-16 relative, where ``torch.nn.utils.clip_grad_norm_``
    sums fp32 norms and differs by ~1e-5 between world sizes. Gradients are then multiplied by
    ``min(1, max_norm / (norm + 1e-6))``, the rule of ``torch.nn.utils.clip_grad_norm_``.

    ``extras`` lets a caller sum a few other values over all ranks without a collective of its own: they
    travel in the norm's all-reduce when that one spans every rank (FSDP, HSDP, FSDP × TP: one collective
    per step for both), and in one all-reduce of their own otherwise (DDP, a multi-group model). Nothing
    here reads a value to the host.

    Args:
        parameters: the model's parameters (plain tensors or DTensors; those without ``.grad`` are skipped).
        max_norm: the largest allowed norm; ``math.inf`` only measures.
        extras: optional 1-D float64 tensor on the gradients' device, summed over all ranks in place.
        across: ranks holding other parameters (the pipeline's stages, ``mesh["pp"]``'s group): their sums of
            squares are added (one all-reduce more) so the norm is the whole model's.

    Returns:
        A 0-dim float64 tensor on the gradients' device: the global norm before clipping (NaN or inf when a
        gradient is not finite; the caller decides what to do).
    """
    grads = [p.grad for p in parameters if p.grad is not None]
    world = dist.get_world_size() if dist.is_initialized() else 1
    if not grads and across is None:
        if extras is not None and world > 1:
            dist.all_reduce(extras)
        return torch.zeros((), dtype=torch.float64)
    local = [g.to_local() if isinstance(g, DTensor) else g for g in grads]
    if not grads:  # a pipeline stage without trainable parameters: nothing of its own to add
        total = torch.zeros((), dtype=torch.float64, device=extras.device if extras is not None else "cpu")
        if extras is not None:
            dist.all_reduce(extras)
    elif world > 1 and all(isinstance(g, DTensor) and g.device_mesh.size() == world for g in grads):
        total = _world_sum_of_squares(grads, local, extras)  # every mesh spans the world: one all-reduce
    else:
        total = _grouped_sum_of_squares(grads, local, extras, world)
    if across is not None:
        dist.all_reduce(total, group=across)
    norm = total.sqrt()
    if math.isfinite(max_norm):
        coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
        for t in local:
            t.mul_(coef.to(device=t.device, dtype=t.dtype))
    return norm
