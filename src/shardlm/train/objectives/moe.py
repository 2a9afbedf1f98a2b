"""A mixture of experts' router losses as an auxiliary term of any objective: the load-balancing loss (and
the optional router z-loss) over every data-parallel rank's tokens of a micro-step
(:func:`shardlm.train.moe_loss.moe_loss_term`), averaged over the step's micro-steps."""

from __future__ import annotations

import torch
from torch import nn

from shardlm.config import Config
from shardlm.train.moe_loss import moe_loss_term
from shardlm.train.objectives.objective import AuxiliaryTerm
from shardlm.train.step_metrics import moe_metrics


class MoERouterLoss(AuxiliaryTerm):
    """``model.router_aux_loss_coef · aux + model.router_z_loss_coef · z`` after each micro-batch's forward
    (one all-reduce of the router statistics, a collective), and the record's ``moe_aux_loss``,
    ``moe_z_loss`` and tokens per expert.

    Each rank's term is its share of the loss of all ranks' tokens, so the shares sum to it over ranks;
    FSDP averages gradients over the N ranks, hence × N, and / micro-steps for the mean over them.
    """

    def __init__(self, cfg: Config, world_size: int) -> None:
        self.cfg, self.world_size = cfg, world_size

    def __call__(self, model: nn.Module, micro_batches: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The term (0-dim fp32) and ``[aux, z, counts (layers × experts)...]`` (fp64) of the last forward."""
        m = self.cfg.model
        moe = moe_loss_term(model, m.router_aux_loss_coef, m.router_z_loss_coef)
        sums = torch.cat([torch.stack([moe.aux, moe.z]), moe.counts.reshape(-1)]).double()
        return moe.term * (self.world_size / micro_batches), sums

    def metrics(self, sums: list[float], micro_batches: int) -> dict[str, float]:
        """The step's means over micro-steps and tokens per (layer, expert) pair
        (:func:`shardlm.train.step_metrics.moe_metrics`)."""
        return moe_metrics(sums, micro_batches, self.cfg.model, self.cfg.train.log_moe_layers)
