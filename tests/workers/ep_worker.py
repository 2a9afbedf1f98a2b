"""The expert-parallel MoE layer at 4 ranks (EP 2 x FSDP 2, EP 4, EP 1 x FSDP 4, and gpt-oss's experts at EP 2
x FSDP 2) against one process, forward and backward, with a routing that sends no token to experts 6 and 7 (so
EP 4's last rank receives none at all); then on padded rows (each rank's row real up to another position): the
router statistics pooled over the ranks and the aux and z terms' gradients equal one process's over the real
tokens.

Usage (from tests/dist/test_moe_parallel.py): ``torchrun --nproc_per_node=4 tests/workers/ep_worker.py``;
prints one ``OK`` line per layout and rank.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import distribute_tensor

from shardlm.model.moe import ClampedSwiGLUExperts, MoE
from shardlm.parallel.ep import apply_ep, build_ep_mesh
from shardlm.train.moe_loss import moe_loss_term
from tolerance import EPS, assert_close


def moe(gpt_oss: bool) -> MoE:
    """The layer under test: Qwen3-MoE's (softmax top-k, renormalised) or gpt-oss's (biased router, top-k then
    softmax, experts with biases and the clamped SwiGLU)."""
    if gpt_oss:
        return MoE(16, 8, 8, 2, "topk_softmax", router_bias=True, router_name="router",
                   experts=ClampedSwiGLUExperts(8, 16, 8, 1.702, 1.0))
    return MoE(16, 8, 8, 2, norm_topk_prob=True)


def main() -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    for ep, gpt_oss in ((2, False), (4, False), (1, False), (2, True)):
        check(rank, world, ep, gpt_oss)
    dist.destroy_process_group()


def check(rank: int, world: int, ep: int, gpt_oss: bool) -> None:
    """One layout: the layer at ``ep`` against the same layer in one process, forward and backward."""
    torch.manual_seed(0)
    ref = moe(gpt_oss)
    for p in ref.parameters():
        torch.nn.init.normal_(p, std=0.5)
    x_all = torch.randn(world, 6, 16)
    x_all[..., 0] = 3.0
    router = ref.router if gpt_oss else ref.gate
    with torch.no_grad():
        router.weight[:6, 0] = 0.0
        router.weight[6:, 0] = -20.0  # experts 6 and 7: logits far below the others for every token
        if gpt_oss:
            router.bias[6:] = -5.0
    y_ref = ref(x_all.reshape(-1, 16))
    assert ref.stats.counts[6:].sum() == 0 and ref.stats.counts[:6].min() > 0, ref.stats.counts
    y_ref.square().sum().backward()
    mesh = build_ep_mesh("cpu", world, ep)
    with torch.device("meta"):
        model = moe(gpt_oss)
    experts = apply_ep(model, mesh)
    for module in experts:  # as apply_fsdp does with expert_mesh
        fully_shard(module, mesh=mesh["efsdp"])
        module.set_gradient_divide_factor(float(world))
        module.set_force_sum_reduction_for_comms(mesh["efsdp"].size() > 1)
    fully_shard(model, mesh=mesh["dp_shard"])
    model.to_empty(device="cpu")
    with torch.no_grad():
        for (_name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
            p.copy_(distribute_tensor(q.detach(), p.device_mesh, p.placements))
    y = model(x_all[rank])
    assert_close(y, y_ref.reshape(world, 6, 16)[rank], rtol=64 * EPS, what=f"ep={ep} output")
    (y.square().sum() * world).backward()  # the trainer's convention: × N, FSDP averages
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        assert_close(p.grad.full_tensor(), q.grad, rtol=64 * EPS, what=f"ep={ep} {name}")
    check_padded(rank, world, model, ref, x_all, router.weight, ep)
    print(f"rank {rank} ep {ep}{' gpt-oss' if gpt_oss else ''}: OK", flush=True)


def one_process_terms(ref: MoE, aux_coef: float, z_coef: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(aux, the differentiable aux and z term) of ``ref``'s last forward in this process alone (no
    all-reduce: every rank holds the same one-process layer), by moe_loss.py's formula."""
    s = ref.stats
    f = s.counts / s.tokens
    aux = ref.n_experts * (f * s.prob_sum / s.tokens).sum()
    return aux.detach(), aux_coef * aux + z_coef * s.z_sum / s.tokens


def check_padded(rank: int, world: int, model: nn.Module, ref: MoE, x_all: torch.Tensor,
                 router_weight: torch.Tensor, ep: int) -> None:
    """Padded rows: rank r's row real up to position ``6 - r`` (r = 3: 3 real tokens); the statistics pooled
    over the ranks (moe_loss_term's all-reduce) equal the one-process layer's over all rows with the same
    mask, and so do the router weight's gradients of the aux and z terms."""
    real_all = torch.arange(6).expand(world, 6) < (6 - torch.arange(world)).unsqueeze(1)
    ref.zero_grad(set_to_none=True)
    model.zero_grad(set_to_none=True)
    ref(x_all.reshape(-1, 16), real_all.reshape(-1))
    aux_ref, term_ref = one_process_terms(ref, 0.5, 0.1)
    term_ref.backward()
    y = model(x_all[rank], real_all[rank])
    got = moe_loss_term(model, 0.5, 0.1)
    assert got.counts.sum() == int(real_all.sum()) * ref.top_k
    assert torch.equal(got.counts[0], ref.stats.counts)
    assert abs(got.aux - aux_ref) <= 1e-6 * aux_ref, (ep, got.aux.item(), aux_ref.item())
    assert abs(got.z - ref.stats.z_sum / ref.stats.tokens) <= 1e-6 * got.z
    # the trainer's convention: x N, FSDP averages; the output in the graph (times 0) as the token loss puts
    # it there, so that FSDP's backward hooks run
    ((y.square().sum() * 0.0 + got.term) * world).backward()
    mine = [p for n, p in model.named_parameters() if n.endswith(("gate.weight", "router.weight"))][0]
    assert_close(mine.grad.full_tensor(), router_weight.grad, rtol=64 * EPS,
                 what=f"ep={ep} padded router gradient")


if __name__ == "__main__":
    main()
