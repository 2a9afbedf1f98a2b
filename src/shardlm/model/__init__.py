"""The Llama model: pure PyTorch, no distributed code."""

from shardlm.model.llama import Block, KVCache, Llama, RMSNorm, ffn_hidden_size, num_params, rotary_tables

__all__ = ["Block", "KVCache", "Llama", "RMSNorm", "ffn_hidden_size", "num_params", "rotary_tables"]
