"""``shardlm report RUN_DIR [RUN_DIR ...] [--out DIR]``: PNG plots and a Markdown summary of runs."""

from __future__ import annotations

import argparse


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register the ``report`` sub-command."""
    r = sub.add_parser("report", help="PNG plots (loss, lr, tokens/s, per-rank memory) and a summary of runs")
    r.add_argument("runs", nargs="+", metavar="RUN_DIR", help="run directories (holding metrics.jsonl)")
    r.add_argument("--out", help="output directory (default: RUN_DIR/report of the first run)")
    r.set_defaults(fn=cmd_report)


def cmd_report(args: argparse.Namespace, overrides: list[str]) -> None:
    """Write the report and print where."""
    from shardlm.config import ConfigError
    from shardlm.metrics.report import write_report

    if overrides:
        raise ConfigError(f"unknown arguments: {' '.join(overrides)}")
    for path in write_report(args.runs, args.out):
        print(path)
