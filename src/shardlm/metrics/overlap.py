"""Overlap of communication with compute, from a ``torch.profiler`` trace of training steps.

Intervals are read from the profiler's events and classified:

- all-gather / reduce-scatter / other communication: on CUDA the NCCL kernels (``nccl...AllGather``,
  ``...ReduceScatter``, ``...AllReduce``); on CPU the c10d collective ops (``c10d::_allgather_base_``,
  ``c10d::_reduce_scatter_base_``, ``c10d::allreduce_``...) and the waits on them;
- compute: on CUDA every other kernel; on CPU every top-level ``aten::`` op not inside a collective.

Per step (the ``record_function`` range named ``STEP_PREFIX + i``), with |·| the length of a union
of intervals:

    hidden communication  = |comm ∩ compute|
    exposed communication = |comm \\ compute|
    idle                  = step − |comm ∪ compute|
    exposed communication + |compute| + idle = step time   (the identity the tests check)
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass
from typing import Any

Interval = tuple[float, float]
STEP_PREFIX = "shardlm.train_step#"
"""Name prefix of the ``record_function`` range around each profiled step."""
KINDS = ("compute", "all_gather", "reduce_scatter", "other_comm")

_AG = re.compile(r"all_?gather|allgather", re.I)
_RS = re.compile(r"reduce_?scatter|all_?to_?all", re.I)  # shardlm's gloo reduce-scatter is an all-to-all


def comm_kind(name: str) -> str | None:
    """'all_gather', 'reduce_scatter', 'other_comm' for a collective's event name, else None.

    Collectives are the c10d ops (``c10d::...``, ``_c10d_functional::...``), gloo's events (its
    worker thread), NCCL's kernels and shardlm's own (``shardlm::...``: the point-to-point all-gather of
    ``shardlm/parallel/all_gather.py``, whose sends and receives it covers).
    """
    low = name.lower()
    if not (low.startswith(("c10d::", "_c10d_functional::", "gloo:", "shardlm::")) or "nccl" in low):
        return None
    if _AG.search(name):
        return "all_gather"
    if _RS.search(name):
        return "reduce_scatter"
    return "other_comm"


def union(intervals: list[Interval]) -> list[Interval]:
    """Sorted, merged intervals covering the same points."""
    out: list[Interval] = []
    for a, b in sorted(i for i in intervals if i[1] > i[0]):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def length(intervals: list[Interval]) -> float:
    """Total length of a union of intervals."""
    return sum(b - a for a, b in union(intervals))


def intersect(x: list[Interval], y: list[Interval]) -> list[Interval]:
    """Intersection of two unions of intervals."""
    x, y = union(x), union(y)
    out, i, j = [], 0, 0
    while i < len(x) and j < len(y):
        a, b = max(x[i][0], y[j][0]), min(x[i][1], y[j][1])
        if a < b:
            out.append((a, b))
        if x[i][1] < y[j][1]:
            i += 1
        else:
            j += 1
    return out


def clip(intervals: list[Interval], window: Interval) -> list[Interval]:
    """The parts of ``intervals`` inside ``window``."""
    return [(max(a, window[0]), min(b, window[1])) for a, b in intervals if b > window[0] and a < window[1]]


@dataclass
class StepOverlap:
    """Accounting of one step on one rank; times in milliseconds."""

    step_ms: float
    compute_ms: float
    all_gather_ms: float
    reduce_scatter_ms: float
    other_comm_ms: float
    comm_ms: float
    hidden_comm_ms: float
    exposed_comm_ms: float
    idle_ms: float

    @property
    def hidden_fraction(self) -> float:
        """Share of communication time hidden behind compute (0 when there is none)."""
        return self.hidden_comm_ms / self.comm_ms if self.comm_ms else 0.0


def account(step: Interval, kinds: dict[str, list[Interval]]) -> StepOverlap:
    """Overlap accounting of one step window given intervals per kind (µs in, ms out)."""
    k = {name: union(clip(kinds.get(name, []), step)) for name in KINDS}
    comm = union(k["all_gather"] + k["reduce_scatter"] + k["other_comm"])
    compute = k["compute"]
    hidden = length(intersect(comm, compute))
    busy = length(comm + compute)
    step_len = step[1] - step[0]
    ms = 1e-3
    return StepOverlap(
        step_len * ms, length(compute) * ms, length(k["all_gather"]) * ms, length(k["reduce_scatter"]) * ms,
        length(k["other_comm"]) * ms, length(comm) * ms, hidden * ms, (length(comm) - hidden) * ms,
        (step_len - busy) * ms,
    )


def classify_events(events: Any) -> tuple[list[Interval], dict[str, list[Interval]]]:
    """Step windows and intervals per kind (µs) from ``prof.events()`` (a list of FunctionEvent).

    Device kernels (CUDA) are classified by name; on the CPU only the outermost op of each
    call stack counts, and nothing below a collective counts as compute.
    """
    steps: list[Interval] = []
    kinds: dict[str, list[Interval]] = {name: [] for name in KINDS}
    device_kernels = [e for e in events if str(getattr(e, "device_type", "")).endswith("CUDA")]

    def visit(e: Any) -> None:
        name = e.name
        interval = (e.time_range.start, e.time_range.end)
        if name.startswith(STEP_PREFIX):
            steps.append(interval)
        kind = comm_kind(name)
        if kind is not None:
            kinds[kind].append(interval)
            return
        if name.startswith("aten::") and not device_kernels:
            kinds["compute"].append(interval)
            return
        for child in e.cpu_children:
            visit(child)

    for e in events:
        if str(getattr(e, "device_type", "")).endswith("CPU") and e.cpu_parent is None:
            visit(e)
    for e in device_kernels:
        kind = comm_kind(e.name) or "compute"
        kinds[kind].append((e.time_range.start, e.time_range.end))
    return sorted(steps), kinds


def summarize(steps: list[Interval], kinds: dict[str, list[Interval]]) -> list[dict[str, float]]:
    """:func:`account` for each step, as plain dicts (for JSON)."""
    out = []
    for s in steps:
        acc = account(s, kinds)
        out.append({**asdict(acc), "hidden_fraction": acc.hidden_fraction})
    return out


def plot_timeline(per_rank: list[dict[str, Any]], path: str) -> None:
    """A PNG timeline: one panel per rank, one row per kind (compute, all-gather, reduce-scatter, other).

    ``per_rank[r]`` holds ``steps`` and ``kinds`` (µs) as returned by :func:`classify_events`.
    Times are shown in ms from the first profiled step's start on each rank.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"compute": "tab:blue", "all_gather": "tab:green", "reduce_scatter": "tab:red",
              "other_comm": "tab:gray"}
    fig, axes = plt.subplots(len(per_rank), 1, figsize=(12, 1.6 * len(per_rank) + 0.8), squeeze=False)
    for r, (ax, data) in enumerate(zip(axes[:, 0], per_rank)):
        t0 = data["steps"][0][0] if data["steps"] else 0.0
        for row, kind in enumerate(KINDS):
            bars = [((a - t0) / 1e3, (b - a) / 1e3) for a, b in union(data["kinds"][kind])]
            ax.broken_barh(bars, (row - 0.4, 0.8), facecolors=colors[kind])
        for a, b in data["steps"]:
            ax.axvline((a - t0) / 1e3, color="black", lw=0.6, ls=":")
            ax.axvline((b - t0) / 1e3, color="black", lw=0.6, ls=":")
        ax.set_yticks(range(len(KINDS)), ["compute", "all-gather", "reduce-scatter", "other comm"])
        ax.set_ylim(-0.6, len(KINDS) - 0.4)
        ax.set_ylabel(f"rank {r}")
        ax.invert_yaxis()
    axes[-1, 0].set_xlabel("time (ms) from the first profiled step")
    fig.suptitle("compute vs communication per rank (dotted lines: step boundaries)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
