"""Rotary position embeddings (Su et al., "RoFormer", 2021) as Hugging Face computes them: the inverse
frequencies of each RoPE type (default, linear, Llama 3.1's llama3 scaling, YaRN with its attention factor on
the tables, dynamic NTK within the context), the cos/sin tables, rotate-half.

Tables are float32 (max_seq_len, head_dim), the angle vector concatenated with itself (HF's rotate-half
layout, not the interleaved one of the RoFormer paper); the decoder keeps them as buffers
(:func:`rope_buffers`).
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
    ``inv_freq / factor``. YaRN (``rope_yarn_factor > 0``): :func:`yarn_inv_freq`. Dynamic NTK
    (``rope_dynamic_factor``): the default frequencies, as HF has them for every sequence within
    ``max_seq_len`` (longer ones, where HF would raise the base, are refused by the model).
    With ``rope_scaling_factor > 0``, Llama 3.1's
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
    if cfg.rope_yarn_factor > 0:
        return yarn_inv_freq(cfg)
    if cfg.rope_scaling_factor <= 0:
        # default RoPE; also dynamic NTK within max_seq_len (rope_dynamic_factor)
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


def yarn_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """YaRN's inverse frequencies (Peng et al., "YaRN: Efficient Context Window Extension of Large Language
    Models", 2023, §3.2 "NTK-by-parts"), (head_dim / 2,) float32, as HF's ``_compute_yarn_parameters``
    computes them (transformers 5.24; the same operations in the same order, so bit-identical).

    With L = ``rope_original_max_seq_len``, s = ``rope_yarn_factor``, d = ``head_dim``, θ = ``rope_theta``:
    the dimension that turns r times over L tokens is ``d · ln(L / (2π r)) / (2 ln θ)``; ``low`` is that of
    ``beta_fast`` rotations and ``high`` that of ``beta_slow`` (rounded outward when ``rope_yarn_truncate``,
    then clamped to [0, d - 1]). Frequency i keeps its value (extrapolation) below ``low``, is divided by s
    (interpolation) above ``high``, and between them mixes the two by the linear ramp
    ``clamp((i - low) / (high - low), 0, 1)``. The attention temperature is :func:`rope_attention_factor`.
    """
    d, theta, original = cfg.head_dim, cfg.rope_theta, cfg.rope_original_max_seq_len

    def correction_dim(rotations: float) -> float:
        return (d * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(cfg.rope_yarn_beta_fast), correction_dim(cfg.rope_yarn_beta_slow)
    if cfg.rope_yarn_truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, d - 1)
    if low == high:
        high += 0.001  # HF's guard against a zero-width ramp
    pos_freqs = theta ** (torch.arange(0, d, 2).float() / d)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (cfg.rope_yarn_factor * pos_freqs)
    keep = 1 - torch.clamp((torch.arange(d // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    return interpolation * (1 - keep) + extrapolation * keep


def rope_attention_factor(cfg: ModelConfig) -> float:
    """Factor of the global layers' cos and sin tables: YaRN's attention temperature ``sqrt(1/t)`` =
    ``rope_yarn_attention_factor``, by default ``0.1 · ln(s) + 1`` for the factor s (YaRN §3.4; 1 when s <=
    1); 1 without YaRN."""
    if cfg.rope_yarn_factor <= 0:
        return 1.0
    if cfg.rope_yarn_attention_factor > 0:
        return cfg.rope_yarn_attention_factor
    return 0.1 * math.log(cfg.rope_yarn_factor) + 1.0 if cfg.rope_yarn_factor > 1 else 1.0


def rotary_tables(
    head_dim: int, max_seq_len: int, theta: float, inv_freq: torch.Tensor | None = None, scale: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables of rotary embeddings, each (max_seq_len, head_dim) float32, as HF computes them.

    ``inv_freq[i] = 1 / theta^(2i / head_dim)`` unless ``inv_freq`` is given (see :func:`rope_inv_freq`);
    angle[t, i] = t · inv_freq[i]; the table is the angle vector concatenated with itself (rotate-half), times
    ``scale`` (HF's ``attention_scaling``: YaRN's, :func:`rope_attention_factor`).
    """
    if inv_freq is None:
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    positions = torch.arange(max_seq_len, dtype=torch.int64).float()
    freqs = torch.outer(positions, inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    if scale != 1.0:
        return emb.cos() * scale, emb.sin() * scale
    return emb.cos(), emb.sin()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """(x1, x2) -> (-x2, x1) over the last dimension, split in halves."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rope_buffers(cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """The decoder's rotary tables by buffer name, each (max_seq_len, head_dim) float32
    (see :class:`~shardlm.model.decoder.Decoder`)."""
    cos, sin = rotary_tables(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta, rope_inv_freq(cfg),
                             rope_attention_factor(cfg))
    tables = {"rope_cos": cos, "rope_sin": sin}
    if cfg.sliding_window and cfg.rope_local_theta:
        cos, sin = rotary_tables(cfg.head_dim, cfg.max_seq_len, cfg.rope_local_theta,
                                 rope_inv_freq(cfg, local=True))
        tables.update(rope_local_cos=cos, rope_local_sin=sin)
    return tables
