"""Gemma 3 (text): q/k norm, RMSNorm × (1 + weight), norms before and after attention and MLP, GeGLU (tanh
GELU), embedding × sqrt(dim), local (sliding-window, own RoPE base) and global layers,
``query_pre_attn_scalar``, final logit soft-capping (Gemma 3 technical report, 2025).

``config.json`` (``Gemma3TextConfig``): ``hidden_activation``, ``query_pre_attn_scalar``, ``sliding_window``,
``rope_local_base_freq``, ``layer_types`` (every n-th layer global; 4.x ``sliding_window_pattern``),
``final_logit_softcapping``; ``use_bidirectional_attention`` is refused. GGUF: llama.cpp adds 1 to every norm
weight and stores neither the local RoPE base nor the layer pattern (llama.cpp's and transformers' defaults:
10000, every 6th layer global).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from shardlm.errors import ModelDirError
from shardlm.model.families.registry import GGUF_BLOCK_NAMES, Family, ModelFields

#: Gemma's four norms per block: llama.cpp names the norm before the MLP ``ffn_norm``
GGUF_GEMMA_BLOCK_NAMES = {**GGUF_BLOCK_NAMES, "post_attention_norm": "post_attention_layernorm",
                          "ffn_norm": "pre_feedforward_layernorm",
                          "post_ffw_norm": "post_feedforward_layernorm"}


def _int_if_whole(x: float) -> int | float:
    """``x`` as an int when it is whole (transformers' config classes type some fields as int)."""
    return int(x) if float(x).is_integer() else x


def hf_fields_out(cfg: ModelFields) -> dict[str, Any]:
    """Gemma 3's ``config.json`` fields beyond the shared ones, in ``Gemma3TextConfig``'s names. Without a
    window (``model.sliding_window = 0``) every layer is ``full_attention`` and ``sliding_window`` is 0:
    transformers refuses null there (its masks need an int even when no layer uses it)."""
    return {
        "query_pre_attn_scalar": _int_if_whole(cfg.query_pre_attn_scalar or cfg.head_dim),
        "sliding_window": cfg.sliding_window,
        "rope_local_base_freq": cfg.rope_local_theta or cfg.rope_theta,
        "layer_types": [
            "sliding_attention" if cfg.is_local(i) else "full_attention" for i in range(cfg.n_layers)
        ],
        "final_logit_softcapping": cfg.final_logit_softcap or None,
        "attn_logit_softcapping": None,
    }


def hf_fields_in(cfg: ModelFields, config: dict[str, Any], local_rope: dict[str, Any], source: str) -> None:
    """Set ``cfg``'s sliding window, layer pattern, local RoPE base, ``query_pre_attn_scalar`` and
    soft-capping from ``config.json``, in place, as transformers decides them.

    Raises:
        ModelDirError: ``use_bidirectional_attention``, or ``layer_types`` other than every n-th layer global.
    """
    window = config.get("sliding_window")
    if window:
        cfg.sliding_window = int(window)
        if config.get("use_bidirectional_attention"):
            raise ModelDirError(f"{source}: use_bidirectional_attention=true is not supported")
        types = config.get("layer_types")
        pattern = int(config.get("sliding_window_pattern") or 6)
        if types:
            n_global = types.count("full_attention")
            # every n-th: the first global is the n-th
            pattern = types.index("full_attention") + 1 if n_global else 0
            built = ["sliding_attention" if (not pattern or (i + 1) % pattern) else "full_attention"
                     for i in range(len(types))]
            if types != built:
                raise ModelDirError(f"{source}: layer_types {types} is not every n-th layer global; not "
                                    "supported")
        cfg.sliding_window_pattern = pattern
        cfg.rope_local_theta = float(
            config.get("rope_local_base_freq", local_rope.get("rope_theta", 10000.0))
        )
    cfg.query_pre_attn_scalar = float(config.get("query_pre_attn_scalar") or 256)
    if cfg.query_pre_attn_scalar == cfg.head_dim:
        cfg.query_pre_attn_scalar = 0.0
    cfg.final_logit_softcap = float(config.get("final_logit_softcapping") or 0.0)


def gguf_fields_in(cfg: ModelFields, metadata: Callable[[str, Any], Any]) -> None:
    """Set ``cfg``'s sliding window (default 4096), layer pattern (every 6th global), local RoPE base (10000)
    and, for the 27B model, ``query_pre_attn_scalar`` (hidden / heads, llama.cpp's rule) from GGUF metadata,
    in place."""
    cfg.sliding_window = int(metadata("attention.sliding_window", 4096))
    cfg.sliding_window_pattern, cfg.rope_local_theta = 6, 10000.0
    if cfg.n_layers == 62:  # Gemma 3 27B scales by hidden / heads, not the head width (llama.cpp's rule)
        cfg.query_pre_attn_scalar = float(cfg.dim // cfg.n_heads)


FAMILY = Family(
    "gemma3", "gemma3_text", "Gemma3ForCausalLM",
    qk_norm=True, gemma_norms=True, activation="gelu_tanh", sliding_window=True,
    hf_activation_key="hidden_activation", hf_false_flags=("attention_bias",),
    hf_default_rope_theta=1_000_000.0, hf_default_head_dim=256, hf_default_tie=True,
    hf_fields_out=hf_fields_out, hf_fields_in=hf_fields_in,
    gguf_architecture="gemma3", gguf_block_names=GGUF_GEMMA_BLOCK_NAMES, gguf_norm_offset=1.0,
    gguf_linear_rope=True, gguf_fields_in=gguf_fields_in,
)
