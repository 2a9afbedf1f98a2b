"""AdamW with parameter groups, and the learning-rate schedule (linear warm-up, cosine decay)."""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.optim.lr_scheduler import LambdaLR

from shardlm.config import TrainConfig


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
    it works on DTensor shards, so each rank updates only its own shard.
    """
    fused = device.type in ("cuda", "cpu")
    return torch.optim.AdamW(
        param_groups(model, tcfg.weight_decay, tcfg.decay_norms_and_embeddings),
        lr=tcfg.lr, betas=tcfg.betas, eps=tcfg.eps, fused=fused,
    )


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


def apply_train_config(optimizer: torch.optim.Optimizer, scheduler: LambdaLR, tcfg: TrainConfig, step: int) -> None:
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
