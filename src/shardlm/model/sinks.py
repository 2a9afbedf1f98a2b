"""Attention sinks (gpt-oss): each head's learned logit joins every query's softmax normaliser as a key of
value zero (Xiao et al., "Efficient Streaming Language Models with Attention Sinks", 2023; transformers'
``GptOssAttention``). :func:`fold_sinks` joins them to a kernel's output and log-sum-exp (flex, context
parallelism's blockwise attention, and the dense-mask path :func:`sink_attention` through the CPU's flash
kernel, :func:`lse_kernels`); :func:`shardlm.model.attention.attention` calls these under every mask form.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

#: a kernel with log-sum-exp: (q, k, v, causal, additive mask or None, scale) -> (out, lse (b, h, n) float32)
Forward = Callable[..., tuple[torch.Tensor, torch.Tensor]]
#: its backward: (d_out, q, k, v, out, lse, causal, mask, scale) -> (dq, dk, dv)
Backward = Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


def lse_kernels(device_type: str) -> tuple[Forward, Backward] | None:
    """The attention kernel with a log-sum-exp, and its backward, for ``device_type``; None where shardlm has
    none (then :class:`~shardlm.parallel.cp.ContextParallel` keeps its all-gather path under a dense mask, and
    :func:`sink_attention` its eager path).

    CPU: ``torch.ops.aten._scaled_dot_product_flash_attention_for_cpu`` and its ``_backward``, private ATen
    ops pinned by torch==2.13.0 (the project's pin). Measured there: they read grouped K/V heads as they are
    (no repeat), take an additive ``attn_mask`` of q's dtype (not a boolean one) broadcast over batch and
    heads, and return out 0 and lse 0 for a row whose keys are all masked (their callers set such rows' lse
    to -inf). CUDA's counterparts (``_scaled_dot_product_flash_attention`` /
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


def fold_sinks(out: torch.Tensor, lse: torch.Tensor,
               sinks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Join attention sinks to an attention result that left them out: the sink logit of each head becomes one
    more term of every query's softmax normaliser, a key whose value is zero.

    Args:
        out: (batch, n_heads, seq, head_dim), softmax-weighted values over the keys alone, any float dtype.
        lse: (batch, n_heads, seq), the log-sum-exp (natural log) of each query's scaled, masked scores over
            those keys (-inf for a query that sees none), float32 or float64.
        sinks: (n_heads,), one logit per head.

    Returns:
        ``out · exp(lse - lse')`` in ``out``'s dtype and ``lse' = log(exp(lse) + exp(sink))`` in ``lse``'s
        dtype: the output and log-sum-exp of the softmax over the keys and the sink together, since
        ``softmax([s, sink])_j = exp(s_j - lse')`` and the sink's value is zero. The same merge as that of two
        partial attentions by log-sum-exp (Milakov & Gimelshein 2018), one of them the sink with output 0;
        it is how transformers' ``GptOssAttention`` reads (a sink column in the softmax, dropped after).
        Applied once to the full row's log-sum-exp it gives the sink its share exactly once.
    """
    sink = sinks.to(lse.dtype).view(1, -1, 1)
    total = torch.logaddexp(lse, sink)
    return out * torch.exp(lse - total).unsqueeze(-1).to(out.dtype), total


class KernelSinkAttention(torch.autograd.Function):
    """Sink attention through a kernel with a log-sum-exp (:func:`lse_kernels`), saving no seq × seq tensor.

    ``apply(q, k, v, sinks, causal, mask, scale, kernels)``: q (b, h, n, d), k, v (b, kv_h, m, d), sinks (h,),
    ``causal`` the kernel's causal flag (n == m, no mask), ``mask`` None or additive (b or 1, 1, n, m) in q's
    dtype -> (b, h, n, d) in q's dtype. The forward runs the kernel over the keys alone and joins the sinks
    to its output and log-sum-exp (:func:`fold_sinks`); it saves q, k, v, the joined output and log-sum-exp.
    The backward runs the kernel's backward with those, which is exact for the softmax with the sink column
    (the column's value is zero: it adds nothing to ``dP``; FlashAttention-2, Dao 2023, Algorithm 2), and
    gives the sinks ``-Σ exp(sink - lse') · rowsum(dO ∘ out')`` (the softmax gradient of their column)."""

    @staticmethod
    def forward(ctx, q, k, v, sinks, causal, mask, scale, kernels):
        out, lse = kernels[0](q, k, v, causal, mask, scale)
        if mask is not None:  # a row that sees no key: the kernel's lse 0 means "no mass" here
            lse = lse.masked_fill(torch.isneginf(mask).all(-1), float("-inf"))
        out, lse = fold_sinks(out, lse, sinks.detach())
        lse = lse.contiguous()
        ctx.save_for_backward(q, k, v, out, lse, sinks, mask)
        ctx.causal, ctx.scale, ctx.kernels = causal, scale, kernels
        return out

    @staticmethod
    def backward(ctx, d_out):
        q, k, v, out, lse, sinks, mask = ctx.saved_tensors
        dq, dk, dv = ctx.kernels[1](d_out.contiguous(), q, k, v, out, lse, ctx.causal, mask, ctx.scale)
        delta = (d_out.float() * out.float()).sum(-1)  # (b, h, n)
        d_sinks = -(torch.exp(sinks.float().view(1, -1, 1) - lse) * delta).sum((0, 2))
        return dq, dk, dv, d_sinks.to(sinks.dtype), None, None, None, None


def sink_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                   sinks: torch.Tensor, scale: float | None = None, kernel: bool = True) -> torch.Tensor:
    """Attention with a learned sink logit per head under a dense mask (or none), as transformers'
    ``GptOssAttention`` defines it (SDPA has no sinks; Xiao et al., "Efficient Streaming Language Models with
    Attention Sinks", 2023): each query's scores ``q·k · scale`` get the head's sink as one more logit, the
    softmax runs over all, the sink's probability is dropped and the rest weight v.

    Where :func:`lse_kernels` has a kernel (CPU) and ``kernel`` is True, through it
    (:class:`KernelSinkAttention`: memory linear in the sequence, as SDPA's); elsewhere eagerly as
    transformers' eager attention (the softmax in float32; the (batch, n_heads, seq, kv_seq) float32
    probabilities are kept for the backward).

    Args:
        q: (batch, n_heads, seq, head_dim); k, v: (batch, n_kv_heads, kv_seq, head_dim), grouped as in
            :func:`attention`.
        mask: None (causal; the queries are the last ``seq`` of ``kv_seq`` positions), a boolean mask (True =
            attend) or an additive one (0 = attend, -inf = not), broadcastable to (batch, n_heads, seq,
            kv_seq), and over heads: the mask forms of :func:`attention`.
        sinks: (n_heads,).
        scale: factor of the scores; None means ``head_dim ** -0.5``.
        kernel: False computes eagerly even where a kernel exists (the reference the kernel is tested
            against).

    Returns:
        (batch, n_heads, seq, head_dim) in q's dtype.
    """
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    n, m = q.shape[2], k.shape[2]
    kernels = lse_kernels(q.device.type) if kernel else None
    if kernels is not None:
        if mask is None and n != m:
            mask = torch.ones(n, m, dtype=torch.bool, device=q.device).tril(m - n)
        if mask is not None:
            if mask.dtype == torch.bool:
                mask = torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill_(
                    ~mask, float("-inf"))
            mask = mask.to(q.dtype)
            mask = mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape))
        return KernelSinkAttention.apply(q, k, v, sinks, mask is None, mask, scale, kernels)
    repeat = q.shape[1] // k.shape[1]
    if repeat > 1:
        k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
    scores = torch.matmul(q, k.transpose(2, 3)).float() * scale
    if mask is None:
        mask = torch.ones(n, m, dtype=torch.bool, device=q.device).tril(m - n)
    if mask.dtype == torch.bool:
        scores = scores.masked_fill(~mask, float("-inf"))
    else:
        scores = scores + mask.float()
    sink = sinks.float().reshape(1, -1, 1, 1).expand(scores.shape[0], -1, n, 1)
    probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    return torch.matmul(probs.to(v.dtype), v)
