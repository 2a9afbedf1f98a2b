"""Resume and retention never mix runs: run ids, retention of this run's checkpoints only, auto-resume of the
run directory's own run.

One torchrun launch at 2 ranks (tests/ckpt_worker.py) runs every scenario in order on a ~100k-parameter model.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import tiny_overrides, torchrun

WORKER = Path(__file__).resolve().parent / "ckpt_worker.py"


def manifest(ckpt: Path) -> dict:
    return json.loads((ckpt / "manifest.json").read_text())


def listing(run: Path) -> list[str]:
    return sorted(p.name for p in (run / "checkpoints").iterdir())


@pytest.fixture(scope="module")
def launch(small_data, tmp_path_factory):
    """One 2-rank launch of all scenarios; returns (reports {name: [rank0, rank1]}, root, finished process)."""
    root = tmp_path_factory.mktemp("resume")
    out = root / "out"
    r1, r2, r5 = root / "r1", root / "r2", root / "r5"

    def sc(name: str, run: Path, extra: dict, **hooks) -> dict:
        base = {"train.micro_batch_size": 4, "train.eval_interval": 0, "checkpoint.keep": 0}
        return {"name": name, "overrides": tiny_overrides(small_data, run, {**base, **extra}), **hooks}

    every1_keep1 = {"checkpoint.interval": 1, "checkpoint.keep": 1}
    scenarios = [
        # issue 13, scenario 1: an older run's step-3 and step-6, then a new run with overwrite, keep=1, interval=1
        sc("r1_old", r1, {"train.steps": 6, "checkpoint.interval": 3, "train.lr": 1e-3, "train.min_lr": 1e-4}),
        sc("r1_new", r1, {"train.steps": 2, **every1_keep1, "train.lr": 5e-4, "train.min_lr": 1e-4}),
        sc("r1_auto", r1, {"train.steps": 8, **every1_keep1, "train.lr": 5e-4, "train.min_lr": 1e-4,
                           "checkpoint.resume": '"auto"'}),
        # the same without overwrite: resume the run from its step-3 while its step-6 exists, keep=1, interval=1
        sc("r2_old", r2, {"train.steps": 6, "checkpoint.interval": 3}),
        sc("r2_from3", r2, {"train.steps": 5, **every1_keep1, "checkpoint.resume": f'"{r2 / "checkpoints/step-3"}"'}),
        sc("r2_auto", r2, {"train.steps": 8, **every1_keep1, "checkpoint.resume": '"auto"'}),
        # another run's checkpoint resumed into r1: r1's own run's checkpoints are now another run's
        sc("r1_foreign", r1, {"train.steps": 10, **every1_keep1,
                              "checkpoint.resume": f'"{r2 / "checkpoints/step-8"}"'}),
        # the newest checkpoint's shard corrupted: auto-resume skips it (says so, keeps it) and takes step-4
        sc("r5_ref", r5, {"train.steps": 8, "checkpoint.interval": 2}),
        sc("r5_auto", r5, {"train.steps": 8, "checkpoint.interval": 2, "checkpoint.resume": '"auto"'},
           flip_byte=str(r5 / "checkpoints" / "step-8" / "__0_0.distcp")),
    ]
    out.mkdir(parents=True)
    spec = out / "spec.json"
    spec.write_text(json.dumps({"out": str(out), "scenarios": scenarios}))
    proc = torchrun(2, [str(WORKER), str(spec)], timeout=600)
    reports = {s["name"]: [json.loads((out / s["name"] / f"rank{r}.json").read_text()) for r in range(2)]
               for s in scenarios}
    return reports, root, proc


def test_overwrite_starts_a_new_run_and_retention_keeps_what_it_just_wrote(launch):
    reports, root, proc = launch
    old, new, auto = reports["r1_old"][0], reports["r1_new"][0], reports["r1_auto"][0]
    assert old["run_id"] != new["run_id"] and auto["run_id"] == new["run_id"]
    # the new run said what it removed
    assert (f"removed the previous run's checkpoints/ (step-3, step-6 of run {old['run_id']}), metrics.jsonl, "
            "config.json, final/" in proc.stdout), proc.stdout
    # keep=1, interval=1: the new run's step-2 survived (it resumed from it), not the old run's step-6
    assert auto["start_step"] == 2 and auto["last_load"]["path"] == str(root / "r1" / "checkpoints" / "step-2")
    assert [rec["step"] for rec in auto["history"]] == list(range(3, 9))
    assert f"resumed run {new['run_id']} from {root / 'r1' / 'checkpoints' / 'step-2'} at step 2" in proc.stdout


def test_resume_from_an_earlier_step_keeps_the_new_saves(launch):
    reports, root, _ = launch
    r2 = root / "r2"
    old, from3, auto = reports["r2_old"][0], reports["r2_from3"][0], reports["r2_auto"][0]
    assert from3["start_step"] == 3 and from3["run_id"] == old["run_id"]  # a resume keeps the run id
    assert from3["last_save"]["step"] == 5
    # the saves of steps 4 and 5 stayed, and auto picked the newest save (step-5), not the higher step-6
    assert auto["start_step"] == 5 and auto["last_load"]["path"] == str(r2 / "checkpoints" / "step-5")
    assert auto["run_id"] == old["run_id"]
    assert listing(r2) == ["step-8"] and manifest(r2 / "checkpoints" / "step-8")["run_id"] == old["run_id"]


def test_retention_never_removes_another_runs_checkpoints(launch):
    reports, root, _ = launch
    r1 = root / "r1"
    foreign, r1_run = reports["r1_foreign"][0], reports["r1_auto"][0]["run_id"]
    assert foreign["run_id"] == reports["r2_old"][0]["run_id"] and foreign["start_step"] == 8
    # keep=1 kept this run's newest (step-10) and left the other run's step-8 alone
    assert listing(r1) == ["step-10", "step-8"]
    assert manifest(r1 / "checkpoints" / "step-8")["run_id"] == r1_run
    assert manifest(r1 / "checkpoints" / "step-10")["run_id"] == foreign["run_id"]
    assert json.loads((r1 / "config.json").read_text())["run_id"] == foreign["run_id"]
    seqs = [manifest(r1 / "checkpoints" / n)["save_seq"] for n in ("step-8", "step-10")]
    assert all(isinstance(s, int) and s >= 1 for s in seqs)


def test_auto_resume_skips_a_damaged_checkpoint(launch):
    reports, root, proc = launch
    ckpts = root / "r5" / "checkpoints"
    ref, auto = reports["r5_ref"], reports["r5_auto"]
    assert auto[0]["start_step"] == 6 and auto[0]["last_load"]["path"] == str(ckpts / "step-6")
    assert [s["path"] for s in auto[0]["skipped"]] == [str(ckpts / "step-8")]
    assert "file __0_0.distcp fails its SHA-256 checksum" in auto[0]["skipped"][0]["reason"]
    warning = (f"warning: skipping damaged checkpoint {ckpts / 'step-8'}: checkpoint {ckpts / 'step-8'} is damaged: "
               "file __0_0.distcp fails its SHA-256 checksum (corrupted); resuming from an earlier one. "
               f"The damaged one is kept for inspection as {ckpts / 'step-8.damaged'}")
    assert proc.stderr.count(warning) == 1, proc.stderr[-3000:]
    assert (ckpts / "step-8.damaged" / "manifest.json").is_file()  # kept, under a name auto never picks
    # steps 7 and 8 again: the same losses and bit-identical parameters on every rank
    want = {r["step"]: r["loss"] for r in ref[0]["history"]}
    assert [(r["step"], r["loss"]) for r in auto[0]["history"]] == [(s, want[s]) for s in (7, 8)]
    assert all(a["final_digest"] == b["final_digest"] for a, b in zip(auto, ref))
    assert (ckpts / "step-8" / "manifest.json").is_file()  # written again by the resumed run
