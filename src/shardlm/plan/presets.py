"""Model shapes for the planner: common public models by name, or any Hugging Face ``config.json``.

Each preset is the shape part of the model's public ``config.json`` on the Hugging Face Hub (the repository is
named beside it), read through :func:`shardlm.model.hf_config.model_config_from_hf_dict` like any other
``config.json``, so a preset and the file it was copied from give the same :class:`ModelConfig`. Gemma 3's
4B/12B/27B presets are the ``text_config`` of the multimodal checkpoints (the language model alone). Imports
no torch.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from shardlm.errors import ConfigError, ModelDirError
from shardlm.json_file import read_json
from shardlm.model.config import ModelConfig
from shardlm.model.hf_config import model_config_from_hf_dict


def _llama(
    dim: int,
    ffn: int,
    layers: int,
    heads: int,
    kv: int,
    vocab: int = 128256,
    *,
    tied: bool = False,
    head_dim: int = 0,
    max_pos: int = 131072,
    theta: float = 500000.0,
    scaling: float = 8.0,
) -> dict[str, Any]:
    config: dict[str, Any] = {
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": dim,
        "intermediate_size": ffn, "num_hidden_layers": layers, "num_attention_heads": heads,
        "num_key_value_heads": kv, "vocab_size": vocab, "max_position_embeddings": max_pos,
        "rope_theta": theta, "rms_norm_eps": 1e-5, "tie_word_embeddings": tied, "hidden_act": "silu"}
    if head_dim:
        config["head_dim"] = head_dim
    if scaling:
        config["rope_scaling"] = {"rope_type": "llama3", "factor": scaling, "low_freq_factor": 1.0,
                                  "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    return config


def _qwen2(dim: int, ffn: int, layers: int, heads: int, kv: int, vocab: int, tied: bool, max_pos: int,
           eps: float) -> dict[str, Any]:
    return {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "hidden_size": dim,
            "intermediate_size": ffn, "num_hidden_layers": layers, "num_attention_heads": heads,
            "num_key_value_heads": kv, "vocab_size": vocab, "max_position_embeddings": max_pos,
            "rope_theta": 1000000.0, "rms_norm_eps": eps, "tie_word_embeddings": tied, "hidden_act": "silu",
            "use_sliding_window": False}


def _qwen3(dim: int, ffn: int, layers: int, heads: int, tied: bool) -> dict[str, Any]:
    return {"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "hidden_size": dim,
            "intermediate_size": ffn, "num_hidden_layers": layers, "num_attention_heads": heads,
            "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936, "max_position_embeddings": 40960,
            "rope_theta": 1000000.0, "rms_norm_eps": 1e-6, "tie_word_embeddings": tied, "hidden_act": "silu",
            "use_sliding_window": False}


def _gemma3(dim: int, ffn: int, layers: int, heads: int, kv: int, head_dim: int, window: int, vocab: int,
            max_pos: int, *, scalar: int = 256, linear: float = 0.0) -> dict[str, Any]:
    config: dict[str, Any] = {
        "model_type": "gemma3_text", "architectures": ["Gemma3ForCausalLM"], "hidden_size": dim,
        "intermediate_size": ffn, "num_hidden_layers": layers, "num_attention_heads": heads,
        "num_key_value_heads": kv, "head_dim": head_dim, "vocab_size": vocab,
        "max_position_embeddings": max_pos, "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0,
        "rms_norm_eps": 1e-6, "tie_word_embeddings": True, "hidden_activation": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": scalar, "sliding_window": window, "sliding_window_pattern": 6}
    if linear:
        config["rope_scaling"] = {"rope_type": "linear", "factor": linear}
    return config


def _smollm2(dim: int, ffn: int, layers: int, heads: int, kv: int, theta: float) -> dict[str, Any]:
    return _llama(dim, ffn, layers, heads, kv, 49152, tied=True, max_pos=8192, theta=theta, scaling=0.0)


#: preset name -> (Hugging Face repository the values come from, the shape fields of its ``config.json``)
PRESETS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama3-8b": ("meta-llama/Meta-Llama-3-8B", _llama(4096, 14336, 32, 32, 8, max_pos=8192, scaling=0.0)),
    "llama3-70b": ("meta-llama/Meta-Llama-3-70B", _llama(8192, 28672, 80, 64, 8, max_pos=8192, scaling=0.0)),
    "llama3.1-8b": ("meta-llama/Llama-3.1-8B", _llama(4096, 14336, 32, 32, 8)),
    "llama3.1-70b": ("meta-llama/Llama-3.1-70B", _llama(8192, 28672, 80, 64, 8)),
    "llama3.1-405b": ("meta-llama/Llama-3.1-405B", _llama(16384, 53248, 126, 128, 8)),
    "llama3.2-1b": ("meta-llama/Llama-3.2-1B",
                    _llama(2048, 8192, 16, 32, 8, tied=True, head_dim=64, scaling=32.0)),
    "llama3.2-3b": ("meta-llama/Llama-3.2-3B",
                    _llama(3072, 8192, 28, 24, 8, tied=True, head_dim=128, scaling=32.0)),
    "qwen2.5-0.5b": ("Qwen/Qwen2.5-0.5B", _qwen2(896, 4864, 24, 14, 2, 151936, True, 32768, 1e-6)),
    "qwen2.5-1.5b": ("Qwen/Qwen2.5-1.5B", _qwen2(1536, 8960, 28, 12, 2, 151936, True, 131072, 1e-6)),
    "qwen2.5-3b": ("Qwen/Qwen2.5-3B", _qwen2(2048, 11008, 36, 16, 2, 151936, True, 32768, 1e-6)),
    "qwen2.5-7b": ("Qwen/Qwen2.5-7B", _qwen2(3584, 18944, 28, 28, 4, 152064, False, 131072, 1e-6)),
    "qwen2.5-14b": ("Qwen/Qwen2.5-14B", _qwen2(5120, 13824, 48, 40, 8, 152064, False, 131072, 1e-5)),
    "qwen2.5-32b": ("Qwen/Qwen2.5-32B", _qwen2(5120, 27648, 64, 40, 8, 152064, False, 131072, 1e-5)),
    "qwen2.5-72b": ("Qwen/Qwen2.5-72B", _qwen2(8192, 29568, 80, 64, 8, 152064, False, 131072, 1e-5)),
    "qwen3-0.6b": ("Qwen/Qwen3-0.6B", _qwen3(1024, 3072, 28, 16, True)),
    "qwen3-1.7b": ("Qwen/Qwen3-1.7B", _qwen3(2048, 6144, 28, 16, True)),
    "qwen3-4b": ("Qwen/Qwen3-4B", _qwen3(2560, 9728, 36, 32, True)),
    "qwen3-8b": ("Qwen/Qwen3-8B", _qwen3(4096, 12288, 36, 32, False)),
    "qwen3-14b": ("Qwen/Qwen3-14B", _qwen3(5120, 17408, 40, 40, False)),
    "qwen3-32b": ("Qwen/Qwen3-32B", _qwen3(5120, 25600, 64, 64, False)),
    "mistral-7b": ("mistralai/Mistral-7B-v0.3", {
        "model_type": "mistral", "architectures": ["MistralForCausalLM"], "hidden_size": 4096,
        "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
        "num_key_value_heads": 8, "vocab_size": 32768, "max_position_embeddings": 32768,
        "rope_theta": 1000000.0, "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "hidden_act": "silu",
        "sliding_window": None}),
    "gemma3-270m": ("google/gemma-3-270m", _gemma3(640, 2048, 18, 4, 1, 256, 512, 262144, 32768)),
    "gemma3-1b": ("google/gemma-3-1b-pt", _gemma3(1152, 6912, 26, 4, 1, 256, 512, 262144, 32768)),
    "gemma3-4b": ("google/gemma-3-4b-pt",
                  _gemma3(2560, 10240, 34, 8, 4, 256, 1024, 262208, 131072, linear=8.0)),
    "gemma3-12b": ("google/gemma-3-12b-pt",
                   _gemma3(3840, 15360, 48, 16, 8, 256, 1024, 262208, 131072, linear=8.0)),
    "gemma3-27b": ("google/gemma-3-27b-pt",
                   _gemma3(5376, 21504, 62, 32, 16, 128, 1024, 262208, 131072, scalar=168,
                                                    linear=8.0)),
    "smollm2-135m": ("HuggingFaceTB/SmolLM2-135M", _smollm2(576, 1536, 30, 9, 3, 100000.0)),
    "smollm2-360m": ("HuggingFaceTB/SmolLM2-360M", _smollm2(960, 2560, 32, 15, 5, 100000.0)),
    "smollm2-1.7b": ("HuggingFaceTB/SmolLM2-1.7B", _smollm2(2048, 8192, 24, 32, 32, 130000.0)),
}


def preset_config(name: str) -> ModelConfig:
    """The :class:`ModelConfig` of preset ``name`` (a key of :data:`PRESETS`).

    Raises:
        ConfigError: an unknown name (the message lists the known ones).
    """
    if name not in PRESETS:
        raise ConfigError(f"unknown model preset {name!r} (known: {', '.join(PRESETS)})")
    repo, config = PRESETS[name]
    return model_config_from_hf_dict(config, f"preset {name} ({repo})")


def config_json_config(path: str | Path) -> ModelConfig:
    """The :class:`ModelConfig` of a Hugging Face ``config.json`` (the file, or a directory holding it).

    A multimodal Gemma 3 ``config.json`` (``model_type`` ``gemma3``) gives its ``text_config``'s
    language model.

    Raises:
        ModelDirError: the file is missing, is not JSON, or describes a model the decoder does not build (the
            message names the field, see :func:`~shardlm.model.hf_config.model_config_from_hf_dict`).
    """
    file = Path(path)
    if file.is_dir():
        file = file / "config.json"
    if not file.is_file():
        raise ModelDirError(f"--model-config {path}: no such file")
    config = read_json(file, ModelDirError)
    if config.get("model_type") == "gemma3" and isinstance(config.get("text_config"), dict):
        config = {"model_type": "gemma3_text", "architectures": ["Gemma3ForCausalLM"],
                  **config["text_config"]}
    return model_config_from_hf_dict(config, str(file))


def shape_overrides(shape: ModelConfig) -> list[str]:
    """``--model.KEY=VALUE`` overrides that give a config every shape field of ``shape`` and an empty
    ``model.init_from`` (``init_std`` is kept), so that :func:`shardlm.config.load_config` checks
    the result."""
    out = [f"--model.{f.name}={json.dumps(getattr(shape, f.name))}" for f in dataclasses.fields(ModelConfig)
           if f.name not in ("init_std", "init_from")]
    return out + ['--model.init_from=""']
