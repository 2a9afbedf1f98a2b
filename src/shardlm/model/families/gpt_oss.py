"""gpt-oss (OpenAI, 2025; transformers' ``GptOssForCausalLM``): attention with learned sinks and biases on
q/k/v/o, sliding-window layers alternating with full ones, and a mixture of experts in every layer: a router
with a bias, top-k then softmax, experts with biases and a clamped SwiGLU
(``swiglu_alpha``, ``swiglu_limit``).

``config.json``: ``num_local_experts``, ``num_experts_per_tok``, ``intermediate_size`` (each expert's width),
``swiglu_alpha``, ``swiglu_limit``, ``sliding_window`` with ``layer_types`` alternating sliding / full (built
only so), ``router_aux_loss_coef``. RoPE: the released checkpoints' YaRN (factor 32 over an original 4096
tokens, ``beta_fast`` 32, ``beta_slow`` 1, ``truncate`` false; :func:`shardlm.model.rope.yarn_inv_freq`),
which is also transformers' default when ``config.json`` names no RoPE (:data:`HF_DEFAULT_ROPE`); plain RoPE
is exported as an explicit ``rope_type = "default"``. On disk the experts have the in-memory names
(``mlp.experts.gate_up_proj``...); MXFP4-quantised files (the released ones, ``quantization_config``) are
refused: dequantise them first.
"""

from __future__ import annotations

from typing import Any

from shardlm.errors import ModelDirError
from shardlm.model.families.registry import Family, ModelFields

#: transformers 5.24's ``GptOssConfig`` RoPE when ``config.json`` has none: the released checkpoints' YaRN
HF_DEFAULT_ROPE = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                   "truncate": False, "original_max_position_embeddings": 4096}


def hf_fields_out(cfg: ModelFields) -> dict[str, Any]:
    """gpt-oss's ``config.json`` fields beyond the shared ones. Without a window (``model.sliding_window =
    0``) every layer is ``full_attention`` and ``sliding_window`` is 0: transformers refuses null there."""
    return {
        "num_local_experts": cfg.n_experts,
        "num_experts_per_tok": cfg.n_experts_per_token,
        "intermediate_size": cfg.expert_ffn_dim,
        "swiglu_alpha": cfg.swiglu_alpha,
        "swiglu_limit": cfg.swiglu_limit,
        "router_aux_loss_coef": cfg.router_aux_loss_coef,
        "attention_bias": True,
        "sliding_window": cfg.sliding_window,
        "layer_types": [
            "sliding_attention" if cfg.is_local(i) else "full_attention" for i in range(cfg.n_layers)
        ],
    }


def hf_fields_in(cfg: ModelFields, config: dict[str, Any], local_rope: dict[str, Any], source: str) -> None:
    """Set ``cfg``'s experts, clamped SwiGLU and alternating windows from ``config.json``, in place.

    Raises:
        ModelDirError: ``attention_bias`` false, ``layer_types`` other than sliding / full alternating
            (every layer full without a window), or a ``quantization_config`` (the released MXFP4 experts
            are not read).
    """
    quant = config.get("quantization_config")
    if quant:
        method = quant.get("quant_method") if isinstance(quant, dict) else quant
        raise ModelDirError(f"{source}: quantization_config (quant_method {method!r}) is not supported: "
                            "quantised expert weights (MXFP4) are not read; dequantise the checkpoint first "
                            "(transformers: from_pretrained(..., "
                            "quantization_config=Mxfp4Config(dequantize=True)), then save_pretrained)")
    if config.get("attention_bias") is False:
        raise ModelDirError(f"{source}: attention_bias=false is not supported for gpt_oss")
    cfg.n_experts = int(config.get("num_local_experts", 128))
    cfg.n_experts_per_token = int(config.get("num_experts_per_tok", 4))
    cfg.swiglu_alpha = float(config.get("swiglu_alpha", 1.702))
    cfg.swiglu_limit = float(config.get("swiglu_limit", 7.0))
    cfg.router_aux_loss_coef = float(config.get("router_aux_loss_coef", 0.001))  # transformers 5.24 default
    # transformers 5.24's default when absent
    cfg.sliding_window = int(config.get("sliding_window", 128) or 0)
    built = ["sliding_attention" if cfg.sliding_window and (i + 1) % 2 else "full_attention"
             for i in range(cfg.n_layers)]
    types = config.get("layer_types") or built
    if types != built:
        raise ModelDirError(f"{source}: layer_types {types} is not sliding / full alternating (every layer "
                            "full without a sliding_window); not supported")
    cfg.sliding_window_pattern = 2 if cfg.sliding_window else 0


FAMILY = Family(
    "gpt_oss", "gpt_oss", "GptOssForCausalLM", qkv_bias=True, sliding_window=True, window_patterns=(2,),
    moe=True,
    routing="topk_softmax", router_bias=True, router_name="router", experts="clamped_swiglu",
    attention_sinks=True, attention_out_bias=True, hf_default_rope_theta=150000.0, hf_default_head_dim=64,
    hf_default_rope=HF_DEFAULT_ROPE,
    hf_fields_out=hf_fields_out, hf_fields_in=hf_fields_in,
)
