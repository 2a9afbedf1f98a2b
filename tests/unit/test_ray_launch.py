"""``shardlm train --ray``'s bad input, answered before Ray starts (issue 47); the launch itself is
tests/dist/test_ray_train.py."""

from __future__ import annotations

import sys

import pytest

from conftest import ROOT
from shardlm.cli.main import main
from shardlm.integrations.ray import WorkerExit, failure_cause, worker_argv

TINY = ["--config", str(ROOT / "configs" / "shakespeare-tiny.toml"), "--train.global_batch_size=8",
        "--train.micro_batch_size=4"]


def errors(capsys) -> list[str]:
    return [line for line in capsys.readouterr().err.splitlines() if line.strip()]


def test_ray_without_ray_installed_is_one_message_naming_the_extra(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "ray", None)  # ``import ray`` fails as when it is not installed
    assert main(["train", "--ray", "--num-workers", "2", *TINY]) == 2
    assert errors(capsys) == ["error: --ray needs Ray Train (the ray package with its train extra), which is "
                              "not installed here: pip install 'shardlm[ray]'"]


def test_workers_that_do_not_divide_the_batch_are_one_message_naming_num_workers(capsys):
    assert main(["train", "--ray", "--num-workers", "3", *TINY]) == 2
    assert errors(capsys) == ["error: --num-workers=3: train.global_batch_size=8 must be divisible by world "
                              "size × train.micro_batch_size = 3 × 4 = 12"]


@pytest.mark.parametrize("argv, message", [
    (["--num-workers", "2"], "--num-workers is for Ray Train workers: add --ray (or use --nproc-per-node N "
                             "to start N ranks with torchrun)"),
    (["--ray"], "--ray needs --num-workers N: the number of ranks (Ray workers)"),
    (["--ray", "--num-workers", "2", "--nproc-per-node", "2"],
     "--ray starts the ranks as Ray workers: --nproc-per-node=2 is torchrun's; give --num-workers N (and "
     "--ray-address for a cluster)"),
    (["--ray", "--num-workers", "0"], "--num-workers must be >= 1, got 0"),
])
def test_ray_launch_options_that_do_not_fit_together(argv, message, capsys):
    assert main(["train", *argv, *TINY]) == 2
    assert errors(capsys) == [f"error: {message}"]


def test_the_workers_resume_from_the_newest_checkpoint_unless_a_resume_is_given():
    assert worker_argv(["--config", "a.toml", "--train.steps=5"]) == ["--config", "a.toml", "--train.steps=5",
                                                                      "--resume=auto"]
    for given in (["--resume=runs/x/checkpoints/step-4"], ["--checkpoint.resume=auto"]):
        assert worker_argv(["--config", "a.toml", *given]) == ["--config", "a.toml", *given]


class WorkerGroupError(RuntimeError):
    """Shaped as Ray Train's: the failed ranks' errors in ``worker_failures``."""

    def __init__(self, message: str, worker_failures: dict[int, BaseException]) -> None:
        super().__init__(message)
        self.worker_failures = worker_failures


def test_a_failed_ray_run_is_one_line_naming_each_failed_rank():
    died = RuntimeError("The actor died unexpectedly before finishing this task.\n\tclass_name: X")
    error = WorkerGroupError("Training failed due to worker errors:\n...",
                             {1: died, 0: WorkerExit("rank 0 exited with code 4")})
    assert failure_cause(error) == ("rank 0: WorkerExit: rank 0 exited with code 4; rank 1: RuntimeError: "
                                    "The actor died unexpectedly before finishing this task.")
    assert failure_cause(RuntimeError("x" * 200)) == "RuntimeError: " + "x" * 160
