"""``shardlm tune``: choose the FSDP settings that fit and run fastest, from the planner and a few
measured steps.

See :mod:`shardlm.plan.tune` for the candidates and the search (:mod:`.tune_candidates`, :mod:`.tune_search`)
and the launch, :mod:`shardlm.cli.tune_worker` for the measuring workers.
"""

from __future__ import annotations

import argparse
import shlex
import time
from pathlib import Path

from shardlm.errors import ConfigError, TuneError


def duration(text: str) -> float:
    """Seconds from ``600``, ``90s``, ``15m`` or ``1h`` (``--time-budget``).

    Raises:
        ConfigError: not a positive number with an optional s / m / h unit.
    """
    units = {"s": 1, "m": 60, "h": 3600}
    number, unit = (text[:-1], text[-1]) if text[-1:] in units else (text, "s")
    try:
        seconds = float(number) * units[unit]
    except ValueError:
        seconds = float("nan")
    if not seconds > 0 or seconds == float("inf"):
        raise ConfigError("--time-budget must be a positive duration in seconds, or with s / m / h, got "
                          f"{text!r}")
    return seconds


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register ``tune`` on the ``shardlm`` command's subparsers."""
    p = sub.add_parser(
        "tune",
        help="measure candidate FSDP settings (and context / tensor / expert-parallel degrees) that fit "
        "(one torchrun launch) and write the fastest as config overrides",
    )
    p.add_argument("config", help="TOML config (overrides follow as --section.key=value)")
    p.add_argument("--world-size", type=int, required=True, help="number of ranks N (on this machine)")
    p.add_argument(
        "--out",
        default=None,
        help="TOML file for the chosen settings (default: <config stem>.tuned.toml "
        "in the current directory); train with --config CONFIG --config OUT",
    )
    p.add_argument("--device", default="auto",
                   help="whose memory the candidates must fit: auto (this machine's " "GPU, else its RAM "
                                                                                      "shared by the ranks), "
                                                                                      "cpu, h100, h100-pcie, "
                                                                                      "h100-96gb, h200, "
                                                                                      "a100-80gb, b200")
    p.add_argument(
        "--memory-per-rank",
        type=float,
        default=None,
        help="GiB per rank the candidates may use, instead of the device's (default: the device's)",
    )
    p.add_argument("--headroom", type=float, default=0.05, help="fraction of the memory kept free")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per candidate")
    p.add_argument("--steps", type=int, default=3, help="timed steps per candidate (the median is compared)")
    p.add_argument("--repeats", type=int, default=1,
                   help="times the candidate list is measured (times pooled)")
    p.add_argument("--confirm", type=int, default=2,
                   help="the fastest this many candidates are measured once " "more at the end and their "
                                                                              "times pooled (0 or 1: no "
                                                                              "second pass)")
    p.add_argument("--time-budget", default=None, metavar="SECONDS",
                   help="wall time for the measuring (e.g. 600, 90s, 15m, 1h): a candidate starts only when "
                   "the longest measurement so far still ends within it; the fastest of those measured is "
                   "picked (default: no limit)")
    p.add_argument("--search", default="staged", choices=["staged", "full"],
                   help="staged: the config's settings, one change at a time, then the best of each "
                        "combined; full: every fitting candidate (slow; the benchmark's grid)")
    p.set_defaults(fn=cmd_tune, takes_overrides=True)


def cmd_tune(args: argparse.Namespace, overrides: list[str]) -> None:
    """Enumerate, filter by predicted memory, measure in one launch, print the table, write the pick."""
    if args.world_size < 1:
        raise ConfigError(f"--world-size must be >= 1, got {args.world_size}")
    time_budget = None if args.time_budget is None else duration(args.time_budget)
    out = Path(args.out or f"{Path(args.config).stem}.tuned.toml")
    if out.is_dir():
        raise ConfigError(f"--out {out} is a directory: name a file")
    import torch

    from shardlm.config import load_config
    from shardlm.plan.tune import format_table, overrides_toml, run_tune, write_text_atomic
    from shardlm.plan.tune_candidates import config_candidate, dotted, memory_budget, size

    on_cpu = load_config(args.config, overrides).parallel.device == "cpu"
    cuda = args.device == "auto" and not on_cpu and torch.cuda.is_available()
    budget = memory_budget(args.device, args.world_size, args.headroom, args.memory_per_rank,
                           torch.cuda.get_device_name(0) if cuda else None,
                           torch.cuda.get_device_properties(0).total_memory if cuda else 0)

    loaded = []

    def announce(cfg, rows) -> None:
        loaded.append(cfg)
        layouts = "".join(
            f", {d} {'/'.join(map(str, sorted({r.cand.key(d) for r in rows})))}"
            for d in ("cp", "tp", "ep")
            if len({r.cand.key(d) for r in rows}) > 1
        )  # the context / tensor / expert-parallel degrees tried
        print(f"tune | {cfg.run.name}: fsdp at world size {args.world_size}{layouts}, global batch "
              f"{cfg.train.global_batch_size} x {cfg.train.seq_len} tokens; usable memory "
              f"{size(budget.bytes)} per rank ({budget.source}); {sum(r.fits for r in rows)} of {len(rows)} "
              f"candidates fit ({args.search} "
              f"search{'; then their best values combined, when new' if args.search == 'staged' else ''}), "
              f"each {args.warmup} warm-up + {args.steps} timed steps x {args.repeats}"
              + (f"; time budget {time_budget:.0f} s" if time_budget else ""), flush=True)

    try:
        result = run_tune(args.config, overrides, args.world_size, budget, args.search, args.warmup,
                          args.steps, args.repeats, args.confirm, announce, time_budget)
    except TuneError as e:  # a failed launch: show what was measured before it failed, then the error
        if e.rows and loaded:
            print("measured before the launch failed (nothing was written):")
            print(format_table(e.rows, loaded[0], args.world_size, None), flush=True)
        raise
    cfg, rows, best = result.cfg, result.rows, result.picked
    print(format_table(rows, cfg, args.world_size, best.cand if best else None))
    if best is None:  # pragma: no cover - prepare() guarantees one fitting candidate
        raise ConfigError("no candidate was measured")
    tokens = cfg.train.global_batch_size * cfg.train.seq_len
    own = next((r for r in rows if r.cand == config_candidate(cfg, args.world_size) and r.times), None)
    versus = f"; the config's settings: {own.step_s:.3f} s ({own.step_s / best.step_s:.2f}x)" if own else ""
    command = shlex.join(["shardlm", "tune", args.config, "--world-size", str(args.world_size), *overrides])
    # an override applies after every --config: those of the settings the pick sets would undo it
    tuned = tuple(f"--{key}=" for key in best.cand.overrides())
    kept = [o for o in overrides if not o.startswith(tuned)]
    train = shlex.join(["torchrun", f"--nproc_per_node={args.world_size}", "-m", "shardlm.train", "--config",
                        args.config, "--config", str(out), *kept])
    header = [f"written by: {command} ({time.strftime('%Y-%m-%d %H:%M')}, {result.seconds:.0f} s)",
              f"picked: {best.step_s:.3f} s/step, {tokens / best.step_s:,.0f} tokens/s at world size "
              f"{args.world_size}{versus}",
              f"predicted peak {size(best.predicted_bytes)} per rank of {size(budget.bytes)} usable",
              f"train: {train}", f"or add: {dotted(best.cand)}"]
    write_text_atomic(out, overrides_toml(best.cand, header))
    skipped = sum(r.skipped for r in rows)
    if skipped:
        print(f"time budget {time_budget:.0f} s: {sum(bool(r.times) for r in rows)} candidates measured in "
              f"{result.seconds:.0f} s, {skipped} that fit not measured (marked 'skipped'); the pick is the "
              "fastest of those measured")
    print(f"picked #{rows.index(best) + 1}: {best.step_s:.3f} s/step, {tokens / best.step_s:,.0f} "
          f"tokens/s{versus}")
    print(f"wrote {out}; train with: {train}")
    print(f"dotted overrides: {dotted(best.cand)}")
