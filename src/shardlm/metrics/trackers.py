"""Experiment trackers: Weights & Biases and MLflow as two more sinks of the metrics records (rank 0 only).

Each tracker receives what ``metrics.jsonl`` receives, through its own library: the resolved config
once, then every logged record at its ``step`` (scalars under their own key, each per-rank list of
``*_bytes`` as ``<key>/rank<r>``), and at the end the final model directory's path (MLflow also gets
``config.json`` and the ``shardlm report`` PNGs as artefacts).

Identity: the ids of the tracker runs are kept in ``<run dir>/trackers.json``, so a resumed run
(``checkpoint.resume``, or a torchrun restart) continues the same W&B run and the same MLflow run.
:meth:`Tracker.rewind` is called with the checkpoint's step on resume:

- W&B rewinds the run to that step (``resume_from="<id>?_step=<step>"``, W&B's run rewind), so the
  resumed steps replace what the interrupted attempt logged past it; with ``metrics.wandb_rewind =
  false``, or when the server refuses a rewind, it continues with ``resume="allow"``, and W&B keeps
  the first value it received for a step (it ignores a step it already has);
- MLflow cannot delete metric points: the points the interrupted attempt logged past the checkpoint
  stay in the history beside the resumed attempt's points of the same steps (the later timestamp is
  the resumed run's); the tag ``shardlm.rewound_to_steps`` lists every rewind.

A tracker never stops training: any error (missing login, no network, a bad URI) prints one
warning naming the tracker and the cause, and the tracker is switched off for the rest of the run.
Only a tracker switched on without its package installed is an error (:class:`ConfigError` naming the
extra), raised before training starts.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any, Literal

from shardlm.config import Config
from shardlm.errors import ConfigError
from shardlm.metrics.report import write_report

#: how a run ends, as the trackers record it
Outcome = Literal["finished", "preempted", "failed"]

#: the file of the run directory that keeps the tracker run ids across resumes
IDS_FILE = "trackers.json"

#: tracker name -> (module it imports, pip extra that installs it)
PACKAGES = {"wandb": ("wandb", "wandb"), "mlflow": ("mlflow", "mlflow")}


def check_packages(cfg: Config) -> None:
    """Raise :class:`ConfigError` naming the extra when a tracker is switched on but its package
    is missing."""
    for name, (module, extra) in PACKAGES.items():
        if getattr(cfg.metrics, name) and importlib.util.find_spec(module) is None:
            raise ConfigError(f"metrics.{name} = true needs the {module} package: pip install "
                              f"'shardlm[{extra}]'")


def tracker_metrics(record: dict[str, Any]) -> dict[str, float | int]:
    """The numbers of a metrics record as tracker metrics (``step`` left out).

    Scalars keep their key (``loss``, ``val_loss``, ``lr``, ``grad_norm``, ``tokens_per_s``...); a per-rank
    summary (``shard_bytes``, ``rss_bytes``, ``max_allocated_bytes``...: min, max, mean, max_rank) becomes
    ``<key>/<stat>``; a full per-rank list (``<key>_per_rank``, with ``train.log_per_rank``, or a plain list)
    one metric per rank, ``<key>/rank<r>``. Values are the record's own, unconverted (ints stay ints).
    """
    out: dict[str, float | int] = {}

    def number(v: Any) -> bool:
        return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)

    for key, value in record.items():
        if key == "step" or isinstance(value, bool):
            continue
        if isinstance(value, (int, float)):
            if math.isfinite(value):
                out[key] = value
        elif isinstance(value, dict):
            out.update({f"{key}/{stat}": v for stat, v in value.items() if number(v)})
        elif isinstance(value, list):
            name = key.removesuffix("_per_rank")
            out.update({f"{name}/rank{rank}": v for rank, v in enumerate(value) if number(v)})
    return out


def flat_config(tree: dict[str, Any], prefix: str = "") -> dict[str, str]:
    """A nested config as ``{"train.lr": "0.0003", ...}`` (MLflow parameters are strings)."""
    out: dict[str, str] = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(flat_config(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = json.dumps(value) if isinstance(value, (list, tuple)) else str(value)
    return out


def _cause(e: BaseException) -> str:
    """One line for a warning: the exception's type and the first line of its message (at most
    300 characters)."""
    text = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return f"{type(e).__name__}: {text[:300]}" if text else type(e).__name__


class Tracker:
    """One experiment tracker; every public method catches the tracker's errors (see the module docstring).

    Subclasses implement ``_start``, ``_log``, ``_rewind`` and ``_finish``. ``ids`` holds what
    ``trackers.json`` keeps for this tracker (run id...); ``resume_step`` is the checkpoint's step
    when the run continues an earlier attempt (None for a fresh run).
    """

    name = ""

    def __init__(self, cfg: Config, run_dir: Path) -> None:
        self.cfg, self.run_dir = cfg, run_dir
        self.ids: dict[str, Any] = {}
        self.active = False
        self.warning: str | None = None
        self.rewound_to: int | None = None  # the step the tracker run was last rewound to

    def _guard(self, what: str, fn: Any, *args: Any) -> Any:
        if not self.active:
            return None
        try:
            return fn(*args)
        except Exception as e:  # noqa: BLE001 - a tracker never stops training
            self.active = False
            self.warning = (f"warning: {self.name} tracking stopped ({what}: {_cause(e)}); training goes on "
                            "with the other metrics sinks")
            print(self.warning, file=sys.stderr, flush=True)
            try:
                self._abandon()
            except Exception:  # noqa: BLE001
                pass
            return None

    def start(self, config: dict[str, Any], ids: dict[str, Any], resume_step: int | None) -> None:
        """Open (or, with ``ids`` and a ``resume_step``, continue) the tracker run and log the config once."""
        self.active = True
        self._guard("start", self._start, config, ids, resume_step)
        self.rewound_to = resume_step

    def log(self, record: dict[str, Any]) -> None:
        """Log one metrics record at ``record["step"]``."""
        if "step" in record:
            self._guard("log", self._log, int(record["step"]), tracker_metrics(record))

    def rewind(self, step: int) -> None:
        """Forget what was logged after ``step`` where the backend allows it (see the module docstring).

        Idempotent: a tracker started with ``resume_step`` (or rewound already) to this step does nothing.
        """
        if step != self.rewound_to:
            self._guard("rewind", self._rewind, step)
            self.rewound_to = step

    def finish(self, outcome: Outcome, model_dir: Path | None = None) -> None:
        """Record how the run ended (and the final model directory's path), then close the tracker run."""
        self._guard("finish", self._finish, outcome, model_dir)
        self.active = False

    # ---- per tracker -------------------------------------------------------------------------
    def _start(self, config: dict[str, Any], ids: dict[str, Any], resume_step: int | None) -> None:
        raise NotImplementedError

    def _log(self, step: int, metrics: dict[str, float | int]) -> None:
        raise NotImplementedError

    def _rewind(self, step: int) -> None:
        raise NotImplementedError

    def _finish(self, outcome: Outcome, model_dir: Path | None) -> None:
        raise NotImplementedError

    def _abandon(self) -> None:
        """Release what a failed tracker holds (best effort; errors are ignored)."""


class WandbTracker(Tracker):
    """Weights & Biases through ``wandb.init`` / ``run.log`` (online, or offline for a later ``wandb sync``).

    Settings: ``metrics.wandb_project`` (else ``WANDB_PROJECT``, else ``shardlm``), ``wandb_entity``
    (else ``WANDB_ENTITY``), ``wandb_name`` (else ``WANDB_NAME``, else ``run.name``), ``wandb_tags``
    (else ``WANDB_TAGS``), ``wandb_mode`` (else ``WANDB_MODE``, else online). Files go to
    ``WANDB_DIR`` or the run directory (``<run dir>/wandb/``).
    """

    name = "wandb"

    def __init__(self, cfg: Config, run_dir: Path) -> None:
        super().__init__(cfg, run_dir)
        self.run: Any = None
        self._config: dict[str, Any] = {}

    def _init(self, resume_step: int | None) -> None:
        import wandb

        m = self.cfg.metrics
        kwargs: dict[str, Any] = dict(
            project=m.wandb_project or os.environ.get("WANDB_PROJECT") or "shardlm",
            entity=m.wandb_entity or None,
            name=m.wandb_name or os.environ.get("WANDB_NAME") or self.cfg.run.name,
            tags=list(m.wandb_tags) or None, mode=m.wandb_mode or None, config=self._config,
            dir=os.environ.get("WANDB_DIR") or str(self.run_dir),
        )
        Path(kwargs["dir"]).mkdir(parents=True, exist_ok=True)
        if (m.wandb_mode or os.environ.get("WANDB_MODE") or "online") == "online" and not wandb.login(
                prompt=False, verify=False):
            # never an interactive prompt on rank 0 while the other ranks wait
            raise RuntimeError("not logged in to W&B: run `wandb login` or set WANDB_API_KEY, or set "
                               'metrics.wandb_mode = "offline"')
        run_id = self.ids.get("id")
        if resume_step is None:
            self.run = wandb.init(id=run_id, **kwargs)
            self.ids = {"id": self.run.id}
            return
        if m.wandb_rewind:
            try:
                self.run = wandb.init(resume_from=f"{run_id}?_step={resume_step}", **kwargs)
                self.ids["rewound_to_steps"] = [*self.ids.get("rewound_to_steps", []), resume_step]
                return
            except Exception as e:  # noqa: BLE001 - e.g. a server without run rewind: continue without it
                print(f"warning: wandb could not rewind run {run_id} to step {resume_step} ({_cause(e)}); "
                      "continuing it with resume='allow' (W&B keeps the values it already has for steps "
                      f"after {resume_step})", file=sys.stderr, flush=True)
        self.run = wandb.init(id=run_id, resume="allow", **kwargs)

    def _start(self, config: dict[str, Any], ids: dict[str, Any], resume_step: int | None) -> None:
        self._config = config
        self.ids = dict(ids)
        # without a W&B run id (a fresh run, or its ids were lost) W&B opens a new run and picks the id
        self._init(resume_step if ids.get("id") else None)

    def _log(self, step: int, metrics: dict[str, float | int]) -> None:
        self.run.log(metrics, step=step)

    def _rewind(self, step: int) -> None:
        """A rewind once the run is open: close this segment and reopen the run rewound to ``step``."""
        self.run.finish(exit_code=0)
        self._init(step)

    def _finish(self, outcome: Outcome, model_dir: Path | None) -> None:
        if model_dir is not None:
            self.run.summary["final_model_dir"] = str(Path(model_dir).resolve())
        self.run.summary["outcome"] = outcome
        if outcome == "preempted":
            self.run.mark_preempting()  # W&B shows a preempted run as such (a non-zero exit code follows)
        self.run.finish(exit_code=0 if outcome == "finished" else 1)
        self.run = None

    def _abandon(self) -> None:
        if self.run is not None:
            self.run.finish(exit_code=1)
            self.run = None


def default_mlflow_uri(cwd: Path) -> tuple[str, str | None]:
    """MLflow's own default store, as an absolute URI, and a note when it falls back; MLflow 3's rule
    (``mlflow.tracking._tracking_service.utils._get_default_tracking_uri``): a file store ``./mlruns`` that
    already holds experiments is kept; otherwise the SQLite database ``./mlflow.db``. SQLite needs the
    ``sqlalchemy`` and ``alembic`` packages (the full ``mlflow`` package has them, ``mlflow-skinny`` not):
    without them the file store ``./mlruns``, with the note saying so and how to get SQLite.
    """
    mlruns = cwd / "mlruns"
    if any((d / "meta.yaml").exists() for d in mlruns.glob("[0-9]*") if d.is_dir()):
        return f"file:{mlruns}", None
    if all(importlib.util.find_spec(m) is not None for m in ("sqlalchemy", "alembic")):
        return f"sqlite:///{cwd / 'mlflow.db'}", None
    return f"file:{mlruns}", (f"no sqlalchemy/alembic: logging to the file store {mlruns} (MLflow 3 keeps it "
                              "in maintenance mode); pip install sqlalchemy alembic for MLflow's default, "
                              "the SQLite store mlflow.db")


class MlflowTracker(Tracker):
    """MLflow through ``MlflowClient`` (``mlflow-skinny``): parameters, metrics, tags and artefacts of
    one run.

    Settings: ``metrics.mlflow_tracking_uri`` (else ``MLFLOW_TRACKING_URI``, else the store this run used
    before, from ``trackers.json``, else MLflow's own default: :func:`default_mlflow_uri`),
    ``mlflow_experiment`` (else ``MLFLOW_EXPERIMENT_NAME``, else ``shardlm``), ``mlflow_run_name`` (else
    ``run.name``). The config goes in as parameters (``train.lr`` ...) and as the artefact ``config.json``.
    HTTP requests use MLflow's own retry settings, with shorter defaults unless set in the environment
    (``MLFLOW_HTTP_REQUEST_MAX_RETRIES=2``, ``MLFLOW_HTTP_REQUEST_TIMEOUT=20`` seconds): a tracker that cannot
    reach its server must not hold training up for minutes. A local ``file:`` store needs
    ``MLFLOW_ALLOW_FILE_STORE=true`` in MLflow 3 (its file store is in maintenance mode): it is set for this
    process when the URI is a file store.
    """

    #: printed once when the default falls back to the file store (no sqlalchemy / alembic)
    note: str | None = None

    name = "mlflow"

    def __init__(self, cfg: Config, run_dir: Path) -> None:
        super().__init__(cfg, run_dir)
        self.client: Any = None
        self.run_id: str | None = None

    def tracking_uri(self, ids: dict[str, Any] | None = None) -> str:
        """The tracking URI this run uses (see the class docstring); ``ids``: this tracker's ``trackers.json``
        entry (a resumed run keeps the default store it started in)."""
        uri = self.cfg.metrics.mlflow_tracking_uri or os.environ.get("MLFLOW_TRACKING_URI", "")
        if uri:
            return uri
        if ids and ids.get("tracking_uri"):
            return ids["tracking_uri"]
        uri, self.note = default_mlflow_uri(Path.cwd())
        return uri

    def _start(self, config: dict[str, Any], ids: dict[str, Any], resume_step: int | None) -> None:
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "2")
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "20")
        uri = self.tracking_uri(ids)
        if self.note:
            print(f"mlflow: {self.note}", file=sys.stderr, flush=True)
        if uri.startswith("file:") or "://" not in uri:
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        from mlflow.entities import Param, RunStatus
        from mlflow.exceptions import MlflowException
        from mlflow.tracking import MlflowClient

        self.client = client = MlflowClient(tracking_uri=uri)
        m = self.cfg.metrics
        if resume_step is not None and ids.get("run_id") and ids.get("tracking_uri") == uri:
            try:
                run = client.get_run(ids["run_id"])
            except MlflowException as e:
                if e.error_code != "RESOURCE_DOES_NOT_EXIST":
                    raise
                run = None
            if run is not None:  # continue it: the parameters it has stay; new ones are added
                self.run_id, self.ids = run.info.run_id, dict(ids)
                client.update_run(self.run_id, status=RunStatus.to_string(RunStatus.RUNNING))
                client.set_tag(self.run_id, "shardlm.outcome", "running")
                have = run.data.params
                new = {k: v for k, v in flat_config(config).items() if k not in have}
                changed = sorted(k for k, v in flat_config(config).items() if k in have and have[k] != v)
                self._log_params(new, Param)
                if changed:
                    # MLflow parameters cannot change: say which did, keep the new config as an artefact
                    client.set_tag(self.run_id, f"shardlm.config_changed_at_step_{resume_step}",
                                   ",".join(changed))
                    client.log_dict(self.run_id, config, f"config-resumed-at-step-{resume_step}.json")
                self._rewind(resume_step)
                return
        name = m.mlflow_experiment or os.environ.get("MLFLOW_EXPERIMENT_NAME") or "shardlm"
        experiment = client.get_experiment_by_name(name)
        if experiment is None:
            try:
                experiment_id = client.create_experiment(name)
            except MlflowException:  # created meanwhile by another run
                experiment_id = client.get_experiment_by_name(name).experiment_id
        else:
            experiment_id = experiment.experiment_id
        run = client.create_run(experiment_id, run_name=m.mlflow_run_name or self.cfg.run.name, tags={
            "shardlm.run_dir": str(self.run_dir.resolve()), "shardlm.outcome": "running"})
        self.run_id = run.info.run_id
        self.ids = {"tracking_uri": uri, "experiment_id": experiment_id, "run_id": self.run_id}
        self._log_params(flat_config(config), Param)
        client.log_dict(self.run_id, config, "config.json")

    def _log_params(self, params: dict[str, str], param_cls: Any) -> None:
        items = [param_cls(k, v[:6000]) for k, v in params.items()]
        for i in range(0, len(items), 100):  # MLflow takes at most 100 parameters per batch
            self.client.log_batch(self.run_id, params=items[i:i + 100])

    def _log(self, step: int, metrics: dict[str, float | int]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(k, v, now, step) for k, v in metrics.items()])

    def _rewind(self, step: int) -> None:
        """MLflow cannot delete metric points: record the rewind in the tag ``shardlm.rewound_to_steps``."""
        tags = self.client.get_run(self.run_id).data.tags
        steps = [s for s in tags.get("shardlm.rewound_to_steps", "").split(",") if s]
        self.client.set_tag(self.run_id, "shardlm.rewound_to_steps", ",".join([*steps, str(step)]))

    def _finish(self, outcome: Outcome, model_dir: Path | None) -> None:
        client = self.client
        if model_dir is not None:
            client.set_tag(self.run_id, "shardlm.final_model_dir", str(Path(model_dir).resolve()))
        if outcome != "failed" and (self.run_dir / "metrics.jsonl").is_file():
            for path in write_report([self.run_dir], self.run_dir / "report"):
                client.log_artifact(self.run_id, str(path), "report")
        client.set_tag(self.run_id, "shardlm.outcome", outcome)
        status = {"finished": "FINISHED", "preempted": "KILLED", "failed": "FAILED"}[outcome]
        client.set_terminated(self.run_id, status=status)


#: tracker classes by their ``metrics.<name>`` switch
TRACKERS: dict[str, type[Tracker]] = {"wandb": WandbTracker, "mlflow": MlflowTracker}


def read_ids(run_dir: Path) -> dict[str, Any]:
    """``<run dir>/trackers.json``: {tracker name: its ids, "run_id": the shardlm run's id when known},
    or {}."""
    try:
        data = json.loads((run_dir / IDS_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def start_trackers(
    cfg: Config, run_dir: Path, resume_step: int | None, run_id: str | None = None
) -> list[Tracker]:
    """Open the trackers switched on in ``cfg.metrics`` (call on rank 0 only); write their ids.

    Args:
        cfg: the run's config; ``cfg.to_dict()`` (with ``run_id``, as in ``config.json``) is logged once as
            the tracker runs' config.
        run_dir: the run directory (holds ``trackers.json``).
        resume_step: the step the run resumes from (a continued run keeps its tracker runs and is
            rewound to this step), or None for a fresh run (new tracker runs).
        run_id: the identity of the shardlm run, when known: tracker runs recorded for another run id
            are never continued.

    Returns:
        The trackers that started; one that failed has printed its warning and is left out.
    """
    names = [name for name in TRACKERS if getattr(cfg.metrics, name)]
    if not names:
        return []
    old = read_ids(run_dir) if resume_step is not None else {}
    if run_id is not None and old.get("run_id", run_id) != run_id:
        old = {}  # another run's tracker runs
    config = {"run_id": run_id, **cfg.to_dict()} if run_id is not None else cfg.to_dict()  # as in config.json
    started: list[Tracker] = []
    for name in names:
        tracker = TRACKERS[name](cfg, run_dir)
        tracker.start(config, old.get(name, {}), resume_step)
        if tracker.active:
            started.append(tracker)
    ids = {**old, **{t.name: t.ids for t in started}, **({"run_id": run_id} if run_id is not None else {})}
    tmp = run_dir / f"{IDS_FILE}.tmp"
    tmp.write_text(json.dumps(ids, indent=2) + "\n", encoding="utf-8")
    os.replace(tmp, run_dir / IDS_FILE)
    return started


__all__ = ["IDS_FILE", "MlflowTracker", "Outcome", "TRACKERS", "Tracker", "WandbTracker", "check_packages",
           "flat_config", "read_ids", "start_trackers", "tracker_metrics"]
