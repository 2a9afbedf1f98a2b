"""``shardlm tune``: choose the FSDP settings of a config from the planner's memory prediction and
measured steps.

The settings tuned (all fields of :class:`shardlm.config.Config`; everything else stays as the config has it):

======================  ==========================================================================
dimension               values
======================  ==========================================================================
reshard                 ``parallel.reshard_after_forward``: true, false
prefetch                ``parallel.forward_prefetch`` = ``backward_prefetch`` = 0, 1, 2 (and the config's
                        pair)
activation checkpoint   ``parallel.activation_checkpoint``: none, every_n (``activation_checkpoint_n`` as
                        configured), selective, full
batching                ``train.micro_batch_size`` m with G / (N·m) micro-batches per step (the global batch
                        G stays fixed): m = G/N, G/2N, G/4N, G/8N where whole, and the config's; with more
                        than one micro-batch each ``parallel.grad_sync`` policy (``every_micro_batch``,
                        ``last_micro_batch``; with HSDP also ``reduce_scatter_every_all_reduce_last``)
compile                 ``parallel.compile``: false, true (when TorchInductor's C++ compiler is found;
                        the compiled blocks are built in each candidate's untimed warm-up steps)
grouping                ``parallel.blocks_per_group``: 1, 2, all blocks in one group (and the config's)
tensor parallel         ``parallel.tp``: the config's, and each divisor of N that the trainer accepts (it
                        divides the query and key/value heads, the FFN width, the vocabulary, the sequence
                        and the ranks of the node, which is this machine; mode fsdp; no LoRA, MoE or
                        preference tuning; under context parallel cp × tp divides N and tp a CP rank's
                        tokens). A tp candidate's data-parallel ranks are N / (cp·tp): the same micro-batch
                        means tp times the micro-batches. Checkpointing under tp: none or full (the modes the
                        planner models there)
expert parallel         ``parallel.ep`` (mixtures of experts): the config's, and each divisor of N and of
                        ``model.n_experts`` that the trainer accepts (no HSDP)
context parallel        ``parallel.cp``: the config's, and each divisor of N that the trainer accepts with the
                        config's tp and ep (``train.seq_len`` >= cp; no preference tuning; N / (cp·tp)
                        data-parallel ranks dividing the global batch; cp × tp dividing N). The cp ranks of
                        a group split each sequence and take the same samples: the same micro-batch means cp
                        times the micro-batches. The predicted peak is the planner's under CP
                        (:mod:`shardlm.plan.context_parallel`); when nothing fits at the config's cp, the
                        staged search's base is the first other cp at which something does
======================  ==========================================================================

``train.loss_chunk_tokens`` is not tuned: the planner counts the chunked loss by it (:mod:`shardlm.plan.loss`:
one chunk's fp32 logits beside the output weight's gradient, which the plain loss makes too), and
``bench/bench_loss.py`` measured 256-token chunks about as fast as the whole logits, so the chunk size changes
neither what fits nor the pick by more than the loss's own small peak.

Each candidate's per-rank peak memory is :func:`shardlm.plan.memory.plan_memory`'s, plus, for an explicit
prefetch depth d, d unsharded copies of the largest block group (the groups it all-gathers early, at most all
other groups; an upper bound).
A candidate fits when that is at most the usable memory per rank: the device's memory (on a CPU the RAM
available now, divided by the ranks) less a headroom.

Search (``--search``):

* ``staged`` (the default): activation checkpointing is not searched but follows the memory: each candidate
  takes the lightest mode that fits with its other settings (recomputation only adds time; ``full`` checks
  this). The *base* is the config's reshard, prefetch and batching (or, when nothing fits with those, its
  smaller micro-batches, then the same with resharding and no prefetch, then all these at each other cp).
  Round 1 measures the config's own settings (when they fit), the base, and every candidate that differs
  from the base in one of reshard, prefetch, batching, compile, grouping, tp, ep, cp; round 2 takes the
  fastest value of each of these and measures their combination when it is new, the trainer accepts it
  (cp × tp dividing N) and it fits.
* ``full``: every fitting candidate of the whole product (the benchmark's grid, ``bench/bench_tune.py``).

Prefetch depths beyond the other block groups are cut to their number (:meth:`Candidate.normalized`), so that
settings that run the same are measured once.

All candidates are measured in one torchrun launch (:mod:`shardlm.cli.tune_worker`): for each in turn the
workers build the run's :class:`shardlm.train.trainer.Trainer` (same data, model, optimizer), run ``warmup``
steps, then time ``steps`` steps; a step's time is the slowest rank's; a candidate's time is the median. The
pick is the candidate with the most tokens/s (global batch × sequence length / step time); before it is made,
the ``confirm`` (default 2) fastest candidates are measured once more, one after another, and their times
pooled.

Three modules: :mod:`shardlm.plan.tune_candidates` (the candidates, their predicted peaks, the memory budget),
:mod:`shardlm.plan.tune_search` (the staged and full searches, the pick, what to say when nothing fits) and
this one (the measuring launch, the table, the written pick); this one's ``__all__`` is the whole interface.
"""

from __future__ import annotations

import json
import os
import re
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
from shardlm.config.auto import with_fixed_defaults
from shardlm.errors import TuneError
from shardlm.plan.devices import MIB
from shardlm.plan.tune_candidates import (
    Budget,
    Candidate,
    Planner,
    config_candidate,
    dotted,
    local_batch,
    memory_budget,
    size,
    space,
    toml_value,
)
from shardlm.plan.tune_search import Row, base_candidate, combine, first_round, pick

#: the tuner's interface, from this module and the two it is split into (:mod:`.tune_candidates`,
#: :mod:`.tune_search`)
__all__ = ["Budget", "Candidate", "Planner", "Row", "TuneError", "TuneResult", "combine", "config_candidate",
           "dotted", "first_round", "format_table", "launch", "memory_budget", "overrides_toml", "pick",
           "prepare", "run_tune", "size", "space", "write_text_atomic"]


# ---- the launch -------------------------------------------------------------------------------
def child_env(world_size: int) -> dict[str, str]:
    """The workers' environment: this shardlm importable, and (unless set) the cores shared among
    the ranks."""
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

    The workers' progress lines (``tune: ...``, and ``prepare: ...`` when the first candidate prepares the
    data) are passed on to stderr as they come; an ``error: ...`` line of a worker becomes this
    process's error.

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
        if line.startswith(("tune: ", "prepare: ")):
            # progress: each candidate's time, the data's preparation
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
                # not torchrun's
                output = "; the end of the workers' output:\n" + "\n".join(tail[:report][-30:])
        raise TuneError(f"{error}; {len(measured)} candidates were measured before the failure{output}",
                        measured)
    return [Row.from_dict(d) for d in json.loads(out.read_text())]


@dataclass
class TuneResult:
    """What one tuning run found: the config, the usable memory, the base, every row (in table order),
    the pick."""

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
    cfg = with_fixed_defaults(load_config(config, overrides))  # tune measures from the fixed defaults
    if cfg.parallel.mode != "fsdp":
        raise ConfigError("shardlm tune chooses FSDP settings: parallel.mode must be 'fsdp', not "
                          f"{cfg.parallel.mode!r}")
    planner = Planner(cfg, world_size, budget.device, budget.bytes)
    rows = first_round(cfg, planner, search)
    base = base_candidate(cfg, planner) if search == "staged" else next(r.cand for r in rows if r.fits)
    assert base is not None  # first_round raised otherwise
    return cfg, base, rows


def run_tune(config: str | None, overrides: list[str], world_size: int, budget: Budget,
             search: str = "staged", warmup: int = 2, steps: int = 3, repeats: int = 1, confirm: int = 2,
             announce: Callable[[Config, list[Row]], None] | None = None,
             time_budget: float | None = None) -> TuneResult:
    """Enumerate (:func:`prepare`; then ``announce(cfg, rows)`` if given), then measure every fitting
    candidate in one launch (:func:`launch`); the ``confirm`` fastest are measured once more at the end.

    ``time_budget``: seconds of wall time from the launch on; a measurement starts only when the longest one
    so far still ends within it (the first always runs; see :mod:`shardlm.cli.tune_worker`); the rest are
    ``skipped``. None: no limit.

    Raises:
        ConfigError, TuneError: see :func:`prepare`; TuneError also when the measuring launch fails (with the
            rows measured before it, see :func:`launch`). ConfigError: a ``time_budget`` that is not positive.
    """
    if warmup < 0 or steps < 1 or repeats < 1 or confirm < 0:
        raise ConfigError(f"--warmup and --confirm must be >= 0, --steps and --repeats >= 1, got {warmup}, "
                          f"{confirm}, {steps}, {repeats}")
    if time_budget is not None and not time_budget > 0:
        raise ConfigError(f"--time-budget must be a positive number of seconds, got {time_budget}")
    cfg, base, rows = prepare(config, overrides, world_size, budget, search)
    if announce is not None:
        announce(cfg, rows)
    spec = {"config": config, "overrides": overrides, "rows": [r.to_dict() for r in rows],
            "base": base.to_dict(), "warmup": warmup, "steps": steps, "repeats": repeats, "confirm": confirm,
            "search": search, "device": budget.device, "budget": budget.bytes,
            "deadline": None if time_budget is None else time.time() + time_budget}
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="shardlm-tune-") as tmp:
        rows = launch(spec, world_size, Path(tmp))
    return TuneResult(cfg, budget, base, rows, time.perf_counter() - start)


def format_table(rows: list[Row], cfg: Config, world_size: int, picked: Candidate | None) -> str:
    """The table ``shardlm tune`` prints: one line per candidate, measured or not (``-``)."""
    head = ["#", "reshard", "prefetch f/b", "AC", "micro-batch x accum", "grad sync", "compile",
            "blocks/group", "cp", "tp", "ep", "predicted MiB/rank", "fits", "step s", "tokens/s", "note"]
    gpu = any(r.measured_peak_bytes >= 0 for r in rows)
    if gpu:
        head.insert(13, "measured MiB")
    own = config_candidate(cfg, world_size)
    tokens_per_step = cfg.train.global_batch_size * cfg.train.seq_len
    lines = []
    for i, r in enumerate(rows, 1):
        c, step = r.cand, r.step_s
        accum = local_batch(cfg, world_size, c.tp, c.cp) // c.micro_batch_size
        note = ", ".join(n for n, on in (("picked", c == picked), ("config", c == own),
                                         (f"round {r.round}", r.round > 1), ("confirmed", r.confirmed),
                                         ("skipped: time budget", r.skipped)) if on)
        cells = [str(i), str(c.reshard_after_forward).lower(), f"{c.forward_prefetch}/{c.backward_prefetch}",
                 c.activation_checkpoint, f"{c.micro_batch_size} x {accum}",
                 c.grad_sync if accum > 1 else "-", str(c.compile).lower(), str(c.blocks_per_group),
                 str(c.cp), str(c.tp), str(c.ep), f"{r.predicted_bytes / MIB:,.1f}",
                 "yes" if r.fits else "no",
                 f"{step:.3f}" if step is not None else "-",
                 f"{tokens_per_step / step:,.0f}" if step is not None else "-", note]
        if gpu:
            cells.insert(13, f"{r.measured_peak_bytes / MIB:,.1f}" if r.measured_peak_bytes >= 0 else "-")
        lines.append(cells)
    widths = [max(len(h), *(len(cells[i]) for cells in lines)) for i, h in enumerate(head)]

    def fmt(cells: Iterable[str]) -> str:
        return "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths)) + " |"

    return "\n".join([fmt(head), "|" + "|".join("-" * (w + 2) for w in widths) + "|", *map(fmt, lines)])


def overrides_toml(cand: Candidate, header: list[str]) -> str:
    """The chosen settings as a TOML config fragment (``[parallel]`` and ``[train]``), ``header``
    as comments."""
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
