"""Qwen2 / Qwen2.5: Llama with a bias on the query, key and value projections (Qwen2 technical report, 2024).

``config.json``: ``use_sliding_window`` is built only as false (Qwen's window is not built).
"""

from __future__ import annotations

from shardlm.model.families.registry import Family

FAMILY = Family(
    "qwen2", "qwen2", "Qwen2ForCausalLM", qkv_bias=True,
    hf_false_flags=("use_sliding_window",),
    gguf_architecture="qwen2",
)
