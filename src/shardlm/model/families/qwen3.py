"""Qwen3: Llama with an RMSNorm over each query and key head before RoPE and an explicit ``head_dim``
(Qwen3 technical report, 2025).

``config.json``: ``use_sliding_window`` and ``attention_bias`` are built only as false.
"""

from __future__ import annotations

from shardlm.model.families.registry import Family

FAMILY = Family(
    "qwen3", "qwen3", "Qwen3ForCausalLM", qk_norm=True,
    hf_false_flags=("use_sliding_window", "attention_bias"),
    gguf_architecture="qwen3",
)
