"""``shardlm tune``: choose the FSDP settings of a config from the planner's memory prediction and measured steps.

The settings tuned (all fields of :class:`shardlm.config.Config`; everything else stays as the config has it):

======================  ==========================================================================
dimension               values
======================  ==========================================================================
reshard                 ``parallel.reshard_after_forward``: true, false
prefetch                ``parallel.forward_prefetch`` = ``backward_prefetch`` = 0, 1, 2 (and the config's pair)
activation checkpoint   ``parallel.activation_checkpoint``: none, every_n (``activation_checkpoint_n`` as
                        configured), selective, full
batching                ``train.micro_batch_size`` m with G / (N·m) micro-batches per step (the global batch
                        G stays fixed): m = G/N, G/2N, G/4N, G/8N where whole, and the config's; with more
                        than one micro-batch each ``parallel.grad_sync`` policy (``every_micro_batch``,
                        ``last_micro_batch``; with HSDP also ``reduce_scatter_every_all_reduce_last``)
compile                 ``parallel.compile``: false, true (when TorchInductor's C++ compiler is found;
                        the compiled blocks are built in each candidate's untimed warm-up steps)
grouping                ``parallel.blocks_per_group``: 1, 2, all blocks in one group (and the config's)
======================  ==========================================================================

Each candidate's per-rank peak memory is :func:`shardlm.plan.memory.plan_memory`'s, plus, for an explicit
prefetch depth d, d unsharded copies of the largest block group (the groups it all-gathers early, at most all
other groups; an upper bound).
A candidate fits when that is at most the usable memory per rank: the device's memory (on a CPU the RAM
available now, divided by the ranks) less a headroom.

Search (``--search``):

* ``staged`` (the default): activation checkpointing is not searched but follows the memory: each candidate
  takes the lightest mode that fits with its other settings (recomputation only adds time; ``full`` checks
  this). The *base* is the config's reshard, prefetch and batching (or, when nothing fits with those, its
  smaller micro-batches, then the same with resharding and no prefetch). Round 1 measures the config's own
  settings (when they fit), the base, and every candidate that differs from the base in one of reshard,
  prefetch, batching, compile, grouping; round 2 takes the fastest value of each of these and measures their
  combination when it is new and fits.
* ``full``: every fitting candidate of the whole product (the benchmark's grid, ``bench/bench_tune.py``).

Prefetch depths beyond the other block groups are cut to their number (:meth:`Candidate.normalized`), so that
settings that run the same are measured once.

All candidates are measured in one torchrun launch (:mod:`shardlm.cli.tune_worker`): for each in turn the
workers build the run's :class:`shardlm.train.Trainer` (same data, model, optimizer), run ``warmup`` steps,
then time ``steps`` steps; a step's time is the slowest rank's; a candidate's time is the median. The pick is
the candidate with the most tokens/s (global batch × sequence length / step time); before it is made, the
``confirm`` (default 2) fastest candidates are measured once more, one after another, and their times pooled.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import shardlm
from shardlm.config import Config, ConfigError, load_config
from shardlm.errors import TuneError
from shardlm.parallel.ac import find_cxx_compiler
from shardlm.plan.devices import GIB, MIB, device_for_cuda_name, get_device
from shardlm.plan.memory import param_groups, plan_memory

#: activation checkpointing modes, lightest (least recomputation) first: a staged search's candidates take the first
#: that fits
AC_ORDER = ("none", "selective", "every_n", "full")
PREFETCH_DEPTHS = (0, 1, 2)
SEARCHES = ("staged", "full")
DIMENSIONS = ("reshard", "prefetch", "ac", "batching", "compile", "grouping")
#: what the staged search varies; the checkpointing follows: the lightest mode that fits
STAGED_DIMENSIONS = ("reshard", "prefetch", "batching", "compile", "grouping")


@dataclass(frozen=True)
class Candidate:
    """One setting of the tuned fields."""

    reshard_after_forward: bool
    forward_prefetch: int
    backward_prefetch: int
    activation_checkpoint: str
    micro_batch_size: int
    grad_sync: str
    compile: bool = False
    blocks_per_group: int = 1

    def key(self, dimension: str) -> Any:
        """This candidate's value in ``dimension`` (one of :data:`DIMENSIONS`)."""
        return {"reshard": self.reshard_after_forward, "prefetch": (self.forward_prefetch, self.backward_prefetch),
                "ac": self.activation_checkpoint, "batching": (self.micro_batch_size, self.grad_sync),
                "compile": self.compile, "grouping": self.blocks_per_group}[dimension]

    def with_value(self, dimension: str, value: Any) -> Candidate:
        """A copy with ``dimension`` set to ``value`` (as :meth:`key` returns it)."""
        if dimension == "reshard":
            return dataclasses.replace(self, reshard_after_forward=value)
        if dimension == "prefetch":
            return dataclasses.replace(self, forward_prefetch=value[0], backward_prefetch=value[1])
        if dimension == "ac":
            return dataclasses.replace(self, activation_checkpoint=value)
        if dimension == "compile":
            return dataclasses.replace(self, compile=value)
        if dimension == "grouping":
            return dataclasses.replace(self, blocks_per_group=value)
        return dataclasses.replace(self, micro_batch_size=value[0], grad_sync=value[1])

    def normalized(self, n_layers: int) -> Candidate:
        """The same settings with each prefetch depth at most the number of other block groups (a deeper
        prefetch all-gathers nothing more: with all blocks in one group there is nothing to prefetch)."""
        others = -(-n_layers // self.blocks_per_group) - 1
        return dataclasses.replace(self, forward_prefetch=min(self.forward_prefetch, others),
                                   backward_prefetch=min(self.backward_prefetch, others))

    def overrides(self) -> dict[str, Any]:
        """The dotted config keys this candidate sets, with their values."""
        return {
            "parallel.reshard_after_forward": self.reshard_after_forward,
            "parallel.forward_prefetch": self.forward_prefetch,
            "parallel.backward_prefetch": self.backward_prefetch,
            "parallel.activation_checkpoint": self.activation_checkpoint,
            "parallel.grad_sync": self.grad_sync,
            "train.micro_batch_size": self.micro_batch_size,
            "parallel.compile": self.compile,
            "parallel.blocks_per_group": self.blocks_per_group,
        }

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Candidate:
        return cls(**d)


def size(nbytes: float) -> str:
    """``nbytes`` for a message: GiB with two decimals from 1 GiB on, MiB with one below."""
    return f"{nbytes / GIB:.2f} GiB" if nbytes >= GIB else f"{nbytes / MIB:.1f} MiB"


def toml_value(value: Any) -> str:
    """``value`` as a TOML value (bool, int, float or string)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    return json.dumps(str(value))  # a TOML basic string


def dotted(cand: Candidate) -> str:
    """The candidate as command-line overrides: ``--parallel.reshard_after_forward=false ...``."""
    return " ".join(f"--{k}={toml_value(v)}" for k, v in cand.overrides().items())


def apply(cfg: Config, cand: Candidate) -> Config:
    """A copy of ``cfg`` with the candidate's settings."""
    out = copy.deepcopy(cfg)
    for key, value in cand.overrides().items():
        section, name = key.split(".")
        setattr(getattr(out, section), name, value)
    return out


def local_batch(cfg: Config, world_size: int) -> int:
    """Sequences per rank per step, G / N.

    Raises:
        ConfigError: N does not divide the global batch.
    """
    g = cfg.train.global_batch_size
    if world_size < 1:
        raise ConfigError(f"--world-size must be >= 1, got {world_size}")
    if g % world_size:
        raise ConfigError(f"train.global_batch_size={g} must be divisible by the world size {world_size}")
    return g // world_size


def sync_policies(cfg: Config) -> list[str]:
    """The ``parallel.grad_sync`` values worth trying under accumulation (the third one only with HSDP)."""
    out = ["every_micro_batch", "last_micro_batch"]
    if cfg.parallel.dp_replicate != 1:
        out.append("reduce_scatter_every_all_reduce_last")
    return out


def space(cfg: Config, world_size: int) -> dict[str, list[Any]]:
    """The values of each dimension (see the module docstring), the config's own first where it is one of them."""
    p = cfg.parallel
    per_rank = local_batch(cfg, world_size)
    micro = sorted({per_rank >> j for j in range(4) if per_rank % (1 << j) == 0}
                   | ({cfg.train.micro_batch_size} if per_rank % cfg.train.micro_batch_size == 0 else set()),
                   reverse=True)
    batching: list[tuple[int, str]] = []
    for m in micro:
        if per_rank // m == 1:  # one micro-batch: the gradient sync policy changes nothing
            batching.append((m, p.grad_sync))
        else:
            batching += [(m, s) for s in sync_policies(cfg)]
    depth_cap = max(0, cfg.model.n_layers - 1)
    prefetch = [(d, d) for d in PREFETCH_DEPTHS if d <= depth_cap]
    if (p.forward_prefetch, p.backward_prefetch) not in prefetch:
        prefetch.append((p.forward_prefetch, p.backward_prefetch))
    compile_values = [p.compile, not p.compile] if find_cxx_compiler() else [p.compile]
    grouping = [p.blocks_per_group] + [k for k in sorted({1, min(2, cfg.model.n_layers), cfg.model.n_layers})
                                       if k != p.blocks_per_group]
    return {"reshard": [True, False], "prefetch": prefetch, "ac": list(AC_ORDER), "batching": batching,
            "compile": compile_values, "grouping": grouping}


def config_candidate(cfg: Config, world_size: int) -> Candidate:
    """The config's own settings as a candidate (an N-way ``reshard_after_forward`` counts as true: the planner
    models true and false only; a micro-batch that does not divide G / N becomes the largest smaller one that
    does; a grad_sync that has no effect with one micro-batch is kept as it is; prefetch depths are cut to the
    other block groups, :meth:`Candidate.normalized`)."""
    p = cfg.parallel
    reshard = p.reshard_after_forward if isinstance(p.reshard_after_forward, bool) else True
    per_rank = local_batch(cfg, world_size)
    micro = max(m for m in range(1, min(per_rank, cfg.train.micro_batch_size) + 1) if per_rank % m == 0)
    return Candidate(reshard, p.forward_prefetch, p.backward_prefetch, p.activation_checkpoint, micro, p.grad_sync,
                     p.compile, p.blocks_per_group).normalized(cfg.model.n_layers)


def block_bytes(cfg: Config, world_size: int) -> int:
    """Bytes of the largest block group's unsharded parameters in the compute dtype (what one prefetch holds)."""
    param_bytes = 2 if cfg.parallel.param_dtype == "bfloat16" else 4
    groups, _, _ = param_groups(cfg, world_size, param_bytes)
    blocks = [g for g in groups if g.name.startswith("block")] or groups
    return max(round(g.numel * param_bytes * g.gather_factor) for g in blocks)


class Planner:
    """Predicted per-rank peak bytes of candidates of one config, cached (each prediction builds a meta model)."""

    def __init__(self, cfg: Config, world_size: int, device: str, budget: float) -> None:
        self.cfg, self.world_size, self.device, self.budget = cfg, world_size, device, budget
        self._cache: dict[Candidate, int] = {}
        self._group: dict[int, int] = {}  # blocks per group -> bytes of the largest block group

    def bytes(self, cand: Candidate) -> int:
        """Predicted peak bytes per rank of ``cand``: the planner's, plus the explicit prefetch's blocks.

        Raises:
            ConfigError: the planner refuses the candidate (e.g. global batch not divisible).
        """
        if cand not in self._cache:
            cfg = apply(self.cfg, cand)
            plan = plan_memory(cfg, self.world_size, self.device)
            if cand.blocks_per_group not in self._group:
                self._group[cand.blocks_per_group] = block_bytes(cfg, self.world_size)
            cut = cand.normalized(cfg.model.n_layers)  # a depth holds at most the other groups
            depth = max(cut.forward_prefetch, cut.backward_prefetch)
            self._cache[cand] = plan.peak + depth * self._group[cand.blocks_per_group]
        return self._cache[cand]

    def fits(self, cand: Candidate) -> bool:
        return self.bytes(cand) <= self.budget


def lightest_fitting(cand: Candidate, planner: Planner) -> Candidate:
    """``cand`` with the lightest activation checkpointing mode (:data:`AC_ORDER`) that fits with its other
    settings; ``cand`` with ``full`` when none fits."""
    for ac in AC_ORDER:
        variant = cand.with_value("ac", ac)
        if planner.fits(variant):
            return variant
    return cand.with_value("ac", AC_ORDER[-1])


def base_candidate(cfg: Config, planner: Planner) -> Candidate | None:
    """The staged search's starting point: the config's reshard, prefetch and batching with the lightest
    checkpointing that fits; when nothing does, the config's smaller micro-batches, then the same with
    resharding and no prefetch; None when none of these fits."""
    own = config_candidate(cfg, planner.world_size)
    dims = space(cfg, planner.world_size)
    batching = [own.key("batching")] + [b for b in dims["batching"] if b[0] < own.micro_batch_size]
    starts = [own, dataclasses.replace(own, reshard_after_forward=True, forward_prefetch=0, backward_prefetch=0)]
    for start in starts:
        for value in batching:
            cand = lightest_fitting(start.with_value("batching", value), planner)
            if planner.fits(cand):
                return cand
    return None


@dataclass
class Row:
    """One line of the table: a candidate, its prediction, and (when measured) its times."""

    cand: Candidate
    predicted_bytes: int
    fits: bool
    round: int = 1
    times: list[float] = dataclasses.field(default_factory=list)
    """Measured step times in seconds (slowest rank per step), over every repeat."""
    measured_peak_bytes: int = -1
    """Peak allocated bytes of the busiest rank (CUDA only; -1 elsewhere)."""
    confirmed: bool = False
    """Measured a second time as one of the fastest (its times pooled)."""

    @property
    def step_s(self) -> float | None:
        return statistics.median(self.times) if self.times else None

    def to_dict(self) -> dict[str, Any]:
        return {"cand": self.cand.to_dict(), "predicted_bytes": self.predicted_bytes, "fits": self.fits,
                "round": self.round, "times": self.times, "measured_peak_bytes": self.measured_peak_bytes,
                "confirmed": self.confirmed}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Row:
        return cls(Candidate.from_dict(d["cand"]), d["predicted_bytes"], d["fits"], d["round"], d["times"],
                   d.get("measured_peak_bytes", -1), d.get("confirmed", False))


def first_round(cfg: Config, planner: Planner, search: str) -> list[Row]:
    """The candidates enumerated before anything is measured, fitting or not (the fitting ones are measured; a
    staged search adds its round-2 candidate after round 1, :func:`combine`).

    Raises:
        TuneError: no candidate fits (see :func:`no_fit_message`).
    """
    if search not in SEARCHES:
        raise ConfigError(f"--search must be one of {list(SEARCHES)}, got {search!r}")
    dims = space(cfg, planner.world_size)
    if search == "full":
        product = itertools.product(dims["reshard"], dims["prefetch"], dims["ac"], dims["batching"],
                                    dims["compile"], dims["grouping"])
        cands = list(dict.fromkeys(Candidate(r, f, b, ac, m, s, c, g).normalized(cfg.model.n_layers)
                                   for r, (f, b), ac, (m, s), c, g in product))  # the same settings once
        rows = [Row(c, planner.bytes(c), planner.fits(c)) for c in cands]
        if not any(r.fits for r in rows):
            raise TuneError(no_fit_message(cfg, planner))
        return rows
    base = base_candidate(cfg, planner)
    if base is None:
        raise TuneError(no_fit_message(cfg, planner))
    own = config_candidate(cfg, planner.world_size)
    cands = [own] if own != base else []
    cands.append(base)
    for dim in STAGED_DIMENSIONS:
        for value in dims[dim]:
            cand = lightest_fitting(base.with_value(dim, value).normalized(cfg.model.n_layers), planner)
            if cand not in cands:
                cands.append(cand)
    return [Row(c, planner.bytes(c), planner.fits(c)) for c in cands]


def combine(rows: list[Row], base: Candidate, planner: Planner) -> Candidate:
    """Round 2 of the staged search: for each of :data:`STAGED_DIMENSIONS`, the value of the fastest measured
    row among those that agree with the base in the other dimensions; these values combined, with the lightest
    checkpointing that fits."""
    best = base
    for dim in STAGED_DIMENSIONS:
        alike = [r for r in rows if r.times and all(r.cand.key(d) == base.key(d) for d in STAGED_DIMENSIONS
                                                    if d != dim)]
        if alike:
            best = best.with_value(dim, min(alike, key=lambda r: r.step_s).cand.key(dim))
    return lightest_fitting(best.normalized(planner.cfg.model.n_layers), planner)


def no_fit_message(cfg: Config, planner: Planner) -> str:
    """What to say when no candidate fits: what the smallest candidate needs, and what would fit instead: more
    ranks (with the checkpointing and micro-batch they need), bf16 compute, CPU offload on a GPU."""
    n, budget = planner.world_size, planner.budget
    smallest = Candidate(True, 0, 0, "full", 1, "every_micro_batch")
    fixes: list[str] = []
    for m in (2 * n, 4 * n, 8 * n, 16 * n, 32 * n, 64 * n):
        wider = copy.deepcopy(cfg)
        g = cfg.train.global_batch_size
        wider.train.global_batch_size = -(-g // m) * m  # the next multiple of the new world size
        wide = Planner(wider, m, planner.device, budget)
        base = base_candidate(wider, wide)
        if base is not None:
            batch = "" if wider.train.global_batch_size == g else \
                f" --train.global_batch_size={wider.train.global_batch_size}"
            fixes.append(f"more ranks: --world-size {m}{batch}, with activation checkpointing "
                         f"'{base.activation_checkpoint}' and micro-batch {base.micro_batch_size} "
                         f"({size(wide.bytes(base))} per rank)")
            break
    small = apply(cfg, smallest)
    others = []
    if cfg.parallel.param_dtype == "float32":
        others.append(("bf16 compute: --parallel.param_dtype=bfloat16", {"param_dtype": "bfloat16"}))
    if planner.device != "cpu" and not cfg.parallel.cpu_offload:
        others.append(("CPU offload: --parallel.cpu_offload=true", {"cpu_offload": True}))
    for text, change in others:
        variant = copy.deepcopy(small)
        for key, value in change.items():
            setattr(variant.parallel, key, value)
        need = plan_memory(variant, n, planner.device).peak
        if need <= budget:
            fixes.append(f"{text} (with activation checkpointing 'full' and micro-batch 1: {size(need)} "
                         "per rank)")
    what = "; ".join(fixes) if fixes else ("nothing up to 64x the ranks: a smaller model, a shorter "
                                           "train.seq_len, or more memory per rank")
    return (f"no candidate fits at world size {n}: even activation checkpointing 'full' with micro-batch 1 needs "
            f"{size(planner.bytes(smallest))} per rank, {size(budget)} usable; what would fit: "
            f"{what}")


# ---- memory budget ----------------------------------------------------------------------------
def available_host_memory() -> int:
    """Bytes of RAM available now (``MemAvailable`` of /proc/meminfo; free pages elsewhere)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


@dataclass(frozen=True)
class Budget:
    """Usable bytes per rank, the planner's device name, and how the figure was found (for the report)."""

    bytes: float
    device: str
    source: str


def memory_budget(device: str, world_size: int, headroom: float, memory_per_rank_gib: float | None,
                  cuda_name: str | None = None, cuda_total_bytes: int = 0) -> Budget:
    """The usable memory per rank.

    Args:
        device: ``cpu``, a name of :data:`shardlm.plan.devices.DEVICES`, or ``auto`` (the GPU described by
            ``cuda_name``/``cuda_total_bytes`` when given, else the CPU).
        world_size: ranks sharing the host's RAM on a CPU.
        headroom: fraction kept free (allocator fragmentation, the process itself).
        memory_per_rank_gib: overrides the device's memory per rank when given.

    Raises:
        ConfigError: unknown device name, or a headroom outside [0, 1).
    """
    if not 0 <= headroom < 1:
        raise ConfigError(f"--headroom must be in [0, 1), got {headroom}")
    if device == "auto":
        device = "cpu"
        if cuda_name is not None:  # the planner needs a GPU name (only offload depends on it): an unknown one
            known = device_for_cuda_name(cuda_name)  # counts as an H100, with its own memory size
            device = known.name if known is not None else "h100"
    dev = get_device(device)
    if memory_per_rank_gib is not None:
        if memory_per_rank_gib <= 0:
            raise ConfigError(f"--memory-per-rank must be positive (GiB), got {memory_per_rank_gib}")
        total, source = memory_per_rank_gib * GIB, "--memory-per-rank"
    elif device == "cpu":
        total = available_host_memory() / world_size
        source = f"RAM available now / {world_size} ranks"
    elif cuda_total_bytes:
        total, source = cuda_total_bytes, f"{cuda_name} memory"
    else:
        total, source = dev.memory_bytes, f"{dev.name} memory"
    return Budget(total * (1 - headroom), device,
                  f"{size(total)} per rank ({source}) less {headroom:.0%} headroom")


# ---- the launch -------------------------------------------------------------------------------
def child_env(world_size: int) -> dict[str, str]:
    """The workers' environment: this shardlm importable, and (unless set) the cores shared among the ranks."""
    env = dict(os.environ)
    src = str(Path(shardlm.__file__).resolve().parents[1])
    env["PYTHONPATH"] = src + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // world_size)))
    return env


def root_cause(output: list[str]) -> str | None:
    """The first failed rank and how it ended, from torchrun's "Root Cause" report at the end of ``output``
    (its lines): ``rank 1 ended with exit code -9 (SIGKILL)``; None when there is no such report."""
    text = "\n".join(output)
    cause = text.split("Root Cause", 1)[1] if "Root Cause" in text else ""
    rank = re.search(r"rank\s*:\s*(\d+)", cause)
    exit_code = re.search(r"exitcode\s*:\s*(-?\d+)[^\n]*?(\(SIG\w+\))?\s*$", cause, re.M)
    if rank is None or exit_code is None:
        return None
    return f"rank {rank.group(1)} ended with exit code {exit_code.group(1)}" + (
        f" {exit_code.group(2)}" if exit_code.group(2) else "")


def launch(spec: dict[str, Any], world_size: int, workdir: Path) -> list[Row]:
    """Run the measuring workers (one torchrun launch of ``world_size`` ranks) and return their rows.

    The workers' progress lines (``tune: ...``, and ``prepare: ...`` when the first candidate prepares the data)
    are passed on to stderr as they come; an ``error: ...`` line of a worker becomes this process's error.

    Raises:
        TuneError: the launch failed: a worker's ``error: ...`` message, else the rank that failed first and
            how (torchrun's root cause: a rank killed by a signal), with the end of the launch's output when a
            rank crashed. Its ``rows`` are the candidates measured before the failure (the workers write them
            after each measurement).
    """
    spec_path, out = workdir / "spec.json", workdir / "rows.json"
    spec_path.write_text(json.dumps({**spec, "out": str(out), "workdir": str(workdir)}))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world_size}",
           "-m", "shardlm.cli.tune_worker", str(spec_path)]
    proc = subprocess.Popen(cmd, env=child_env(world_size), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, bufsize=1)
    tail: list[str] = []
    error = None
    assert proc.stdout is not None
    for line in proc.stdout:
        tail = (tail + [line.rstrip()])[-200:]
        if line.startswith(("tune: ", "prepare: ")):  # progress: each candidate's time, the data's preparation
            print(line.rstrip(), file=sys.stderr, flush=True)
        elif line.startswith("error: ") and error is None:
            error = line[len("error: "):].strip()
    code = proc.wait()
    if code != 0 or not out.exists():
        partial = out.with_name(out.name + ".partial")
        measured = [Row.from_dict(d) for d in json.loads(partial.read_text())] if partial.exists() else []
        measured = [r for r in measured if r.times]
        output = ""
        if error is None:
            cause = root_cause(tail)
            error = f"the measuring launch failed ({cause or f'exit code {code}'})"
            if cause is None or "(SIG" not in cause:  # a crash, not a kill: the workers' last words say where
                report = next((i for i, t in enumerate(tail) if "elastic/multiprocessing" in t), len(tail))
                output = "; the end of the workers' output:\n" + "\n".join(tail[:report][-30:])  # not torchrun's
        raise TuneError(f"{error}; {len(measured)} candidates were measured before the failure{output}", measured)
    return [Row.from_dict(d) for d in json.loads(out.read_text())]


@dataclass
class TuneResult:
    """What one tuning run found: the config, the usable memory, the base, every row (in table order), the pick."""

    cfg: Config
    budget: Budget
    base: Candidate
    rows: list[Row]
    seconds: float

    @property
    def picked(self) -> Row | None:
        return pick(self.rows)


def prepare(config: str | None, overrides: list[str], world_size: int, budget: Budget,
            search: str = "staged") -> tuple[Config, Candidate, list[Row]]:
    """Load the config and enumerate the first round (no launch).

    Raises:
        ConfigError: a bad config, world size or search, or ``parallel.mode`` other than ``fsdp``.
        TuneError: no candidate fits (:func:`no_fit_message`).
    """
    cfg = load_config(config, overrides)
    if cfg.parallel.mode != "fsdp":
        raise ConfigError(f"shardlm tune chooses FSDP settings: parallel.mode must be 'fsdp', not {cfg.parallel.mode!r}")
    planner = Planner(cfg, world_size, budget.device, budget.bytes)
    rows = first_round(cfg, planner, search)
    base = base_candidate(cfg, planner) if search == "staged" else next(r.cand for r in rows if r.fits)
    assert base is not None  # first_round raised otherwise
    return cfg, base, rows


def run_tune(config: str | None, overrides: list[str], world_size: int, budget: Budget, search: str = "staged",
             warmup: int = 2, steps: int = 3, repeats: int = 1, confirm: int = 2,
             announce: Callable[[Config, list[Row]], None] | None = None) -> TuneResult:
    """Enumerate (:func:`prepare`; then ``announce(cfg, rows)`` if given), then measure every fitting candidate
    in one launch (:func:`launch`); the ``confirm`` fastest are measured once more at the end.

    Raises:
        ConfigError, TuneError: see :func:`prepare`; TuneError also when the measuring launch fails (with the
            rows measured before it, see :func:`launch`).
    """
    if warmup < 0 or steps < 1 or repeats < 1 or confirm < 0:
        raise ConfigError(f"--warmup and --confirm must be >= 0, --steps and --repeats >= 1, got {warmup}, "
                          f"{confirm}, {steps}, {repeats}")
    cfg, base, rows = prepare(config, overrides, world_size, budget, search)
    if announce is not None:
        announce(cfg, rows)
    spec = {"config": config, "overrides": overrides, "rows": [r.to_dict() for r in rows], "base": base.to_dict(),
            "warmup": warmup, "steps": steps, "repeats": repeats, "confirm": confirm, "search": search,
            "device": budget.device, "budget": budget.bytes}
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="shardlm-tune-") as tmp:
        rows = launch(spec, world_size, Path(tmp))
    return TuneResult(cfg, budget, base, rows, time.perf_counter() - start)


def format_table(rows: list[Row], cfg: Config, world_size: int, picked: Candidate | None) -> str:
    """The table ``shardlm tune`` prints: one line per candidate, measured or not (``-``)."""
    head = ["#", "reshard", "prefetch f/b", "AC", "micro-batch x accum", "grad sync", "compile", "blocks/group",
            "predicted MiB/rank", "fits", "step s", "tokens/s", "note"]
    gpu = any(r.measured_peak_bytes >= 0 for r in rows)
    if gpu:
        head.insert(10, "measured MiB")
    own = config_candidate(cfg, world_size)
    per_rank = local_batch(cfg, world_size)
    tokens_per_step = cfg.train.global_batch_size * cfg.train.seq_len
    lines = []
    for i, r in enumerate(rows, 1):
        c, step = r.cand, r.step_s
        accum = per_rank // c.micro_batch_size
        note = ", ".join(n for n, on in (("picked", c == picked), ("config", c == own),
                                         (f"round {r.round}", r.round > 1), ("confirmed", r.confirmed)) if on)
        cells = [str(i), str(c.reshard_after_forward).lower(), f"{c.forward_prefetch}/{c.backward_prefetch}",
                 c.activation_checkpoint, f"{c.micro_batch_size} x {accum}", c.grad_sync if accum > 1 else "-",
                 str(c.compile).lower(), str(c.blocks_per_group), f"{r.predicted_bytes / MIB:,.1f}",
                 "yes" if r.fits else "no",
                 f"{step:.3f}" if step is not None else "-",
                 f"{tokens_per_step / step:,.0f}" if step is not None else "-", note]
        if gpu:
            cells.insert(10, f"{r.measured_peak_bytes / MIB:,.1f}" if r.measured_peak_bytes >= 0 else "-")
        lines.append(cells)
    widths = [max(len(h), *(len(cells[i]) for cells in lines)) for i, h in enumerate(head)]

    def fmt(cells: Iterable[str]) -> str:
        return "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths)) + " |"

    return "\n".join([fmt(head), "|" + "|".join("-" * (w + 2) for w in widths) + "|", *map(fmt, lines)])


def pick(rows: list[Row]) -> Row | None:
    """The row with the shortest median step time (the most tokens/s: the global batch is fixed), among the
    confirmed finalists when there are any (measured twice, see ``confirm``), else among all measured rows."""
    measured = [r for r in rows if r.times and r.confirmed] or [r for r in rows if r.times]
    return min(measured, key=lambda r: r.step_s) if measured else None


def overrides_toml(cand: Candidate, header: list[str]) -> str:
    """The chosen settings as a TOML config fragment (``[parallel]`` and ``[train]``), ``header`` as comments."""
    sections: dict[str, list[str]] = {}
    for key, value in cand.overrides().items():
        section, name = key.split(".")
        sections.setdefault(section, []).append(f"{name} = {toml_value(value)}")
    body = "\n\n".join(f"[{s}]\n" + "\n".join(lines) for s, lines in sections.items())
    return "".join(f"# {h}\n" for h in header) + "\n" + body + "\n"


def write_text_atomic(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file beside it and a rename (never half-written).

    Raises:
        OSError: the directory cannot be written (naming the path).
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
