"""The model's shape: :class:`ModelConfig`, a dataclass with a docstring per field and its derived sizes.

Field names follow the Llama papers; Hugging Face ``config.json`` names are given in brackets. Values
derived from the fields (head width, key/value heads, MLP width) are properties, computed in one place.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass
class ModelConfig:
    """Shape of the Llama-style decoder (Hugging Face ``LlamaConfig`` names in brackets)."""

    dim: int = 256
    """Hidden size, the width of the residual stream [hidden_size]."""
    n_layers: int = 4
    """Number of transformer blocks [num_hidden_layers]."""
    n_heads: int = 8
    """Number of query heads [num_attention_heads]; must divide ``dim``."""
    n_kv_heads: int = 0
    """Number of key/value heads for grouped-query attention [num_key_value_heads]; 0 means ``n_heads``."""
    ffn_hidden: int = 0
    """Hidden size of the SwiGLU MLP [intermediate_size]; 0 means the Llama rule: 8/3·dim rounded up to 256."""
    vocab_size: int = 4096
    """Rows of the token embedding [vocab_size]; must hold every tokenizer id."""
    max_seq_len: int = 1024
    """Longest sequence the rotary tables cover, in tokens [max_position_embeddings]."""
    rope_theta: float = 10000.0
    """Base of the rotary frequencies [rope_theta]."""
    norm_eps: float = 1e-5
    """Epsilon inside RMSNorm [rms_norm_eps]."""
    tie_embeddings: bool = False
    """Share the input embedding with the output projection [tie_word_embeddings]."""
    init_std: float = 0.02
    """Standard deviation of the normal initialisation of weight matrices."""
    rope_scaling_factor: float = 0.0
    """Llama 3.1 RoPE scaling ``factor`` (8 for Llama 3.1) [rope_scaling.factor, rope_type llama3]; 0 means no scaling."""
    rope_low_freq_factor: float = 1.0
    """Llama 3.1 RoPE scaling ``low_freq_factor`` [rope_scaling.low_freq_factor]; used when rope_scaling_factor > 0."""
    rope_high_freq_factor: float = 4.0
    """Llama 3.1 RoPE scaling ``high_freq_factor`` [rope_scaling.high_freq_factor]; used when rope_scaling_factor > 0."""
    rope_original_max_seq_len: int = 8192
    """Llama 3.1 pre-training context, in tokens [rope_scaling.original_max_position_embeddings]."""
    init_from: str = ""
    """Hugging Face Llama directory (``config.json`` + ``*.safetensors``) to start from instead of a random
    init; empty means random. When set, the model's shape (every field above except ``init_std``) is read
    from its ``config.json`` and overrides the TOML and command line; the tokenizer defaults to its
    ``tokenizer.json``. Each rank reads only the rows of its own shards."""

    @property
    def head_dim(self) -> int:
        """Width of one attention head: ``dim // n_heads``."""
        return self.dim // self.n_heads

    @property
    def kv_heads(self) -> int:
        """Key/value heads actually used: ``n_kv_heads``, or ``n_heads`` when 0 (no grouping)."""
        return self.n_kv_heads or self.n_heads

    @property
    def ffn_dim(self) -> int:
        """SwiGLU hidden size: ``ffn_hidden``, or the Llama rule when 0: 8/3·dim rounded up to a multiple of 256."""
        if self.ffn_hidden:
            return self.ffn_hidden
        return 256 * math.ceil(int(8 * self.dim / 3) / 256)
