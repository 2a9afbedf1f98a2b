"""Pictures and a summary of finished runs: ``shardlm report RUN_DIR [RUN_DIR ...]``.

Reads each run's ``metrics.jsonl`` (and ``config.json`` when present) and draws, with matplotlib's
Agg backend, one PNG per quantity against step: training and validation loss, learning rate,
tokens/s, and per-rank memory (MiB: RSS on CPU or the allocator on GPU, and shard bytes; a colour per rank).
Several runs share each picture, one colour per run (per run and rank in the memory picture).
``summary.md`` lists each run's config, final losses, throughput and wall time (summed over the attempts of a
resumed run, each shown).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shardlm.errors import ConfigError
from shardlm.json_file import read_json
from shardlm.metrics.logger import read_metrics

#: the PNG files a report writes, by figure name
FIGURES = ("loss", "lr", "tokens_per_s", "memory")


@dataclass
class Run:
    """One run directory's records (``metrics.jsonl``) and its config (``config.json``, or {})."""

    name: str
    path: Path
    records: list[dict[str, Any]]
    config: dict[str, Any] = field(default_factory=dict)

    def series(self, key: str) -> tuple[list[int], list[Any]]:
        """(steps, values) of every record that has ``key``."""
        rows = [(r["step"], r[key]) for r in self.records if key in r and "step" in r]
        return [s for s, _ in rows], [v for _, v in rows]


def load_run(path: str | Path) -> Run:
    """Read a run directory.

    Raises:
        ConfigError: the directory does not exist, has no ``metrics.jsonl``, the file is not JSON
            lines, or it holds no records.
    """
    p = Path(path)
    if not p.is_dir():
        raise ConfigError(f"{path}: not a run directory")
    metrics = p / "metrics.jsonl"
    if not metrics.is_file():
        raise ConfigError(f"{path}: no metrics.jsonl (is this a run directory of shardlm.train?)")
    try:
        records = read_metrics(metrics)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{metrics}: not JSON lines ({e})") from e
    if not records:
        raise ConfigError(f"{metrics} is empty: the run logged no step")
    config: dict[str, Any] = {}
    if (p / "config.json").is_file():
        config = read_json(p / "config.json", ConfigError)
    name = config.get("run", {}).get("name") or p.name
    return Run(name=name if name != "final" else p.name, path=p, records=records, config=config)


def _memory_keys(run: Run) -> list[str]:
    """The per-rank byte figures a run logged (full lists ``<key>_per_rank`` or summaries ``<key>``), process
    memory (RSS / device allocator) first, shard bytes last."""
    keys: list[str] = []
    for r in run.records:
        keys += [
            k
            for k, v in r.items()
            if k not in keys
            and (
                (k.endswith("bytes_per_rank") and isinstance(v, list))
                or (k.endswith("bytes") and isinstance(v, dict))
            )
        ]
    lists = {k.removesuffix("_per_rank") for k in keys if k.endswith("_per_rank")}
    keys = [k for k in keys if k not in lists]  # a full list replaces its own summary
    return sorted(keys, key=lambda k: k.startswith("shard_bytes"))


def _memory_lines(run: Run, key: str) -> dict[str, list[tuple[int, float]]]:
    """(label suffix -> (step, MiB) rows) for one memory key: ``rank<r>`` for a full list, ``max``/``min`` for
    a summary."""
    steps, values = run.series(key)
    if key.endswith("_per_rank"):
        ranks = max((len(v) for v in values), default=0)
        return {
            f"rank{r}": [(s, v[r] / 2**20) for s, v in zip(steps, values) if r < len(v)] for r in range(ranks)
        }
    return {stat: [(s, v[stat] / 2**20) for s, v in zip(steps, values)] for stat in ("max", "min")}


def make_figures(runs: list[Run]) -> dict[str, Any]:
    """One matplotlib Figure per name in :data:`FIGURES`, every run drawn in each.

    Lines are labelled ``<run>`` / ``<run> val`` (loss) and ``<run> <key> rank<r>`` (memory from a full
    per-rank list) or ``<run> <key> max`` / ``min`` (from a summary; MiB = bytes / 2**20); their x data are
    steps and their y data the logged values, so ``line.get_xydata()`` gives back what ``metrics.jsonl``
    holds. The memory figure has two y axes: process memory (RSS or the device allocator) on the left
    (``axes[0]``), shard bytes (dashed) on the right (``axes[1]``, each scaled to its own values: the shards
    are often a hundredth of the process memory and would sit flat on the bottom of a shared axis).
    """
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    figs: dict[str, Any] = {}
    titles = {"loss": ("loss (nats/token)", "training and validation loss"),
              "lr": ("learning rate", "learning rate"),
              "tokens_per_s": ("tokens/s (all ranks)", "throughput"),
              "memory": ("process MiB (solid)", "per-rank memory: process (solid), shard bytes (dashed)")}
    for name in FIGURES:
        fig = Figure(figsize=(7, 4), dpi=100)
        ax = fig.add_subplot()
        ax.set_xlabel("step")
        ax.set_ylabel(titles[name][0])
        ax.set_title(titles[name][1])
        ax.grid(alpha=0.3)
        figs[name] = fig
    shard_ax = figs["memory"].axes[0].twinx()  # the shard bytes' own scale, on the right
    shard_ax.set_ylabel("shard MiB (dashed)")
    for i, run in enumerate(runs):
        color = f"C{i % 10}"
        ax = figs["loss"].axes[0]
        ax.plot(*run.series("loss"), color=color, label=f"{run.name}")
        steps, val = run.series("val_loss")
        if steps:
            ax.plot(steps, val, color=color, linestyle="--", marker="o", markersize=3,
                    label=f"{run.name} val")
        figs["lr"].axes[0].plot(*run.series("lr"), color=color, label=run.name)
        figs["tokens_per_s"].axes[0].plot(*run.series("tokens_per_s"), color=color, label=run.name)
        # colour: the rank or statistic (several runs: the run, then it); line style: which memory;
        # marker: rank
        styles, markers = ["-", ":", "-."], "ox^sv<>*"
        for j, key in enumerate(_memory_keys(run)):
            style = "--" if key.startswith("shard_bytes") else styles[j % len(styles)]
            lines = _memory_lines(run, key)
            name = key.removesuffix("_per_rank").removesuffix("_bytes")
            for r, (suffix, rows) in enumerate(lines.items()):
                ax = shard_ax if key.startswith("shard_bytes") else figs["memory"].axes[0]
                ax.plot(
                    [s for s, _ in rows], [m for _, m in rows], color=f"C{(i * len(lines) + r) % 10}",
                    linestyle=style, marker=markers[r % len(markers)], markersize=3,
                    markevery=max(len(rows) // 10, 1), label=f"{run.name} {name} {suffix}")
    for fig in figs.values():
        lines = [line for ax in fig.axes for line in ax.lines]
        if lines:  # one legend for both axes of the memory figure
            fig.axes[-1].legend(lines, [line.get_label() for line in lines], fontsize=7, loc="best")
        fig.tight_layout()
    return figs


def _fmt(value: Any, spec: str) -> str:
    return format(value, spec) if isinstance(value, (int, float)) else "-"


def attempt_seconds(run: Run) -> list[float]:
    """Wall seconds of each attempt of ``run`` (its fresh start, then every resume), in order.

    Each record's ``elapsed_s`` counts from its attempt's start, so it falls where a resumed attempt begins;
    an attempt's time is its last kept record's ``elapsed_s`` (records past the checkpoint it was resumed from
    were dropped at the resume, and so is the time they took).
    """
    out: list[float] = []
    previous = None
    for r in run.records:
        t = r.get("elapsed_s")
        if not isinstance(t, (int, float)):
            continue
        if previous is None or t < previous:
            out.append(float(t))
        else:
            out[-1] = float(t)
        previous = t
    return out


def _wall(run: Run) -> str:
    """The summary's wall time: the sum over attempts, with how many when more than one."""
    attempts = attempt_seconds(run)
    if len(attempts) <= 1:
        return _fmt(attempts[0] if attempts else None, ".1f")
    return f"{sum(attempts):.1f} ({len(attempts)} attempts: " + " + ".join(f"{a:.1f}" for a in attempts) + ")"


def summary_markdown(runs: list[Run]) -> str:
    """A Markdown summary: per run, model/batch/parallel config, final losses, mean tokens/s, wall time (over
    every attempt: :func:`attempt_seconds`)."""
    lines = ["# Run report", "",
             "| run | model (dim x layers) | world size | global batch x seq | steps | final loss | final "
             "val loss | mean tokens/s | wall time (s) |", "|---|---|---|---|---|---|---|---|---|"]
    for run in runs:
        cfg = run.config
        model, train, parallel = cfg.get("model", {}), cfg.get("train", {}), cfg.get("parallel", {})
        last = run.records[-1]
        _, val = run.series("val_loss")
        _, tps = run.series("tokens_per_s")
        # the first step includes warm-up (allocation, first all-gathers): leave it out of the mean
        # when possible
        tps_mean = sum(tps[1:]) / len(tps[1:]) if len(tps) > 1 else (tps[0] if tps else None)
        ranks = next((r["world_size"] for r in run.records if "world_size" in r), None)
        lines.append(
            f"| {run.name} | {model.get('dim', '?')} x {model.get('n_layers', '?')} | {ranks or '?'} "
            f"({parallel.get('mode', '?')}) | {train.get('global_batch_size', '?')} x "
            f"{train.get('seq_len', '?')} | {last.get('step', '?')} | {_fmt(last.get('loss'), '.4f')} | "
            f"{_fmt(val[-1] if val else None, '.4f')} | {_fmt(tps_mean, ',.0f')} | {_wall(run)} |")
    lines += ["", "Pictures: " + ", ".join(f"`{n}.png`" for n in FIGURES), ""]
    for run in runs:
        if run.config:
            lines += [f"## {run.name} config", "", "```json", json.dumps(run.config, indent=1), "```", ""]
    return "\n".join(lines)


def write_report(run_dirs: list[str | Path], out_dir: str | Path | None = None) -> list[Path]:
    """Write ``<name>.png`` for each of :data:`FIGURES` and ``summary.md`` into ``out_dir``.

    ``out_dir`` defaults to ``<first run dir>/report``. Returns the written paths.

    Raises:
        ConfigError: no run directories, or one that :func:`load_run` refuses (nothing is written then).
    """
    if not run_dirs:
        raise ConfigError("no run directories given")
    runs = [load_run(d) for d in run_dirs]
    out = Path(out_dir) if out_dir is not None else Path(run_dirs[0]) / "report"
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name, fig in make_figures(runs).items():
        path = out / f"{name}.png"
        fig.savefig(path)
        written.append(path)
    (out / "summary.md").write_text(summary_markdown(runs))
    written.append(out / "summary.md")
    return written
