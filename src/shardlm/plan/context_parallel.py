"""The planner's activation model under context parallelism (``parallel.cp``, ``shardlm/parallel/cp.py``).

Each rank holds ``t_l = T_pad / cp`` tokens of a sequence (``T_pad``: the sequence padded to a multiple of
2·cp), so every per-token activation of :mod:`shardlm.plan.activations` is counted at ``t_l`` tokens (the
caller builds the :class:`~shardlm.plan.activations.Shape` with ``t = t_l``). Attention differs by its path
(:meth:`shardlm.parallel.cp.ContextParallel.attend`), and this module adds the difference.

Blockwise (where :func:`~shardlm.parallel.cp_attention.lse_kernels` has kernels: the CPU): attention saves
what SDPA saves without CP at ``t_l`` rows (q, the local k and v, the output shared with ``o_proj``, the
log-sum-exp), so a block saves nothing more. Once per forward: the rotary cos and sin of this rank's tokens
gathered per token (2·4·b·t_l·hd bytes) and, under documents, the padded document ids (8·b·T_pad). Transient
in one block's backward, K and V travelling the ring one rank's ``t_l`` tokens at a time: the held and the
incoming K/V (2·c·b·t_l·kv·hd each) with the float32 gradient of the held one (2·4·b·t_l·kv·hd) while a step
computes, or the new K/V with the gradient and its incoming copy when the gradient moves on, whichever is
more; and the float32 query gradient (4·b·t_l·a). The forward's K/V in flight are below that backward high
point and not counted; per-block masks and partial outputs are ``c = T_pad / (2·cp)`` rows each.

Under tensor parallel (``parallel.tp`` = T; CP groups T ranks apart,
:func:`shardlm.parallel.cp.build_context_parallel`) a rank's attention runs over its CP share of the tokens
with its ``h / T`` query and ``kv / T`` key/value heads only, and the ring or the all-gather passes those
heads' keys and values: every term below is counted on the shape :func:`tp_local_heads` gives (the per-token
rotary tables and the dense masks do not depend on the heads).

Fallback (CUDA; on CP rank 0, whose tail chunk is the sequence's last):

- causal attention runs SDPA's causal kernel over this rank's queries scattered into ``L = T_pad`` rows and
  the gathered keys and values in global order cut at ``L``: SDPA saves the padded queries and its padded
  output (c·b·L·a each), the ordered keys and values (c·b·L·kv·hd each) and the log-sum-exp (4·b·h·L);
  ``o_proj`` saves its own copy of this rank's output rows (c·b·t_l·a). The local q, k and v after RoPE are
  not saved, so they are taken off the local count;
- block-causal or windowed attention runs SDPA over all ``T_pad`` keys under a dense mask of this rank's rows,
  ``b·t_l·T_pad`` booleans plus their additive copy in the compute dtype, one per distinct window, shared by
  the layers; SDPA then saves q and its output at ``t_l`` rows and the gathered keys and values at ``T_pad``;
- backward transients beyond a block's: the ordered key and value gradients, their scatter into the gathered
  order and the all-to-all's send and receive buffers, 4 × 2·c·b·T_pad·kv·hd bytes at most.
"""

from __future__ import annotations

from dataclasses import replace

from shardlm.parallel.cp_attention import lse_kernels
from shardlm.plan.activations import Shape


def cp_is_blockwise(device: str) -> bool:
    """Whether CP attention runs blockwise on the planner's ``device`` (``cpu`` or a GPU name)."""
    return lse_kernels("cpu" if device == "cpu" else "cuda") is not None


def tp_local_heads(s: Shape, tp: int) -> Shape:
    """``s`` with a tensor-parallel rank's ``h / tp`` query and ``kv / tp`` key/value heads (the head
    dimension kept): the heads CP's attention sees on that rank; ``s`` itself at ``tp = 1``."""
    if tp == 1:
        return s
    return replace(s, h=s.h // tp, kv=s.kv // tp, head_dim=s.hd)


def cp_block_extra_saved(s: Shape, t_pad: int, dense: bool, blockwise: bool) -> int:
    """Bytes one block saves under CP beyond :func:`~shardlm.plan.activations.block_saved_none` at ``s.t =
    t_l`` tokens (see the module docstring). ``dense``: documents or a window; ``blockwise``:
    :func:`cp_is_blockwise`."""
    if blockwise:
        return 0
    c, b, t_l = s.c, s.b, s.t
    kv_width = s.kv * s.hd
    # counted without CP: q, out, k, v, lse
    local = 2 * c * b * t_l * s.a + 2 * c * b * t_l * kv_width + 4 * b * s.h * t_l
    if dense:
        cp_saved = 2 * c * b * t_l * s.a + 2 * c * b * t_pad * kv_width + 4 * b * s.h * t_l
    else:
        cp_saved = (2 * c * b * t_pad * s.a + 2 * c * b * t_pad * kv_width + 4 * b * s.h * t_pad
                    + c * b * t_l * s.a)
    return cp_saved - local


def cp_forward_saved(s: Shape, t_pad: int, dense_windows: int, blockwise: bool, documents: bool) -> int:
    """Bytes saved once per forward under CP: the per-token rotary cos and sin; blockwise the padded document
    ids (``documents``), the fallback ``dense_windows`` masks (boolean and additive) of ``b·t_l·T_pad`` values
    each."""
    rope = 2 * 4 * s.b * s.t * s.hd
    if blockwise:
        return rope + (8 * s.b * t_pad if documents else 0)
    return rope + dense_windows * (1 + s.c) * s.b * s.t * t_pad


def cp_backward_transient(s: Shape, t_pad: int, blockwise: bool) -> int:
    """Extra bytes alive in one block's backward under CP (the module docstring's high point of each path)."""
    if blockwise:  # per rank's K/V: held + incoming and their gradient, or K/V + gradient + incoming gradient
        kv = s.b * s.t * s.kv * s.hd
        return max(4 * s.c * kv + 2 * 4 * kv, 2 * s.c * kv + 4 * 4 * kv) + 4 * s.b * s.t * s.a
    return 4 * 2 * s.c * s.b * t_pad * s.kv * s.hd
