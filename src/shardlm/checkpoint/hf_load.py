"""Starting from a Hugging Face Llama directory: its config, and sharded loading of its weights.

A directory holds ``config.json`` (``LlamaForCausalLM``) and one or more ``*.safetensors`` files.
:func:`load_pretrained_` fills a model whose parameters are FSDP shards (``Shard(0)`` DTensors) by
reading, on each rank, only the rows of its own shard with safetensors' ``safe_open(...).get_slice``,
so no rank ever materialises a whole tensor; it counts the bytes each rank reads.
"""

from __future__ import annotations

import json
import math
from dataclasses import fields
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

from shardlm.config import Config, ModelConfig

#: tensors some older HF checkpoints carry that hold no weights (recomputed, never loaded)
_IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)


def _error(message: str) -> Exception:
    from shardlm.checkpoint.hf import ModelDirError

    return ModelDirError(message)


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
        raise _error(f"{source}: model_type={config.get('model_type')!r}, architectures={arch}: only Llama "
                     "('llama', LlamaForCausalLM) is supported")
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size"):
        if key not in config:
            raise _error(f"{source}: missing field {key!r}")
    dim, heads = int(config["hidden_size"]), int(config["num_attention_heads"])
    if config.get("head_dim") not in (None, dim // heads):
        raise _error(f"{source}: head_dim={config['head_dim']} differs from hidden_size / num_attention_heads = "
                     f"{dim // heads}; not supported")
    if config.get("hidden_act", "silu") != "silu":
        raise _error(f"{source}: hidden_act={config['hidden_act']!r}; only 'silu' is supported")
    for key in ("attention_bias", "mlp_bias"):
        if config.get(key):
            raise _error(f"{source}: {key}=true is not supported")
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
            raise _error(f"{source}: rope_scaling (llama3) lacks field {e.args[0]!r}") from None
        cfg.rope_original_max_seq_len = int(rope.get("original_max_position_embeddings", cfg.max_seq_len))
    elif rope_type != "default":
        raise _error(f"{source}: rope_scaling type {rope_type!r} is not supported (only default and llama3)")
    return cfg


def read_model_dir_config(path: str | Path) -> ModelConfig:
    """The :class:`ModelConfig` of an HF Llama directory, from its ``config.json``.

    Raises:
        ModelDirError: the directory or its ``config.json`` is missing or invalid, or not a Llama.
    """
    path = Path(path)
    file = path / "config.json"
    if not file.is_file():
        raise _error(f"{path} is not a model directory: config.json not found")
    try:
        config = json.loads(file.read_text())
    except json.JSONDecodeError as e:
        raise _error(f"{file}: invalid JSON ({e})") from None
    return model_config_from_hf_dict(config, str(file))


def apply_init_from(cfg: Config) -> None:
    """Make ``cfg.model`` the shape of ``cfg.model.init_from``'s ``config.json`` (in place).

    Every shape field is replaced (``init_std`` and ``init_from`` are kept): the pretrained weights
    decide the model. ``data.tokenizer`` defaults to the directory's ``tokenizer.json`` when empty.

    Raises:
        ModelDirError: see :func:`read_model_dir_config`.
    """
    src = read_model_dir_config(cfg.model.init_from)
    for f in fields(ModelConfig):
        if f.name not in ("init_std", "init_from"):
            setattr(cfg.model, f.name, getattr(src, f.name))
    tokenizer = Path(cfg.model.init_from) / "tokenizer.json"
    if not cfg.data.tokenizer and tokenizer.is_file():
        cfg.data.tokenizer = str(tokenizer)


def tensor_files(path: str | Path) -> dict[str, Path]:
    """``{tensor name: safetensors file}`` over every ``*.safetensors`` file of the directory.

    Raises:
        ModelDirError: no safetensors file, or one tensor name in two files.
    """
    path = Path(path)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise _error(f"{path}: no *.safetensors weights found")
    where: dict[str, Path] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as st:
            for name in st.keys():
                if name in where:
                    raise _error(f"{path}: tensor {name} is in both {where[name].name} and {f.name}")
                where[name] = f
    return where


def check_weights(path: str | Path, model: nn.Module) -> dict[str, Path]:
    """Check that the directory holds exactly the model's tensors with the model's shapes (headers only).

    Returns :func:`tensor_files`. Raises ModelDirError naming a missing, unexpected or
    wrongly-shaped tensor (with both shapes).
    """
    where = tensor_files(path)
    expected = {name: tuple(p.shape) for name, p in model.named_parameters()}
    tied = getattr(getattr(model, "cfg", None), "tie_embeddings", False)
    for name, shape in expected.items():
        if name not in where:
            raise _error(f"{path}: tensor {name} is missing from the weights")
        with safe_open(str(where[name]), framework="pt") as st:
            found = tuple(st.get_slice(name).get_shape())
        if found != shape:
            raise _error(f"{path}: tensor {name} has shape {found}, config.json implies {shape}")
    for name in where:
        if name not in expected and not name.endswith(_IGNORED_SUFFIXES) and not (tied and name == "lm_head.weight"):
            raise _error(f"{path}: unexpected tensor {name} (config.json does not describe it)")
    return where


def local_rows(param: torch.Tensor) -> tuple[int, int]:
    """(first row, number of rows) of this rank's shard of ``param`` along dim 0; the whole for a plain tensor.

    Uses the DTensor's own layout (``compute_local_shape_and_global_offset``), i.e. the ``torch.chunk``
    split of dim 0 for ``Shard(0)``.

    Raises:
        ValueError: a DTensor sharded on another dimension than 0.
    """
    from torch.distributed.tensor import DTensor, Shard

    if not isinstance(param, DTensor):
        return 0, param.shape[0] if param.dim() else 1
    if any(isinstance(p, Shard) and p.dim != 0 for p in param.placements):
        raise ValueError(f"only Shard(0) parameters can be loaded by rows, got {param.placements}")
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
    return int(offset[0]), int(shape[0])


@torch.no_grad()
def load_pretrained_(model: nn.Module, path: str | Path) -> dict[str, Any]:
    """Fill ``model``'s parameters (plain or ``Shard(0)`` DTensors) from an HF Llama directory, in place.

    Each parameter's local rows ``[offset, offset + rows)`` are read with
    ``safe_open(...).get_slice(name)[offset:offset + rows]`` and copied (cast to the parameter's
    dtype) into its local tensor, so each rank materialises only its own rows. Rotary tables are
    recomputed afterwards (``init_rotary``).

    Returns:
        ``{"bytes_read": bytes materialised from the files on this rank, "total_bytes": bytes of
        every tensor in the files that the model uses, "max_slice_bytes": the largest single slice read,
        "full_tensors": names read whole although the parameter is sharded over > 1 rank}``.

    Raises:
        ModelDirError: a missing, unexpected or wrongly-shaped tensor (named), before anything is read.
    """
    from torch.distributed.tensor import DTensor

    where = check_weights(path, model)
    stats: dict[str, Any] = {"bytes_read": 0, "total_bytes": 0, "max_slice_bytes": 0, "full_tensors": []}
    handles: dict[Path, Any] = {}
    try:
        for name, param in model.named_parameters():
            f = where[name]
            if f not in handles:
                handles[f] = safe_open(str(f), framework="pt")
            tslice = handles[f].get_slice(name)
            full_rows = param.shape[0]
            start, rows = local_rows(param)
            local = param.to_local() if isinstance(param, DTensor) else param
            if rows:
                piece = tslice[start:start + rows]
                nbytes = piece.numel() * piece.element_size()
                stats["bytes_read"] += nbytes
                stats["max_slice_bytes"] = max(stats["max_slice_bytes"], nbytes)
                sharded = isinstance(param, DTensor) and param.device_mesh.size() > 1
                if sharded and rows == full_rows:
                    stats["full_tensors"].append(name)
                local.copy_(piece.to(local.dtype))
            stats["total_bytes"] += math.prod(param.shape) * _itemsize(tslice.get_dtype())
    finally:
        handles.clear()
    model.init_rotary()
    return stats


def _itemsize(safetensors_dtype: str) -> int:
    """Bytes per element of a safetensors dtype name (``F32``, ``BF16``...)."""
    return {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
            "BOOL": 1}[safetensors_dtype]
