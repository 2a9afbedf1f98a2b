"""The load-balancing loss of mixture-of-experts models, with its statistics over every data-parallel rank.

transformers' ``load_balancing_loss_func`` (Switch Transformers, Fedus et al. 2021, eqs. 4-6, as transformers
5.x sums it over layers): with C_e the (token, slot) assignments expert e received and S_e the sum of the
router probabilities of e, both summed over the layers and the tokens of a forward, and R = layers × tokens,

    aux = E · Σ_e (C_e / R) · (S_e / R).

Its gradient flows through S only (C counts discrete choices). Computed over the tokens of all data-parallel
ranks together: one all-reduce of every layer's (C, S, z) and the token count (no gradient) after the forward;
then each rank's differentiable term is ``E · Σ_e (C_e / R) · (S_e^local / R)``, whose sum over ranks is the
aux loss of the ranks' tokens together, so N ranks equal one process that sees the same tokens in one forward.
Only real tokens count (the ``real_tokens`` mask of :class:`shardlm.model.moe.MoE`, transformers'
``attention_mask``): R is layers × real tokens, and padding adds to neither C nor S. Under context
parallelism the ranks of a CP group hold parts of the same sequences, each its slice of the mask (CP's own
padding False): pooled over every rank (the default group), the statistics are those of the whole sequences.
Optional router z-loss (Zoph et al., "ST-MoE", 2022, eq. 5): the mean over (layer, token) rows of
logsumexp(router logits)².
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from shardlm.model.moe import MoE


@dataclass
class MoELossTerm:
    """The MoE terms of one forward (all data-parallel ranks together)."""

    term: torch.Tensor
    """() fp32, differentiable: this rank's share of ``aux_coef · aux + z_coef · z``; the shares sum to it."""
    aux: torch.Tensor
    """() fp32, no gradient: the load-balancing loss of all ranks' tokens (transformers' ``aux_loss``)."""
    z: torch.Tensor
    """() fp32, no gradient: the router z-loss of all ranks' tokens."""
    counts: torch.Tensor
    """(layers, E) fp32: assignments per expert and MoE layer over all ranks' tokens."""


def moe_layers(model: nn.Module) -> list[MoE]:
    """The model's MoE layers, in order (none for a dense model)."""
    return [m for m in model.modules() if isinstance(m, MoE)]


def moe_loss_term(model: nn.Module, aux_coef: float, z_coef: float = 0.0,
                  group: dist.ProcessGroup | None = None) -> MoELossTerm | None:
    """The MoE loss terms of the model's last forward, or None for a dense model.

    Reads each layer's :class:`~shardlm.model.moe.RouterStats`; when a process group is initialised
    (``group``, default the world: every rank's tokens, data- and context-parallel; not for tensor parallel,
    whose ranks hold the same tokens) sums counts, probability sums, z sums and tokens with one ``all_reduce``
    (a collective: every rank calls it after each forward).

    Raises:
        RuntimeError: a MoE layer has no statistics (the model was not run forward).
    """
    layers = moe_layers(model)
    if not layers:
        return None
    if any(layer.stats is None for layer in layers):
        raise RuntimeError("a MoE layer has no router statistics: run the model forward first")
    stats = [layer.stats for layer in layers]
    n, e = len(stats), stats[0].counts.shape[0]
    local_p = torch.stack([s.prob_sum for s in stats])  # (layers, E), differentiable
    local_z = torch.stack([s.z_sum for s in stats])  # (layers,), differentiable
    flat = torch.cat([torch.stack([s.counts for s in stats]).reshape(-1), local_p.detach().reshape(-1),
                      local_z.detach(), stats[0].tokens.reshape(1).to(local_p)])
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(flat, group=group)
    counts = flat[:n * e].view(n, e)
    p_all, z_all, tokens = flat[n * e:2 * n * e].view(n, e), flat[2 * n * e:2 * n * e + n], flat[-1]
    rows = tokens * n
    f = counts.sum(0) / rows
    aux = e * (f * p_all.sum(0) / rows).sum()
    z = z_all.sum() / rows
    term = aux_coef * e * (f * local_p.sum(0) / rows).sum()
    if z_coef:
        term = term + z_coef * local_z.sum() / rows
    return MoELossTerm(term, aux, z, counts)
