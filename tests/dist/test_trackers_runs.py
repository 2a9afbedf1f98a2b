"""Experiment trackers: W&B (offline) and MLflow (local file store) receive exactly what metrics.jsonl holds,
from rank 0 only; a killed and resumed run stays one run in each; an unreachable MLflow server costs
one warning.

Two torchrun launches of tests/workers/ckpt_worker.py at 2 ranks on the ~100k-parameter model. Everything is
read back with each library's own reader: W&B's transaction log through ``wandb leet inspect --json``, MLflow
through ``MlflowClient``. Nothing leaves the machine (W&B offline, MLflow on a file store or 127.0.0.1).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import tiny_overrides
from shardlm.metrics import read_metrics
from shardlm.metrics.trackers import flat_config, tracker_metrics
from test_checkpoint import launch, micro

EXPERIMENT = "shardlm-test"
WARNING = "warning: mlflow tracking stopped"


def tracked(data: Path, root: Path, name: str, extra: dict | None = None, **hooks) -> dict:
    """A scenario logging to W&B (offline, files in the run directory) and to the MLflow store
    under ``root``."""
    overrides = {**micro(2), "train.steps": 6, "train.eval_interval": 3, "metrics.wandb": "true",
                 "metrics.wandb_mode": '"offline"', "metrics.wandb_project": '"shardlm-test"',
                 "metrics.mlflow": "true", "metrics.mlflow_tracking_uri": f'"file:{root / "mlruns"}"',
                 "metrics.mlflow_experiment": f'"{EXPERIMENT}"', "run.name": f'"{name}"', **(extra or {})}
    return {"name": name, "overrides": tiny_overrides(data, root / name, overrides), **hooks}


@pytest.fixture(autouse=True)
def mlflow_file_store_readable(monkeypatch):
    """Reading the runs' MLflow file store back in this process: MLflow 3 refuses a file store unless
    ``MLFLOW_ALLOW_FILE_STORE`` is set (the trainer sets it for its own process only)."""
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")


@pytest.fixture(scope="module")
def runs(small_data, tmp_path_factory):
    """Launch 1: a tracked run, an unreachable MLflow server, then a run killed after step 5 (checkpoint at
    3). Launch 2: the killed run resumed, and a run preempted (SIGTERM) after step 2."""
    root = tmp_path_factory.mktemp("trackers")
    d, out = small_data, root / "out"
    with pytest.MonkeyPatch.context() as mp:  # torchrun's workers inherit these
        mp.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")  # the unreachable server: fail at once
        # wandb-core sends no error reports: nothing leaves the machine
        mp.setenv("WANDB_ERROR_REPORTING", "false")
        mp.delenv("WANDB_API_KEY", raising=False)  # no W&B credentials anywhere: online mode cannot log in
        mp.setenv("NETRC", str(root / "no-netrc"))
        mp.setenv("WANDB_CONFIG_DIR", str(root / "wandb-config"))
        reports, first = launch(2, [
            tracked(d, root, "both"),
            tracked(d, root, "unreachable", {"train.steps": 4, "metrics.wandb_mode": '"online"',
                                             "metrics.mlflow_tracking_uri": '"http://127.0.0.1:9"'}),
            tracked(d, root, "killed", {"train.steps": 8, "checkpoint.interval": 3}, kill_after_step=5,
                    kill_rank=1),
        ], out, check=False)
        more, second = launch(2, [
            tracked(d, root, "resumed",
                    {"train.steps": 8, "checkpoint.interval": 3, "checkpoint.resume": '"auto"',
                                         "run.dir": f'"{root / "killed"}"', "run.name": '"killed"'}),
            tracked(d, root, "preempted", {"train.steps": 5}, sigterm_after_step=2, sigterm_rank=0),
        ], out)
    return {**reports, **more}, root, first, second


def wandb_segments(run_dir: Path) -> list[list[dict]]:
    """The records of each offline W&B run segment under ``run_dir/wandb``, oldest first (W&B's
    own reader)."""
    files = sorted((run_dir / "wandb").glob("offline-run-*/run-*.wandb"))
    env = {**os.environ, "WANDB_MODE": "offline"}  # offline: the reader uploads no telemetry either
    segments = []
    for f in files:
        proc = subprocess.run([sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(f)],
                              capture_output=True, text=True, env=env, timeout=120, check=True)
        segments.append([json.loads(line) for line in proc.stdout.splitlines() if line.strip()])
    return segments


def of_type(records: list[dict], kind: str) -> list[dict]:
    return [r[kind] for r in records if r["type"] == kind]


def wandb_history(segment: list[dict]) -> dict[int, dict]:
    """{step: logged values} of one segment (W&B's own ``_step``/``_runtime``/``_timestamp`` left out)."""
    out = {}
    for h in of_type(segment, "history"):
        out[h["step"]["num"]] = {k: v for k, v in h["item"].items() if not k.startswith("_")}
    return out


def wandb_summary(segment: list[dict]) -> dict:
    summary: dict = {}
    for s in of_type(segment, "summary"):
        summary.update(s.get("update", {}))
    return summary


def expected(run_dir: Path) -> dict[int, dict]:
    """{step: tracker metrics} of the run's metrics.jsonl."""
    return {r["step"]: tracker_metrics(r) for r in read_metrics(run_dir / "metrics.jsonl")}


def mlflow_run(root: Path, name: str):
    """The only MLflow run named ``name`` in the test store (fails when there are none or several)."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"file:{root / 'mlruns'}")
    experiment = client.get_experiment_by_name(EXPERIMENT)
    found = [r for r in client.search_runs([experiment.experiment_id]) if r.info.run_name == name]
    assert len(found) == 1, [r.info.run_name for r in found]
    return client, found[0]


def mlflow_points(client, run) -> dict[str, list]:
    """{metric key: every point of its history} (MLflow's own ``get_metric_history``)."""
    return {key: client.get_metric_history(run.info.run_id, key) for key in run.data.metrics}


@pytest.mark.dist
def test_both_trackers_get_config_and_every_step_from_rank_0_only(runs):
    reports, root, _, _ = runs
    run_dir = root / "both"
    assert [r["trackers"] for r in reports["both"]] == [["wandb", "mlflow"], []]  # rank 0 only
    want = expected(run_dir)
    assert sorted(want) == [1, 2, 3, 4, 5, 6] and "val_loss" in want[3] and "rss_bytes/max" in want[1]
    config = json.loads((run_dir / "config.json").read_text())

    (segment,) = wandb_segments(run_dir)  # one W&B run, written by one process
    run = of_type(segment, "run")[0]
    assert {k: v for k, v in run["config"]["update"].items() if k != "_wandb"} == config
    assert run["display_name"] == "both" and run["project"] == "shardlm-test"
    assert wandb_history(segment) == want  # every logged step, every value, exactly
    summary = wandb_summary(segment)
    assert (
        summary["final_model_dir"] == str((run_dir / "final").resolve()) and summary["outcome"] == "finished"
    )
    assert of_type(segment, "exit")[0]["exit_code"] == 0
    ids = json.loads((run_dir / "trackers.json").read_text())
    assert ids["wandb"]["id"] == run["run_id"]

    client, mrun = mlflow_run(root, "both")  # one MLflow run
    assert mrun.info.status == "FINISHED" and mrun.info.run_id == ids["mlflow"]["run_id"]
    assert mrun.data.params == flat_config(config)
    assert mrun.data.tags["shardlm.final_model_dir"] == str((run_dir / "final").resolve())
    got: dict[int, dict] = {}
    for key, points in mlflow_points(client, mrun).items():
        assert len(points) == len({p.step for p in points})  # each step once
        for p in points:
            got.setdefault(p.step, {})[key] = p.value
    assert got == want
    artifacts = {a.path for a in client.list_artifacts(mrun.info.run_id)}
    assert "config.json" in artifacts and "report" in artifacts
    reports_png = {Path(a.path).name for a in client.list_artifacts(mrun.info.run_id, "report")}
    assert {"loss.png", "lr.png"} <= reports_png


@pytest.mark.dist
def test_unreachable_mlflow_one_warning_and_training_finishes(runs):
    """The unreachable scenario: MLflow at 127.0.0.1:9 (nothing listens), W&B online without credentials."""
    reports, root, first, _ = runs
    assert first.stderr.count(WARNING) == 1, first.stderr[-3000:]  # the unreachable scenario only
    line = next(x for x in first.stderr.splitlines() if WARNING in x)
    assert "127.0.0.1" in line or "Connection" in line, line
    assert (
        first.stderr.count("warning: wandb tracking stopped (start: RuntimeError: not logged in to W&B") == 1
    )
    assert [r["trackers"] for r in reports["unreachable"]] == [[], []]
    assert [r["step"] for r in read_metrics(root / "unreachable" / "metrics.jsonl")] == [1, 2, 3, 4]
    assert (root / "unreachable" / "final" / "model.safetensors").is_file()


@pytest.mark.dist
def test_killed_and_resumed_run_is_one_run_in_each_tracker(runs):
    reports, root, first, _ = runs
    run_dir = root / "killed"
    assert first.returncode != 0 and "killed" not in reports and reports["resumed"][0]["start_step"] == 3
    want = expected(run_dir)
    assert sorted(want) == list(range(1, 9))

    killed, resumed = wandb_segments(run_dir)  # the killed attempt's segment, then the resumed one
    killed_history = wandb_history(killed)
    assert max(killed_history) > 3  # the killed attempt logged steps past its checkpoint
    (k_run,), (r_run,) = of_type(killed, "run"), of_type(resumed, "run")
    assert k_run["run_id"] == r_run["run_id"]  # one W&B run
    # rewound to step 3
    assert r_run["branch_point"] == {"metric": "_step", "run": k_run["run_id"], "value": 3}
    # what W&B shows after the rewind: the first attempt up to step 3, then the resumed attempt's steps
    shown = {s: v for s, v in killed_history.items() if s <= 3} | wandb_history(resumed)
    assert shown == want
    assert min(wandb_history(resumed)) == 4

    client, mrun = mlflow_run(root, "killed")  # one MLflow run
    assert mrun.info.status == "FINISHED" and mrun.data.tags["shardlm.rewound_to_steps"] == "3"
    twice = 0
    for key, points in mlflow_points(client, mrun).items():
        by_step: dict[int, list] = {}
        for p in points:
            by_step.setdefault(p.step, []).append(p)
        for step, ps in by_step.items():
            latest = max(ps, key=lambda p: p.timestamp)  # the resumed attempt's point is the later one
            assert latest.value == want[step][key], (key, step)
            twice += len(ps) > 1
            assert len(ps) == (2 if 3 < step <= max(killed_history) else 1), (key, step, len(ps))
    assert twice > 0  # MLflow keeps the killed attempt's points past the checkpoint (README)


@pytest.mark.dist
def test_preempted_run_marks_itself(runs):
    reports, root, _, _ = runs
    assert reports["preempted"][0]["preempted"]
    (segment,) = wandb_segments(root / "preempted")
    assert wandb_summary(segment)["outcome"] == "preempted" and of_type(segment, "exit")[0]["exit_code"] == 1
    assert sorted(wandb_history(segment)) == [1, 2]
    _, mrun = mlflow_run(root, "preempted")
    assert mrun.info.status == "KILLED" and mrun.data.tags["shardlm.outcome"] == "preempted"
