"""Mixtral: Mistral's attention (a sliding window in every layer when set) with a sparse mixture of experts in
every layer, top-k routing renormalised over the chosen experts (Jiang et al., "Mixtral of Experts", 2024;
transformers' ``MixtralForCausalLM``).

``config.json``: ``num_local_experts``, ``num_experts_per_tok``, ``intermediate_size`` (each expert's width:
no layer is dense), ``router_aux_loss_coef``, ``sliding_window`` (null: none); ``router_jitter_noise`` is
built only as 0. On disk the experts are ``block_sparse_moe.experts.{e}.w1/w2/w3``
(:mod:`shardlm.convert.hf_experts`).
"""

from __future__ import annotations

from typing import Any

from shardlm.errors import ModelDirError
from shardlm.model.families.registry import Family, ModelFields


def hf_fields_out(cfg: ModelFields) -> dict[str, Any]:
    """Mixtral's ``config.json`` fields beyond the shared ones (``intermediate_size`` is the
    experts' width)."""
    return {"num_local_experts": cfg.n_experts, "num_experts_per_tok": cfg.n_experts_per_token,
            "intermediate_size": cfg.expert_ffn_dim, "router_aux_loss_coef": cfg.router_aux_loss_coef,
            "router_jitter_noise": 0.0, "sliding_window": cfg.sliding_window or None}


def hf_fields_in(cfg: ModelFields, config: dict[str, Any], local_rope: dict[str, Any], source: str) -> None:
    """Set ``cfg``'s experts and sliding window from ``config.json``, in place.

    Raises:
        ModelDirError: ``router_jitter_noise`` > 0 (multiplicative router noise is not built).
    """
    if config.get("router_jitter_noise"):
        raise ModelDirError(f"{source}: router_jitter_noise={config['router_jitter_noise']} is not supported "
                            "(router noise is not built)")
    cfg.n_experts = int(config.get("num_local_experts", 8))
    cfg.n_experts_per_token = int(config.get("num_experts_per_tok", 2))
    cfg.router_aux_loss_coef = float(config.get("router_aux_loss_coef", 0.001))
    cfg.sliding_window = int(config.get("sliding_window") or 0)


FAMILY = Family(
    "mixtral", "mixtral", "MixtralForCausalLM", sliding_window=True, window_patterns=(0,), moe=True,
    always_norm_topk=True,
    hf_default_rope_theta=1e6, hf_fields_out=hf_fields_out, hf_fields_in=hf_fields_in,
    hf_expert_names=("block_sparse_moe", "w1", "w3", "w2"),
)
