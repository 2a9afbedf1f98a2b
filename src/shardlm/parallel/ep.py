"""Expert parallelism: each of ``ep`` ranks holds ``n_experts / ep`` whole experts, and tokens travel to them.

The recipe (torchtitan's ``ExpertParallel``; DeepSpeed-MoE, Rajbhandari et al. 2022; GShard, Lepikhin et al.
2020), applied from outside the model by :func:`apply_ep`:

1. the ranks form a 2-D mesh ``("efsdp", "ep")`` (:func:`build_ep_mesh`), ``ep`` the inner dimension; its
   flattening ``dp_shard`` (all ranks) keeps the usual FSDP of attention, router, norms and embeddings;
2. each MoE layer's :class:`~shardlm.model.moe.Experts` parameters become ``Shard(0)`` DTensors over ``ep``
   (rank r of an ``ep`` group holds experts ``[r·E/ep, (r+1)·E/ep)``); FSDP then shards each rank's experts
   over ``efsdp`` (:func:`shardlm.parallel.fsdp.apply_fsdp`'s ``expert_mesh``);
3. around the experts' forward, the tokens (already sorted by expert, with ``tokens_per_expert``) are
   dispatched with ``all_to_all_single`` (uneven splits: each rank sends each expert's tokens to its owner),
   regrouped by local expert, run, and combined back by the reverse all-to-all (autograd through both).

Gradients: each rank's objective is scaled by the world size N (the trainer's convention, as FSDP averages
over ranks); an expert's gradient sums the contributions of every rank's tokens, so the experts' FSDP groups
divide by N instead of their own size (``set_gradient_divide_factor``; measured: without it the experts'
gradients come out ``ep`` times too large).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import Shard, distribute_module, distribute_tensor

from shardlm.errors import ConfigError
from shardlm.model.moe import Experts, MoE


def build_ep_mesh(device_type: str, world_size: int, ep: int) -> DeviceMesh:
    """The 2-D mesh ``("efsdp", "ep")`` of ``world_size / ep`` rows of ``ep`` consecutive ranks, with the
    flattened 1-D ``"dp_shard"`` (all ranks, in rank order) registered beside it (``mesh["dp_shard"]``).

    Raises:
        ConfigError: ``ep`` < 1 or not dividing ``world_size``.
    """
    if ep < 1 or world_size % ep:
        raise ConfigError(f"parallel.ep={ep} must divide the data-parallel ranks ({world_size})")
    mesh = init_device_mesh(device_type, (world_size // ep, ep), mesh_dim_names=("efsdp", "ep"))
    mesh._flatten("dp_shard")
    return mesh


class ExpertParallel:
    """Token dispatch and combine around one :class:`Experts` module over an ``ep`` mesh (one instance per
    module: it keeps the current forward's splits between its input and output functions)."""

    def __init__(self) -> None:
        self.splits: tuple[list[int], list[int]] | None = None
        self.order: torch.Tensor | None = None

    @staticmethod
    def partition(name: str, module: nn.Module, mesh: DeviceMesh) -> None:
        """Each stacked expert tensor (E, ...) -> a ``Shard(0)`` DTensor over ``mesh`` (whole experts
        per rank)."""
        for pname, param in list(module.named_parameters(recurse=False)):
            shard = nn.Parameter(distribute_tensor(param, mesh, [Shard(0)]),
                                 requires_grad=param.requires_grad)
            module.register_parameter(pname, shard)

    def dispatch(self, module: nn.Module, inputs: tuple, mesh: DeviceMesh) -> tuple:
        """(x (N, dim) sorted by global expert, counts (E,)) -> (tokens of this rank's experts grouped by
        local expert, their counts (E / ep,)); one all-to-all of the counts, one of the tokens."""
        x, counts = inputs
        group, ep = mesh.get_group(), mesh.size()
        send = counts.reshape(ep, -1)  # row r: my tokens for rank r's experts
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=group)  # row s: rank s's tokens for my experts
        n_local = send.shape[1]
        both = torch.stack([send.sum(1), recv.sum(1)]).tolist()  # one read to the host
        self.splits = (both[0], both[1])
        received = funcol.all_to_all_single_autograd(x, both[1], both[0], group)
        # received is ordered (source rank, local expert); the experts want (local expert, source rank)
        sizes = recv.reshape(-1)
        starts = torch.cumsum(sizes, 0) - sizes
        by_expert = torch.arange(ep * n_local, device=x.device).reshape(ep, n_local).t().reshape(-1)
        sizes_e, starts_e = sizes[by_expert], starts[by_expert]
        offsets = torch.cumsum(sizes_e, 0) - sizes_e
        total = int(sizes.sum())
        self.order = torch.repeat_interleave(starts_e - offsets, sizes_e, output_size=total) + torch.arange(
            total, device=x.device)
        return received[self.order], recv.sum(0)

    def combine(self, module: nn.Module, y: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
        """The experts' outputs back to the ranks and order their tokens came from: (N, dim) as
        ``dispatch``'s x."""
        back = torch.empty_like(self.order)
        back[self.order] = torch.arange(self.order.numel(), device=y.device)
        send, recv = self.splits
        out = funcol.all_to_all_single_autograd(y[back], send, recv, mesh.get_group())
        self.splits, self.order = None, None
        return funcol.wait_tensor(out) if isinstance(out, funcol.AsyncCollectiveTensor) else out


def apply_ep(model: nn.Module, mesh: DeviceMesh) -> list[Experts]:
    """Make every MoE layer's experts expert-parallel over ``mesh["ep"]`` (see the module's recipe), in place.

    Call on the meta-device model before FSDP; returns the expert modules, which
    :func:`shardlm.parallel.fsdp.apply_fsdp` then shards over ``mesh["efsdp"]``.
    """
    experts = [m.experts for m in model.modules() if isinstance(m, MoE)]
    for module in experts:
        style = ExpertParallel()
        distribute_module(module, mesh["ep"], style.partition, input_fn=style.dispatch,
                          output_fn=style.combine)
    return experts
