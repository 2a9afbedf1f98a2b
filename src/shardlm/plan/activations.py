"""Bytes autograd saves for backward, derived op by op from ``shardlm/model/decoder.py``.

Notation: b micro-batch size, t sequence length, B = b·t tokens, d ``dim``, f the SwiGLU hidden size, h query
heads, hd the head dimension (d/h unless the family sets ``head_dim``), a = h·hd the attention width, kv the
key/value heads, V the vocabulary, c the bytes of the compute dtype (4 for fp32, 2 for bf16 under FSDP's
``param_dtype``). Per family: Gemma 3's two extra norms per block (after attention and after the MLP) are
counted like the others; the q/k norms of Qwen3 and Gemma 3 as norms of width a and kv·hd; sliding-window
masks ((t, t) booleans, shared by the batch) and biases save nothing measurable.

What each op saves (PyTorch's derivative formulas, ``tools/autograd/derivatives.yaml``; autograd
saves an operand only when the other operand needs a gradient):

RMSNorm ``weight * (x.float() * rsqrt(mean(x.float()²) + eps)).to(dtype)``:
  ``x.float()`` (4·B·d; with c = 4 it is x itself, kept anyway as the residual stream), the rsqrt
  (4·B), the normalised value in the compute dtype (c·B·d; with c = 2 a separate bf16 copy after
  the fp32 product 4·B·d, which is then freed) and the output, the next matmul's input (c·B·d).
Attention: q after RoPE (c·B·a); k and v after RoPE at their own head count (c·B·kv·hd each: SDPA's
  ``enable_gqa=True`` reads the grouped heads without repeating them, ``model/decoder.py::attention``);
  RoPE's ``cos``/``sin`` cast to the compute dtype (2·t·hd·c, only when c ≠ 4; otherwise views of the
  fp32 buffers); SDPA (flash on CUDA, the flash kernel on CPU) saves q, k, v, its output (c·B·a, which
  ``o_proj`` also saves as
  its input: ``transpose(1, 2).reshape`` is a view) and the log-sum-exp (4·b·h·t).
Residual ``h = x + attn``: add saves nothing; h is saved by the next norm (c = 4) or only its fp32
  copy is (c = 2, counted in the norm).
SwiGLU ``down(silu(gate(x)) * up(x))``: gate output (SiLU's input), SiLU output, up output (both
  saved by the product) and the product (``down_proj``'s input): 4·c·B·f.

These formulas were checked against ``torch.autograd.graph.saved_tensors_hooks`` during development;
nothing here runs the model.
"""

from __future__ import annotations

from dataclasses import dataclass

from shardlm.config import ModelConfig

AC_MODES = ("none", "full", "selective", "every_n")
TP_AC_MODES = ("none", "full")
"""The checkpointing modes modelled under tensor parallel (:func:`block_saved_tp`)."""


@dataclass(frozen=True)
class Shape:
    """Sizes of one micro-batch through the model (see the module docstring for the letters)."""

    b: int
    t: int
    d: int
    f: int
    h: int
    kv: int
    vocab: int
    n_layers: int
    c: int
    head_dim: int = 0
    """hd when the family sets it; 0 means d / h."""
    gemma_norms: bool = False
    """Four norms per block instead of two (Gemma)."""
    qk_norm: bool = False
    """An RMSNorm over each query and key head (Qwen3, Gemma 3)."""

    @property
    def tokens(self) -> int:
        """B = b·t, tokens in one micro-batch."""
        return self.b * self.t

    @property
    def hd(self) -> int:
        """Head dimension: ``head_dim``, or d / h."""
        return self.head_dim or self.d // self.h

    @property
    def a(self) -> int:
        """Attention width h·hd (the width of q and of the attention output; d for Llama)."""
        return self.h * self.hd


def shape_of(mcfg: ModelConfig, micro_batch_size: int, seq_len: int, compute_bytes: int) -> Shape:
    """The :class:`Shape` of a micro-batch of ``micro_batch_size`` × ``seq_len`` tokens.

    A mixture of experts counts its MLP width per token as the k experts a token visits (f = k · expert
    width), as if every layer were sparse: the experts' activations; the router, the sorted token copies and
    the all-to-all buffers are :mod:`shardlm.plan.moe`'s.
    """
    f = mcfg.n_experts_per_token * mcfg.expert_ffn_dim if mcfg.arch.moe and mcfg.n_experts else mcfg.ffn_dim
    return Shape(micro_batch_size, seq_len, mcfg.dim, f, mcfg.n_heads,
                 mcfg.kv_heads, mcfg.vocab_size, mcfg.n_layers, compute_bytes, mcfg.head_dim,
                 mcfg.arch.gemma_norms, mcfg.arch.qk_norm)


def norm_saved(s: Shape, width: int = 0, rows: int = 0) -> int:
    """Bytes one RMSNorm saves, excluding its input when that is the (saved anyway) fp32 residual.

    ``width`` (default d) over ``rows`` normalised vectors (default B; the q/k norms: B·heads of width hd).
    """
    rows = rows or s.tokens
    bd, c = rows * (width or s.d), s.c
    if c == 4:
        return 4 * bd + c * bd + 4 * rows  # normalised x, output, rsqrt
    return 4 * bd + 2 * bd + c * bd + 4 * rows  # fp32 copy of x, bf16 normalised x, output, rsqrt


def family_norms_saved(s: Shape) -> int:
    """Bytes the norms beyond Llama's two save in one block: Gemma's post-attention and post-MLP norms, the
    q/k head norms."""
    extra = 2 * norm_saved(s) if s.gemma_norms else 0
    if s.qk_norm:
        extra += norm_saved(s, s.hd, s.tokens * s.h) + norm_saved(s, s.hd, s.tokens * s.kv)
    return extra


def block_saved_none(s: Shape) -> int:
    """Bytes one transformer block leaves saved for backward with no activation checkpointing.

    Includes the block's output when it is saved by what follows (c = 4: the next norm keeps x itself).
    """
    bd, bf, c = s.tokens * s.d, s.tokens * s.f, s.c
    # q, SDPA output; k, v; lse
    attn = 2 * c * s.tokens * s.a + 2 * c * s.tokens * s.kv * s.hd + 4 * s.b * s.h * s.t
    if c != 4:
        attn += 2 * s.t * s.hd * c  # cos and sin cast to the compute dtype
    residuals = 2 * c * bd if c == 4 else 0  # h after attention and the block output
    return 2 * norm_saved(s) + family_norms_saved(s) + attn + residuals + 4 * c * bf


def block_saved_selective(s: Shape) -> int:
    """Bytes one block saves under torchtitan's op-level selective checkpointing.

    That policy keeps the block input, the SDPA outputs (output and log-sum-exp) and every other
    matmul output (the 1st, 3rd, 5th, 7th of q, k, v, o, gate, up, down: q, v, gate, down).
    """
    bd, bf, c = s.tokens * s.d, s.tokens * s.f, s.c
    v = c * s.tokens * s.kv * s.hd
    return c * bd + c * s.tokens * s.a + v + c * s.tokens * s.a + 4 * s.b * s.h * s.t + c * bf + c * bd


def block_saved(s: Shape, mode: str, layer: int, every_n: int = 2) -> int:
    """Bytes block ``layer`` keeps saved between its forward and its backward under AC ``mode``.

    ``full`` keeps only the block input (c·B·d); ``every_n`` checkpoints (fully) blocks n, 2n, ...
    (1-based, as parallel/ac.py applies it) and saves all of the others.
    """
    if mode == "none":
        return block_saved_none(s)
    if mode == "full":
        return s.c * s.tokens * s.d
    if mode == "selective":
        return block_saved_selective(s)
    if mode == "every_n":
        return block_saved(s, "full" if fully_checkpointed(mode, layer, every_n) else "none", layer)
    raise ValueError(f"unknown activation checkpointing mode {mode!r} (known: {', '.join(AC_MODES)})")


def fully_checkpointed(mode: str, layer: int, every_n: int = 2) -> bool:
    """Whether block ``layer`` (0-based) keeps only its input under AC ``mode``: every block under ``full``,
    blocks n, 2n, ... (1-based) under ``every_n``."""
    return mode == "full" or (mode == "every_n" and (layer + 1) % max(1, every_n) == 0)


def block_backward_transient(s: Shape) -> int:
    """Extra bytes alive at the high point of one block's backward, beyond its saved tensors.

    The high point is the SwiGLU product's backward: it holds the incoming gradient (c·B·f) and
    produces the gradients of the SiLU and up outputs (2·c·B·f), while the product itself, saved
    by ``down_proj``, was released when ``down_proj``'s backward ran: net +2·c·B·f. (Under
    non-reentrant checkpointing recomputed tensors are likewise released as backward uses them.)
    """
    return 2 * s.c * s.tokens * s.f


def embedding_saved(s: Shape, mode: str) -> int:
    """Bytes of the embedding output kept for backward, beyond what the blocks count.

    In fp32 with no checkpointing the first norm keeps x itself (c·B·d). Under checkpointing it is
    block 0's saved input (counted in :func:`block_saved`); in bf16 only its fp32 copy is kept (counted
    in the norm).
    """
    return s.c * s.tokens * s.d if s.c == 4 and mode == "none" else 0


def last_output_saved(s: Shape, mode: str) -> int:
    """Bytes of the last block's output kept by the final norm when the block did not count it.

    In fp32 the final norm keeps x itself; :func:`block_saved_none` already counts each block's
    output, the checkpointed modes count inputs only, so they add this one.
    """
    return s.c * s.tokens * s.d if s.c == 4 and mode != "none" else 0


def final_norm_saved(s: Shape) -> int:
    """Bytes the final norm saves (the output projection's input included)."""
    return norm_saved(s)


# ---- tensor parallel with sequence parallel (parallel.tp = T; shardlm/parallel/tp.py) ----------------------
# Between the blocks every rank holds B/T tokens (the residual stream, the norms); each norm's output is
# all-gathered into the B tokens the column-split q/k/v (or gate/up) multiply, which saves that gathered
# input; inside attention and the MLP every rank holds h/T query heads, kv/T key/value heads and f/T of the
# FFN width over all B tokens. Modelled for activation checkpointing ``none`` and ``full``.

def sp_norm_saved(s: Shape, tp: int) -> int:
    """Bytes a sequence-parallel norm before attention or the MLP saves: its normalised x and rsqrt on B/T
    tokens (and the fp32 copy in bf16), and the all-gathered B tokens the next (column-split) matmul saves."""
    rows = s.tokens // tp
    own = 4 * rows * s.d + 4 * rows + (2 * rows * s.d if s.c != 4 else 0)
    return own + s.c * s.tokens * s.d


def block_saved_tp(s: Shape, tp: int, mode: str) -> int:
    """Bytes one block keeps saved for backward at tensor-parallel degree ``tp`` (``mode``: ``none``
    or ``full``)."""
    rows, c = s.tokens // tp, s.c
    if mode == "full":
        return c * rows * s.d
    if mode != "none":
        raise ValueError("the planner models tensor parallel with activation checkpointing none or full, "
                         f"not {mode!r}")
    h, kv, f = s.h // tp, s.kv // tp, s.f // tp
    attn = 2 * c * s.tokens * h * s.hd + 2 * c * s.tokens * kv * s.hd + 4 * s.b * h * s.t
    if c != 4:
        attn += 2 * s.t * s.hd * c
    extra = 2 * norm_saved(s, rows=rows) if s.gemma_norms else 0  # Gemma's post-norms, on the local tokens
    if s.qk_norm:
        extra += norm_saved(s, s.hd, s.tokens * h) + norm_saved(s, s.hd, s.tokens * kv)
    residuals = 2 * c * rows * s.d if c == 4 else 0
    return 2 * sp_norm_saved(s, tp) + extra + attn + residuals + 4 * c * s.tokens * f


def head_saved(s: Shape, mode: str, tp: int = 1) -> int:
    """Bytes the final norm keeps for backward (the output projection's input included), with the last block's
    output when no block counted it (:func:`final_norm_saved` + :func:`last_output_saved`). Under tensor
    parallel (``tp`` > 1, ``mode`` none or full) on the B/T local tokens: the fp32 normalised x and rsqrt, and
    under checkpointing the block output; the loss all-gathers the hidden states itself
    (:func:`shardlm.plan.loss.vocab_parallel_loss_events`)."""
    if tp == 1:
        return final_norm_saved(s) + last_output_saved(s, mode)
    local = s.tokens // tp * s.d
    return 4 * local + 4 * s.tokens // tp + (s.c * local if mode != "none" else 0)


def block_backward_transient_tp(s: Shape, tp: int) -> int:
    """Extra bytes at the high point of a block's backward under tensor parallel: the SwiGLU product's
    gradients on the local FFN width (2·c·B·f/T), the output gradient all-gathered over the sequence for the
    row-split down_proj (c·B·d, RowwiseParallel's backward) and the gathered input's partial gradient (c·B·d)
    before its reduce-scatter."""
    return 2 * s.c * s.tokens * (s.f // tp) + 2 * s.c * s.tokens * s.d
