"""Experiment trackers in one process: a missing package names the extra, per-rank lists are flattened, a
tracker failing mid-run warns once, tracker ids are kept for the same run only, MLflow's default store. The
runs at 2 ranks are tests/dist/test_trackers_runs.py."""

from __future__ import annotations

import pytest

from shardlm.config import load_config
from shardlm.errors import ConfigError
from shardlm.metrics.trackers import check_packages, tracker_metrics

wandb = pytest.importorskip("wandb")
mlflow = pytest.importorskip("mlflow")


@pytest.fixture(autouse=True)
def _file_store(monkeypatch):
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # reading the file store back in this process


def test_missing_package_names_the_extra(monkeypatch):
    cfg = load_config(None, ["--metrics.mlflow=true"])
    monkeypatch.setattr("shardlm.metrics.trackers.importlib.util.find_spec", lambda name: None)
    message = r"metrics.mlflow = true needs the mlflow package: pip install 'shardlm\[mlflow\]'"
    with pytest.raises(ConfigError, match=message):
        check_packages(cfg)
    check_packages(load_config(None, []))  # nothing switched on: nothing needed


def test_tracker_metrics_flatten_per_rank_lists():
    record = {"step": 7, "loss": 2.5, "lr": 1e-3, "shard_bytes": [10, 12], "elapsed_s": 1.0}
    assert tracker_metrics(record) == {"loss": 2.5, "lr": 1e-3, "shard_bytes/rank0": 10,
                                       "shard_bytes/rank1": 12, "elapsed_s": 1.0}
    summary = {"step": 7, "rss_bytes": {"min": 10, "max": 12, "mean": 11.0, "max_rank": 1},
               "rss_bytes_per_rank": [10, 12]}
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
    """No URI configured: MLflow 3's default, the SQLite store ./mlflow.db when sqlalchemy and alembic are
    there, else the file store ./mlruns with one note saying why and how to get SQLite; an existing ./mlruns
    store with experiments is kept (MLflow's own rule); a configured URI, then MLFLOW_TRACKING_URI, then the
    store a resumed run started in, come first. The default is then used for real: a run logged and read back
    with MlflowClient from the store it names."""
    from mlflow.tracking import MlflowClient

    from shardlm.metrics import trackers

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    real = trackers.importlib.util.find_spec
    sql = all(real(m) is not None for m in ("sqlalchemy", "alembic"))
    for present in (True, False):
        monkeypatch.setattr(trackers.importlib.util, "find_spec",
                            lambda m, p=present: object() if p else None)
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
    # a resumed run's store
    assert tracker.tracking_uri({"tracking_uri": "file:/elsewhere"}) == "file:/elsewhere"
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
