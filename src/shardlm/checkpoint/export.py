"""Checkpoint to Hugging Face directory (``shardlm export``), and a checkpoint's summary (``shardlm inspect``).

Both run in one process without a process group. Export reads only the model's tensors (not the
optimizer state) with ``dcp.load(no_dist=True)``, which assembles each full tensor from the shards
of whatever world size wrote them, so the process holds exactly one full copy of the weights; they
leave as safetensors through :func:`shardlm.checkpoint.hf.save_model_dir`, the writer of ``final/``.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from shardlm.checkpoint.dcp import check_shapes, verify_checkpoint
from shardlm.checkpoint.hf import save_model_dir
from shardlm.checkpoint.manifest import CheckpointError, check_files, read_manifest
from shardlm.checkpoint.safe_load import SafeFileSystemReader, SafeLoadPlanner, UnsafeCheckpointError, read_metadata
from shardlm.config import ConfigError, ModelConfig
from shardlm.model import Llama


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
        CheckpointError: not a checkpoint, damaged, unsafe metadata, or tensors that do not fit the
            recorded model config.
    """
    path = Path(ckpt)
    manifest, metadata = verify_checkpoint(path)
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
    from copy import copy

    md = copy(metadata)
    md.state_dict_metadata = {k: v for k, v in metadata.state_dict_metadata.items()
                              if k.startswith("model.") and not (tied and k == "model.lm_head.weight")}
    return md


def export_checkpoint(ckpt: str | Path, out_dir: str | Path) -> Path:
    """Write a checkpoint's weights as the same HF Llama directory as a run's ``final/``; return it.

    The directory gets ``model.safetensors``, ``config.json`` and (when the checkpoint carries it)
    ``tokenizer.json``; it is written to a temporary name and renamed, so a failure leaves nothing.

    Raises:
        CheckpointError: see :func:`load_model_weights`.
    """
    state, cfg, manifest = load_model_weights(ckpt)
    tokenizer = Path(ckpt) / "tokenizer.json"
    return save_model_dir(state, cfg, out_dir, tokenizer if tokenizer.is_file() else None,
                          manifest.get("special_ids"))


def inspect_checkpoint(ckpt: str | Path) -> dict[str, Any]:
    """Describe a checkpoint without loading its tensors.

    Returns a dict with ``step``, ``world_size`` (of the run that wrote it), ``tensors`` (a list of
    ``(name, shape, dtype)``), ``other_items`` (names of non-tensor items), ``total_bytes`` (all
    files), and ``checksums`` (``"ok"`` or the list of problems).

    Raises:
        CheckpointError: not a checkpoint, or its metadata cannot be read safely.
    """
    path = Path(ckpt)
    manifest = read_manifest(path)
    problems = check_files(path, manifest, sorted(manifest["files"]))
    try:
        metadata = read_metadata(path / ".metadata")
    except (UnsafeCheckpointError, OSError) as e:
        raise CheckpointError(f"checkpoint {path}: {e}") from None
    tensors, others = [], []
    for name, entry in metadata.state_dict_metadata.items():
        if isinstance(entry, TensorStorageMetadata):
            tensors.append((name, tuple(entry.size), str(entry.properties.dtype).removeprefix("torch.")))
        else:
            others.append(name)
    return {
        "path": str(path), "step": manifest.get("step"), "world_size": manifest.get("world_size"),
        "tensors": tensors, "other_items": others,
        "total_bytes": sum(int(f["bytes"]) for f in manifest["files"].values()),
        "files": len(manifest["files"]), "checksums": problems or "ok",
    }


def format_inspection(report: dict[str, Any]) -> str:
    """The text ``shardlm inspect`` prints for a :func:`inspect_checkpoint` report."""
    lines = [
        f"checkpoint  {report['path']}",
        f"step        {report['step']}",
        f"world size  {report['world_size']} (the run that wrote it; it loads at any world size)",
        f"files       {report['files']}, {report['total_bytes']:,} bytes",
        "checksums   " + ("ok (SHA-256 of every file matches the manifest)" if report["checksums"] == "ok"
                          else "FAILED: " + "; ".join(report["checksums"])),
        f"tensors     {len(report['tensors'])}, plus {len(report['other_items'])} plain values",
    ]
    width = max((len(n) for n, _, _ in report["tensors"]), default=0)
    for name, shape, dtype in report["tensors"]:
        lines.append(f"  {name:<{width}}  {dtype:<8} {list(shape)}")
    return "\n".join(lines)
