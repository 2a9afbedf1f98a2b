"""Context-parallel attention that saves only the rank's own tensors: blockwise, merged by log-sum-exp.

The ring attention of Megatron-LM / torchtitan and of PyTorch's own ``context_parallel``. CP rank r holds two
query chunks of ``c`` tokens, global chunks ``r`` (head) and ``2·cp - 1 - r`` (tail) of the ``2·cp`` chunks
(:mod:`shardlm.parallel.cp`). The forward passes each rank's K and V around the CP group's ring
(point-to-point, :func:`ring_pass`: at step s this rank holds CP rank ``(r - s) % cp``'s two chunks, sends
them on while it computes, and drops them after), attends each query chunk to every key chunk it may see with
a kernel that returns the log-sum-exp of its scores, and merges the partial outputs exactly: ``lse = log(Σ_m
exp(lse_m))``, ``out = Σ_m exp(lse_m - lse)·out_m`` (Milakov & Gimelshein 2018, "Online normalizer calculation
for softmax"; FlashAttention-2, Dao 2023, §3.1), in float64 per chunk. Per block: the diagonal block (a chunk
against itself) under the kernel's causal flag, earlier chunks unmasked, later ones skipped; under documents
or a window a boolean mask of that block only, built from the global indices and document ids, and a block
with no visible key skipped. It saves q, the local k and v, the output and the log-sum-exp: nothing of
``T_pad`` rows.

The backward passes K and V around the ring again and runs the kernel's backward per block with the merged
output and log-sum-exp, which is exact: with ``P = exp(S - lse)`` and ``D = rowsum(dO ∘ O)`` of the whole row,
every block's ``dS = P ∘ (dP - D)`` is the block of the full row's (FlashAttention-2, Algorithm 2). The key
and value gradients (float32) travel with their K and V and reach their owner after ``cp`` passes, each summed
in ring order. Memory beyond the saved tensors: two ranks' K/V (the held and the incoming) and in the backward
their gradients, ``4·c`` rows each, whatever ``cp``.

Attention sinks (gpt-oss: a logit per head in every query's softmax normaliser, a key of value zero) join
each query chunk's merged log-sum-exp once, after all its blocks, on the rank that holds the query
(:func:`shardlm.model.sinks.fold_sinks`): ``lse' = log(exp(lse) + exp(sink))``, ``out' = out ·
exp(lse - lse')``. The backward runs each block's kernel with ``out'`` and ``lse'``, which is exact for the
softmax with the sink (its column's value is zero, so it adds nothing to ``dP``), and the sink's gradient is
``-Σ exp(sink - lse') · D`` over this rank's queries (``D = rowsum(dO ∘ out')``, the softmax gradient of the
sink's column); the ranks' parts are summed with the other parameters' gradients.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

from shardlm.model.sinks import fold_sinks
from shardlm.model.sinks import lse_kernels as lse_kernels  # where the kernels live (re-exported)


@dataclass(frozen=True)
class SequenceMask:
    """What masked CP attention needs to build any block's mask: the sequence's document ids and a window."""

    documents: torch.Tensor | None
    """(batch, T_pad) int64 document ids of the padded sequence (the data's padding -1; each token of CP's
    padding a document of its own: ids -2, -3, ...), or None (one document)."""
    window: int
    """Sliding window in tokens: query i sees key j only when i - window < j (0 = no window)."""


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


def visible(queries: torch.Tensor, keys: torch.Tensor, spec: SequenceMask) -> torch.Tensor:
    """Which keys each query sees, by global token index: queries (n,) and keys (m,) int64 ->
    (1 or batch, n, m) bool, True = attend: key j of query i when j <= i, i - window < j (``spec.window`` >
    0) and, with ``spec.documents``, both are in the same document."""
    qi, kj = queries.view(-1, 1), keys.view(1, -1)
    allowed = kj <= qi
    if spec.window:
        allowed = allowed & (kj > qi - spec.window)
    allowed = allowed.unsqueeze(0)
    if spec.documents is not None:
        docs = spec.documents
        allowed = allowed & (docs[:, queries].unsqueeze(2) == docs[:, keys].unsqueeze(1))
    return allowed


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
            allowed = visible(torch.arange(q_chunk * c, (q_chunk + 1) * c, device=device),
                              torch.arange(k_chunk * c, (k_chunk + 1) * c, device=device), spec)
            if not allowed.any():
                continue
            yield Block(query, p, False, None if allowed.all() else allowed.unsqueeze(1))


def _additive(mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """A boolean block mask as the kernels take it: 0 where True, -inf elsewhere, in ``dtype``."""
    if mask is None:
        return None
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))


def ring_steps(cp: int, rank: int, c: int, spec: SequenceMask | None,
               device: torch.device) -> list[list[Block]]:
    """:func:`blocks` by ring step: step s holds the keys and values of CP rank ``(rank - s) % cp`` (its
    chunks: gathered positions ``2·src`` and ``2·src + 1``); step 0 (this rank's own) starts with the diagonal
    blocks, so each query chunk's merge still starts from its diagonal."""
    steps: list[list[Block]] = [[] for _ in range(cp)]
    for blk in blocks(cp, rank, c, spec, device):
        steps[(rank - blk.key // 2) % cp].append(blk)
    steps[0].sort(key=lambda blk: global_chunk(blk.key, cp) != (rank, 2 * cp - 1 - rank)[blk.query])
    return steps


def ring_pass(x: torch.Tensor, group: dist.ProcessGroup, rank: int) -> tuple[torch.Tensor, list[dist.Work]]:
    """Send ``x`` to the next CP rank of the ring and receive the previous one's (same shape and dtype) into a
    new tensor; returns it and the requests to wait on (point-to-point, overlapping the caller's compute)."""
    cp = group.size()
    received = torch.empty_like(x)
    works = dist.batch_isend_irecv([
        dist.P2POp(dist.isend, x, group=group, group_peer=(rank + 1) % cp),
        dist.P2POp(dist.irecv, received, group=group, group_peer=(rank - 1) % cp)])
    return received, works


def _wait(works: list[dist.Work]) -> None:
    for work in works:
        work.wait()


def _rows(chunk: int, c: int) -> slice:
    """The sequence slice of a rank's chunk 0 (head) or 1 (tail), ``c`` tokens each."""
    return slice(chunk * c, (chunk + 1) * c)


class BlockwiseAttention(torch.autograd.Function):
    """See the module docstring. ``forward(q, k, v, spec, group, rank, scale, kernels, sinks=None)``: q (b, h,
    2·c, d), k, v (b, kv_h, 2·c, d) this rank's tokens (head chunk, tail chunk) -> (b, h, 2·c, d) in q's
    dtype; ``spec`` a :class:`SequenceMask` or None (causal), ``kernels`` from :func:`lse_kernels`,
    ``sinks`` None or (h,) attention sinks (one logit per head, joined once to each query's normaliser).

    K and V travel around the ring (:func:`ring_pass`): at step s this rank holds CP rank ``(rank - s) %
    cp``'s two chunks and sends them on while it attends to them; in the backward their float32 gradients
    travel with them and reach their owner after ``cp`` passes (each rank's K/V gradient summed in ring
    order)."""

    @staticmethod
    def forward(ctx, q, k, v, spec, group, rank, scale, kernels, sinks=None):
        fwd = kernels[0]
        cp, c = group.size(), q.shape[2] // 2
        b, h, n, d = q.shape
        out = q.new_empty(b, n, h, d).transpose(1, 2)  # (b, n, h, d) in memory: o_proj's input is a view
        lse = torch.empty(b, h, n, dtype=torch.float32, device=q.device)
        merged: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # per chunk, float64 (one chunk's rows)
        kv = torch.stack([k, v])  # (2, b, kv_h, 2·c, d): the chunks of the step's source rank
        for step, step_blocks in enumerate(ring_steps(cp, rank, c, spec, q.device)):
            received, works = ring_pass(kv, group, rank) if step < cp - 1 else (None, [])
            for blk in step_blocks:
                rows, keys = _rows(blk.query, c), _rows(blk.key % 2, c)
                o, m = fwd(q[:, :, rows], kv[0, :, :, keys], kv[1, :, :, keys], blk.causal,
                           _additive(blk.mask, q.dtype), scale)
                if blk.mask is not None:  # rows with no visible key: the kernel's lse 0 means "no mass" here
                    m = m.masked_fill(~blk.mask.any(-1), float("-inf"))
                if blk.query not in merged:
                    merged[blk.query] = (o.double(), m.double())
                    continue
                o_acc, m_acc = merged[blk.query]
                m_new = torch.logaddexp(m_acc, m.double())
                o_acc = (o_acc * (m_acc - m_new).exp().unsqueeze(-1)
                         + o.double() * (m - m_new).exp().unsqueeze(-1))
                merged[blk.query] = (o_acc, m_new)
            _wait(works)
            kv = received
        for query, (o_acc, m_acc) in merged.items():
            if sinks is not None:  # the sink joins the whole row's normaliser: once, after every block
                o_acc, m_acc = fold_sinks(o_acc, m_acc, sinks.detach())
            out[:, :, _rows(query, c)] = o_acc
            lse[:, :, _rows(query, c)] = m_acc
        ctx.save_for_backward(q, k, v, out, lse, sinks)
        ctx.spec, ctx.group, ctx.rank, ctx.scale, ctx.kernels = spec, group, rank, scale, kernels
        return out

    @staticmethod
    def backward(ctx, d_out):
        q, k, v, out, lse, sinks = ctx.saved_tensors
        bwd, group, rank = ctx.kernels[1], ctx.group, ctx.rank
        cp, c = group.size(), q.shape[2] // 2
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        kv = torch.stack([k, v])
        dkv = torch.zeros(kv.shape, dtype=torch.float32, device=q.device)  # the gradient of the step's kv
        for step, step_blocks in enumerate(ring_steps(cp, rank, c, ctx.spec, q.device)):
            received, works = ring_pass(kv, group, rank) if step < cp - 1 else (None, [])
            for blk in step_blocks:
                rows, keys = _rows(blk.query, c), _rows(blk.key % 2, c)
                gq, gk, gv = bwd(d_out[:, :, rows].contiguous(), q[:, :, rows], kv[0, :, :, keys],
                                 kv[1, :, :, keys], out[:, :, rows], lse[:, :, rows].contiguous(), blk.causal,
                                 _additive(blk.mask, q.dtype), ctx.scale)
                dq[:, :, rows] += gq
                dkv[0, :, :, keys] += gk
                dkv[1, :, :, keys] += gv
            _wait(works)
            kv = received
            dkv, works = ring_pass(dkv, group, rank)  # on to the next rank; the last pass brings ours home
            _wait(works)
        d_sinks = None
        if sinks is not None:  # the softmax gradient of the sink's column: -P_sink · D, summed over queries
            delta = (d_out.double() * out.double()).sum(-1)  # (b, h, 2·c)
            p_sink = torch.exp(sinks.double().view(1, -1, 1) - lse.double())
            d_sinks = (-(p_sink * delta).sum((0, 2))).to(sinks.dtype)
        return (dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None, None, None,
                d_sinks)
