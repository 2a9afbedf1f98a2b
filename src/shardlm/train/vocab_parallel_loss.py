"""The token loss with the output projection split over the vocabulary (tensor parallel), chunked and exact.

Each of the T ranks of a tensor-parallel group holds the rows ``[v0, v0 + V/T)`` of the output weight W (V, D)
(:func:`shardlm.parallel.tp.apply_tp`). Per chunk of c tokens each rank makes only its logits ``z_r = h_c ·
W_rᵀ`` (c, V/T), and the cross-entropy is assembled from per-rank pieces with two all-reduces over the group
(Megatron-LM's vocabulary-parallel cross-entropy, Shoeybi et al. 2019; the same sums as PyTorch's
``loss_parallel``)::

    m = max_r max_j z_r,j                                      all-reduce MAX            (c,)
    S = Σ_r Σ_j exp(z_r,j - m),  z_t = Σ_r [t in r] z_r,t     one all-reduce SUM        (2, c)
    loss_c = Σ_i (m_i - z_t,i) + log S_i                       (= logsumexp(z_i) - z_i,t_i, exactly rewritten)
    g_r = exp(z_r - m) / S - onehot_r(t)    [· (1 - tanh²(z / cap)), Gemma's soft-cap]
    dh_c = Σ_r g_r · W_r  (summed over the group in the backward),  dW_r += g_rᵀ · h_c (this rank's rows only)

As in :func:`shardlm.train.loss.linear_cross_entropy_sum` the gradients are made in the forward and only
scaled in the backward, and nothing of size ``tokens × V`` (nor ``tokens × V/T`` beyond one chunk) is kept.
Ignored targets (``IGNORE_INDEX``) are projected and masked (no host read). The hidden states arrive sharded
along the sequence (sequence parallel): they are all-gathered once, and their gradient's partial sums
reduce-scattered back.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor
from torch.distributed.tensor import DTensor, Partial, Replicate
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from shardlm.data.instruct import IGNORE_INDEX


def vocab_parallel_loss_sum(hidden: DTensor, weight: DTensor, targets: Tensor, chunk_tokens: int,
                            softcap: float = 0.0, backward_twice: bool = False) -> Tensor:
    """Summed next-token cross-entropy of ``softcap(hidden · weightᵀ)`` with ``weight`` split over
    the vocabulary.

    Args:
        hidden: (B, T, D) DTensor on the 1-D tensor-parallel mesh (any placement; sequence parallel gives
            ``Shard(1)``), the final norm's output in the compute dtype.
        weight: (V, D) DTensor ``Shard(0)`` on the same mesh: this rank's vocabulary rows, the same dtype.
        targets: (B, T) int64 ids in [0, V) or ``IGNORE_INDEX``, the same on every rank of the group.
        chunk_tokens: tokens per chunk, >= 1 (the peak is about ``chunk_tokens × V / T`` fp32 values per
        rank). softcap: Gemma's final logit soft-cap c (``c · tanh(z / c)``); 0 = none.
        backward_twice: allow a second backward with the same incoming gradient (a pipeline's zero-bubble
            schedules split the backward into an input and a weight part): the results are kept until then,
            as in :func:`shardlm.train.loss.linear_cross_entropy_sum`.

    Returns a 0-dim fp32 tensor, the sum in nats over the scored targets, equal on every rank of the group
    (and to the plain loss up to summation order: fp32 within 1e-6 relative, tested).

    Raises:
        ValueError: ``chunk_tokens`` < 1; a weight that is not one ``Shard(0)`` DTensor; shapes that do
        not fit.
    """
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    if (
        not isinstance(weight, DTensor)
        or weight.device_mesh.ndim != 1
        or not weight.placements[0].is_shard(0)
    ):
        raise ValueError("the vocabulary-parallel loss needs the output weight as a Shard(0) DTensor on a "
                         "1-D mesh")
    if hidden.shape[-1] != weight.shape[1] or hidden.shape[:-1] != targets.shape:
        raise ValueError(f"hidden {tuple(hidden.shape)}, weight {tuple(weight.shape)} and targets "
                         f"{tuple(targets.shape)} do not fit: (..., D), (V, D), (...)")
    mesh = weight.device_mesh
    _, offset = compute_local_shape_and_global_offset(weight.shape, mesh, weight.placements)
    # every token on every rank; the gradient's per-rank partial sums go back as a reduce-scatter
    h = hidden.redistribute(mesh, [Replicate()]).to_local(grad_placements=[Partial()])
    w = weight.to_local()  # this rank's rows; their gradient stays this rank's (Shard(0))
    args = (h.reshape(-1, h.shape[-1]), w, targets.reshape(-1), chunk_tokens, softcap, mesh.get_group(),
            offset[0])
    if torch.is_grad_enabled() and (h.requires_grad or w.requires_grad):
        return _VocabParallelCrossEntropy.apply(*args, backward_twice)
    return _chunks(*args, need_h=False, need_w=False)[0]


def _chunks(h: Tensor, w: Tensor, targets: Tensor, chunk: int, softcap: float, group: dist.ProcessGroup,
            v0: int, need_h: bool, need_w: bool) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """The loss sum and, where needed, this rank's partial ``dh`` (n, D) and its rows' ``dw`` (V/T,
    D) fp32."""
    dtype = h.dtype
    n, v_local = h.shape[0], w.shape[0]
    dh = torch.empty_like(h) if need_h else None
    dw = torch.zeros(w.shape, dtype=torch.float32, device=w.device) if need_w else None
    loss = torch.zeros((), dtype=torch.float64, device=h.device)
    for start in range(0, n, chunk):
        h_c, t_c = h[start:start + chunk], targets[start:start + chunk]
        z = F.linear(h_c, w)  # (c, V/T) in the compute dtype
        deriv = None
        if softcap:
            tanh = z.div_(softcap).tanh_()
            z = tanh * softcap
            if need_h or need_w:
                deriv = tanh.float().square_().neg_().add_(1.0)
            del tanh
        z = z.float()
        scored = t_c != IGNORE_INDEX
        local_t = t_c - v0
        mine = scored & (local_t >= 0) & (local_t < v_local)  # this rank holds the target's row
        local_t = torch.where(mine, local_t, 0)
        z_t = torch.where(mine, z.gather(1, local_t.unsqueeze(1)).squeeze(1), 0.0)
        zmax = z.amax(1)
        dist.all_reduce(zmax, op=dist.ReduceOp.MAX, group=group)
        z.sub_(zmax.unsqueeze(1)).exp_()
        sums = torch.stack([z.sum(1), z_t])  # (2, c): the exponentials' sum, the target logit
        dist.all_reduce(sums, group=group)
        total, z_t = sums[0], sums[1]
        row_loss = (zmax - z_t) + total.log()  # the plain loss's rewriting of logsumexp - z_t
        loss += (row_loss * scored).sum(dtype=torch.float64)
        if not (need_h or need_w):
            del z
            continue
        g = z.div_(total.unsqueeze(1))  # this rank's columns of the softmax
        g.scatter_add_(1, local_t.unsqueeze(1), -mine.to(g.dtype).unsqueeze(1))  # - onehot (no host read)
        g.mul_(scored.unsqueeze(1))
        if deriv is not None:
            g.mul_(deriv)
            del deriv
        if dtype != torch.float32:
            g.copy_(g.to(dtype))
        g_mm = g.to(dtype)
        if need_h:
            dh[start:start + chunk] = g_mm @ w
        if need_w:
            dw.addmm_(g.t(), h_c.float())
        del z, g, g_mm
    return loss.float(), dh, dw


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Autograd for :func:`vocab_parallel_loss_sum` on local tensors: gradients made in forward, scaled
    in backward."""

    @staticmethod
    def forward(ctx, h: Tensor, w: Tensor, targets: Tensor, chunk: int, softcap: float,  # noqa: ANN001 - ctx
                group: dist.ProcessGroup, v0: int, backward_twice: bool = False) -> Tensor:
        need_h, need_w = h.requires_grad, w.requires_grad  # (grad mode is off inside forward)
        loss, dh, dw = _chunks(h, w, targets, chunk, softcap, group, v0, need_h, need_w)
        ctx.grads = [dh, dw]
        ctx.twice, ctx.first = backward_twice, None  # (the first backward's incoming gradient and results)
        ctx.dtypes = (h.dtype, w.dtype)
        return loss

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor | None, ...]:  # noqa: ANN001 - autograd's ctx
        if ctx.first is not None and torch.equal(grad, ctx.first[0]):
            # the second of a split backward (zero-bubble schedules): the same results, copied
            return (*(None if g is None else g.clone() for g in ctx.first[1]), None, None, None, None, None,
                    None)
        if ctx.grads is None:
            raise RuntimeError("the vocabulary-parallel loss's backward ran twice (retain_graph): its "
                               "gradients are made in forward and handed out once")
        grads, ctx.grads = ctx.grads, None
        out = [None if g is None else g.mul_(grad).to(dtype) for g, dtype in zip(grads, ctx.dtypes)]
        if ctx.twice:  # kept for a second backward (split into input and weight parts)
            ctx.first = (grad.detach().clone(), out)
        return (*out, None, None, None, None, None, None)
