"""Rotary position embeddings (Su et al., "RoFormer", 2021) as Hugging Face computes them: the inverse frequencies
of each RoPE type (default, linear, Llama 3.1's llama3 scaling), the cos/sin tables, rotate-half.

Tables are float32 (max_seq_len, head_dim), the angle vector concatenated with itself (HF's rotate-half layout,
not the interleaved one of the RoFormer paper); the decoder keeps them as buffers (:func:`rope_buffers`).
"""

from __future__ import annotations

import math

import torch

from shardlm.model.config import ModelConfig


def rope_inv_freq(cfg: ModelConfig, local: bool = False) -> torch.Tensor:
    """Inverse rotary frequencies, (head_dim / 2,) float32, as HF's ``ROPE_INIT_FUNCTIONS`` compute them.

    ``local`` selects the local (sliding-window) layers' base ``rope_local_theta`` (when set), unscaled, as
    Gemma 3 does; otherwise the base is ``rope_theta`` and the scaling below applies.

    Default: ``inv_freq[i] = 1 / theta^(2i / head_dim)``. Linear scaling (``rope_linear_factor > 0``):
    ``inv_freq / factor``. With ``rope_scaling_factor > 0``, Llama 3.1's
    scaling (HF ``_compute_llama3_parameters``, same operations in the same order, so bit-identical):
    wavelengths 2π/inv_freq above ``original / low_freq_factor`` are divided by ``factor``, those
    below ``original / high_freq_factor`` are kept, and those in between are interpolated with
    ``s = (original / wavelen - low) / (high - low)``: ``(1 - s) · f / factor + s · f``.
    """
    head_dim = cfg.head_dim
    theta = cfg.rope_local_theta if local and cfg.rope_local_theta else cfg.rope_theta
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if local and cfg.rope_local_theta:
        return inv_freq
    if cfg.rope_linear_factor > 0:
        return inv_freq / cfg.rope_linear_factor
    if cfg.rope_scaling_factor <= 0:
        return inv_freq
    factor, low, high = cfg.rope_scaling_factor, cfg.rope_low_freq_factor, cfg.rope_high_freq_factor
    old_context_len = cfg.rope_original_max_seq_len
    low_freq_wavelen = old_context_len / low
    high_freq_wavelen = old_context_len / high
    wavelen = 2 * math.pi / inv_freq
    inv_freq_llama = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth_factor = (old_context_len / wavelen - low) / (high - low)
    smoothed_inv_freq = (1 - smooth_factor) * inv_freq_llama / factor + smooth_factor * inv_freq_llama
    is_medium_freq = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium_freq, smoothed_inv_freq, inv_freq_llama)


def rotary_tables(head_dim: int, max_seq_len: int, theta: float,
                  inv_freq: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables of rotary embeddings, each (max_seq_len, head_dim) float32, as HF computes them.

    ``inv_freq[i] = 1 / theta^(2i / head_dim)`` unless ``inv_freq`` is given (see :func:`rope_inv_freq`);
    angle[t, i] = t · inv_freq[i]; the table is the angle vector concatenated with itself (rotate-half).
    """
    if inv_freq is None:
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    positions = torch.arange(max_seq_len, dtype=torch.int64).float()
    freqs = torch.outer(positions, inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """(x1, x2) -> (-x2, x1) over the last dimension, split in halves."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rope_buffers(cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """The decoder's rotary tables by buffer name, each (max_seq_len, head_dim) float32
    (see :class:`~shardlm.model.decoder.Decoder`)."""
    cos, sin = rotary_tables(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta, rope_inv_freq(cfg))
    tables = {"rope_cos": cos, "rope_sin": sin}
    if cfg.sliding_window and cfg.rope_local_theta:
        cos, sin = rotary_tables(cfg.head_dim, cfg.max_seq_len, cfg.rope_local_theta, rope_inv_freq(cfg, local=True))
        tables.update(rope_local_cos=cos, rope_local_sin=sin)
    return tables
