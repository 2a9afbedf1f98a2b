"""Tiny random transformers models for the transformers backend's tests (tests/unit/test_hf_backend.py,
tests/dist/test_hf_backend_fsdp.py): one config per architecture, saved with ``save_pretrained``."""

from __future__ import annotations

from pathlib import Path

import torch

#: the shared shape: 2 layers, width 32, 4 query heads over 2 key/value heads, the 512-token test vocabulary
TINY = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=512, max_position_embeddings=64, pad_token_id=0, bos_token_id=1,
            eos_token_id=2, tie_word_embeddings=False)

#: per model type, what it adds to :data:`TINY` (MoE: 4 experts, top 2, no auxiliary loss)
ARCHS: dict[str, dict] = {
    "llama": {},
    "qwen3": {"head_dim": 8},
    "qwen3_moe": {"head_dim": 8, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16,
                  "router_aux_loss_coef": 0.0, "norm_topk_prob": True},
    "deepseek_v3": {"moe_intermediate_size": 16, "n_routed_experts": 4, "num_experts_per_tok": 2,
                    "n_shared_experts": 1, "first_k_dense_replace": 1, "kv_lora_rank": 16, "q_lora_rank": 16,
                    "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 8, "n_group": 1,
                    "topk_group": 1, "num_key_value_heads": 4},
    "qwen3_next": {"head_dim": 8, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16,
                   "shared_expert_intermediate_size": 16, "linear_num_value_heads": 4,
                   "linear_num_key_heads": 2, "linear_key_head_dim": 8, "linear_value_head_dim": 8,
                   "layer_types": ["linear_attention", "full_attention"], "router_aux_loss_coef": 0.0},
    "glm4": {"head_dim": 8},
    "phi3": {},
    "olmo2": {},
}

#: the architectures shardlm has no native family for
NEW_ARCHS = ("deepseek_v3", "qwen3_next", "glm4", "phi3", "olmo2")


def hf_dir(path: Path, model_type: str, seed: int = 0, **overrides) -> Path:
    """A random ``model_type`` model (fp32, sdpa) saved with ``save_pretrained`` at ``path``; returned."""
    import transformers

    config = transformers.AutoConfig.for_model(model_type, **{**TINY, **ARCHS[model_type], **overrides})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    model.save_pretrained(str(path))
    return path
