"""Hugging Face style model directories: ``config.json`` + ``model.safetensors`` + ``tokenizer.json``.

Our parameter names are HF ``LlamaForCausalLM``'s, so the state dict is written as is; a tied
output weight is written once (as ``model.embed_tokens.weight``, with ``tie_word_embeddings``).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from shardlm.atomic import atomic_directory, save_safetensors
from shardlm.config import ModelConfig
from shardlm.model import Llama, ffn_hidden_size


class ModelDirError(ValueError):
    """A model directory is missing, not a Llama, or inconsistent with its weights."""


def hf_config(cfg: ModelConfig, special_ids: dict[str, int | None] | None = None,
              dtype: torch.dtype = torch.float32) -> dict:
    """The ``config.json`` dict (``model_type: llama``) for a model of shape ``cfg``."""
    special_ids = special_ids or {}
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": cfg.dim,
        "intermediate_size": ffn_hidden_size(cfg),
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads or cfg.n_heads,
        "head_dim": cfg.dim // cfg.n_heads,
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


def model_config_from_hf(config: dict) -> ModelConfig:
    """Our :class:`ModelConfig` from an HF Llama ``config.json`` dict.

    Raises:
        ModelDirError: not a Llama (see :func:`shardlm.checkpoint.hf_load.model_config_from_hf_dict`).
    """
    from shardlm.checkpoint.hf_load import model_config_from_hf_dict

    return model_config_from_hf_dict(config)


def gather_full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """All-gather the model's full (unsharded) state dict onto rank 0, on CPU.

    A collective: every rank must call it. Rank 0 gets ``{name: full fp tensor}``; other ranks get
    an empty dict. Uses ``get_model_state_dict(full_state_dict=True, cpu_offload=True)``
    (torch.distributed.checkpoint.state_dict), which gathers one tensor at a time.
    """
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def save_model_dir(state: dict[str, torch.Tensor], cfg: ModelConfig, out_dir: str | Path,
                   tokenizer_path: str | Path | None = None, special_ids: dict | None = None,
                   extra_files: list[Path] = ()) -> Path:
    """Write an HF-style Llama directory atomically (temp dir, then rename) and return its path.

    ``state`` maps our (= HF) parameter names to full tensors; with tied embeddings
    ``lm_head.weight`` is dropped so the shared tensor is stored once. ``extra_files`` (e.g. a
    tokenizer's chat template) are copied in by name before the rename.
    """
    out = Path(out_dir)
    tensors = {k: v.detach().contiguous().cpu() for k, v in state.items()}
    if cfg.tie_embeddings:
        tensors.pop("lm_head.weight", None)
    dtype = next(iter(tensors.values())).dtype
    with atomic_directory(out) as tmp:
        save_safetensors(tensors, tmp / "model.safetensors", metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(hf_config(cfg, special_ids, dtype), indent=2) + "\n")
        if tokenizer_path is not None:
            shutil.copyfile(tokenizer_path, tmp / "tokenizer.json")
        for extra in extra_files:
            shutil.copyfile(extra, tmp / extra.name)
    return out


def load_model_dir(path: str | Path, device: torch.device | str = "cpu") -> Llama:
    """Load an HF-style Llama directory (``config.json`` + ``*.safetensors``) into a whole :class:`Llama`.

    Weights are read with safetensors (no pickle). Raises ModelDirError naming the missing file, a
    missing or unexpected tensor, or a shape mismatch (tensor name and both shapes).
    """
    path = Path(path)
    if not (path / "config.json").is_file():
        raise ModelDirError(f"{path} is not a model directory: config.json not found")
    cfg = model_config_from_hf(json.loads((path / "config.json").read_text()))
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelDirError(f"{path}: no *.safetensors weights found")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(str(f)))
    with torch.device("meta"):
        model = Llama(cfg)
    model.to_empty(device=device)
    expected = dict(model.named_parameters())
    for name, param in expected.items():
        if name not in state:
            raise ModelDirError(f"{path}: tensor {name} is missing from the weights")
        if tuple(state[name].shape) != tuple(param.shape):
            raise ModelDirError(
                f"{path}: tensor {name} has shape {tuple(state[name].shape)}, config.json implies {tuple(param.shape)}")
        with torch.no_grad():
            param.copy_(state[name])
    model.init_rotary()
    return model
