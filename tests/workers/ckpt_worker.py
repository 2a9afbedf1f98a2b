"""Training scenarios for tests/dist/test_checkpoint.py, with test-only ways to interrupt a run.

Usage: ``torchrun --nproc_per_node=N tests/workers/ckpt_worker.py SPEC.json``; the spec is like
tests/workers/dist_worker.py's, and a scenario may also hold (kills only when torchrun has not
restarted the job):

- ``kill_after_step`` + ``kill_rank``: SIGKILL that rank right after that optimizer step;
- ``kill_in_save_step`` + ``kill_rank``: SIGKILL that rank as it starts writing its shards of that
  step's checkpoint;
- ``sigterm_after_step`` + ``sigterm_rank``: send that rank SIGTERM (as Slurm would) during that step, before
  its gradient-norm all-reduce (which carries the flag to every rank): the run stops after that step.
- ``slow_save_step`` + ``slow_save_s``: every rank's DCP write of that step's checkpoint first sleeps that
  long (with ``checkpoint.async``: a background save held in flight);
- ``enospc_save_step`` + ``enospc_rank``: that rank's shard file of that step's checkpoint fails to write with
  ENOSPC (a full disk), as the file system would report it.

With ``expect_error``, a CheckpointError out of ``train()`` is reported too (``{"error", "step"}``). Each rank
also reports ``step_times`` ({step: time.time() after it}) and ``saves`` ([step, time entering save,
time leaving]).

Before the trainer is built, ``flip_byte`` (a file path) has rank 0 flip one bit in the middle of
that file (a damaged checkpoint). With ``expect_error``, a Trainer that fails to build with a
CheckpointError or ConfigError is not fatal: each rank reports ``{"error": message}``.

Each rank that finishes writes ``OUT/<name>/rank<r>.json``: history, sample ids, the step it
resumed from, what it loaded and saved, the run id, the damaged checkpoints skipped, and whether it
stopped on preemption.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import sys
import time
from pathlib import Path

import torch
from torch.distributed.checkpoint import FileSystemWriter

from dist_worker import local_digests, write_rank_report
from shardlm.checkpoint import fs_errors
from shardlm.checkpoint.manifest import CheckpointError
from shardlm.config import ConfigError, load_config
from shardlm.parallel import exit_process, init_distributed
from shardlm.train.trainer import Trainer

ATTEMPT = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def add_interruptions(trainer: Trainer, scenario: dict) -> None:
    """Wrap the trainer's step (and DCP's writer) to kill or signal this rank where the scenario says."""
    rank = trainer.info.rank
    train_step = trainer.train_step
    now = ATTEMPT == 0

    trainer.step_times, trainer.saves = {}, []
    save = trainer.checkpointer.save

    def timed_save(*args, **kwargs):  # noqa: ANN002, ANN003 - the checkpointer's arguments
        entered = time.time()
        path = save(*args, **kwargs)
        trainer.saves.append([args[3], entered, time.time()])  # (model, optimizer, scheduler, step)
        return path

    trainer.checkpointer.save = timed_save

    def step(log: bool = True) -> dict | None:
        # the signal arrives before this step's gradient-norm all-reduce, which carries it to every rank:
        # all stop after this step
        if rank == scenario.get("sigterm_rank") and trainer.step + 1 == scenario.get("sigterm_after_step"):
            os.kill(os.getpid(), signal.SIGTERM)
        record = train_step(log=log)
        trainer.step_times[trainer.step] = time.time()
        if now and rank == scenario.get("kill_rank") and trainer.step == scenario.get("kill_after_step"):
            os.kill(os.getpid(), signal.SIGKILL)
        return record

    trainer.train_step = step
    if now and rank == scenario.get("kill_rank") and "kill_in_save_step" in scenario:
        write_data = FileSystemWriter.write_data
        target = f"step-{scenario['kill_in_save_step']}"

        def killing_write_data(self, plan, planner):  # noqa: ANN001 - DCP's signature
            if str(self.path).endswith(target):
                os.kill(os.getpid(), signal.SIGKILL)
            return write_data(self, plan, planner)

        FileSystemWriter.write_data = killing_write_data
    if "slow_save_step" in scenario:
        slow_write_data = FileSystemWriter.write_data
        slow_target = str(trainer.run_dir / "checkpoints" / f".tmp-step-{scenario['slow_save_step']}")

        def slow(self, plan, planner):  # noqa: ANN001 - DCP's signature
            if str(self.path) == slow_target:
                time.sleep(scenario["slow_save_s"])
            return slow_write_data(self, plan, planner)

        FileSystemWriter.write_data = slow
    if rank == scenario.get("enospc_rank") and "enospc_save_step" in scenario:
        full = trainer.run_dir / "checkpoints" / f".tmp-step-{scenario['enospc_save_step']}"
        real_write = fs_errors._RecordingFile.write

        class FullDisk:  # a file whose writes fail as on a full file system (no file name, like a real write)
            def __init__(self, raw) -> None:  # noqa: ANN001
                self.raw = raw

            def write(self, data) -> int:  # noqa: ANN001
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

            def __getattr__(self, name: str):
                return getattr(self.raw, name)

        def write(self, data) -> int:  # noqa: ANN001
            if self._path.parent == full and not isinstance(self._raw, FullDisk):
                self._raw = FullDisk(self._raw)
            return real_write(self, data)

        fs_errors._RecordingFile.write = write


def flip_byte(path: str) -> None:
    """Flip the lowest bit of the middle byte of ``path`` (rank 0; every rank waits)."""
    if int(os.environ.get("RANK", "0")) == 0:
        data = bytearray(Path(path).read_bytes())
        data[len(data) // 2] ^= 0x01
        Path(path).write_bytes(bytes(data))
    if torch.distributed.is_initialized():
        torch.distributed.barrier()


def trainers(spec_path: str):
    """Like dist_worker.scenario_trainers, with the ``flip_byte`` and ``expect_error`` hooks."""
    spec = json.loads(Path(spec_path).read_text())
    for scenario in spec["scenarios"]:
        if "flip_byte" in scenario:
            flip_byte(scenario["flip_byte"])
        cfg = load_config(scenario.get("config"), scenario.get("overrides", []))
        try:
            trainer = Trainer(cfg, init_distributed(cfg.parallel), keep_history=True)
        except (CheckpointError, ConfigError) as e:
            if not scenario.get("expect_error"):
                raise
            write_rank_report(Path(spec["out"]), scenario["name"], int(os.environ.get("RANK", "0")),
                              {"error": str(e)})
            continue
        yield scenario, trainer, Path(spec["out"])


def main() -> None:
    for scenario, trainer, out in trainers(sys.argv[1]):
        info = trainer.info
        start_step = trainer.step
        trackers = [t.name for t in trainer.logger.trackers]  # W&B / MLflow runs this rank opened
        add_interruptions(trainer, scenario)
        try:
            history = trainer.train()
        except CheckpointError as e:
            if not scenario.get("expect_error"):
                raise
            write_rank_report(out, scenario["name"], info.rank, {"error": str(e), "step": trainer.step})
            continue
        report = {
            "history": history, "start_step": start_step, "world_size": info.world_size,
            "sample_ids": {str(k): v for k, v in trainer.sample_ids.items()},
            "last_load": trainer.checkpointer.last_load, "last_save": trainer.checkpointer.last_save,
            "run_id": trainer.run_id, "final_digest": local_digests(trainer),
            "changes": [c.line() for c in trainer.checkpointer.changes],
            "param_groups": [{k: g[k] for k in ("betas", "eps", "weight_decay", "initial_lr")}
                             for g in trainer.optimizer.param_groups],
                             "skipped": trainer.checkpointer.skipped,
            "preempted": trainer.preempted,
            "restart_count": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")), "trackers": trackers,
            "step_times": trainer.step_times, "saves": trainer.saves,
        }
        write_rank_report(out, scenario["name"], info.rank, report)


if __name__ == "__main__":
    main()
    exit_process(0)  # destroys the process group; skips a teardown that can abort (SIGABRT)
