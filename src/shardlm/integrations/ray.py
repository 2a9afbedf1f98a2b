"""Ray Train: ``shardlm train --ray --num-workers N [--ray-address ADDR] --config FILE [overrides]``, or
:func:`train` from Python.

The ranks are the workers of one ``ray.train.torch.TorchTrainer`` (Ray Train v2, the default from Ray 2.50):
one worker is one rank, Ray starts the default process group (gloo on CPU workers, NCCL on GPU workers) and
sets torchrun's variables (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``,
``MASTER_PORT``), and each worker runs the same training as ``torchrun -m shardlm.train`` with the same
arguments (:func:`shardlm.parallel.init_distributed` joins the group Ray started). Checkpoints, metrics and
the final model go to the run directory as under torchrun, so on several machines it must be on storage that
every node mounts at the same path; the workers start in the directory the command was run in (relative paths
in the config resolve there).

Failure: a worker that dies or raises stops the whole worker group; Ray restarts the group up to
``max_failures`` times (``FailureConfig``; the CLI's ``--max-restarts``), and the new workers continue from
the newest complete checkpoint of the run directory (``--resume=auto`` is added unless a resume is given),
as torchrun's restarts do. After the last restart the command prints one ``error:`` line and exits 1.

Ray is an optional extra: ``pip install 'shardlm[ray]'``.
"""

from __future__ import annotations

import os
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from shardlm.checkpoint.run import LAUNCH_ENV
from shardlm.cli.train import main as train_main
from shardlm.cli.train import parse_args, train_config
from shardlm.config import Config, ConfigError
from shardlm.config.checks import gradient_accumulation_steps
from shardlm.parallel.dist import dp_mesh_shape, pick_backend

#: the extra that installs Ray Train (pyproject.toml's ``ray``)
INSTALL_HINT = "pip install 'shardlm[ray]'"


class WorkerExit(RuntimeError):
    """A Ray worker's training returned a non-zero exit code (its ``error:`` line is in the worker's log);
    raised so that Ray counts the attempt as failed."""


def require_ray() -> None:
    """Check that Ray Train's torch support can be imported.

    Raises:
        ConfigError: Ray (or its ``train`` extra) is not installed, naming the install command.
    """
    try:
        import ray.train.torch  # noqa: F401
    except ImportError:
        raise ConfigError(f"--ray needs Ray Train (the ray package with its train extra), which is not "
                          f"installed here: {INSTALL_HINT}") from None


def check_workers(cfg: Config, num_workers: int) -> None:
    """Refuse a worker count the run cannot use, before Ray starts anything.

    The mesh (``parallel.dp_replicate × dp_shard × cp × tp``) must fit ``num_workers`` ranks and the data-
    parallel ranks times ``train.micro_batch_size`` must divide ``train.global_batch_size``: the same
    checks the ranks make at start-up, on the driver, as if all workers were on one node (the node split is
    Ray's placement; a shard group that does not fit a node is refused by the ranks).

    Raises:
        ConfigError: ``num_workers < 1``, or either check fails; the message starts with ``--num-workers=N``.
    """
    if num_workers < 1:
        raise ConfigError(f"--num-workers must be >= 1, got {num_workers}")
    try:
        dp_mesh_shape(cfg.parallel, num_workers, num_workers)
        gradient_accumulation_steps(cfg, num_workers // (cfg.parallel.cp * cfg.parallel.tp))
    except ConfigError as e:
        raise ConfigError(f"--num-workers={num_workers}: {e}") from None


def worker_argv(argv: Sequence[str]) -> list[str]:
    """The workers' ``shardlm.train`` arguments: ``argv`` plus ``--resume=auto`` when it gives no resume, so
    a restarted worker group continues from the newest checkpoint (a fresh run directory starts fresh)."""
    _, overrides = parse_args(list(argv))
    if any(o.startswith("--checkpoint.resume=") for o in overrides):
        return list(argv)
    return [*argv, "--resume=auto"]


def train_loop(loop_config: dict[str, Any]) -> None:
    """The function each Ray worker runs: the training of ``python -m shardlm.train`` with
    ``loop_config["argv"]``, from the directory ``loop_config["cwd"]`` when this node has it.

    Raises:
        WorkerExit: the training ended with a non-zero exit code (bad input 2, non-finite loss 3, stopped by a
            signal 5...; see :mod:`shardlm.errors`).
    """
    if os.path.isdir(loop_config["cwd"]):
        os.chdir(loop_config["cwd"])
    os.environ[LAUNCH_ENV] = loop_config["launch"]  # the resume command the ranks print
    code = train_main(list(loop_config["argv"]))
    if code:
        raise WorkerExit(f"rank {os.environ.get('RANK', '?')} exited with code {code}")


def train(config: str | Sequence[str] | None, overrides: Sequence[str] = (), *, num_workers: int,
          address: str | None = None, max_failures: int = 0, storage_path: str | None = None,
          launch: str | None = None) -> int:
    """Train with ``num_workers`` Ray Train workers, one rank each (see the module docstring).

    Args:
        config: TOML config path(s), as ``--config`` (None: ``--resume=auto`` from the run directory's
            ``config.json``).
        overrides: ``--section.key=value`` arguments and ``--resume``, as for ``shardlm.train``.
        num_workers: ranks; each takes 1 CPU, and 1 GPU when the cluster has GPUs and
            ``parallel.device`` is not ``cpu``.
        address: the Ray cluster (``auto``: the one running on this machine; ``ray://host:10001``); None:
            ``RAY_ADDRESS`` if set, else a local cluster of this machine started for the run.
        max_failures: worker-group restarts after a failure (Ray's ``FailureConfig.max_failures``; -1:
            without limit).
        storage_path: Ray Train's own run records (``RunConfig.storage_path``; None: Ray's default,
            ``~/ray_results``). shardlm's checkpoints stay in the run directory.
        launch: the command line shown in the resume command the ranks print (default: this call as
            ``shardlm train --ray ...``).

    Returns:
        0 when the training finished (or stopped after saving, on every worker), else 1 (printed as one
        ``error:`` line on stderr).

    Raises:
        ConfigError: Ray is not installed (:func:`require_ray`), the config is invalid, or ``num_workers``
            does not fit it (:func:`check_workers`).
    """
    require_ray()
    paths = [config] if isinstance(config, str) else list(config or [])
    argv = [a for p in paths for a in ("--config", p)] + list(overrides)
    config_paths, parsed = parse_args(argv)
    cfg = train_config(config_paths, parsed)  # bad input: one message, before Ray starts
    check_workers(cfg, num_workers)
    import ray
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    # the ranks print straight to their stdout, which Ray forwards once (Ray Train's print patch would log
    # each line a second time); set before the controller starts, which passes it on to the workers
    os.environ.setdefault("RAY_TRAIN_ENABLE_PRINT_PATCH", "0")
    address = address or os.environ.get("RAY_ADDRESS")
    if not ray.is_initialized():
        if address:
            ray.init(address=address)
        else:
            ray.init(address="local", num_cpus=max(num_workers, os.cpu_count() or 1), include_dashboard=False,
                     log_to_driver=True)
    use_gpu = cfg.parallel.device != "cpu" and ray.cluster_resources().get("GPU", 0) > 0
    if cfg.parallel.device == "cuda" and not use_gpu:
        raise ConfigError("parallel.device='cuda' but the Ray cluster has no GPU")
    backend = pick_backend(torch.device("cuda" if use_gpu else "cpu"), cfg.parallel.backend,
                           cfg.parallel.cpu_offload)
    launch = launch or shlex.join(["shardlm", "train", "--ray", f"--num-workers={num_workers}"]
                                  + ([f"--ray-address={address}"] if address else [])
                                  + ([f"--max-restarts={max_failures}"] if max_failures else []))
    # a new name per launch: Ray Train restores its own records of a run of the same name and storage path
    # (shardlm's checkpoints in the run directory are what a restart resumes from)
    name = f"shardlm-{cfg.run.name}-{os.getpid()}-{ray.get_runtime_context().get_job_id()}"
    trainer = TorchTrainer(
        train_loop,
        train_loop_config={"argv": worker_argv(argv), "cwd": str(Path.cwd()), "launch": launch},
        torch_config=TorchConfig(backend=backend, timeout_s=int(cfg.parallel.timeout_s)),
        scaling_config=ScalingConfig(num_workers=num_workers, use_gpu=use_gpu),
        run_config=RunConfig(name=name, storage_path=storage_path,
                             failure_config=FailureConfig(max_failures=max_failures)),
    )
    try:
        trainer.fit()
    except ray.train.TrainingFailedError as e:
        tries = "no restart" if not max_failures else f"{max_failures} restart{'s' * (max_failures != 1)}"
        print(f"error: the Ray Train run failed after {tries} ({failure_cause(e)}); the newest complete "
              "checkpoint, if any, is the one --resume=auto takes", file=sys.stderr, flush=True)
        return 1
    return 0


def failure_cause(error: BaseException) -> str:
    """One line for Ray Train's failure ``error``: per failed rank (``WorkerGroupError.worker_failures``) the
    error's type and the first line of its message (at most 160 characters), else ``error``'s own."""
    def line(e: BaseException) -> str:
        first = next((x.strip() for x in str(e).splitlines() if x.strip()), "")
        return f"{type(e).__name__}: {first[:160]}" if first else type(e).__name__

    failures = getattr(error, "worker_failures", None) or {}
    return "; ".join(f"rank {r}: {line(e)}" for r, e in sorted(failures.items())) or line(error)
