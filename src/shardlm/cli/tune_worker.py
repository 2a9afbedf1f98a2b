"""The measuring side of ``shardlm tune``: one torchrun launch that builds and times each candidate in turn.

Started by :func:`shardlm.plan.tune.launch` as ``torchrun ... -m shardlm.cli.tune_worker SPEC.json``. Every
rank reads the spec (config, overrides, the candidates to measure, the staged search's base, warm-up and
measured steps, repeats), builds the run's :class:`shardlm.train.trainer.Trainer` for each candidate (its
data, model, optimizer; no checkpoints, no evaluation, no trackers; a run directory of its own under the
launch's work directory), runs ``warmup`` steps, then times ``steps`` steps. A step's time is the slowest
rank's (an all-reduce of the times after the candidate, not a collective per step). Repeats measure the whole
list again in the same order, so a load that drifts touches every candidate alike. After the first round of a
staged search, the ranks, which hold the same times, compute the same second-round candidate
(:func:`shardlm.plan.tune_search.combine`) and measure it when it fits. Last, the ``confirm`` fastest rows are
measured once more, one after another, and their times pooled: the pick between close contenders rests on
twice the steps. Rank 0 writes the rows as JSON and prints one ``tune: ...`` line per measurement; after each
measurement it also writes the rows so far (``<out>.partial``), so a launch that fails later still shows what
was measured.

With a time budget (the spec's ``deadline``, wall-clock seconds since the epoch, set by ``shardlm tune
--time-budget``) a candidate is started only when the time now plus the longest measurement so far (its
trainer's build, warm-up and timed steps) is before the deadline; the ranks agree on it (the latest rank's
clock counts). The first candidate is always measured (a pick needs one); the others are marked ``skipped``.
"""

from __future__ import annotations

import gc
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from shardlm.cli.errors import run_cli
from shardlm.config import Config, load_config
from shardlm.parallel import DistInfo, init_distributed
from shardlm.parallel.dist import exit_process
from shardlm.plan.tune_candidates import Candidate, Planner, apply
from shardlm.plan.tune_search import Row, combine
from shardlm.train.trainer import Trainer


def label(cand: Candidate) -> str:
    """A short description of a candidate for the progress lines."""
    return (f"reshard={str(cand.reshard_after_forward).lower()} prefetch={cand.forward_prefetch}/"
            f"{cand.backward_prefetch} ac={cand.activation_checkpoint} micro-batch={cand.micro_batch_size} "
            f"sync={cand.grad_sync} compile={str(cand.compile).lower()} blocks/group={cand.blocks_per_group} "
            f"cp={cand.cp} tp={cand.tp} ep={cand.ep}")


def run_config(cfg: Config, cand: Candidate, spec: dict[str, Any], index: int) -> Config:
    """The config one candidate runs with: its settings; a run directory of its own; no checkpoints,
    evaluation or trackers; ``train.steps`` = the steps run; a nominal MFU peak (MFU is not reported: no
    start-up measurement of the matrix-multiply rate)."""
    out = apply(cfg, cand)
    out.run.dir = str(Path(spec["workdir"]) / f"candidate-{index}")
    out.run.overwrite = True
    out.checkpoint.enabled = False
    out.checkpoint.resume = ""
    out.train.steps = spec["warmup"] + spec["steps"]
    out.train.eval_interval = 0
    out.metrics.wandb = out.metrics.mlflow = False
    if out.train.peak_flops <= 0:
        out.train.peak_flops = 1.0
    return out


def time_candidate(cfg: Config, info: DistInfo) -> tuple[list[float], int]:
    """Build the trainer of ``cfg``, run its steps; return the measured steps' times in seconds (the slowest
    rank's per step) and, on CUDA, the busiest rank's peak allocated bytes (else -1)."""
    cuda = info.device.type == "cuda"
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(info.device)
    trainer = Trainer(cfg, info)
    times: list[float] = []
    try:
        for _ in range(cfg.train.steps):
            if cuda:
                torch.cuda.synchronize(info.device)
            start = time.perf_counter()
            trainer.train_step()
            if cuda:
                torch.cuda.synchronize(info.device)
            times.append(time.perf_counter() - start)
    finally:
        trainer.fault_monitor.close()
        trainer.checkpointer.close()
        trainer.logger.close("finished")
    peak = torch.cuda.max_memory_allocated(info.device) if cuda else -1
    del trainer
    gc.collect()
    torch.compiler.reset()  # the next candidate compiles afresh (no recompilation limit, no stale graphs)
    t = torch.tensor(times + [float(peak)], dtype=torch.float64, device=info.device)
    if info.world_size > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    values = t.tolist()
    return values[:-1], int(values[-1])


def write_rows(path: Path, rows: list[Row]) -> None:
    """The rows as JSON at ``path``, through a temporary file and a rename (never half-written)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps([r.to_dict() for r in rows]))
    tmp.replace(path)


#: wall-clock seconds since the epoch (the budget's deadline is on this clock)
clock = time.time


def measure(spec: dict[str, Any]) -> None:
    """Measure the spec's candidates (and, in a staged search, the second-round one); rank 0 writes
    the rows."""
    cfg = load_config(spec["config"], spec["overrides"])
    info = init_distributed(cfg.parallel)
    rows = [Row.from_dict(d) for d in spec["rows"]]
    warmup = spec["warmup"]
    count = [0]
    longest = [0.0]  # seconds of the longest measurement so far
    partial = Path(spec["out"] + ".partial")
    deadline = spec.get("deadline")

    def in_time() -> bool:
        """Whether the next measurement may start (see the module docstring); the same answer on
        every rank."""
        if deadline is None or count[0] == 0:
            return True
        t = torch.tensor([clock() + longest[0]], dtype=torch.float64, device=info.device)
        if info.world_size > 1:
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t.item() <= deadline

    def run(todo: list[Row], passes: int, what: str = "") -> None:
        for repeat in range(passes):
            for row in todo:
                if not in_time():
                    if not row.times:
                        row.skipped = True
                    if info.is_main:
                        print(f"tune: {label(row.cand)}: skipped (time budget)" + what, flush=True)
                    continue
                count[0] += 1
                start = clock()
                times, peak = time_candidate(run_config(cfg, row.cand, spec, count[0]), info)
                longest[0] = max(longest[0], clock() - start)
                row.times += times[warmup:]
                row.measured_peak_bytes = max(row.measured_peak_bytes, peak)
                if info.is_main:
                    write_rows(partial, rows)  # before the line: a line seen means the row is kept
                    print(f"tune: {label(row.cand)}: {statistics.median(times[warmup:]):.3f} s/step"
                          + (f" (repeat {repeat + 1})" if passes > 1 else "") + what, flush=True)

    run([r for r in rows if r.fits], spec["repeats"])
    if spec["search"] == "staged":
        planner = Planner(cfg, info.world_size, spec["device"], spec["budget"])
        best = combine(rows, Candidate.from_dict(spec["base"]), planner)
        if all(r.cand != best for r in rows):
            rows.append(Row(best, planner.bytes(best), planner.fits(best), round=2))
            if rows[-1].fits:
                run([rows[-1]], spec["repeats"])
    finalists = sorted((r for r in rows if r.times), key=lambda r: r.step_s)[:spec.get("confirm", 0)]
    if len(finalists) > 1 and in_time():
        # the closest contenders once more, one after the other: times pooled
        before = [len(r.times) for r in finalists]
        run(finalists, 1, " (confirming)")
        confirmed = [r for r, n in zip(finalists, before) if len(r.times) > n]
        for row in confirmed if len(confirmed) > 1 else []:  # a lone confirmation decides nothing
            row.confirmed = True
    if info.is_main:
        write_rows(Path(spec["out"]), rows)


def main(argv: list[str] | None = None) -> int:
    """Entry point: ``python -m shardlm.cli.tune_worker SPEC.json`` under torchrun; returns the exit code."""
    args = sys.argv[1:] if argv is None else argv
    return run_cli(lambda: measure(json.loads(Path(args[0]).read_text())))


if __name__ == "__main__":
    exit_process(main())
