"""Context-parallel attention that saves only the rank's own tensors: blockwise, merged by log-sum-exp.

The pattern of PyTorch's own ``context_parallel`` and of Megatron-LM / torchtitan's ring attention, with the
keys and values all-gathered instead of passed around a ring. CP rank r holds two query chunks of ``c``
tokens, global chunks ``r`` (head) and ``2·cp - 1 - r`` (tail) of the ``2·cp`` chunks
(:mod:`shardlm.parallel.cp`). The forward all-gathers K and V (transient: freed when the layer's forward
ends), attends each query chunk to every key chunk it may see with a kernel that returns the log-sum-exp of
its scores, and merges the partial outputs exactly: ``lse = log(Σ_m exp(lse_m))``, ``out = Σ_m exp(lse_m -
lse)·out_m`` (Milakov & Gimelshein 2018, "Online normalizer calculation for softmax"; FlashAttention-2, Dao
2023, §3.1). Per block: the diagonal block (a chunk against itself) under the kernel's causal flag, earlier
chunks unmasked, later ones skipped; under documents or a window a boolean mask of that block only, built from
the global indices and document ids, and a block with no visible key skipped. It saves q, the local k and v,
the output and the log-sum-exp: nothing of ``T_pad`` rows.

The backward all-gathers K and V again and runs the kernel's backward per block with the merged output and
log-sum-exp, which is exact: with ``P = exp(S - lse)`` and ``D = rowsum(dO ∘ O)`` of the whole row, every
block's ``dS = P ∘ (dP - D)`` is the block of the full row's (FlashAttention-2, Algorithm 2). The gathered key
and value gradients are summed over the CP group onto their owners (a reduce-scatter: one all-to-all and a
local sum, as :mod:`shardlm.parallel.reduce_scatter`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

#: a kernel with log-sum-exp: (q, k, v, causal, additive mask or None, scale) -> (out, lse (b, h, n) float32)
Forward = Callable[..., tuple[torch.Tensor, torch.Tensor]]
#: its backward: (d_out, q, k, v, out, lse, causal, mask, scale) -> (dq, dk, dv)
Backward = Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


def lse_kernels(device_type: str) -> tuple[Forward, Backward] | None:
    """The attention kernel with a log-sum-exp, and its backward, for ``device_type``; None where shardlm has
    none (then :class:`~shardlm.parallel.cp.ContextParallel` keeps its all-gather path under a dense mask).

    CPU: ``torch.ops.aten._scaled_dot_product_flash_attention_for_cpu`` and its ``_backward``, private ATen
    ops pinned by torch==2.13.0 (the project's pin). Measured there: they read grouped K/V heads as they are
    (no repeat), take an additive ``attn_mask`` of q's dtype (not a boolean one) broadcast over batch and
    heads, and return out 0 and lse 0 for a row whose keys are all masked (:class:`BlockwiseAttention` sets
    such rows' lse to -inf). CUDA's counterparts (``_scaled_dot_product_flash_attention`` /
    ``_efficient_attention``, which PyTorch's ``context_parallel`` uses) are not wired: no GPU has run them
    here, so CUDA keeps the tested fallback.
    """
    ops = torch.ops.aten
    if device_type != "cpu" or not hasattr(ops, "_scaled_dot_product_flash_attention_for_cpu_backward"):
        return None
    fwd_op = ops._scaled_dot_product_flash_attention_for_cpu
    bwd_op = ops._scaled_dot_product_flash_attention_for_cpu_backward

    def forward(q, k, v, causal, mask, scale):
        return fwd_op(q, k, v, 0.0, causal, attn_mask=mask, scale=scale)

    def backward(d_out, q, k, v, out, lse, causal, mask, scale):
        return bwd_op(d_out, q, k, v, out, lse, 0.0, causal, attn_mask=mask, scale=scale)

    return forward, backward


@dataclass(frozen=True)
class SequenceMask:
    """What masked CP attention needs to build any block's mask: the sequence's document ids and a window."""

    documents: torch.Tensor | None
    """(batch, T_pad) int64 document ids of the padded sequence (each padding token a document of its own:
    ids -1, -2, ...), or None (one document)."""
    window: int
    """Sliding window in tokens: query i sees key j only when i - window < j (0 = no window)."""


def all_gather_sequence(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """(batch, heads, s, d) on each rank -> (batch, heads, cp·s, d), the ranks' slices in rank order (no
    autograd)."""
    world = group.size()
    b, h, s, d = x.shape
    out = torch.empty((world * b, h, s, d), dtype=x.dtype, device=x.device)
    dist.all_gather_single(out, x.contiguous(), group=group)
    return out.view(world, b, h, s, d).permute(1, 2, 0, 3, 4).reshape(b, h, world * s, d)


def reduce_scatter_sequence(grad: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """(batch, heads, cp·s, d) -> (batch, heads, s, d): this rank's slice summed over the group (one
    all-to-all and a local sum in rank order, so every rank adds in the same order)."""
    world = group.size()
    b, h, ws, d = grad.shape
    pieces = grad.reshape(b, h, world, ws // world, d).permute(2, 0, 1, 3, 4).contiguous()
    received = torch.empty_like(pieces)
    shape = (world * b, h, ws // world, d)
    dist.all_to_all_single(received.view(shape), pieces.view(shape), group=group)
    out = received[0].clone()
    for piece in received[1:]:
        out.add_(piece)
    return out


def global_chunk(position: int, cp: int) -> int:
    """The global chunk index of chunk ``position`` (0 .. 2·cp-1) of the gathered order: rank p // 2's
    head (even positions) or tail (odd positions)."""
    rank, tail = divmod(position, 2)
    return 2 * cp - 1 - rank if tail else rank


@dataclass(frozen=True)
class Block:
    """One query chunk of this rank against one key chunk of the gathered keys."""

    query: int
    """This rank's query chunk: 0 (head) or 1 (tail)."""
    key: int
    """The key chunk's position in the gathered order (0 .. 2·cp-1)."""
    causal: bool
    """The diagonal block without a mask: the kernel's causal flag."""
    mask: torch.Tensor | None
    """(batch or 1, 1, c, c) bool, True = attend, where some but not all pairs are visible; None otherwise."""


def blocks(cp: int, rank: int, c: int, spec: SequenceMask | None, device: torch.device) -> Iterator[Block]:
    """The blocks this rank computes, per query chunk the diagonal one first (every query sees itself there,
    so the merge starts from a finite log-sum-exp), masks built one block at a time. ``spec`` None: causal by
    global position. Blocks whose keys all lie after the chunk, outside the window, or in other documents are
    skipped."""
    for query, q_chunk in enumerate((rank, 2 * cp - 1 - rank)):
        keys = sorted((p for p in range(2 * cp) if global_chunk(p, cp) <= q_chunk),
                      key=lambda p: global_chunk(p, cp) != q_chunk)
        for p in keys:
            k_chunk = global_chunk(p, cp)
            if spec is None:
                yield Block(query, p, k_chunk == q_chunk, None)
                continue
            if spec.window and (k_chunk + 1) * c - 1 <= q_chunk * c - spec.window:
                continue  # every key of the block is at or before every query's window start
            qi = torch.arange(q_chunk * c, (q_chunk + 1) * c, device=device).view(-1, 1)
            kj = torch.arange(k_chunk * c, (k_chunk + 1) * c, device=device).view(1, -1)
            allowed = kj <= qi
            if spec.window:
                allowed = allowed & (kj > qi - spec.window)
            allowed = allowed.unsqueeze(0)
            if spec.documents is not None:
                docs = spec.documents
                allowed = allowed & (docs[:, qi.view(-1)].unsqueeze(2) == docs[:, kj.view(-1)].unsqueeze(1))
            if not allowed.any():
                continue
            yield Block(query, p, False, None if allowed.all() else allowed.unsqueeze(1))


def _additive(mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """A boolean block mask as the kernels take it: 0 where True, -inf elsewhere, in ``dtype``."""
    if mask is None:
        return None
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))


class BlockwiseAttention(torch.autograd.Function):
    """See the module docstring. ``forward(q, k, v, spec, group, rank, scale, kernels)``: q (b, h, 2·c, d),
    k, v (b, kv_h, 2·c, d) this rank's tokens (head chunk, tail chunk) -> (b, h, 2·c, d) in q's dtype;
    ``spec`` a :class:`SequenceMask` or None (causal), ``kernels`` from :func:`lse_kernels`."""

    @staticmethod
    def forward(ctx, q, k, v, spec, group, rank, scale, kernels):
        fwd = kernels[0]
        cp, c = group.size(), q.shape[2] // 2
        k_all, v_all = all_gather_sequence(k, group), all_gather_sequence(v, group)
        b, h, n, d = q.shape
        out = q.new_empty(b, n, h, d).transpose(1, 2)  # (b, n, h, d) in memory: o_proj's input is a view
        lse = torch.empty(b, h, n, dtype=torch.float32, device=q.device)
        merged: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # per chunk, float64 (one chunk's rows)
        for blk in blocks(cp, rank, c, spec, q.device):
            rows, keys = slice(blk.query * c, (blk.query + 1) * c), slice(blk.key * c, (blk.key + 1) * c)
            o, m = fwd(q[:, :, rows], k_all[:, :, keys], v_all[:, :, keys], blk.causal,
                       _additive(blk.mask, q.dtype), scale)
            if blk.mask is not None:  # rows with no visible key: the kernel's lse 0 means "no mass" here
                m = m.masked_fill(~blk.mask.any(-1), float("-inf"))
            if blk.query not in merged:
                merged[blk.query] = (o.double(), m.double())
                continue
            o_acc, m_acc = merged[blk.query]
            m_new = torch.logaddexp(m_acc, m.double())
            o_acc = o_acc * (m_acc - m_new).exp().unsqueeze(-1) + o.double() * (m - m_new).exp().unsqueeze(-1)
            merged[blk.query] = (o_acc, m_new)
        for query, (o_acc, m_acc) in merged.items():
            out[:, :, query * c:(query + 1) * c] = o_acc
            lse[:, :, query * c:(query + 1) * c] = m_acc
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.spec, ctx.group, ctx.rank, ctx.scale, ctx.kernels = spec, group, rank, scale, kernels
        return out

    @staticmethod
    def backward(ctx, d_out):
        q, k, v, out, lse = ctx.saved_tensors
        bwd, group = ctx.kernels[1], ctx.group
        cp, c = group.size(), q.shape[2] // 2
        k_all, v_all = all_gather_sequence(k, group), all_gather_sequence(v, group)
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        dk_all = torch.zeros(k_all.shape, dtype=torch.float32, device=q.device)
        dv_all = torch.zeros(v_all.shape, dtype=torch.float32, device=q.device)
        for blk in blocks(cp, ctx.rank, c, ctx.spec, q.device):
            rows, keys = slice(blk.query * c, (blk.query + 1) * c), slice(blk.key * c, (blk.key + 1) * c)
            gq, gk, gv = bwd(d_out[:, :, rows].contiguous(), q[:, :, rows], k_all[:, :, keys],
                             v_all[:, :, keys], out[:, :, rows], lse[:, :, rows].contiguous(), blk.causal,
                             _additive(blk.mask, q.dtype), ctx.scale)
            dq[:, :, rows] += gq
            dk_all[:, :, keys] += gk
            dv_all[:, :, keys] += gv
        del k_all, v_all
        dk = reduce_scatter_sequence(dk_all, group).to(k.dtype)
        dv = reduce_scatter_sequence(dv_all, group).to(v.dtype)
        return dq.to(q.dtype), dk, dv, None, None, None, None, None
