"""``shardlm train --ray``: a local Ray cluster of this machine, 2 Ray Train workers, the tiny model (issue 47).

Two launches: ``torchrun --nproc_per_node=2 -m shardlm.train`` (the reference) and ``shardlm train --ray
--num-workers 2 --max-restarts 1``, whose rank-1 worker is killed (SIGKILL) after the step-20 checkpoint.
Ray restarts the worker group, which resumes from that checkpoint (``--resume=auto``, added by the launch),
and the run's every step and its final model are those of the reference, bit for bit.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import cpu_env, require_dist_marker, tiny_overrides, torchrun

STEPS, KILL_AFTER = 60, 25
EXTRA = {"train.steps": STEPS, "train.micro_batch_size": 4, "train.eval_interval": 0, "checkpoint.interval": 10}
#: Ray Train's line naming a worker of the group it started: ``- (ip=..., pid=N) world_rank=1, ...``
WORKER_LINE = re.compile(r"pid=(\d+)\) world_rank=1,")


def losses(run: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


def last_step(run: Path) -> int:
    path = run / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.is_file() else []
    return json.loads(lines[-1])["step"] if lines else 0


def ray_run_killed_once(overrides: list[str], run: Path, log: Path) -> tuple[int, str, int]:
    """Start the Ray launch; once ``run`` has logged step :data:`KILL_AFTER`, SIGKILL the rank-1 worker that
    Ray named; return (exit code, output, the killed pid)."""
    require_dist_marker()
    cmd = [sys.executable, "-m", "shardlm", "train", "--ray", "--num-workers", "2", "--max-restarts", "1",
           *overrides]
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, env=cpu_env(), stdout=out, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 300
            while last_step(run) < KILL_AFTER and proc.poll() is None:
                assert time.monotonic() < deadline, log.read_text()[-3000:]
                time.sleep(0.05)
            pids = WORKER_LINE.findall(log.read_text())
            assert pids and proc.poll() is None, log.read_text()[-3000:]
            os.kill(int(pids[0]), signal.SIGKILL)
            code = proc.wait(timeout=300)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return code, log.read_text(), int(pids[0])


@pytest.fixture(scope="module")
def runs(small_data, tmp_path_factory):
    root = tmp_path_factory.mktemp("ray")
    torchrun(2, ["-m", "shardlm.train", *tiny_overrides(small_data, root / "ref", EXTRA)])
    killed = ray_run_killed_once(tiny_overrides(small_data, root / "ray", EXTRA), root / "ray",
                                 root / "ray.log")
    return root, killed


@pytest.mark.dist
def test_ray_workers_train_as_torchrun_does_and_a_killed_worker_resumes_from_the_newest_checkpoint(runs):
    root, (code, out, killed) = runs
    assert code == 0, out[-4000:]
    # Ray saw the worker die and restarted the group
    assert "[FailurePolicy] RETRY" in out and f"pid: {killed}" in out.split("[FailurePolicy] RETRY")[1], \
        out[-4000:]
    ckpt = root / "ray" / "checkpoints" / "step-20"
    assert re.search(rf"resumed run \S+ from {re.escape(str(ckpt))} at step 20", out), out[-4000:]
    want, got = losses(root / "ref"), losses(root / "ray")
    assert sorted(got) == list(range(1, STEPS + 1)) and got == want  # every step once, bit-equal
    p = load_file(str(root / "ray" / "final" / "model.safetensors"))
    q = load_file(str(root / "ref" / "final" / "model.safetensors"))
    assert p.keys() == q.keys() and all(torch.equal(p[k], q[k]) for k in q)
    assert out.count("model written to") == 1  # rank 0's lines once (Ray's print patch is off)
