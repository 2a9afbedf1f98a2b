"""Resume and retention never mix runs: run ids, retention of this run's checkpoints only, auto-resume of the
run directory's own run.

One torchrun launch at 2 ranks (tests/workers/ckpt_worker.py) runs every scenario in order on a
~100k-parameter model.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import assert_full_disk_error, tiny_overrides, torchrun
from shardlm.cli.main import main as shardlm_main
from shardlm.cli.train import main as train_main
from shardlm.config import TrainConfig
from shardlm.train.export import export_checkpoint
from shardlm.data import prepare_corpus
from shardlm.train.optim import lr_at

WORKER = Path(__file__).resolve().parents[1] / "workers" / "ckpt_worker.py"
pytestmark = pytest.mark.dist  # every test reads the one torchrun launch
OLD_SCHEDULE = {"train.lr": 1e-3, "train.min_lr": 1e-4, "train.warmup_steps": 2}
NEW_SCHEDULE = {"train.steps": 8, "train.lr": 5e-4, "train.min_lr": 5e-5, "train.warmup_steps": 1,
                "train.betas": "[0.8, 0.99]", "train.weight_decay": 0.05, "train.grad_clip": 0.5,
                "checkpoint.interval": 3}


def refused_changes(other_data: Path) -> list[dict]:
    """Changes a resume must refuse (the field each names: see test_refused_changes_name_the_field)."""
    return [{"model.ffn_hidden": 96}, {"data.tokenizer": '"/elsewhere/tokenizer.json"'},
            {"data.dir": f'"{other_data}"', "model.vocab_size": 512}, {"train.global_batch_size": 16},
            {"train.seed": 1}]


def manifest(ckpt: Path) -> dict:
    return json.loads((ckpt / "manifest.json").read_text())


def listing(run: Path) -> list[str]:
    return sorted(p.name for p in (run / "checkpoints").iterdir())


@pytest.fixture(scope="module")
def launch(small_data, small_corpus, tmp_path_factory):
    """One 2-rank launch of all scenarios; returns (reports {name: [rank0, rank1]}, root,
    finished process)."""
    root = tmp_path_factory.mktemp("resume")
    out = root / "out"
    r1, r2, r4, r5 = root / "r1", root / "r2", root / "r4", root / "r5"
    other_data = root / "other-data"  # another tokenizer (384 tokens) on one play
    prepare_corpus(str(small_corpus), str(other_data), None, 384, 0.1)

    def sc(name: str, run: Path, extra: dict, **hooks) -> dict:
        base = {"train.micro_batch_size": 4, "train.eval_interval": 0, "checkpoint.keep": 0}
        return {"name": name, "overrides": tiny_overrides(small_data, run, {**base, **extra}), **hooks}

    every1_keep1 = {"checkpoint.interval": 1, "checkpoint.keep": 1}
    scenarios = [
        # issue 13, scenario 1: an older run's step-3 and step-6, then a new run with overwrite,
        # keep=1, interval=1
        sc(
            "r1_old", r1, {"train.steps": 6, "checkpoint.interval": 3, "train.lr": 1e-3, "train.min_lr": 1e-4}
        ),
        sc("r1_new", r1, {"train.steps": 2, **every1_keep1, "train.lr": 5e-4, "train.min_lr": 1e-4}),
        sc(
            "r1_auto",
            r1,
            {
                "train.steps": 8,
                **every1_keep1,
                "train.lr": 5e-4,
                "train.min_lr": 1e-4,
                "checkpoint.resume": '"auto"',
            },
        ),
        # the same without overwrite: resume the run from its step-3 while its step-6 exists,
        # keep=1, interval=1
        sc("r2_old", r2, {"train.steps": 6, "checkpoint.interval": 3}),
        sc(
            "r2_from3",
            r2,
            {"train.steps": 5, **every1_keep1, "checkpoint.resume": f'"{r2 / "checkpoints/step-3"}"'},
        ),
        sc("r2_auto", r2, {"train.steps": 8, **every1_keep1, "checkpoint.resume": '"auto"'}),
        # another run's checkpoint resumed into r1: r1's own run's checkpoints are now another run's
        sc(
            "r1_foreign",
            r1,
            {"train.steps": 10, **every1_keep1, "checkpoint.resume": f'"{r2 / "checkpoints/step-8"}"'},
        ),
        # the newest checkpoint's shard corrupted: auto-resume skips it (says so, keeps it) and takes step-4
        sc("r5_ref", r5, {"train.steps": 8, "checkpoint.interval": 2}),
        sc(
            "r5_auto",
            r5,
            {"train.steps": 8, "checkpoint.interval": 2, "checkpoint.resume": '"auto"'},
            flip_byte=str(r5 / "checkpoints" / "step-8" / "__0_0.distcp"),
        ),
        # a changed schedule, AdamW settings and clipping take effect at the resumed step ...
        sc("r4_base", r4, {"train.steps": 6, "checkpoint.interval": 3, **OLD_SCHEDULE}),
        sc("r4_changed", r4, {**NEW_SCHEDULE, "checkpoint.resume": f'"{r4 / "checkpoints/step-3"}"'}),
        sc("r4_fresh", root / "r4_fresh", NEW_SCHEDULE),  # the new config from the start: the same lr values
        # ... a changed model shape, tokenizer, data or global batch is refused, naming the field
        *[
            sc(
                f"r4_refused_{i}",
                r4,
                {
                    "train.steps": 6,
                    **OLD_SCHEDULE,
                    **change,
                    "checkpoint.resume": f'"{r4 / "checkpoints/step-3"}"',
                },
                expect_error=True,
            )
            for i, change in enumerate(refused_changes(other_data))
        ],
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
    assert (f"removed the previous run's checkpoints/ (step-3, step-6 of run {old['run_id']}), "
            "metrics.jsonl, config.json, final/" in proc.stdout), proc.stdout
    # keep=1, interval=1: the new run's step-2 survived (it resumed from it), not the old run's step-6
    assert auto["start_step"] == 2 and auto["last_load"]["path"] == str(
        root / "r1" / "checkpoints" / "step-2"
    )
    assert [rec["step"] for rec in auto["history"]] == list(range(3, 9))
    assert (
        f"resumed run {new['run_id']} from {root / 'r1' / 'checkpoints' / 'step-2'} at step 2" in proc.stdout
    )


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
    warning = (f"warning: skipping damaged checkpoint {ckpts / 'step-8'}: checkpoint {ckpts / 'step-8'} is "
               "damaged: file __0_0.distcp fails its SHA-256 checksum (corrupted); resuming from an earlier "
               f"one. The damaged one is kept for inspection as {ckpts / 'step-8.damaged'}")
    assert proc.stderr.count(warning) == 1, proc.stderr[-3000:]
    assert (ckpts / "step-8.damaged" / "manifest.json").is_file()  # kept, under a name auto never picks
    # steps 7 and 8 again: the same losses and bit-identical parameters on every rank
    want = {r["step"]: r["loss"] for r in ref[0]["history"]}
    assert [(r["step"], r["loss"]) for r in auto[0]["history"]] == [(s, want[s]) for s in (7, 8)]
    assert all(a["final_digest"] == b["final_digest"] for a, b in zip(auto, ref))
    assert (ckpts / "step-8" / "manifest.json").is_file()  # written again by the resumed run


def test_changed_schedule_takes_effect_at_the_resumed_step(launch):
    reports, root, proc = launch
    changed, fresh = reports["r4_changed"][0], reports["r4_fresh"][0]
    assert changed["start_step"] == 3
    got = {r["step"]: r["lr"] for r in changed["history"]}
    want = {r["step"]: r["lr"] for r in fresh["history"]}
    assert sorted(got) == list(range(4, 9))
    assert all(got[s] == want[s] for s in got), (got, want)  # the new config's schedule, exactly
    tcfg = TrainConfig(steps=8, lr=5e-4, min_lr=5e-5, warmup_steps=1)
    assert all(abs(got[s] - lr_at(s - 1, tcfg)) <= 1e-12 for s in got)
    assert got[8] == 5e-5 and got[4] > got[5] > got[8]  # cosine decay to the new min_lr
    for group, decay in zip(changed["param_groups"], (0.05, 0.0)):
        assert group == {"betas": [0.8, 0.99], "eps": 1e-8, "weight_decay": decay, "initial_lr": 5e-4}
    assert json.loads((root / "r4" / "config.json").read_text())["train"]["lr"] == 5e-4
    # the printed diff lists every changed field, old -> new
    diff = [line.split(" (")[0] for line in changed["changes"]]
    assert diff == [
        "train.steps: 6 -> 8", "train.lr: 0.001 -> 0.0005", "train.min_lr: 0.0001 -> 5e-05",
        "train.warmup_steps: 2 -> 1", "train.betas: [0.9, 0.95] -> [0.8, 0.99]",
        "train.weight_decay: 0.1 -> 0.05", "train.grad_clip: 1.0 -> 0.5",
    ], diff  # checkpoint.resume, which every resume sets, is not listed
    assert "resume from " + str(root / "r4" / "checkpoints" / "step-3") + ": 7 settings differ" in proc.stdout
    assert "  train.lr: 0.001 -> 0.0005 (takes effect: the LR schedule is rebuilt" in proc.stdout


@pytest.mark.parametrize("i,needle", enumerate([
    "model.ffn_hidden changed 128 -> 96 (the model's shape",
    'data.tokenizer changed "" -> "/elsewhere/tokenizer.json"',
    # refused from the settings recorded with the data, before any data preparation (the prepared data's own
    # comparison, data_problems, is tests/unit/test_launch.py::test_other_prepared_data_is_refused_by_content)
    "data.tokenizer_vocab_size changed 512 -> 384 (the prepared data",
    "train.global_batch_size changed 8 -> 16",
    "train.seed changed 0 -> 1",
]))
def test_refused_changes_name_the_field(launch, i, needle):
    reports, root, _ = launch
    errors = [r["error"] for r in reports[f"r4_refused_{i}"]]
    assert errors[0] == errors[1] and needle in errors[0], errors[0]


def test_every_config_field_has_a_resume_rule():
    from shardlm.checkpoint.resume_config import RULES, flatten, rule
    from shardlm.config import Config

    keys = list(flatten(Config().to_dict()))
    assert len(keys) > 50
    assert {rule(k)[0] for k in keys} == {"takes effect", "refused"}  # rule() raises for a field without one
    page = (Path(__file__).resolve().parents[2] / "docs" / "checkpoints.md").read_text()
    for key in RULES:  # each rule is in the docs' resume table (a row may list several fields of a section)
        section, field = key.split(".")
        assert f"`{key}`" in page or f"`{field}`" in page, key


# ---- file-system faults and file modes (one process each) -------------------------------------------------
def one_process(small_data: Path, run: Path, **extra) -> list[str]:
    base = {"train.steps": 6, "train.eval_interval": 0, "checkpoint.interval": 1, "checkpoint.keep": 0}
    return tiny_overrides(small_data, run, {**base, **extra})



def test_full_disk_names_the_cause_keeps_the_previous_checkpoint_and_resumes_exactly(
        small_data, tiny_fs, tmp_path, capsys):
    run, ckpts = tiny_fs / "run", tiny_fs / "run" / "checkpoints"
    # a checkpoint is ~1.7 MB: step-1 fits on the 3 MB file system, step-2 does not
    assert train_main(one_process(small_data, run)) == 2
    assert_full_disk_error(capsys.readouterr().err, ckpts)
    # a read-only file system: the same kind of one-line error
    subprocess.run(["mount", "-o", "remount,ro", str(tiny_fs)], check=True)
    assert train_main(one_process(small_data, run, **{"checkpoint.resume": '"auto"'})) == 2
    err = capsys.readouterr().err
    assert err.count("error:") == 1 and "error: Read-only file system: " + str(run) in err, err
    # room again: auto-resume picks step-1 and ends bit-identical to an uninterrupted run
    subprocess.run(["mount", "-o", "remount,rw,size=16M", str(tiny_fs)], check=True)
    assert (
        train_main(one_process(small_data, run, **{"checkpoint.resume": '"auto"', "checkpoint.keep": 1})) == 0
    )
    assert f"from {ckpts / 'step-1'} at step 1" in capsys.readouterr().out
    assert train_main(one_process(small_data, tmp_path / "ref", **{"checkpoint.enabled": "false"})) == 0
    got, want = (load_file(str(d / "final" / "model.safetensors")) for d in (run, tmp_path / "ref"))
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


def test_every_file_follows_the_umask(small_corpus, tmp_path):
    old = os.umask(0o022)
    try:
        data, run = tmp_path / "data", tmp_path / "run"
        prepare_corpus(str(small_corpus), str(data), None, 512, 0.1)
        assert train_main(one_process(data, run, **{"train.steps": 2})) == 0
        export_checkpoint(run / "checkpoints" / "step-2", tmp_path / "export")
        assert shardlm_main(["export", str(run), str(tmp_path / "copy")]) == 0
    finally:
        os.umask(old)
    files = [p for d in (data, run, tmp_path / "export", tmp_path / "copy") for p in d.rglob("*")]
    modes = {str(p.relative_to(tmp_path)): oct(p.stat().st_mode & 0o777) for p in files}
    assert "run/final/model.safetensors" in modes and "export/model.safetensors" in modes
    assert "run/checkpoints/step-2/__0_0.distcp" in modes and "data/tokens/000000.bin" in modes
    bad = {k: m for k, m in modes.items() if m != (oct(0o755) if (tmp_path / k).is_dir() else oct(0o644))}
    assert not bad, bad
