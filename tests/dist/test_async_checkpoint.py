"""Asynchronous checkpoints (``checkpoint.async``): bit-exact like synchronous ones, a kill during a
background save leaves the previous checkpoint the one resumed, a background save onto a full disk stops the
run once its write failed (at the latest at the next save) with the cause and path, and checksums come from
the bytes as they were written.

Two torchrun launches at 2 ranks on a ~100k-parameter model (tests/workers/ckpt_worker.py); the one-process
run on a 3 MB tmpfs is in tests/unit/test_background_save_full_disk.py."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import scenario, torchrun
from shardlm.checkpoint.run import run_checkpoints

WORKER = Path(__file__).resolve().parents[1] / "workers" / "ckpt_worker.py"
STEPS = 20
SLOW_S = 2.0  # the background write of step-5 in the "async" scenario is held this long


def launch(scenarios: list[dict], out: Path, check: bool = True):
    """One 2-rank torchrun launch of tests/workers/ckpt_worker.py; return ({name: [rank reports]},
    the process)."""
    out.mkdir(parents=True, exist_ok=True)
    spec = out / f"spec-{scenarios[0]['name']}.json"
    spec.write_text(json.dumps({"out": str(out), "scenarios": scenarios}))
    proc = torchrun(2, [str(WORKER), str(spec)], timeout=300, check=check)
    reports = {}
    for s in scenarios:
        files = [out / s["name"] / f"rank{r}.json" for r in range(2)]
        if all(f.is_file() for f in files):
            reports[s["name"]] = [json.loads(f.read_text()) for f in files]
    return reports, proc


@pytest.fixture(scope="module")
def runs(small_data, tmp_path_factory):
    """Launch 1: sync and async runs, an async save that hits a full disk on rank 1, and an async run
    SIGKILLed while its background save of step 10 is held; launch 2 resumes the killed run."""
    root = tmp_path_factory.mktemp("async")
    d, out = small_data, root / "out"
    every5 = {"train.micro_batch_size": 4, "checkpoint.interval": 5, "checkpoint.keep": 0}
    async5 = {**every5, "checkpoint.async": "true"}
    reports, first = launch([
        scenario("sync", d, root, extra=every5),
        scenario("async", d, root, extra=async5, slow_save_step=5, slow_save_s=SLOW_S),
        scenario("enospc", d, root, extra=async5, enospc_save_step=10, enospc_rank=1, expect_error=True),
        scenario("killed", d, root, extra=async5, slow_save_step=10, slow_save_s=120, kill_after_step=12,
                 kill_rank=1),
    ], out, check=False)
    first.after_kill = sorted(p.name for p in (root / "killed" / "checkpoints").iterdir())
    r, _ = launch([scenario("killed_resume", d, root, run="killed",
                            extra={**async5, "checkpoint.resume": '"auto"'})], out)
    reports.update(r)
    return reports, root, first


def losses(report: list[dict]) -> dict[int, float]:
    return {rec["step"]: rec["loss"] for rec in report[0]["history"]}


def final_params(run: Path) -> dict[str, torch.Tensor]:
    return load_file(str(run / "final" / "model.safetensors"))


def manifest(ckpt: Path) -> dict:
    return json.loads((ckpt / "manifest.json").read_text())


@pytest.mark.dist
def test_async_saves_are_bit_exact_and_hashed_as_written(runs):
    reports, root, first = runs
    assert "async" in reports, first.stderr[-5000:]
    got, want = losses(reports["async"]), losses(reports["sync"])
    assert sorted(got) == list(range(1, STEPS + 1)) and got == want
    p, q = final_params(root / "async"), final_params(root / "sync")
    assert p.keys() == q.keys() and all(torch.equal(p[k], q[k]) for k in p)
    for step in (5, 10, 15, 20):
        # the staged copy is the state of that step: the same shard bytes as a sync save
        a, s = root / "async" / "checkpoints" / f"step-{step}", root / "sync" / "checkpoints" / f"step-{step}"
        for name in ("__0_0.distcp", "__1_0.distcp"):
            assert (a / name).read_bytes() == (s / name).read_bytes(), (step, name)
        for ckpt in (a, s):  # checksums computed while writing equal those of the files on disk
            files = manifest(ckpt)["files"]
            assert sorted(files) == sorted(p.name for p in ckpt.iterdir() if p.name != "manifest.json")
            for name, rec in files.items():
                data = (ckpt / name).read_bytes()
                assert rec == {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}, (ckpt, name)


@pytest.mark.dist
def test_training_runs_on_during_a_background_save_and_one_save_is_in_flight(runs):
    reports, root, _ = runs
    for rank in reports["async"]:
        times = {int(k): v for k, v in rank["step_times"].items()}
        saves = {step: (entered, left) for step, entered, left in rank["saves"]}
        done5 = manifest(root / "async" / "checkpoints" / "step-5")["time_unix"]
        assert saves[5][1] < times[6] < times[7] < done5  # steps 6 and 7 ran while step-5 was being written
        assert saves[10][1] >= done5  # the save of step 10 waited for step-5 to complete
        assert saves[5][1] - saves[5][0] < SLOW_S  # the save call itself did not wait for the write


@pytest.mark.dist
def test_kill_during_background_save_resumes_from_the_previous_checkpoint_bit_exact(runs):
    reports, root, first = runs
    assert first.returncode != 0 and "killed" not in reports
    ckpts = root / "killed" / "checkpoints"
    assert first.after_kill == [".tmp-step-10", "step-5"]  # the killed background save never became visible
    resumed = reports["killed_resume"]
    assert resumed[0]["last_load"]["path"] == str(ckpts / "step-5") and resumed[0]["start_step"] == 5
    got, want = losses(resumed), losses(reports["sync"])
    assert sorted(got) == list(range(6, STEPS + 1)) and all(got[s] == want[s] for s in got)
    p, q = final_params(root / "killed"), final_params(root / "sync")
    assert p.keys() == q.keys() and all(torch.equal(p[k], q[k]) for k in p)
    assert sorted(p.name for p in ckpts.iterdir()) == ["step-10", "step-15", "step-20", "step-5"]


@pytest.mark.dist
def test_background_save_on_a_full_disk_stops_the_run_with_cause_and_path(runs):
    reports, root, _ = runs
    ckpts = root / "enospc" / "checkpoints"
    errors = [r["error"] for r in reports["enospc"]]
    assert errors[0] == errors[1], errors  # the same message on every rank
    assert errors[0] == (f"saving checkpoint {ckpts / 'step-10'} failed: No space left on device: "
                         f"{ckpts / '.tmp-step-10' / '__1_0.distcp'} (rank 1); the newest complete "
                         f"checkpoint is still {ckpts / 'step-5'}"), errors[0]
    steps = [r["step"] for r in reports["enospc"]]
    # at the same step on both, once the write has failed: at the latest the next save (step 15), which waits
    # for it (how many steps run before depends on when the writing thread gets the CPU: up to step 15 on CI)
    assert steps[0] == steps[1] and 10 <= steps[0] <= 15, steps
    assert sorted(p.name for p in ckpts.iterdir()) == ["step-5"]  # nothing half-written left behind
    assert [e.path.name for e in run_checkpoints(ckpts, manifest(ckpts / "step-5")["run_id"])] == ["step-5"]
