"""Checkpoint to Hugging Face directory (``shardlm export``).

Runs in one process without a process group. Export reads only the model's tensors (not the
optimizer state) with ``dcp.load(no_dist=True)``, which assembles each full tensor from the shards
of whatever world size wrote them, so the process holds exactly one full copy of the weights; they
leave as safetensors through :func:`shardlm.convert.hf_out.save_model_dir`, the writer of ``final/``.
"""

from __future__ import annotations

import warnings
from copy import copy
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from shardlm.checkpoint.dcp import check_shapes, verify_checkpoint
from shardlm.checkpoint.safe_load import SafeFileSystemReader, SafeLoadPlanner
from shardlm.convert.hf_out import save_model_dir
from shardlm.errors import CheckpointError, ConfigError
from shardlm.model.config import ModelConfig
from shardlm.model.llama import Llama


def checkpoint_model_config(manifest: dict[str, Any]) -> ModelConfig:
    """The :class:`ModelConfig` recorded in a checkpoint's manifest.

    Raises:
        CheckpointError: the manifest has no usable model config.
    """
    try:
        return ModelConfig(**manifest["config"]["model"])
    except (KeyError, TypeError, ConfigError) as e:
        raise CheckpointError(f"the checkpoint manifest has no usable model config: {e}") from None


def load_model_weights(ckpt: str | Path) -> tuple[dict[str, torch.Tensor], ModelConfig, dict[str, Any]]:
    """Verify a checkpoint and read its full model weights into one process (no process group needed).

    Returns ``({HF parameter name: full CPU tensor}, model config, manifest)``. With tied embeddings
    the shared tensor appears once, as ``model.embed_tokens.weight``.

    Raises:
        CheckpointError: not a checkpoint, damaged, unsafe metadata, tensors that do not fit the
            recorded model config, or a checkpoint of trainable parameters only (LoRA, frozen layers).
    """
    path = Path(ckpt)
    manifest, metadata = verify_checkpoint(path)
    if manifest.get("base") is not None:
        raise CheckpointError(f"checkpoint {path} holds only the trainable parameters (LoRA adapters or unfrozen "
                              "layers) on top of a base it refers to; export the run directory's final/ (merged) or "
                              "final-adapter/ (PEFT), or resume the run to the end to write them")
    cfg = checkpoint_model_config(manifest)
    with torch.device("meta"):
        model = Llama(cfg)
    stored = metadata.state_dict_metadata
    state: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters():  # tied weights are listed once
        entry = stored.get(f"model.{name}")
        dtype = entry.properties.dtype if isinstance(entry, TensorStorageMetadata) else p.dtype
        state[name] = torch.empty(p.shape, dtype=dtype)
    check_shapes(path, _only_model(metadata, cfg.tie_embeddings), {"model": state})
    try:
        with warnings.catch_warnings():  # DCP warns that it loads in one process: that is the intent
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load({"model": state}, storage_reader=SafeFileSystemReader(path), planner=SafeLoadPlanner(),
                     no_dist=True)
    except CheckpointException as e:  # derives from BaseException
        raise CheckpointError(f"reading the weights of {path} failed: {e}") from None
    return state, cfg, manifest


def _only_model(metadata: Any, tied: bool) -> Any:
    """A shallow copy of DCP metadata restricted to ``model.*`` entries that are actual parameters.

    With tied embeddings the checkpoint also holds ``model.lm_head.weight``, which ``named_parameters``
    lists once; :func:`check_shapes` should not call it an unknown tensor.
    """
    md = copy(metadata)
    md.state_dict_metadata = {k: v for k, v in metadata.state_dict_metadata.items()
                              if k.startswith("model.") and not (tied and k == "model.lm_head.weight")}
    return md


def export_checkpoint(ckpt: str | Path, out_dir: str | Path) -> Path:
    """Write a checkpoint's weights as the same HF model directory as a run's ``final/``; return it.

    The directory gets ``model.safetensors``, ``config.json`` and (when the checkpoint carries it)
    ``tokenizer.json``; it is written to a temporary name and renamed, so a failure leaves nothing.

    Raises:
        CheckpointError: see :func:`load_model_weights`.
    """
    state, cfg, manifest = load_model_weights(ckpt)
    tokenizer = Path(ckpt) / "tokenizer.json"
    return save_model_dir(state, cfg, out_dir, tokenizer if tokenizer.is_file() else None,
                          manifest.get("special_ids"))
