"""``shardlm profile``: a few training steps under ``torch.profiler`` on every rank; the overlap report.

Run it under torchrun like training: ``torchrun --nproc_per_node=N -m shardlm profile CONFIG [overrides]``.
Each rank writes ``<run dir>/profile/trace_rank<r>.json`` (Chrome trace, open in chrome://tracing or
Perfetto); rank 0 writes ``timeline.png`` (compute against all-gather and reduce-scatter, per rank),
``summary.json`` and prints how much communication time compute hid.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from shardlm.errors import ConfigError


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register ``profile`` on the ``shardlm`` command's subparsers."""
    p = sub.add_parser("profile", help="profile a few steps on every rank (run under torchrun): traces, "
                       "timeline PNG, hidden communication")
    p.add_argument("config", help="TOML config (overrides follow as --section.key=value)")
    p.add_argument("--steps", type=int, default=3, help="profiled steps")
    p.add_argument("--warmup", type=int, default=1, help="steps run before profiling")
    p.set_defaults(fn=cmd_profile, takes_overrides=True)


def format_report(per_rank: list[list[dict[str, float]]]) -> str:
    """A table: per rank, the mean over profiled steps of step, compute, communication, hidden, idle."""
    lines = ["rank | step ms | compute ms | all-gather ms | reduce-scatter ms | other comm ms | hidden ms | "
             "exposed ms | idle ms | hidden %"]
    for r, steps in enumerate(per_rank):
        n = max(1, len(steps))
        mean = {k: sum(s[k] for s in steps) / n for k in steps[0]} if steps else {}
        if not mean:
            continue
        lines.append(
            f"{r:4d} | {mean['step_ms']:7.1f} | {mean['compute_ms']:10.1f} | {mean['all_gather_ms']:13.1f} | "
            f"{mean['reduce_scatter_ms']:17.1f} | {mean['other_comm_ms']:13.1f} | "
            f"{mean['hidden_comm_ms']:9.1f} | {mean['exposed_comm_ms']:10.1f} | {mean['idle_ms']:7.1f} | "
            f"{100 * mean['hidden_comm_ms'] / mean['comm_ms'] if mean['comm_ms'] else 0:7.1f}")
    return "\n".join(lines)


def cmd_profile(args: argparse.Namespace, overrides: list[str]) -> None:
    """Train ``--warmup`` steps, profile ``--steps`` more on every rank, write and print the report."""
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile, record_function

    from shardlm.config import load_config
    from shardlm.metrics.overlap import STEP_PREFIX, classify_events, plot_timeline, summarize
    from shardlm.plan.defaults import choose_defaults
    from shardlm.train.trainer import Trainer

    if args.steps < 1 or args.warmup < 0:
        raise ConfigError(f"--steps must be >= 1 and --warmup >= 0, got {args.steps} and {args.warmup}")
    cfg = load_config(args.config, overrides)
    if cfg.train.steps < args.warmup + args.steps:
        cfg.train.steps = args.warmup + args.steps
    trainer = Trainer(cfg, defaults=choose_defaults)  # the "auto" settings as shardlm train picks them
    info = trainer.info
    out = trainer.run_dir / "profile"
    if info.is_main:
        out.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    for _ in range(args.warmup):
        trainer.train_step()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if info.device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        for i in range(args.steps):
            with record_function(f"{STEP_PREFIX}{i}"):
                trainer.train_step()
    trace = out / f"trace_rank{info.rank}.json"
    prof.export_chrome_trace(str(trace))
    steps, kinds = classify_events(prof.events())
    local: dict[str, Any] = {"steps": steps, "kinds": kinds, "summary": summarize(steps, kinds)}
    gathered: list[Any] = [None] * info.world_size
    dist.all_gather_object(gathered, local)
    if info.is_main:
        per_rank = [g["summary"] for g in gathered]
        plot_timeline(gathered, str(out / "timeline.png"))
        (out / "summary.json").write_text(json.dumps({"per_rank": per_rank, "device": info.device.type,
                                                      "world_size": info.world_size}, indent=1) + "\n")
        print(f"profiled {args.steps} steps on {info.world_size} rank(s), {info.device.type}: traces "
              f"{out}/trace_rank*.json, timeline {out / 'timeline.png'}")
        print(format_report(per_rank))
        if info.device.type == "cpu":
            print("on CPU with gloo FSDP2's collectives run synchronously: communication is serial with "
                  "compute")
    dist.barrier()
