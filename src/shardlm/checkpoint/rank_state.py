"""Per-rank state a checkpoint holds besides DCP's world-size-independent state: what the objective keeps in
memory between steps and cannot recompute from the step (online RL inside a generation cycle: its buffer of
completions, old log-probs and advantages, :mod:`shardlm.train.objectives.grpo`).

Each rank writes ``rank-<r>.state.safetensors`` into the checkpoint's ``.tmp-step-<N>`` directory, before
DCP's files; its size and SHA-256 go into the manifest with the rest, so the file is part of the atomic
save (the directory becomes ``step-<N>`` only once every rank's files and the manifest are written) and is
verified at load like DCP's. safetensors holds tensors and a ``str -> str`` header: nothing is unpickled.
A checkpoint without such files (the default: nothing to keep between steps) resumes at any world size; one
with them only at the world size that wrote them (the state is per rank), which :func:`read_rank_state`
refuses by name otherwise.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save

from shardlm.errors import CheckpointError, ConfigError

#: a rank's state is a dict of tensors and a header of strings (``what``: a description for messages;
#: ``advice``: what else a resume at another world size can do)
RankState = tuple[dict[str, torch.Tensor], dict[str, str]]


def rank_state_file(rank: int) -> str:
    """The file name of rank ``rank``'s state in a checkpoint directory."""
    return f"rank-{rank}.state.safetensors"


def write_rank_state(ckpt_dir: Path, rank: int, world_size: int, step: int, state: RankState
                     ) -> dict[str, dict[str, Any]]:
    """Write this rank's ``state`` into ``ckpt_dir`` (the unfinished ``.tmp-step-<N>``); return its
    manifest record ``{name: {"bytes", "sha256"}}``. The header also records ``rank``, ``world_size`` and
    ``step``.

    Raises:
        OSError: the file cannot be written (a full disk, no permission), naming it.
    """
    tensors, header = state
    name = rank_state_file(rank)
    # serialised in memory (safetensors refuses views that share memory: each tensor its own contiguous
    # copy), then written by Python: a failure is an OSError naming the file, and the checksum is of the bytes
    data = save({k: v.detach().cpu().contiguous().clone() for k, v in tensors.items()},
                metadata={**header, "rank": str(rank), "world_size": str(world_size), "step": str(step)})
    path = ckpt_dir / name
    try:
        with open(path, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    except OSError as e:  # a failed write or close (a full disk) names no file: name it
        raise OSError(e.errno, e.strerror or str(e), str(path)) from None
    return {name: {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}}


def read_rank_state(path: Path, manifest: dict[str, Any], rank: int, world_size: int) -> RankState | None:
    """This rank's state in the verified checkpoint ``path`` (its ``manifest``), or None when it holds none.

    Raises:
        ConfigError: the checkpoint holds per-rank state written at another world size: names both world
            sizes, the state (its ``what``) and what to do (resume at the same world size, or the ``advice``).
        CheckpointError: the state of this rank is missing, or its header does not name this rank, world
            size and step.
    """
    names = [n for n in manifest["files"] if n.startswith("rank-") and n.endswith(".state.safetensors")]
    if not names:
        return None
    saved = int(manifest.get("world_size", 0) or 0)
    step = manifest.get("step")
    if saved != world_size:
        with safe_open(str(path / sorted(names)[0]), framework="pt") as f:
            header = f.metadata() or {}
        raise ConfigError(
            f"cannot resume from {path} at {world_size} rank(s): it was saved after step {step} at {saved} "
            f"rank(s) with per-rank state ({header.get('what', 'the objective state')}), which only that "
            f"layout can read: resume with {saved} rank(s) (the same layout)"
            + (f", or {header['advice']}" if header.get("advice") else ""))
    name = rank_state_file(rank)
    if name not in names:
        raise CheckpointError(f"checkpoint {path} holds per-rank state but no {name} for rank {rank}")
    file = path / name
    with safe_open(str(file), framework="pt") as f:
        header = dict(f.metadata() or {})
    if (header.get("rank"), header.get("world_size"), header.get("step")) != (str(rank), str(world_size),
                                                                              str(step)):
        raise CheckpointError(f"{file}: its header names rank {header.get('rank')}, world size "
                              f"{header.get('world_size')}, step {header.get('step')}; the checkpoint is "
                              f"rank {rank} of {world_size} after step {step}")
    return load_file(str(file)), header

