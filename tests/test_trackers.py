"""Experiment trackers: W&B (offline) and MLflow (local file store) receive exactly what metrics.jsonl holds,
from rank 0 only; a killed and resumed run stays one run in each; an unreachable MLflow server costs one warning.

Two torchrun launches of tests/ckpt_worker.py at 2 ranks on the ~100k-parameter model. Everything is read
back with each library's own reader: W&B's transaction log through ``wandb leet inspect --json``, MLflow
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
from shardlm.config import load_config
from shardlm.errors import ConfigError
from shardlm.metrics import read_metrics
from shardlm.metrics.trackers import check_packages, flat_config, tracker_metrics
from test_checkpoint import launch, micro

wandb = pytest.importorskip("wandb")
mlflow = pytest.importorskip("mlflow")

EXPERIMENT = "shardlm-test"
WARNING = "warning: mlflow tracking stopped"


def tracked(data: Path, root: Path, name: str, extra: dict | None = None, **hooks) -> dict:
    """A scenario logging to W&B (offline, files in the run directory) and to the MLflow store under ``root``."""
    overrides = {**micro(2), "train.steps": 6, "train.eval_interval": 3, "metrics.wandb": "true",
                 "metrics.wandb_mode": '"offline"', "metrics.wandb_project": '"shardlm-test"',
                 "metrics.mlflow": "true", "metrics.mlflow_tracking_uri": f'"file:{root / "mlruns"}"',
                 "metrics.mlflow_experiment": f'"{EXPERIMENT}"', "run.name": f'"{name}"', **(extra or {})}
    return {"name": name, "overrides": tiny_overrides(data, root / name, overrides), **hooks}


@pytest.fixture(scope="module")
def runs(small_data, tmp_path_factory):
    """Launch 1: a tracked run, an unreachable MLflow server, then a run killed after step 5 (checkpoint at 3).
    Launch 2: the killed run resumed, and a run preempted (SIGTERM) after step 2."""
    root = tmp_path_factory.mktemp("trackers")
    d, out = small_data, root / "out"
    with pytest.MonkeyPatch.context() as mp:  # torchrun's workers inherit these
        mp.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")  # the unreachable server: fail at once
        mp.setenv("WANDB_ERROR_REPORTING", "false")  # wandb-core sends no error reports: nothing leaves the machine
        mp.delenv("WANDB_API_KEY", raising=False)  # no W&B credentials anywhere: online mode cannot log in
        mp.setenv("NETRC", str(root / "no-netrc"))
        mp.setenv("WANDB_CONFIG_DIR", str(root / "wandb-config"))
        reports, first = launch(2, [
            tracked(d, root, "both"),
            tracked(d, root, "unreachable", {"train.steps": 4, "metrics.wandb_mode": '"online"',
                                             "metrics.mlflow_tracking_uri": '"http://127.0.0.1:9"'}),
            tracked(d, root, "killed", {"train.steps": 8, "checkpoint.interval": 3}, kill_after_step=5, kill_rank=1),
        ], out, check=False)
        more, second = launch(2, [
            tracked(d, root, "resumed", {"train.steps": 8, "checkpoint.interval": 3, "checkpoint.resume": '"auto"',
                                         "run.dir": f'"{root / "killed"}"', "run.name": '"killed"'}),
            tracked(d, root, "preempted", {"train.steps": 5}, sigterm_after_step=2, sigterm_rank=0),
        ], out)
    return {**reports, **more}, root, first, second


def wandb_segments(run_dir: Path) -> list[list[dict]]:
    """The records of each offline W&B run segment under ``run_dir/wandb``, oldest first (W&B's own reader)."""
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


@pytest.fixture(autouse=True)
def _file_store(monkeypatch):
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # reading the file store back in this process


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
    assert summary["final_model_dir"] == str((run_dir / "final").resolve()) and summary["outcome"] == "finished"
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
    assert first.stderr.count("warning: wandb tracking stopped (start: RuntimeError: not logged in to W&B") == 1
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
    assert r_run["branch_point"] == {"metric": "_step", "run": k_run["run_id"], "value": 3}  # rewound to step 3
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


def test_missing_package_names_the_extra(monkeypatch):
    cfg = load_config(None, ["--metrics.mlflow=true"])
    monkeypatch.setattr("shardlm.metrics.trackers.importlib.util.find_spec", lambda name: None)
    message = r"metrics.mlflow = true needs the mlflow package: pip install 'shardlm\[mlflow\]'"
    with pytest.raises(ConfigError, match=message):
        check_packages(cfg)
    check_packages(load_config(None, []))  # nothing switched on: nothing needed


def test_tracker_metrics_flatten_per_rank_lists():
    record = {"step": 7, "loss": 2.5, "lr": 1e-3, "shard_bytes": [10, 12], "elapsed_s": 1.0}
    assert tracker_metrics(record) == {"loss": 2.5, "lr": 1e-3, "shard_bytes/rank0": 10, "shard_bytes/rank1": 12,
                                       "elapsed_s": 1.0}
    summary = {"step": 7, "rss_bytes": {"min": 10, "max": 12, "mean": 11.0, "max_rank": 1}, "rss_bytes_per_rank": [10, 12]}
    assert tracker_metrics(summary) == {"rss_bytes/min": 10, "rss_bytes/max": 12, "rss_bytes/mean": 11.0,
                                        "rss_bytes/max_rank": 1, "rss_bytes/rank0": 10, "rss_bytes/rank1": 12}


def test_a_tracker_failing_mid_run_warns_once_and_stops(tmp_path, capsys):
    from shardlm.metrics.trackers import Tracker

    class Flaky(Tracker):
        name = "flaky"
        logged: list = []

        def _start(self, config, ids, resume_step):
            self.ids = {"id": "x"}

        def _log(self, step, metrics):
            if step == 2:
                raise ConnectionError("server went away")
            self.logged.append(step)

        def _finish(self, outcome, model_dir):
            raise AssertionError("a stopped tracker is not finished")

    tracker = Flaky(load_config(None, []), tmp_path)
    tracker.start({}, {}, None)
    for step in (1, 2, 3):
        tracker.log({"step": step, "loss": 1.0})
    tracker.finish("finished")
    err = capsys.readouterr().err
    assert Flaky.logged == [1] and not tracker.active
    assert err.count("warning: flaky tracking stopped (log: ConnectionError: server went away)") == 1


def test_tracker_ids_are_kept_for_the_same_run_only(tmp_path, monkeypatch):
    from shardlm.metrics import trackers

    seen = []

    class Fake(trackers.Tracker):
        name = "mlflow"

        def _start(self, config, ids, resume_step):
            seen.append((dict(ids), resume_step))
            self.ids = ids or {"run_id": f"new{len(seen)}"}

    monkeypatch.setattr(trackers, "TRACKERS", {"mlflow": Fake})
    cfg = load_config(None, ["--metrics.mlflow=true"])
    trackers.start_trackers(cfg, tmp_path, None, run_id="A")  # fresh: new tracker run
    trackers.start_trackers(cfg, tmp_path, 5, run_id="A")  # resumed: the same one, rewound to 5
    trackers.start_trackers(cfg, tmp_path, 5, run_id="B")  # another run's checkpoint dir: never continued
    assert seen == [({}, None), ({"run_id": "new1"}, 5), ({}, 5)]
    assert trackers.read_ids(tmp_path) == {"mlflow": {"run_id": "new3"}, "run_id": "B"}


def test_mlflow_default_store_is_mlflows_own(tmp_path, monkeypatch, capsys):
    """No URI configured: MLflow 3's default, the SQLite store ./mlflow.db when sqlalchemy and alembic are there,
    else the file store ./mlruns with one note saying why and how to get SQLite; an existing ./mlruns store with
    experiments is kept (MLflow's own rule); a configured URI, then MLFLOW_TRACKING_URI, then the store a
    resumed run started in, come first. The default is then used for real: a run logged and read back with
    MlflowClient from the store it names."""
    from mlflow.tracking import MlflowClient

    from shardlm.metrics import trackers

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    real = trackers.importlib.util.find_spec
    sql = all(real(m) is not None for m in ("sqlalchemy", "alembic"))
    for present in (True, False):
        monkeypatch.setattr(trackers.importlib.util, "find_spec", lambda m, p=present: object() if p else None)
        uri, note = trackers.default_mlflow_uri(tmp_path / "a")
        assert (uri, note is None) == ((f"sqlite:///{tmp_path / 'a' / 'mlflow.db'}", True) if present else
                                       (f"file:{tmp_path / 'a' / 'mlruns'}", False))
    assert "pip install sqlalchemy alembic" in note and "mlflow.db" in note
    (tmp_path / "b" / "mlruns" / "0").mkdir(parents=True)
    (tmp_path / "b" / "mlruns" / "0" / "meta.yaml").write_text("name: Default\n")
    assert trackers.default_mlflow_uri(tmp_path / "b") == (f"file:{tmp_path / 'b' / 'mlruns'}", None)
    monkeypatch.setattr(trackers.importlib.util, "find_spec", real)

    cfg = load_config(None, ["--metrics.mlflow=true", '--metrics.mlflow_experiment="default-store"'])
    tracker = trackers.MlflowTracker(cfg, tmp_path / "run")
    assert tracker.tracking_uri({"tracking_uri": "file:/elsewhere"}) == "file:/elsewhere"  # a resumed run's store
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:9")
    assert tracker.tracking_uri({"tracking_uri": "file:/elsewhere"}) == "http://127.0.0.1:9"
    cfg.metrics.mlflow_tracking_uri = "file:/configured"
    assert tracker.tracking_uri() == "file:/configured"
    cfg.metrics.mlflow_tracking_uri = ""
    monkeypatch.delenv("MLFLOW_TRACKING_URI")

    tracker.start({"train": {"lr": 0.1}}, {}, None)
    tracker.log({"step": 1, "loss": 2.5})
    tracker.log({"step": 2, "loss": 2.25})
    tracker.finish("finished")
    uri = tracker.ids["tracking_uri"]
    assert tracker.active is False and tracker.warning is None
    assert uri == (f"sqlite:///{tmp_path / 'mlflow.db'}" if sql else f"file:{tmp_path / 'mlruns'}")
    assert (tmp_path / ("mlflow.db" if sql else "mlruns")).exists()
    err = capsys.readouterr().err
    assert ("no sqlalchemy/alembic" in err) is not sql
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # reading a file store back in this process
    history = MlflowClient(tracking_uri=uri).get_metric_history(tracker.ids["run_id"], "loss")
    assert [(m.step, m.value) for m in history] == [(1, 2.5), (2, 2.25)]
