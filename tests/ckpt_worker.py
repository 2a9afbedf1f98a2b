"""Training scenarios for tests/test_checkpoint.py, with test-only ways to interrupt a run.

Usage: ``torchrun --nproc_per_node=N tests/ckpt_worker.py SPEC.json``; the spec is like
tests/dist_worker.py's, and a scenario may also hold (kills only when torchrun has not
restarted the job):

- ``kill_after_step`` + ``kill_rank``: SIGKILL that rank right after that optimizer step;
- ``kill_in_save_step`` + ``kill_rank``: SIGKILL that rank as it starts writing its shards of that step's checkpoint;
- ``sigterm_after_step`` + ``sigterm_rank``: send that rank SIGTERM after that step (as Slurm would).

Each rank that finishes writes ``OUT/<name>/rank<r>.json``: history, sample ids, the step it
resumed from, what it loaded and saved, and whether it stopped on preemption.
"""

from __future__ import annotations

import os
import signal
import sys

from torch.distributed.checkpoint import FileSystemWriter

from dist_worker import scenario_trainers, write_rank_report
from shardlm.parallel import exit_process
from shardlm.train import Trainer

ATTEMPT = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def add_interruptions(trainer: Trainer, scenario: dict) -> None:
    """Wrap the trainer's step (and DCP's writer) to kill or signal this rank where the scenario says."""
    rank = trainer.info.rank
    train_step = trainer.train_step
    now = ATTEMPT == 0

    def step() -> dict:
        record = train_step()
        if now and rank == scenario.get("kill_rank") and trainer.step == scenario.get("kill_after_step"):
            os.kill(os.getpid(), signal.SIGKILL)
        if rank == scenario.get("sigterm_rank") and trainer.step == scenario.get("sigterm_after_step"):
            os.kill(os.getpid(), signal.SIGTERM)
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


def main() -> None:
    for scenario, trainer, out in scenario_trainers(sys.argv[1]):
        info = trainer.info
        start_step = trainer.step
        add_interruptions(trainer, scenario)
        history = trainer.train()
        report = {
            "history": history, "start_step": start_step, "world_size": info.world_size,
            "sample_ids": {str(k): v for k, v in trainer.sample_ids.items()},
            "last_load": trainer.checkpointer.last_load, "last_save": trainer.checkpointer.last_save,
            "preempted": trainer.preempted, "restart_count": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
        }
        write_rank_report(out, scenario["name"], info.rank, report)


if __name__ == "__main__":
    main()
    exit_process(0)  # destroys the process group; skips a teardown that can abort (SIGABRT)
