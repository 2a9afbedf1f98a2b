"""Run identity: which checkpoints belong to which run, and which of them is the newest.

A *run* is one training job from its fresh start through all its resumes. It gets a run id when it
starts fresh (:func:`new_run_id`, e.g. ``20261130-114222-3f9c0a1b``: UTC start time and 32 random
bits); resuming keeps it. The id is recorded

- in the run directory's ``config.json`` (key ``run_id``; :func:`read_run_id` reads it back), which
  also names the run a run directory currently holds, and
- in every checkpoint's ``manifest.json`` (keys ``run_id`` and ``save_seq``, the 1-based number of the
  save within the run, in the order the saves happened).

"Newest" means the latest save of the run (highest ``save_seq``), not the highest step: a run resumed
from ``step-3`` while the same run's ``step-6`` exists writes ``step-4``, and ``step-4`` is then its
newest checkpoint. Retention (``checkpoint.keep``) and ``--resume=auto`` look only at the current run's
checkpoints (:func:`run_checkpoints`), so another run's checkpoints left in the same directory are
never deleted by retention nor resumed into by accident.
"""

from __future__ import annotations

import json
import os
import secrets
import shlex
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shardlm.checkpoint.manifest import MANIFEST, STEP_DIR, TMP_PREFIX

#: the run directory's file that records the run's config and its ``run_id``
RUN_CONFIG = "config.json"
#: what a fresh start with ``run.overwrite`` removes from the run directory (everything shardlm writes there)
RUN_FILES = ("checkpoints", "metrics.jsonl", "config.json", "final", "tensorboard", "profile",
             "trackers.json")


def new_run_id() -> str:
    """A new run id: UTC start time and 8 random hex digits, e.g. ``20261130-114222-3f9c0a1b``."""
    return time.strftime("%Y%m%d-%H%M%S", time.gmtime()) + "-" + secrets.token_hex(4)


def read_run_id(run_dir: str | os.PathLike) -> str | None:
    """The id of the run that ``run_dir`` holds (``config.json``'s ``run_id``), or None.

    None when the directory has no ``config.json``, it is not a JSON object, or it has no run id (written
    by a shardlm before run ids existed). Never raises for a missing or unreadable file.
    """
    path = Path(run_dir) / RUN_CONFIG
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    run_id = data.get("run_id") if isinstance(data, dict) else None
    return run_id if isinstance(run_id, str) and run_id else None


def write_run_config(run_dir: Path, run_id: str, config: dict[str, Any]) -> Path:
    """Write ``run_dir/config.json``: ``{"run_id": ..., <config sections>}``, atomically; return its path."""
    path = Path(run_dir) / RUN_CONFIG
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps({"run_id": run_id, **config}, indent=2) + "\n", encoding="utf-8")
    os.replace(tmp, path)
    return path


@dataclass(frozen=True)
class CheckpointEntry:
    """A complete checkpoint found on disk: its step, directory, run id and save number within the run."""

    step: int
    path: Path
    run_id: str | None
    save_seq: int
    time_unix: float


def read_entries(ckpt_root: Path) -> list[CheckpointEntry]:
    """Every complete checkpoint (``step-<N>`` with a readable manifest) under ``ckpt_root``, any run.

    A manifest that cannot be read is left out (such a checkpoint belongs to no known run). Checkpoints
    written before run ids existed have ``run_id`` None and ``save_seq`` 0.
    """
    if not ckpt_root.is_dir():
        return []
    out = []
    for p in ckpt_root.iterdir():
        m = STEP_DIR.match(p.name)
        if not (m and p.is_dir() and (p / MANIFEST).is_file()):
            continue
        try:
            manifest = json.loads((p / MANIFEST).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        if not isinstance(manifest, dict):
            continue
        out.append(CheckpointEntry(step=int(m.group(1)), path=p, run_id=manifest.get("run_id"),
                                   save_seq=int(manifest.get("save_seq", 0) or 0),
                                   time_unix=float(manifest.get("time_unix", 0.0) or 0.0)))
    return out


def newest_first(entries: list[CheckpointEntry]) -> list[CheckpointEntry]:
    """Entries ordered from the latest save to the earliest (``save_seq``, then step)."""
    return sorted(entries, key=lambda e: (e.save_seq, e.step), reverse=True)


def run_checkpoints(ckpt_root: Path, run_id: str | None) -> list[CheckpointEntry]:
    """The complete checkpoints of run ``run_id`` under ``ckpt_root``, newest (latest save) first."""
    return newest_first([e for e in read_entries(ckpt_root) if e.run_id == run_id])


def run_dir_run_id(run_dir: Path) -> str | None:
    """The run that ``--resume=auto`` continues in ``run_dir``.

    ``config.json``'s run id when it is there; otherwise (a directory from before run ids, or one whose
    ``config.json`` was removed) the run of the most recently written complete checkpoint.
    """
    run_id = read_run_id(run_dir)
    if run_id is not None:
        return run_id
    entries = read_entries(run_dir / "checkpoints")
    if not entries:
        return None
    return max(entries, key=lambda e: (e.time_unix, e.save_seq, e.step)).run_id


def is_run_dir(path: Path) -> bool:
    """Whether ``path`` is a training run's directory: its ``config.json`` records a run id, or it holds
    ``checkpoints/`` (a model directory's ``config.json`` is the model's, with no run id)."""
    return read_run_id(path) is not None or (path / "checkpoints").is_dir()


def remove_directory(path: Path) -> None:
    """Delete a directory so that no half-deleted copy ever looks complete.

    It is first renamed to ``.tmp-deleting-<name>`` in the same parent (one atomic step: from then on no
    reader takes it for a checkpoint), then deleted. A kill in between leaves only that temporary name,
    which the next save clears.
    """
    doomed = path.with_name(f"{TMP_PREFIX}deleting-{path.name}")
    if doomed.exists():
        shutil.rmtree(doomed, ignore_errors=True)
    os.replace(path, doomed)
    shutil.rmtree(doomed, ignore_errors=True)


def clear_run_dir(run_dir: Path) -> list[str]:
    """Remove the previous run's files (:data:`RUN_FILES`) from ``run_dir``; return what was removed.

    Files shardlm does not write there are left alone. Each returned item is a name, with the steps and
    run of the checkpoints for ``checkpoints/`` (``checkpoints/ (step-3, step-6 of run 2026...)``).
    """
    removed = []
    for name in RUN_FILES:
        path = run_dir / name
        if not (path.exists() or path.is_symlink()):
            continue
        label = name + ("/" if path.is_dir() else "")
        if name == "checkpoints" and path.is_dir():
            entries = sorted(read_entries(path), key=lambda e: e.step)
            runs = sorted({e.run_id or "without id" for e in entries})
            if entries:
                label += (" (" + ", ".join(e.path.name for e in entries)
                          + f" of run{'s' if len(runs) > 1 else ''} " + ", ".join(runs) + ")")
        if path.is_dir() and not path.is_symlink():
            remove_directory(path)
        else:
            path.unlink()
        removed.append(label)
    return removed


#: environment variable in which ``shardlm train`` (:mod:`shardlm.cli.launch`) passes its own launch command
#: (without the config and overrides) to the ranks, for :func:`resume_command`
LAUNCH_ENV = "SHARDLM_LAUNCH_COMMAND"


def _launcher_prefix() -> list[str]:
    """The command that started this process up to ``-m shardlm.train`` (exclusive), as the user would
    type it.

    ``shardlm train ...`` when :data:`LAUNCH_ENV` is set; under torchrun the launcher's own options, read from
    its ``/proc/<ppid>/cmdline`` (``torchrun --standalone --nproc_per_node=2``), or, without ``/proc``,
    rebuilt from torchrun's environment; in one process ``python``.
    """
    if os.environ.get(LAUNCH_ENV):
        return shlex.split(os.environ[LAUNCH_ENV])
    if "LOCAL_WORLD_SIZE" not in os.environ:  # not under torchrun
        return ["python"]
    try:
        argv = Path(f"/proc/{os.getppid()}/cmdline").read_bytes().decode().split("\0")[:-1]
    except (OSError, UnicodeDecodeError):
        argv = []
    for i in range(len(argv) - 1):
        if argv[i] == "-m" and argv[i + 1] == "shardlm.train":
            prefix = argv[:i]
            if len(prefix) >= 2 and Path(prefix[1]).name == "torchrun":  # python .../bin/torchrun OPTIONS
                return ["torchrun", *prefix[2:]]
            if prefix[1:3] == ["-m", "torch.distributed.run"]:
                return ["torchrun", *prefix[3:]]
            if prefix and Path(prefix[0]).name == "torchrun":
                return ["torchrun", *prefix[1:]]
    local, world = int(os.environ["LOCAL_WORLD_SIZE"]), int(os.environ.get("WORLD_SIZE", "1"))
    nodes = "--standalone" if local == world else f"--nnodes={world // local} <this job's rendezvous options>"
    return ["torchrun", nodes, f"--nproc_per_node={local}"]


def resume_command(run_dir: Path) -> str:
    """The command line that resumes the run in ``run_dir`` from its newest checkpoint, as this process
    was launched.

    The run's settings come back from ``run_dir/config.json`` (``--resume=auto --run.dir=DIR`` and nothing
    else: see :func:`shardlm.cli.train.train_config`), so the command holds only the launcher,
    ``--resume=auto`` and the run directory, e.g. ``torchrun --standalone --nproc_per_node=2 -m shardlm.train
    --resume=auto --run.dir=runs/tiny``. Run it from the same working directory (relative paths in the config
    stay relative).
    """
    prefix = _launcher_prefix()
    if prefix[:2] != ["shardlm", "train"]:
        prefix = [*prefix, "-m", "shardlm.train"]
    return shlex.join([*prefix, "--resume=auto", f"--run.dir={run_dir}"])
