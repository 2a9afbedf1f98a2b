"""Hugging Face ``config.json`` <-> :class:`ModelConfig`, both directions, for Llama-family decoders.

Reads transformers 4.x and 5.x layouts (``rope_scaling`` or ``rope_parameters``) and refuses, naming the
field, what the model does not build. Imports no torch: the configuration reads it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from shardlm.errors import ModelDirError
from shardlm.model.config import ModelConfig


def hf_config(cfg: ModelConfig, special_ids: dict[str, int | None] | None = None,
              dtype: object = "float32") -> dict:
    """The ``config.json`` dict (``model_type: llama``) for a model of shape ``cfg``.

    ``special_ids`` gives ``bos``/``eos`` token ids; ``dtype`` (a ``torch.dtype`` or its name) is recorded as
    ``torch_dtype``.
    """
    special_ids = special_ids or {}
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": cfg.dim,
        "intermediate_size": cfg.ffn_dim,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.kv_heads,
        "head_dim": cfg.head_dim,
        "vocab_size": cfg.vocab_size,
        "max_position_embeddings": cfg.max_seq_len,
        "rope_theta": cfg.rope_theta,
        "rms_norm_eps": cfg.norm_eps,
        "tie_word_embeddings": cfg.tie_embeddings,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": special_ids.get("bos"),
        "eos_token_id": special_ids.get("eos"),
        "torch_dtype": str(dtype).removeprefix("torch."),
    }
    if cfg.rope_scaling_factor > 0:  # Llama 3.1 RoPE scaling, in HF's format
        config["rope_scaling"] = {
            "rope_type": "llama3", "factor": cfg.rope_scaling_factor, "low_freq_factor": cfg.rope_low_freq_factor,
            "high_freq_factor": cfg.rope_high_freq_factor,
            "original_max_position_embeddings": cfg.rope_original_max_seq_len,
        }
    return config


def model_config_from_hf_dict(config: dict[str, Any], source: str = "config.json") -> ModelConfig:
    """Our :class:`ModelConfig` from an HF Llama ``config.json`` dict (transformers 4.x or 5.x layout).

    Reads the shape, ``rope_theta`` (top level or in ``rope_parameters``), Llama 3.1 RoPE scaling
    (``rope_scaling`` / ``rope_parameters`` with ``rope_type: llama3``), ``rms_norm_eps`` and
    ``tie_word_embeddings``.

    Raises:
        ModelDirError: naming the field: ``model_type`` is not ``llama`` (or ``architectures`` not
            ``LlamaForCausalLM``), a required field is missing, ``head_dim`` differs from
            hidden_size / num_attention_heads, ``hidden_act`` is not ``silu``, attention or MLP
            biases are on, or the RoPE type is not ``default``/``llama3``.
    """
    arch = config.get("architectures") or ["LlamaForCausalLM"]
    if config.get("model_type") != "llama" or arch != ["LlamaForCausalLM"]:
        raise ModelDirError(f"{source}: model_type={config.get('model_type')!r}, architectures={arch}: only Llama "
                     "('llama', LlamaForCausalLM) is supported")
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size"):
        if key not in config:
            raise ModelDirError(f"{source}: missing field {key!r}")
    dim, heads = int(config["hidden_size"]), int(config["num_attention_heads"])
    if config.get("head_dim") not in (None, dim // heads):
        raise ModelDirError(f"{source}: head_dim={config['head_dim']} differs from hidden_size / num_attention_heads = "
                     f"{dim // heads}; not supported")
    if config.get("hidden_act", "silu") != "silu":
        raise ModelDirError(f"{source}: hidden_act={config['hidden_act']!r}; only 'silu' is supported")
    for key in ("attention_bias", "mlp_bias"):
        if config.get(key):
            raise ModelDirError(f"{source}: {key}=true is not supported")
    rope = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    theta = config.get("rope_theta", rope.get("rope_theta", 10000.0))
    cfg = ModelConfig(
        dim=dim, n_layers=int(config["num_hidden_layers"]), n_heads=heads,
        n_kv_heads=int(config.get("num_key_value_heads") or heads), ffn_hidden=int(config["intermediate_size"]),
        vocab_size=int(config["vocab_size"]), max_seq_len=int(config.get("max_position_embeddings", 2048)),
        rope_theta=float(theta), norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        tie_embeddings=bool(config.get("tie_word_embeddings", False)),
    )
    if rope_type == "llama3":
        try:
            cfg.rope_scaling_factor = float(rope["factor"])
            cfg.rope_low_freq_factor = float(rope["low_freq_factor"])
            cfg.rope_high_freq_factor = float(rope["high_freq_factor"])
        except KeyError as e:
            raise ModelDirError(f"{source}: rope_scaling (llama3) lacks field {e.args[0]!r}") from None
        cfg.rope_original_max_seq_len = int(rope.get("original_max_position_embeddings", cfg.max_seq_len))
    elif rope_type != "default":
        raise ModelDirError(f"{source}: rope_scaling type {rope_type!r} is not supported (only default and llama3)")
    return cfg


def read_model_dir_config(path: str | Path) -> ModelConfig:
    """The :class:`ModelConfig` of an HF Llama directory, from its ``config.json``.

    Raises:
        ModelDirError: the directory or its ``config.json`` is missing or invalid, or not a Llama.
    """
    path = Path(path)
    file = path / "config.json"
    if not file.is_file():
        raise ModelDirError(f"{path} is not a model directory: config.json not found")
    try:
        config = json.loads(file.read_text())
    except json.JSONDecodeError as e:
        raise ModelDirError(f"{file}: invalid JSON ({e})") from None
    return model_config_from_hf_dict(config, str(file))
