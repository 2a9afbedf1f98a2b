"""The planner's activation model under context parallelism (``parallel.cp``, ``shardlm/parallel/cp.py``).

Each rank holds ``t_l = T_pad / cp`` tokens of a sequence (``T_pad``: the sequence padded to a multiple of 2·cp), so
every per-token activation of :mod:`shardlm.plan.activations` is counted at ``t_l`` tokens (the caller builds the
:class:`~shardlm.plan.activations.Shape` with ``t = t_l``). Attention differs, and this module adds the difference,
on the rank that holds the most (CP rank 0, whose tail chunk is the sequence's last):

- causal attention (no documents, no window shorter than the sequence) runs SDPA's causal kernel over this rank's
  queries scattered into ``L = T_pad`` rows (rank r: ``(2·cp - r)·t_l / 2``) and the gathered keys and values in
  global order cut at ``L``: SDPA saves the padded queries and its padded output (c·b·L·a each), the ordered
  keys and values (c·b·L·kv·hd each) and the log-sum-exp (4·b·h·L); ``o_proj`` saves its own copy of this rank's
  output rows (c·b·t_l·a). The local q, k and v after RoPE are not saved (the scatter and the all-gather keep
  nothing), so they are taken off the local count;
- block-causal or windowed attention runs SDPA over all ``T_pad`` keys under a dense mask of this rank's rows,
  ``b·t_l·T_pad`` booleans plus their additive copy in the compute dtype, one per distinct window, shared by
  the layers; SDPA then saves q and its output at ``t_l`` rows (the output shared with ``o_proj``, as without CP)
  and the gathered keys and values at ``T_pad``;
- the rotary cos and sin of this rank's tokens are gathered per token: 2·4·b·t_l·hd bytes per forward.

Backward transients beyond a block's: the ordered key and value gradients, their scatter into the gathered
order and the all-to-all's send and receive buffers, 4 × 2·c·b·T_pad·kv·hd bytes at most.
"""

from __future__ import annotations

from shardlm.plan.activations import Shape


def cp_block_extra_saved(s: Shape, t_pad: int, dense: bool) -> int:
    """Bytes one block saves under CP beyond :func:`~shardlm.plan.activations.block_saved_none` at ``s.t = t_l``
    tokens (CP rank 0; see the module docstring). ``dense``: the masked path (documents or a window)."""
    c, b, t_l = s.c, s.b, s.t
    kv_width = s.kv * s.hd
    local = 2 * c * b * t_l * s.a + 2 * c * b * t_l * kv_width + 4 * b * s.h * t_l  # counted: q, out, k, v, lse
    if dense:
        cp_saved = 2 * c * b * t_l * s.a + 2 * c * b * t_pad * kv_width + 4 * b * s.h * t_l
    else:
        cp_saved = 2 * c * b * t_pad * s.a + 2 * c * b * t_pad * kv_width + 4 * b * s.h * t_pad + c * b * t_l * s.a
    return cp_saved - local


def cp_forward_saved(s: Shape, t_pad: int, dense_windows: int) -> int:
    """Bytes saved once per forward under CP: the per-token rotary cos and sin, and ``dense_windows`` masks
    (boolean and additive) of ``b·t_l·T_pad`` values each."""
    return 2 * 4 * s.b * s.t * s.hd + dense_windows * (1 + s.c) * s.b * s.t * t_pad


def cp_backward_transient(s: Shape, t_pad: int) -> int:
    """Extra bytes alive in one block's backward under CP: the key/value gradients in global order, scattered
    back to the gathered order, and the all-to-all's buffers (4 × 2·c·b·T_pad·kv·hd at most)."""
    return 4 * 2 * s.c * s.b * t_pad * s.kv * s.hd
