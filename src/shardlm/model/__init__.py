"""The Llama model: pure PyTorch, no distributed code."""

from shardlm.model.llama import Block, Llama, RMSNorm, ffn_hidden_size, num_params, rotary_tables

__all__ = ["Block", "Llama", "RMSNorm", "ffn_hidden_size", "num_params", "rotary_tables"]
