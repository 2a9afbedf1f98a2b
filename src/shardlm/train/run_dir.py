"""A run's directory: where it is, and refusing to start a fresh run in one that holds another run's files."""

from __future__ import annotations

from pathlib import Path

import torch

from shardlm.checkpoint.dcp import resume_mode
from shardlm.checkpoint.run import clear_run_dir
from shardlm.config import Config
from shardlm.errors import ConfigError
from shardlm.parallel import DistInfo, run_on_main


def run_dir(cfg: Config) -> Path:
    """The run directory: ``run.dir`` or ``runs/<run name>``."""
    return Path(cfg.run.dir or f"runs/{cfg.run.name}")


def check_run_dir(cfg: Config, d: Path) -> None:
    """Refuse a run directory ``d`` that is a file, or that holds files while neither resuming nor
    ``run.overwrite``; changes nothing (the trainer checks it first and clears it with :func:`prepare_run_dir`
    once the data and the model are built, so bad input never costs the previous run's files).

    Raises:
        ConfigError: naming ``d`` and the fix.
    """
    if d.exists() and not d.is_dir():
        raise ConfigError(f"run directory {d} exists and is not a directory: choose another --run.dir")
    if d.exists() and any(d.iterdir()) and not cfg.run.overwrite and not resume_mode(cfg):
        raise ConfigError(f"run directory {d} is not empty: pass --run.overwrite=true or choose --run.dir")


def prepare_run_dir(cfg: Config, info: DistInfo, d: Path) -> None:
    """Refuse a non-empty run directory ``d`` (:func:`run_dir`) unless resuming or ``run.overwrite``; rank 0
    then creates it. A collective (every rank looks at ``d`` before rank 0 changes it).

    A fresh start with ``run.overwrite`` begins a new run: rank 0 removes the previous run's files
    (checkpoints, metrics, config, final model; see :func:`shardlm.checkpoint.run.clear_run_dir`) and
    says which, so nothing of the old run can be resumed into the new one.

    Raises:
        ConfigError: ``d`` is a file, or holds files while neither resuming nor ``run.overwrite``.
    """
    check_run_dir(cfg, d)
    resuming = bool(resume_mode(cfg))  # resuming continues this run dir: metrics are truncated, not wiped

    def create() -> None:
        d.mkdir(parents=True, exist_ok=True)
        if not resuming:
            removed = clear_run_dir(d)
            if removed:
                print(f"run.overwrite: starting a new run in {d}; removed the previous run's "
                      + ", ".join(removed), flush=True)

    torch.distributed.barrier()  # every rank has looked at the directory before rank 0 changes it
    run_on_main(create, info)
