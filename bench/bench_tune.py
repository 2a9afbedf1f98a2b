"""``shardlm tune``'s pick against the full grid of its candidates, measured on this machine (issue 14,
item 6).

Usage (a script, not a test; two torchrun launches: the staged search as ``shardlm tune`` runs it, then
the grid)::

    python bench/bench_tune.py                                   # configs/20m.toml at 2 ranks, the full grid
    python bench/bench_tune.py --ac none                         # the grid without checkpointing (120 rows)
    python bench/bench_tune.py --ac none --micro-batch 4         # ... and without accumulation (24 rows)
    python bench/bench_tune.py --config configs/debug-shape.toml --repeats 2

The grid is every candidate of the space ``shardlm tune`` searches (reshard after forward x prefetch depth x
activation checkpointing x micro-batch and gradient sync x compile x blocks per group x tp x ep x cp, the
global batch fixed; ``--ac`` and ``--micro-batch`` limit it) that the planner says fits, each measured as tune
measures
(``--warmup`` steps, then ``--steps`` timed steps; the slowest rank per step; the median; ``--repeats`` passes
over the whole list, pooled). It prints the staged search's table, the grid's table, and how the staged pick's
step time in the grid compares with the grid's best row (the issue asks: within 5 %). Tokens are the config's
data (the first launch prepares them when missing). ``OMP_NUM_THREADS`` is ``--threads`` per rank.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from shardlm.plan import tune  # noqa: E402


def measure(args: argparse.Namespace, budget: tune.Budget, search: str) -> tuple[object, list[tune.Row]]:
    """One launch: the candidates of ``search`` (the grid limited to ``--ac``), measured; returns
    (cfg, rows)."""
    cfg, base, rows = tune.prepare(args.config, args.overrides, args.world_size, budget, search)
    if search == "full":
        rows = [r for r in rows if r.cand.activation_checkpoint in args.ac.split(",")
                and (args.micro_batch is None or r.cand.micro_batch_size in args.micro_batch)]
    spec = {"config": args.config, "overrides": args.overrides, "rows": [r.to_dict() for r in rows],
            "base": base.to_dict(), "warmup": args.warmup, "steps": args.steps, "repeats": args.repeats,
            "confirm": 2 if search == "staged" else 0,
            "search": search, "device": budget.device, "budget": budget.bytes}
    print(f"{search}: {sum(r.fits for r in rows)} fitting candidates of {len(rows)} ...", file=sys.stderr,
          flush=True)
    with tempfile.TemporaryDirectory(prefix="bench-tune-") as tmp:
        return cfg, tune.launch(spec, args.world_size, Path(tmp))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default=str(ROOT / "configs" / "20m.toml"))
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--ac", default="none,selective,every_n,full", help="checkpointing modes in the grid")
    parser.add_argument("--micro-batch", type=lambda v: [int(x) for x in v.split(",")], default=None,
                        help="micro-batch sizes in the grid, comma-separated (default: all)")
    parser.add_argument("--memory-per-rank", type=float, default=None,
                        help="GiB per rank (default: RAM / ranks)")
    parser.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS per rank")
    parser.add_argument("--out", default="bench/tune_results.json", help="where the JSON rows are written")
    args, args.overrides = parser.parse_known_args()
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    budget = tune.memory_budget("cpu", args.world_size, 0.05, args.memory_per_rank)
    cfg, staged = measure(args, budget, "staged")
    _, grid = measure(args, budget, "full")
    picked, best = tune.pick(staged), tune.pick(grid)
    tokens = cfg.train.global_batch_size * cfg.train.seq_len
    print(f"\nstaged search (shardlm tune {args.config} --world-size {args.world_size}):")
    print(tune.format_table(staged, cfg, args.world_size, picked.cand))
    print(f"\nfull grid (AC {args.ac}; micro-batch {args.micro_batch or 'all'}):")
    print(tune.format_table(grid, cfg, args.world_size, best.cand))
    in_grid = next((r for r in grid if r.cand == picked.cand and r.times), None)
    own = next((r for r in grid if r.cand == tune.config_candidate(cfg, args.world_size) and r.times), None)
    print(f"\ntune picked: {tune.dotted(picked.cand)}")
    if in_grid is not None:
        print(f"  its step time in the grid: {in_grid.step_s:.3f} s ({tokens / in_grid.step_s:,.0f} "
              f"tokens/s); the grid's best row: {best.step_s:.3f} s ({tune.dotted(best.cand)}); ratio "
              f"{in_grid.step_s / best.step_s:.3f} "
              f"({'within' if in_grid.step_s <= 1.05 * best.step_s else 'NOT within'} 5 %)")
    if own is not None:
        print(f"  the config's own settings in the grid: {own.step_s:.3f} s; the pick is "
              f"{own.step_s / in_grid.step_s if in_grid else float('nan'):.2f}x faster")
    print(f"  predicted peak of the pick: {tune.size(picked.predicted_bytes)} per rank of "
          f"{tune.size(budget.bytes)}")
    meta = dict(config=args.config, world_size=args.world_size, warmup=args.warmup, steps=args.steps,
                repeats=args.repeats, threads_per_rank=args.threads, cpu_count=os.cpu_count(),
                load_average=os.getloadavg())
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(dict(meta=meta, staged=[r.to_dict() for r in staged],
                                              grid=[r.to_dict() for r in grid]), indent=1) + "\n")
    print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
