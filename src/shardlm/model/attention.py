"""Document masking (block-causal attention) for packed samples, and the attention backends that run it.

A packed row holds several documents back to back. ``documents`` (batch, seq) int64 gives each token the
index of its document within the row (documents back to back, each one run of equal ids; the padding after
them is a document of its own, id -1 in the prepared data).
Under block-causal attention a query attends only to earlier keys of its own document (and, on a local
layer, only to the last ``window`` of them), and its rotary position counts from 0 at its document's first
token (:func:`document_positions`), so each document gets the logits it would get alone. This is the mask
of Llama 3 (Dubey et al., "The Llama 3 Herd of Models", 2024, §3.2: "an attention mask that prevents
self-attention between different documents within the same sequence") and torchtitan's ``block_causal``.

Backends, behind :func:`attention` (the mask's type selects the kernel):

=========  =====================================================================================
``sdpa``   PyTorch ``scaled_dot_product_attention`` with a dense additive mask (batch, 1, seq, seq) made
           once per forward in the compute dtype: any device, memory ``batch · seq²`` elements per
           distinct window, saved for backward once (not per layer). The CPU default and the reference.
``flex``   ``torch.nn.attention.flex_attention`` with a ``BlockMask`` (Dong et al., "Flex Attention", 2024):
           compiled on CUDA (the default there), eager elsewhere (slow; forward only on CPU: PyTorch
           has no flex backward there).
``varlen`` refused by name: PyTorch's variable-length flash attention (``cu_seqlens``, no padding at all)
           runs only on CUDA, where it has not been tested; ``bench/gpu_check.py`` checks ``sdpa`` and
           compiled ``flex`` on a GPU instead.
=========  =====================================================================================
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

try:  # PyTorch >= 2.5
    from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention
except ImportError:  # pragma: no cover - an old PyTorch: the flex backend is refused by resolve_backend
    BlockMask, create_block_mask, flex_attention = None, None, None

#: the attention patterns ``model.attention`` may name
ATTENTION_KINDS = ("causal", "block_causal")
#: the backends ``model.attention_backend`` may name (``auto`` picks one by device; ``varlen`` is refused
#: by name)
BACKENDS = ("auto", "sdpa", "flex", "varlen")


def flex_available() -> bool:
    """Whether this PyTorch has ``torch.nn.attention.flex_attention`` (PyTorch >= 2.5)."""
    return flex_attention is not None


def resolve_backend(backend: str, device: torch.device | str, training: bool = False) -> str:
    """The backend that runs block-causal attention on ``device``: ``sdpa`` or ``flex``.

    ``auto`` is ``flex`` on CUDA when this PyTorch has it, ``sdpa`` otherwise (the dense-mask reference).
    ``training``: gradients are needed; PyTorch's flex attention has no backward on CPU (its
    ``_validate_device`` refuses it, PyTorch 2.13), so ``flex`` is then refused on CPU.

    Raises:
        ValueError: an unknown backend, ``flex`` on a PyTorch without ``flex_attention``, or ``flex`` for
            training on CPU (each message names the cause and the alternative).
    """
    if backend not in BACKENDS:
        raise ValueError(f"model.attention_backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    if backend == "varlen":
        raise ValueError("model.attention_backend='varlen' (variable-length flash attention over cu_seqlens, "
                         "torch.nn.attention.varlen.varlen_attn) is not built: PyTorch runs it only on CUDA, "
                         "where shardlm cannot test it yet; use 'flex' (compiled on CUDA, skips masked "
                         "blocks) or 'sdpa'")
    device_type = torch.device(device).type
    if backend == "auto":
        return "flex" if device_type == "cuda" and flex_available() else "sdpa"
    if backend == "flex" and not flex_available():
        raise ValueError("model.attention_backend='flex' needs torch.nn.attention.flex_attention, which "
                         f"PyTorch {torch.__version__} lacks (PyTorch >= 2.5); use 'sdpa' (a dense mask) or "
                         "'auto'")
    if backend == "flex" and training and device_type == "cpu":
        raise ValueError(f"model.attention_backend='flex' cannot train on CPU: PyTorch {torch.__version__}'s "
                         "flex_attention has no backward there; use 'sdpa' (a dense mask) or 'auto'")
    return backend


def document_positions(documents: torch.Tensor) -> torch.Tensor:
    """Position of each token within its document: (batch, seq) int64 -> (batch, seq) int64.

    ``documents`` holds each document as one run of equal ids along its row (back to back); a token's
    position is its index minus the index of the first token of its run of equal document ids, so it
    restarts at 0.
    """
    t = documents.shape[1]
    index = torch.arange(t, device=documents.device).expand_as(documents)
    starts = torch.ones_like(documents, dtype=torch.bool)
    starts[:, 1:] = documents[:, 1:] != documents[:, :-1]
    return index - torch.where(starts, index, 0).cummax(dim=1).values


def dense_mask(documents: torch.Tensor, window: int = 0) -> torch.Tensor:
    """Boolean block-causal mask (batch, 1, seq, seq), True = attend: key j of query i when both are in the
    same document, j <= i, and (``window`` > 0) i - window < j (HF's sliding window, per document)."""
    t = documents.shape[1]
    q = torch.arange(t, device=documents.device).view(t, 1)
    k = torch.arange(t, device=documents.device).view(1, t)
    allowed = k <= q
    if window:
        allowed = allowed & (k > q - window)
    return (allowed.unsqueeze(0) & (documents.unsqueeze(2) == documents.unsqueeze(1))).unsqueeze(1)


def additive_mask(
    documents: torch.Tensor, window: int = 0, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """:func:`dense_mask` as SDPA's additive mask (batch, 1, seq, seq) in ``dtype``: 0 = attend, -inf = not.

    SDPA turns a boolean mask into exactly this, in the query's dtype, on every call, and on CPU (flash) and
    CUDA (memory-efficient) keeps that copy for backward: one per layer, ``batch · seq²`` elements each.
    Made once per forward, every layer reads and saves the same tensor. Equal bit for bit to the boolean mask.
    """
    allowed = dense_mask(documents, window)
    return torch.zeros(allowed.shape, dtype=dtype, device=documents.device).masked_fill_(
        ~allowed, float("-inf")
    )


def block_mask(documents: torch.Tensor, window: int = 0) -> Any:
    """The same pattern as :func:`dense_mask` as a flex-attention ``BlockMask`` (batch, 1 head, seq, seq),
    built on ``documents``' device (``create_block_mask``'s own default is CUDA)."""
    b, t = documents.shape

    def mask_mod(batch, head, q, kv):
        same = documents[batch, q] == documents[batch, kv]
        keep = same & (kv <= q)
        return keep & (kv > q - window) if window else keep

    return create_block_mask(mask_mod, b, None, t, t, device=documents.device)


def document_masks(documents: torch.Tensor, windows: set[int], backend: str,
                   dtype: torch.dtype = torch.float32) -> dict[int, Any]:
    """One mask per distinct window (0 = a global layer) for a forward pass: a ``BlockMask`` (``flex``) or an
    additive mask in ``dtype``, the attention's compute dtype (``sdpa``, :func:`additive_mask`)."""
    if backend == "flex":
        return {w: block_mask(documents, w) for w in sorted(windows)}
    return {w: additive_mask(documents, w, dtype) for w in sorted(windows)}


_compiled_flex = None


def flex(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Any, scale: float | None) -> torch.Tensor:
    """Flex attention of q (batch, n_heads, seq, head_dim) over k, v (batch, n_kv_heads, seq, head_dim) under
    the ``BlockMask`` ``mask``: compiled on CUDA (the fused kernel), eager elsewhere. Returns q's shape
    and dtype."""
    global _compiled_flex
    fn = flex_attention
    if q.device.type == "cuda":
        if _compiled_flex is None:
            _compiled_flex = torch.compile(flex_attention, dynamic=False)
        fn = _compiled_flex
    return fn(q, k, v, block_mask=mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1])


def sink_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                   sinks: torch.Tensor, scale: float) -> torch.Tensor:
    """Attention with a learned sink logit per head (gpt-oss; Xiao et al., "Efficient Streaming Language
    Models with Attention Sinks", 2023), as transformers' ``GptOssAttention`` computes it (eager: SDPA has
    no sinks).

    q (batch, n_heads, seq, head_dim); k, v (batch, n_kv_heads, kv_seq, head_dim), grouped as in
    :func:`attention`; ``mask``: None (causal, seq == kv_seq) or boolean (True = attend), broadcastable to
    (batch, n_heads, seq, kv_seq); ``sinks`` (n_heads,). Each query's scores ``q·k · scale`` get the head's
    sink as one more logit; the softmax runs over all (max subtracted first, as transformers), the sink's
    probability is dropped, the rest weight v. Returns (batch, n_heads, seq, head_dim) in q's dtype.

    Raises:
        ValueError: a flex-attention ``BlockMask`` (sinks are built for dense masks only).
    """
    if BlockMask is not None and isinstance(mask, BlockMask):
        raise ValueError("attention sinks (gpt-oss) are built with dense masks only: set "
                         "model.attention_backend = 'sdpa' for block-causal attention")
    repeat = q.shape[1] // k.shape[1]
    if repeat > 1:
        k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
    scores = torch.matmul(q, k.transpose(2, 3)) * scale
    if mask is None:
        t = q.shape[2]
        mask = torch.ones(t, t, dtype=torch.bool, device=q.device).tril()
    scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
    sink = sinks.to(scores.dtype).reshape(1, -1, 1, 1).expand(scores.shape[0], -1, scores.shape[2], 1)
    logits = torch.cat([scores, sink], dim=-1)
    logits = logits - logits.max(dim=-1, keepdim=True).values
    probs = torch.softmax(logits, dim=-1)[..., :-1]
    return torch.matmul(probs.to(v.dtype), v)


def sdpa_has_enable_gqa() -> bool:
    """Whether this PyTorch's ``scaled_dot_product_attention`` takes ``enable_gqa`` (PyTorch >= 2.5)."""
    doc = F.scaled_dot_product_attention.__doc__ or ""
    return "enable_gqa" in doc.split("->", 1)[0]


#: SDPA reads grouped key/value heads itself (no repeated copies of K and V)
SDPA_ENABLE_GQA = sdpa_has_enable_gqa()


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None,
              enable_gqa: bool = SDPA_ENABLE_GQA, scale: float | None = None) -> torch.Tensor:
    """Scaled dot-product attention with grouped query heads; causal when ``mask`` is None.

    Args:
        q: (batch, n_heads, seq, head_dim); k, v: (batch, n_kv_heads, kv_seq, head_dim), n_kv_heads
            dividing n_heads; query head h reads key/value head h // (n_heads / n_kv_heads).
        mask: None (causal over equal lengths), a boolean/additive mask broadcastable to
            (batch, n_heads, seq, kv_seq) (SDPA), or a flex-attention ``BlockMask`` (the flex backend).
        enable_gqa: pass the grouped heads to SDPA as they are (``enable_gqa=True``; no K/V copies, which
            at Llama 3 8B's 32/8 heads would be 4x the K/V memory); False repeats K and V with
            ``repeat_interleave`` first (HF's ``repeat_kv``), for a PyTorch without ``enable_gqa``.
            Both give the same result (tested within 1e-6 in fp32).
        scale: factor of the scores q·k; None means ``head_dim ** -0.5`` (Gemma: ``query_pre_attn_scalar
        ** -0.5``).

    Returns:
        (batch, n_heads, seq, head_dim), the dtype of ``q``.
    """
    if BlockMask is not None and isinstance(mask, BlockMask):
        return flex(q, k, v, mask, scale)
    repeat = q.shape[1] // k.shape[1]
    extra = {}
    if repeat > 1 and enable_gqa:
        extra["enable_gqa"] = True
    elif repeat > 1:
        k = k.repeat_interleave(repeat, dim=1)
        v = v.repeat_interleave(repeat, dim=1)
    if mask is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, **extra)
    if mask.is_floating_point() and mask.dtype != q.dtype:  # an additive mask made in another dtype than q's
        mask = mask.to(q.dtype)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, **extra)
