"""What a training checkpoint holds and how it is checked: the state dict DCP saves and loads in place
(:func:`training_state`), its tensors and bytes, and verification of a checkpoint directory against its
manifest and the model's shapes before anything is loaded (:func:`verify_checkpoint`,
:func:`check_shapes`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import get_state_dict

from shardlm.checkpoint.manifest import (
    check_files,
    read_manifest,
)
from shardlm.checkpoint.safe_load import read_metadata
from shardlm.errors import CheckpointError, UnsafeCheckpointError


def frozen_any(model: nn.Module) -> bool:
    """Whether some parameter of ``model`` is frozen (LoRA, ``train.trainable``): checkpoints then hold only
    the trainable parameters and refer to the base for the rest."""
    return any(not p.requires_grad for p in model.parameters())


def training_state(
    model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any, step: int
) -> dict[str, Any]:
    """The nested state dict that DCP saves and loads in place (see the module docstring).

    When parameters are frozen, ``model`` holds the trainable ones only (the adapters under LoRA): the frozen
    ones equal the base (``model.init_from`` or the seeded initialisation), which the manifest names.
    """
    model_sd, optim_sd = get_state_dict(model, optimizer)
    if frozen_any(model):
        trainable = {name for name, p in model.named_parameters() if p.requires_grad}
        model_sd = {k: v for k, v in model_sd.items() if k in trainable}
    return {"model": model_sd, "optimizer": optim_sd, "lr_scheduler": scheduler.state_dict(),
            "train": {"step": torch.tensor(step, dtype=torch.int64)}}


def flat_tensors(state: dict[str, Any], prefix: str = "") -> dict[str, torch.Tensor]:
    """Tensors of a nested state dict under DCP's flattened keys (``model.lm_head.weight``,
    ``optimizer.state...``)."""
    out: dict[str, torch.Tensor] = {}
    items = state.items() if isinstance(state, dict) else enumerate(state)
    for key, value in items:
        name = f"{prefix}{key}"
        if isinstance(value, torch.Tensor):
            out[name] = value
        elif isinstance(value, (dict, list, tuple)):
            out.update(flat_tensors(value, name + "."))
    return out


def local_bytes(state: dict[str, Any]) -> int:
    """Bytes of this rank's part of a state dict's tensors (DTensors: the local shard)."""
    total = 0
    for t in flat_tensors(state).values():
        local = t.to_local() if hasattr(t, "to_local") else t
        total += local.numel() * local.element_size()
    return total


def check_shapes(path: Path, metadata: Metadata, state: dict[str, Any], part: bool = False) -> None:
    """Compare every tensor of ``state`` (global shapes for DTensors) with the checkpoint's metadata.

    ``part``: ``state`` is a part of the model (a pipeline stage's): the checkpoint's other tensors are the
    other stages' (a change of the model's shape is refused with its config field, ``resume_config.py``).

    Raises:
        CheckpointError: naming the first tensor missing from the checkpoint or of another shape (both
            shapes), or (unless ``part``) the first model tensor in the checkpoint that this model lacks.
    """
    stored = metadata.state_dict_metadata
    ours = flat_tensors(state)
    for name, tensor in ours.items():
        entry = stored.get(name)
        if not isinstance(entry, TensorStorageMetadata):
            raise CheckpointError(f"checkpoint {path} has no tensor {name}: it was written for another model")
        if tuple(entry.size) != tuple(tensor.shape):
            raise CheckpointError(
                f"checkpoint {path} does not fit this model: tensor {name} has shape {tuple(entry.size)} in "
                f"the checkpoint but {tuple(tensor.shape)} in the model")
    for name, entry in stored.items():
        if part:  # the other stages' tensors are not this part's
            break
        if name.startswith("model.") and isinstance(entry, TensorStorageMetadata) and name not in ours:
            raise CheckpointError(f"checkpoint {path} has tensor {name} {tuple(entry.size)}, which this "
                                  "model lacks")


def verify_checkpoint(path: Path, rank: int = 0, world_size: int = 1) -> tuple[dict[str, Any], Metadata]:
    """Check a checkpoint against its manifest and read its metadata safely; return both.

    Files are split over ranks (rank r hashes files r, r + N, ...); with a process group of more than
    one rank the problems are all-gathered, so every rank raises the same error (no rank hangs).

    Raises:
        CheckpointError: not a checkpoint, a file missing, truncated or corrupted, or metadata that
            would build objects outside the allow-list (refused without running them).
    """
    manifest = read_manifest(path)
    names = sorted(manifest["files"])
    problems = check_files(path, manifest, names[rank::world_size])
    if world_size > 1:
        gathered: list[list[str]] = [[] for _ in range(world_size)]
        dist.all_gather_object(gathered, problems)
        problems = [p for ps in gathered for p in ps]
    if problems:
        raise CheckpointError(f"checkpoint {path} is damaged: " + "; ".join(problems))
    try:
        metadata = read_metadata(path / ".metadata")
    except (UnsafeCheckpointError, OSError) as e:
        raise CheckpointError(f"checkpoint {path}: {e}") from None
    return manifest, metadata
