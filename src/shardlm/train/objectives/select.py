"""Which objective and which auxiliary terms a run trains with, from its config and model."""

from __future__ import annotations

from shardlm.data.preference import PREFERENCE
from shardlm.data.prompts import PROMPTS
from shardlm.train.moe_loss import moe_layers
from shardlm.train.objectives.distill import DistillationObjective
from shardlm.train.objectives.grpo import GRPOObjective
from shardlm.train.objectives.moe import MoERouterLoss
from shardlm.train.objectives.objective import AuxiliaryTerm, Objective, ObjectiveContext
from shardlm.train.objectives.preference import PreferenceObjective
from shardlm.train.objectives.token import TokenObjective

#: ``data.format`` -> the objective its samples train (any other format: the token loss)
BY_DATA_FORMAT = {PREFERENCE: PreferenceObjective, PROMPTS: GRPOObjective}


def build_objective(ctx: ObjectiveContext) -> Objective:
    """The run's objective: distillation when ``distill.teacher_from`` names a teacher (on instruction data),
    else the one its ``data.format`` names in :data:`BY_DATA_FORMAT` (preference pairs, prompts of online
    RL), else the token loss of pre-training and SFT. Building a preference, RL or distillation objective
    builds its reference or teacher (a collective under FSDP)."""
    if ctx.cfg.distill.teacher_from:  # instruction data with a teacher (config/checks.py: validate_distill)
        return DistillationObjective.build(ctx)
    return BY_DATA_FORMAT.get(ctx.cfg.data.format, TokenObjective).build(ctx)


def build_auxiliary_terms(ctx: ObjectiveContext) -> list[AuxiliaryTerm]:
    """The terms added to the objective: a mixture of experts' router losses when the model has MoE
    layers; none otherwise."""
    return [MoERouterLoss(ctx.cfg, ctx.info.world_size)] if moe_layers(ctx.model) else []
