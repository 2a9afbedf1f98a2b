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
``per_document``
           each row cut into its documents (runs of equal ids, the padding one of them) and SDPA run on
           each alone, causal (``is_causal``; a local layer: a (n, n) band mask of the document's n
           tokens): no score between two documents is computed, no (seq, seq) mask exists. Any device;
           the CPU default (measured faster than the dense mask at packed rows whose documents average a
           quarter of the row: see ``bench/bench_packing.py``). Sinks as under any mask. Eager inside a
           compiled block (``parallel.compile``): a new layout of documents compiles nothing again.
``sdpa``   PyTorch ``scaled_dot_product_attention`` with a dense additive mask (batch, 1, seq, seq) made
           once per forward in the compute dtype: any device, memory ``batch · seq²`` elements per
           distinct window, saved for backward once (not per layer). The reference the others are
           tested against.
``flex``   ``torch.nn.attention.flex_attention`` with a ``BlockMask`` (Dong et al., "Flex Attention", 2024):
           compiled on CUDA (the default there), eager elsewhere (slow; forward only on CPU: PyTorch
           has no flex backward there).
``varlen`` refused by name: PyTorch's variable-length flash attention (``cu_seqlens``, no padding at all)
           runs only on CUDA, where it has not been tested; ``bench/gpu_check.py`` checks ``sdpa`` and
           compiled ``flex`` on a GPU instead.
=========  =====================================================================================

Attention sinks (gpt-oss) are a property of the attention, not of a backend: ``attention(..., sinks=)``
takes each head's sink logit, which joins every query's softmax normaliser as a key of value zero, under
any mask form (none, boolean, additive, ``BlockMask``; context parallelism's blockwise attention joins it
once to each query's merged log-sum-exp, :mod:`shardlm.parallel.cp_attention`); they live in
:mod:`shardlm.model.sinks`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from shardlm.model.sinks import fold_sinks, sink_attention

try:  # PyTorch >= 2.5
    from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention
except ImportError:  # pragma: no cover - an old PyTorch: the flex backend is refused by resolve_backend
    BlockMask, create_block_mask, flex_attention = None, None, None
try:  # PyTorch >= 2.9 asks for the log-sum-exp this way (``return_lse`` before)
    from torch.nn.attention.flex_attention import AuxRequest
except ImportError:  # pragma: no cover - an older PyTorch
    AuxRequest = None

#: the attention patterns ``model.attention`` may name
ATTENTION_KINDS = ("causal", "block_causal")
#: the backends ``model.attention_backend`` may name (``auto`` picks one by device; ``varlen`` is refused
#: by name)
BACKENDS = ("auto", "per_document", "sdpa", "flex", "varlen")


def flex_available() -> bool:
    """Whether this PyTorch has ``torch.nn.attention.flex_attention`` (PyTorch >= 2.5)."""
    return flex_attention is not None


def resolve_backend(backend: str, device: torch.device | str, training: bool = False) -> str:
    """The backend that runs block-causal attention on ``device``: ``sdpa`` or ``flex``.

    ``auto`` is ``flex`` on CUDA when this PyTorch has it (its ``BlockMask`` skips the masked-out blocks in
    the fused kernel; not run here: no GPU), ``per_document`` otherwise (SDPA on each document alone).
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
        return "flex" if device_type == "cuda" and flex_available() else "per_document"
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


@dataclass(frozen=True)
class DocumentRuns:
    """Block-causal attention as the documents of each row, for :func:`per_document_attention`: ``runs[b]``
    the (start, length) of each run of equal document ids along row b, in order (padding is a run too, as
    under :func:`dense_mask`), ``window`` the layer's (0: global). Host integers, read once per forward."""

    runs: tuple[tuple[tuple[int, int], ...], ...]
    window: int = 0


def document_runs(documents: torch.Tensor, window: int = 0) -> DocumentRuns:
    """The runs of equal ids along each row of ``documents`` (batch, seq) int64 (one device-to-host read)."""
    t = documents.shape[1]
    starts = torch.ones_like(documents, dtype=torch.bool)
    starts[:, 1:] = documents[:, 1:] != documents[:, :-1]
    runs = []
    for row in starts.cpu().tolist():
        first = [i for i, s in enumerate(row) if s] + [t]
        runs.append(tuple((a, b - a) for a, b in zip(first[:-1], first[1:])))
    return DocumentRuns(tuple(runs), window)


@torch.compiler.disable
def per_document_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, runs: DocumentRuns,
                           scale: float | None = None, sinks: torch.Tensor | None = None,
                           enable_gqa: bool = True) -> torch.Tensor:
    """Block-causal attention as causal attention over each document alone: the documents of ``runs`` cut
    out of q (batch, n_heads, seq, head_dim), k and v (batch, n_kv_heads, seq, head_dim), each through
    :func:`attention` (SDPA's ``is_causal``; under a window shorter than the document a (n, n) boolean band
    mask), the outputs joined back in order. Equal to :func:`attention` under :func:`dense_mask` (each query
    sees exactly the keys of its own document, up to itself and the window) up to the kernels' summation
    order; the scores between documents are never computed. Consecutive rows cut at the same places go
    through each call together. Returns q's shape and dtype. Cut by ``torch.split``: one joining copy in
    backward (a slice's gradient would be a zero-filled whole tensor per piece).

    Runs eagerly inside a compiled block (``torch.compiler.disable``): traced, the document lengths would
    become guards, and every new layout of a batch would compile the block again (measured: three
    recompilations in the first 20 steps of block-causal pre-training on Shakespeare; after eight the
    compile cache gives up and runs the block eagerly); left out, the block compiles into the graphs before
    and after attention once, at fixed shapes."""
    groups: list[tuple[int, int]] = []  # [first, last + 1) row ranges of equal runs
    for b, row in enumerate(runs.runs):
        if groups and runs.runs[groups[-1][0]] == row:
            groups[-1] = (groups[-1][0], b + 1)
        else:
            groups.append((b, b + 1))
    out, rows = [], [end - first for first, end in groups]
    for (first, _), qg, kg, vg in zip(groups, *(x.split(rows, dim=0) for x in (q, k, v))):
        lengths, parts = [n for _, n in runs.runs[first]], []
        for n, qs, ks, vs in zip(lengths, *(x.split(lengths, dim=2) for x in (qg, kg, vg))):
            mask = None
            if runs.window and runs.window < n:
                i = torch.arange(n, device=q.device)
                mask = (i.view(1, n) <= i.view(n, 1)) & (i.view(1, n) > i.view(n, 1) - runs.window)
            parts.append(attention(qs, ks, vs, mask, enable_gqa, scale, sinks))
        out.append(join_seq_major(parts, dim=2))
    return join_seq_major(out, dim=0)


def join_seq_major(parts: list[torch.Tensor], dim: int) -> torch.Tensor:
    """``parts`` (batch, heads, seq, head_dim) joined along ``dim`` (0: batch, 2: seq) into one tensor of that
    shape laid out (batch, seq, heads, head_dim) in memory, as SDPA lays out its output, whatever the number
    of parts: the caller's ``transpose(1, 2).reshape(batch, seq, -1)`` is then a view, and a compiled block
    sees the same strides for a row of one document as for a row of several."""
    seq_major = [p.transpose(1, 2) for p in parts]
    joined = seq_major[0].contiguous() if len(parts) == 1 else torch.cat(seq_major, dim={0: 0, 2: 1}[dim])
    return joined.transpose(1, 2)


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
    """One mask per distinct window (0 = a global layer) for a forward pass: a ``BlockMask`` (``flex``), the
    rows' documents (``per_document``, :class:`DocumentRuns`) or an additive mask in ``dtype``, the
    attention's compute dtype (``sdpa``, :func:`additive_mask`)."""
    if backend == "per_document":
        runs = document_runs(documents)
        return {w: DocumentRuns(runs.runs, w) for w in sorted(windows)}
    if backend == "flex":
        return {w: block_mask(documents, w) for w in sorted(windows)}
    return {w: additive_mask(documents, w, dtype) for w in sorted(windows)}


_compiled_flex = None


def flex(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Any, scale: float | None,
         sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Flex attention of q (batch, n_heads, seq, head_dim) over k, v (batch, n_kv_heads, seq, head_dim) under
    the ``BlockMask`` ``mask``: compiled on CUDA (the fused kernel), eager elsewhere. With ``sinks``
    (n_heads,) the kernel's log-sum-exp is asked for too and the sinks joined to it (:func:`fold_sinks`; the
    gradient reaches the sinks, q, k and v through PyTorch's flex backward with a log-sum-exp gradient).
    Returns q's shape and dtype."""
    global _compiled_flex
    fn = flex_attention
    if q.device.type == "cuda":
        if _compiled_flex is None:
            _compiled_flex = torch.compile(flex_attention, dynamic=False)
        fn = _compiled_flex
    gqa = q.shape[1] != k.shape[1]
    if sinks is None:
        return fn(q, k, v, block_mask=mask, scale=scale, enable_gqa=gqa)
    if AuxRequest is not None:
        out, aux = fn(q, k, v, block_mask=mask, scale=scale, enable_gqa=gqa, return_aux=AuxRequest(lse=True))
        lse = aux.lse
    else:  # pragma: no cover - PyTorch < 2.9
        out, lse = fn(q, k, v, block_mask=mask, scale=scale, enable_gqa=gqa, return_lse=True)
    return fold_sinks(out, lse, sinks)[0]


def sdpa_has_enable_gqa() -> bool:
    """Whether this PyTorch's ``scaled_dot_product_attention`` takes ``enable_gqa`` (PyTorch >= 2.5)."""
    doc = F.scaled_dot_product_attention.__doc__ or ""
    return "enable_gqa" in doc.split("->", 1)[0]


#: SDPA reads grouped key/value heads itself (no repeated copies of K and V)
SDPA_ENABLE_GQA = sdpa_has_enable_gqa()


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None,
              enable_gqa: bool = SDPA_ENABLE_GQA, scale: float | None = None,
              sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Scaled dot-product attention with grouped query heads; causal when ``mask`` is None; with attention
    sinks when ``sinks`` is given.

    Args:
        q: (batch, n_heads, seq, head_dim); k, v: (batch, n_kv_heads, kv_seq, head_dim), n_kv_heads
            dividing n_heads; query head h reads key/value head h // (n_heads / n_kv_heads).
        mask: None (causal over equal lengths), a boolean/additive mask broadcastable to
            (batch, n_heads, seq, kv_seq) (SDPA), a flex-attention ``BlockMask`` (the flex backend), or
            :class:`DocumentRuns` (the per-document backend, :func:`per_document_attention`).
        enable_gqa: pass the grouped heads to SDPA as they are (``enable_gqa=True``; no K/V copies, which
            at Llama 3 8B's 32/8 heads would be 4x the K/V memory); False repeats K and V with
            ``repeat_interleave`` first (HF's ``repeat_kv``), for a PyTorch without ``enable_gqa``.
            Both give the same result (tested within 1e-6 in fp32).
        scale: factor of the scores q·k; None means ``head_dim ** -0.5`` (Gemma: ``query_pre_attn_scalar
        ** -0.5``).
        sinks: None, or (n_heads,) one learned logit per head that joins every query's softmax normaliser
            (gpt-oss): under a ``BlockMask`` by flex's log-sum-exp (:func:`fold_sinks`), under any other mask
            by :func:`sink_attention`.

    Returns:
        (batch, n_heads, seq, head_dim), the dtype of ``q``.

    Raises:
        ValueError: ``sinks`` of another shape than (n_heads,).
    """
    if sinks is not None and tuple(sinks.shape) != (q.shape[1],):
        raise ValueError(f"attention sinks of shape {tuple(sinks.shape)} for {q.shape[1]} query heads: one "
                         "logit per head is needed")
    if isinstance(mask, DocumentRuns):
        return per_document_attention(q, k, v, mask, scale, sinks, enable_gqa)
    if BlockMask is not None and isinstance(mask, BlockMask):
        return flex(q, k, v, mask, scale, sinks)
    if sinks is not None:
        return sink_attention(q, k, v, mask, sinks, scale)
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
