"""Qwen3-MoE: Qwen3's attention (q/k norm, explicit ``head_dim``) with sparse mixture-of-experts feed-forward
layers (Qwen3 technical report, 2025; transformers' ``Qwen3MoeForCausalLM``).

Layer i is a MoE layer unless it is in ``mlp_only_layers`` or ``(i + 1) % decoder_sparse_step != 0``; its
router is softmax then top-k, renormalised with ``norm_topk_prob``. ``config.json``: ``num_experts``
(transformers 5.x writes ``num_local_experts``), ``num_experts_per_tok``, ``moe_intermediate_size`` (an
expert's width; ``intermediate_size`` is the dense layers'), ``norm_topk_prob``, ``decoder_sparse_step``,
``mlp_only_layers``, ``router_aux_loss_coef``; ``use_sliding_window`` and ``attention_bias`` are built only as
false. The hub's weights hold one tensor per expert (:mod:`shardlm.convert.hf_experts`).
"""

from __future__ import annotations

from typing import Any

from shardlm.errors import ModelDirError
from shardlm.model.families.registry import Family, ModelFields


def hf_fields_out(cfg: ModelFields) -> dict[str, Any]:
    """Qwen3-MoE's ``config.json`` fields beyond the shared ones: the experts, routing and sparse layers."""
    return {"num_experts": cfg.n_experts, "num_experts_per_tok": cfg.n_experts_per_token,
            "moe_intermediate_size": cfg.expert_ffn_dim, "norm_topk_prob": cfg.norm_topk_prob,
            "decoder_sparse_step": cfg.moe_layer_step, "mlp_only_layers": list(cfg.dense_layers),
            "router_aux_loss_coef": cfg.router_aux_loss_coef, "sliding_window": None}


def hf_fields_in(cfg: ModelFields, config: dict[str, Any], local_rope: dict[str, Any], source: str) -> None:
    """Set ``cfg``'s experts, routing and sparse layers from ``config.json``, in place.

    Raises:
        ModelDirError: ``num_experts`` missing or 0 (a dense Qwen3 is ``qwen3``).
    """
    # transformers 5.x writes the latter
    n_experts = config.get("num_experts") or config.get("num_local_experts")
    if not n_experts:
        raise ModelDirError(f"{source}: num_experts is missing or 0 (a dense Qwen3 has model_type 'qwen3')")
    cfg.n_experts = int(n_experts)
    cfg.n_experts_per_token = int(config.get("num_experts_per_tok", 8))
    cfg.moe_ffn_hidden = int(config.get("moe_intermediate_size", 768))
    cfg.norm_topk_prob = bool(config.get("norm_topk_prob", False))
    cfg.moe_layer_step = int(config.get("decoder_sparse_step", 1))
    cfg.dense_layers = tuple(int(i) for i in config.get("mlp_only_layers") or ())
    cfg.router_aux_loss_coef = float(config.get("router_aux_loss_coef", 0.001))


FAMILY = Family(
    "qwen3_moe", "qwen3_moe", "Qwen3MoeForCausalLM", qk_norm=True, moe=True,
    hf_false_flags=("use_sliding_window", "attention_bias"),
    hf_fields_out=hf_fields_out, hf_fields_in=hf_fields_in,
    hf_expert_names=("mlp", "gate_proj", "up_proj", "down_proj"),
)
