"""Llama 2 / 3.x: the reference family (pre-norm blocks, SwiGLU, grouped-query attention, RoPE with
llama3 scaling).

Touvron et al., "LLaMA" (2023) and the Llama 3 report (2024). ``config.json``: ``attention_bias`` and
``mlp_bias`` are built only as false; a ``sliding_window`` field is not LlamaConfig's and is ignored. GGUF:
llama.cpp permutes the query and key rows to its interleaved RoPE and keeps Llama 3's RoPE scaling as a
``rope_freqs`` tensor.
"""

from __future__ import annotations

from shardlm.model.families.registry import Family

FAMILY = Family(
    "llama", "llama", "LlamaForCausalLM",
    hf_false_flags=("attention_bias", "mlp_bias"),
    gguf_architecture="llama", gguf_qk_permuted=True, gguf_rope_freqs=True,
)
