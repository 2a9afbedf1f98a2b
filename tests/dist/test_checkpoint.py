"""Checkpoints: exact resume after SIGKILL, SIGTERM and a kill during a save; resume at 1 and 4 ranks
from a 2-rank checkpoint; export; inspect; and bad checkpoints refused with one clear error.

Five torchrun launches on a ~100k-parameter model (several scenarios each), plus one-process checks.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import scenario, tensorboard_scalars, tiny_overrides, torchrun
from shardlm.cli.main import main as shardlm_main
from shardlm.cli.train import main as train_main
from shardlm.train.export import export_checkpoint
from shardlm.convert.hf_in import load_model_dir
from tolerance import assert_all_close, assert_close, check

WORKER = Path(__file__).resolve().parents[1] / "workers" / "ckpt_worker.py"
#: relative to the largest loss of the reference run (~6) and to the largest parameter (a norm's, ~1)
LOSS_TOL, PARAM_TOL = 1e-5, 1e-4
STEPS = 20


def launch(nproc: int, scenarios: list[dict], out: Path, extra_args: list[str] = (), check: bool = True):
    """One torchrun launch of tests/workers/ckpt_worker.py; return ({name: [rank reports]} of finished
    scenarios, proc)."""
    out.mkdir(parents=True, exist_ok=True)
    spec = out / f"spec-{scenarios[0]['name']}.json"
    spec.write_text(json.dumps({"out": str(out), "scenarios": scenarios}))
    proc = torchrun(nproc, [*extra_args, str(WORKER), str(spec)], timeout=300, check=check)
    reports = {}
    for s in scenarios:
        files = [out / s["name"] / f"rank{r}.json" for r in range(nproc)]
        if all(f.is_file() for f in files):
            reports[s["name"]] = [json.loads(f.read_text()) for f in files]
    return reports, proc


def micro(world: int) -> dict:
    return {"train.micro_batch_size": 8 // world}


@pytest.fixture(scope="module")
def runs(small_data, tmp_path_factory):
    """All training launches of this file; returns (reports, run root, processes of the killed launches)."""
    root = tmp_path_factory.mktemp("ckpt")
    d, out = small_data, root / "out"
    every5 = {**micro(2), "checkpoint.interval": 5, "checkpoint.keep": 0}
    reports, procs = {}, {}
    r, _ = launch(2, [
        scenario("ref", d, root, extra=every5),
        scenario("sigterm", d, root, extra={**micro(2), "checkpoint.interval": 100},
                 sigterm_after_step=7, sigterm_rank=1),
        scenario("sigterm_resume", d, root, run="sigterm",
                 extra={**micro(2), "checkpoint.interval": 100, "checkpoint.resume": '"auto"'}),
    ], out)
    reports.update(r)
    # SIGKILL rank 1 after step 7: the launch fails
    _, procs["killed"] = launch(2, [scenario("killed", d, root, extra={**micro(2), "checkpoint.interval": 5},
                                             kill_after_step=7, kill_rank=1)], out, check=False)
    # resume it (auto picks step-5); then kill rank 1 as it starts writing its shards of another run's step-10
    r, procs["killsave"] = launch(2, [
        scenario("killed_resume", d, root, run="killed",
                 extra={**micro(2), "checkpoint.interval": 5, "checkpoint.resume": '"auto"'}),
        scenario("killsave", d, root, extra={**micro(2), "checkpoint.interval": 5},
                 kill_in_save_step=10, kill_rank=1),
    ], out, check=False)
    reports.update(r)
    # the same kill under torchrun --max-restarts=1: torchrun restarts both workers, which resume
    # by themselves
    r, procs["restarted"] = launch(2,
                                   [scenario("restarted", d, root,
                                             extra={**micro(2), "checkpoint.interval": 5},
                                                kill_after_step=7, kill_rank=1)], out, ["--max-restarts=1"],
                                   check=False)
    reports.update(r)
    step10 = root / "ref" / "checkpoints" / "step-10"
    r, _ = launch(1, [
        scenario("ws1", d, root, extra={**micro(1), "checkpoint.resume": f'"{step10}"'}),
        scenario("killsave_resume", d, root, run="killsave",
                 extra={**micro(1), "checkpoint.resume": '"auto"'}),
    ], out)
    reports.update(r)
    r, _ = launch(4, [scenario("ws4", d, root, extra={**micro(4), "checkpoint.resume": f'"{step10}"'})], out)
    reports.update(r)
    return reports, root, procs


def losses(report: list[dict]) -> dict[int, float]:
    return {rec["step"]: rec["loss"] for rec in report[0]["history"]}


def metrics_steps(run: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]


def final_params(run: Path) -> dict[str, torch.Tensor]:
    return load_file(str(run / "final" / "model.safetensors"))


def merged_ids(report: list[dict]) -> dict[str, list[int]]:
    steps = report[0]["sample_ids"].keys()
    return {s: [i for r in report for i in r["sample_ids"][s]] for s in steps}


@pytest.mark.dist
def test_sigkill_then_resume_auto_bit_exact(runs):
    reports, root, procs = runs
    assert procs["killed"].returncode != 0 and "killed" not in reports
    assert "killed_resume" in reports, procs["killsave"].stderr[-5000:]
    killed, ref = reports["killed_resume"], reports["ref"]
    assert killed[0]["start_step"] == 5 and killed[0]["last_load"]["step"] == 5
    got, want = losses(killed), losses(ref)
    assert sorted(got) == list(range(6, STEPS + 1))
    assert all(got[s] == want[s] for s in got), [(s, got[s], want[s]) for s in got if got[s] != want[s]]
    p, q = final_params(root / "killed"), final_params(root / "ref")
    assert p.keys() == q.keys() and all(torch.equal(p[k], q[k]) for k in p)
    # steps 6, 7 logged before the kill: once
    assert metrics_steps(root / "killed") == list(range(1, STEPS + 1))
    tb = tensorboard_scalars(root / "killed" / "tensorboard", "train/loss")  # the event files too
    assert [s for s, _ in tb] == list(range(1, STEPS + 1))
    # after 5: the resumed run's
    assert all(value == pytest.approx(got.get(s, value), rel=1e-6) for s, value in tb)


@pytest.mark.dist
def test_torchrun_restart_resumes_by_itself_bit_exact(runs):
    """torchrun --max-restarts=1 after SIGKILL of rank 1 at step 7: the job comes back (a process group of its
    own per attempt, dist.restart_rendezvous), resumes from step-5 without being told, and ends as the
    uninterrupted run did, each step logged once."""
    reports, root, procs = runs
    assert procs["restarted"].returncode == 0, procs["restarted"].stderr[-5000:]
    restarted = reports["restarted"]
    assert all(r["restart_count"] == 1 and r["start_step"] == 5 for r in restarted)
    got, want = losses(restarted), losses(reports["ref"])
    assert sorted(got) == list(range(6, STEPS + 1)) and all(got[s] == want[s] for s in got)
    p, q = final_params(root / "restarted"), final_params(root / "ref")
    assert p.keys() == q.keys() and all(torch.equal(p[k], q[k]) for k in p)
    assert metrics_steps(root / "restarted") == list(range(1, STEPS + 1))


@pytest.mark.dist
def test_sigterm_saves_exits_zero_and_resumes_bit_exact(runs):
    reports, root, _ = runs
    stopped = reports["sigterm"]
    assert all(r["preempted"] for r in stopped)
    assert [rec["step"] for rec in stopped[0]["history"]][-1] == 7
    assert stopped[0]["last_save"]["step"] == 7  # interval 100: only the preemption saved
    resumed = reports["sigterm_resume"]
    assert resumed[0]["start_step"] == 7
    got, want = losses(resumed), losses(reports["ref"])
    assert sorted(got) == list(range(8, STEPS + 1)) and all(got[s] == want[s] for s in got)
    p, q = final_params(root / "sigterm"), final_params(root / "ref")
    assert all(torch.equal(p[k], q[k]) for k in q)
    assert metrics_steps(root / "sigterm") == list(range(1, STEPS + 1))
    # the end-of-run checkpoint replaced nothing: step-7 (preemption) and step-20 (end) are both there
    assert sorted(p.name for p in (root / "sigterm" / "checkpoints").iterdir()) == ["step-20", "step-7"]


@pytest.mark.dist
def test_kill_during_save_leaves_previous_checkpoint(runs):
    reports, root, procs = runs
    assert procs["killsave"].returncode != 0
    ckpts = root / "killsave" / "checkpoints"
    assert (ckpts / "step-5" / "manifest.json").is_file()
    assert not (ckpts / "step-10").exists()  # the killed save never became visible
    resumed = reports["killsave_resume"][0]
    assert resumed["last_load"]["path"] == str(ckpts / "step-5") and resumed["start_step"] == 5
    got, want = losses(reports["killsave_resume"]), losses(reports["ref"])
    assert sorted(got) == list(range(6, STEPS + 1))
    # resumed at 1 rank: another world size
    assert_close([got[s] for s in sorted(got)], [want[s] for s in sorted(got)], rtol=LOSS_TOL, what="loss")
    assert not any(p.name.startswith(".tmp-") for p in ckpts.iterdir())  # the next save cleaned the debris


@pytest.mark.dist
@pytest.mark.parametrize("name", ["ws1", "ws4"])
def test_resume_at_another_world_size(runs, name):
    reports, root, _ = runs
    report, ref = reports[name], reports["ref"]
    assert report[0]["world_size"] == int(name[-1]) and report[0]["start_step"] == 10
    got, want = losses(report), losses(ref)
    assert sorted(got) == list(range(11, STEPS + 1))
    loss_diff = max(abs(got[s] - want[s]) for s in got)
    val_diff = max(abs(a["val_loss"] - b["val_loss"]) for a in report[0]["history"] for b in ref[0]["history"]
                   if a["step"] == b["step"] and "val_loss" in a)
    p, q = final_params(root / name), final_params(root / "ref")
    param_diff = max((p[k] - q[k]).abs().max().item() for k in q)
    print(f"{name}: resumed from a 2-rank checkpoint: loss diff {loss_diff:.2e}, val {val_diff:.2e}, "
          f"params {param_diff:.2e}")
    assert_close([got[s] for s in sorted(got)], [want[s] for s in sorted(got)], rtol=LOSS_TOL, what="loss")
    check(val_diff, LOSS_TOL * max(b["val_loss"] for b in ref[0]["history"] if "val_loss" in b), what="val")
    assert_all_close(p, q, rtol=PARAM_TOL, what="params")
    ids, ref_ids = merged_ids(report), merged_ids(ref)
    assert sorted(ids, key=int) == [str(s) for s in range(10, STEPS)]  # 0-based: global batches 10..19
    # the same samples at every step: nothing dropped or repeated
    assert all(ids[s] == ref_ids[s] for s in ids)
    assert metrics_steps(root / name) == list(range(11, STEPS + 1))


@pytest.mark.dist
def test_keep_and_atomic_layout(runs, small_data, tmp_path):
    _, root, _ = runs
    names = sorted(p.name for p in (root / "ref" / "checkpoints").iterdir())
    assert names == ["step-10", "step-15", "step-20", "step-5"]  # keep=0: all kept
    manifest = json.loads((root / "ref" / "checkpoints" / "step-10" / "manifest.json").read_text())
    assert manifest["step"] == 10 and manifest["world_size"] == 2
    assert {".metadata", "tokenizer.json"} <= set(manifest["files"])
    for name, rec in manifest["files"].items():
        data = (root / "ref" / "checkpoints" / "step-10" / name).read_bytes()
        assert len(data) == rec["bytes"] and hashlib.sha256(data).hexdigest() == rec["sha256"]
    # keep=2 in one process: only the newest two survive
    code = train_main(tiny_overrides(small_data, tmp_path / "keep",
                                     {"train.steps": 6, "checkpoint.interval": 2,
                                                                      "checkpoint.keep": 2,
                                      "train.eval_interval": 0}))
    assert code == 0
    assert sorted(p.name for p in (tmp_path / "keep" / "checkpoints").iterdir()) == ["step-4", "step-6"]


@pytest.mark.dist
def test_export_never_deletes_what_it_did_not_write(runs, tmp_path, capsys):
    _, root, _ = runs
    run = tmp_path / "run"
    shutil.copytree(root / "ref" / "final", run / "final")
    (run / "metrics.jsonl").write_text("{}\n")
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("precious")
    for argv, needle in ((["export", str(run / "final"), str(run)], "contains the source"),
                         (["export", str(run), str(tmp_path / "mine")], "exists and is not empty")):
        assert shardlm_main(argv) == 2
        err = capsys.readouterr().err
        assert err.count("error:") == 1 and needle in err, err
    assert (run / "metrics.jsonl").is_file() and (tmp_path / "mine" / "notes.txt").read_text() == "precious"
    # a run directory exports its final/ model (not its training config.json); --overwrite replaces
    assert shardlm_main(["export", str(run), str(tmp_path / "mine"), "--overwrite"]) == 0
    assert torch.equal(load_file(str(tmp_path / "mine" / "model.safetensors"))["model.norm.weight"],
                       final_params(root / "ref")["model.norm.weight"])


@pytest.mark.dist
def test_export_gives_exactly_the_trained_params(runs, tmp_path):
    _, root, _ = runs
    out = export_checkpoint(root / "ref" / "checkpoints" / "step-20", tmp_path / "export")
    assert {p.name for p in out.iterdir()} == {p.name for p in (root / "ref" / "final").iterdir()}
    model = load_model_dir(out)  # one process, whole model
    trained = final_params(root / "ref")  # gathered from the live FSDP model at the end of training
    params = dict(model.named_parameters())
    assert params.keys() == trained.keys()
    assert all(torch.equal(params[k].detach(), trained[k]) for k in trained)
    # an earlier checkpoint differs: the comparison is not vacuous
    early = load_file(str(export_checkpoint(root / "ref" / "checkpoints" / "step-5", tmp_path / "e5")
                          / "model.safetensors"))
    assert not torch.equal(early["model.layers.0.mlp.up_proj.weight"],
                           trained["model.layers.0.mlp.up_proj.weight"])


@pytest.mark.dist
def test_inspect(runs, capsys):
    _, root, _ = runs
    assert shardlm_main(["inspect", str(root / "ref" / "checkpoints" / "step-15")]) == 0
    text = capsys.readouterr().out
    assert "step        15" in text and "world size  2" in text and "checksums   ok" in text
    assert "model.model.layers.1.mlp.down_proj.weight" in text and "float32  [64, 128]" in text


# ---- bad checkpoints: one clear error, nothing run, no hang ------------------------------------------
def rehash(ckpt: Path, name: str) -> None:
    """Make the manifest agree with a modified file (what an attacker would do)."""
    manifest = json.loads((ckpt / "manifest.json").read_text())
    data = (ckpt / name).read_bytes()
    manifest["files"][name] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (ckpt / "manifest.json").write_text(json.dumps(manifest))


class Malicious:
    """A pickle whose load would create a marker file (by calling os.system)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def damaged(kind: str, src: Path, tmp_path: Path) -> tuple[Path, str]:
    """A damaged copy of checkpoint ``src`` and the text its error must contain."""
    ckpt = tmp_path / "bad" / "step-5"
    shutil.copytree(src, ckpt)
    shard = ckpt / "__1_0.distcp"
    if kind == "truncated shard":
        shard.write_bytes(shard.read_bytes()[:-100])
        return ckpt, "file __1_0.distcp has"
    if kind == "flipped byte":
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 0x01
        shard.write_bytes(bytes(data))
        return ckpt, "file __1_0.distcp fails its SHA-256 checksum"
    if kind == "missing metadata":
        (ckpt / ".metadata").unlink()
        return ckpt, "file .metadata is missing"
    if kind == "not a checkpoint":
        return tmp_path, "is not a complete shardlm checkpoint"
    if kind == "malicious pickle":
        (ckpt / ".metadata").write_bytes(pickle.dumps(Malicious(tmp_path / "PWNED")))
        rehash(ckpt, ".metadata")
        return ckpt, "refusing to load posix.system"
    if kind == "changed model setting":  # refused from the recorded config, before any data preparation
        return ckpt, ("model.ffn_hidden changed 128 -> 96 (the model's shape and initialisation are fixed by "
                      "the checkpoint's tensors)")
    if kind == "other model shape":  # no config recorded (as before it was): the tensors' shapes refuse it
        manifest = json.loads((ckpt / "manifest.json").read_text())
        del manifest["config"]
        (ckpt / "manifest.json").write_text(json.dumps(manifest))
        return ckpt, ("tensor model.model.layers.0.mlp.gate_proj.weight has shape (128, 64) in the "
                      "checkpoint but (96, 64) in the model")
    raise AssertionError(kind)


BAD = ["changed model setting", "other model shape", "truncated shard", "flipped byte", "missing metadata",
       "not a checkpoint", "malicious pickle"]


@pytest.mark.dist
@pytest.mark.parametrize("kind", BAD)
def test_bad_checkpoint_one_clear_error(kind, runs, small_data, tmp_path, capsys):
    _, root, _ = runs
    ckpt, needle = damaged(kind, root / "ref" / "checkpoints" / "step-5", tmp_path)
    extra = {"checkpoint.resume": f'"{ckpt}"',
             **({"model.ffn_hidden": 96} if kind in ("changed model setting", "other model shape") else {})}
    code = train_main(tiny_overrides(small_data, tmp_path / "run", extra))
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.count("error:") == 1 and needle in err, err
    assert "Traceback" not in err
    assert not (tmp_path / "run" / "final").exists()
    if kind not in ("changed model setting", "other model shape"):
        # export refuses the same checkpoint the same way, writing nothing
        assert shardlm_main(["export", str(ckpt), str(tmp_path / "exported")]) == 2
        assert needle in capsys.readouterr().err and not (tmp_path / "exported").exists()
    assert not (tmp_path / "PWNED").exists()  # the malicious pickle never ran


@pytest.mark.dist
def test_bad_checkpoint_under_torchrun_no_hang(runs, small_data, tmp_path):
    _, root, _ = runs
    ckpt, needle = damaged("flipped byte", root / "ref" / "checkpoints" / "step-5", tmp_path)
    args = ["-m", "shardlm.train", *tiny_overrides(small_data, tmp_path / "run", micro(2)),
            f"--resume={ckpt}", "--parallel.timeout_s=60"]
    proc = torchrun(2, args, timeout=120, check=False)
    assert proc.returncode != 0
    assert proc.stderr.count(f"error: checkpoint {ckpt} is damaged") == 1 and needle in proc.stderr


@pytest.mark.dist
def test_inspect_reports_a_bad_checksum(runs, tmp_path, capsys):
    _, root, _ = runs
    ckpt, _ = damaged("flipped byte", root / "ref" / "checkpoints" / "step-5", tmp_path)
    assert shardlm_main(["inspect", str(ckpt)]) == 1
    assert "checksums   FAILED: file __1_0.distcp fails its SHA-256 checksum" in capsys.readouterr().out
