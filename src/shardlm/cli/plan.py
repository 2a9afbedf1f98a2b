"""``shardlm plan``: per-rank peak memory and step time of a config, before launching it."""

from __future__ import annotations

import argparse

from shardlm.errors import ConfigError


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register ``plan`` on the ``shardlm`` command's subparsers."""
    p = sub.add_parser("plan", help="predict per-rank peak memory and step time of a config")
    p.add_argument("config", help="TOML config (overrides follow as --section.key=value)")
    p.add_argument("--world-size", type=int, required=True, help="number of ranks N")
    p.add_argument("--device", default="h100", help="h100 (SXM), h100-pcie, h100-96gb, h200, a100-80gb, b200 or cpu")
    p.add_argument("--headroom", type=float, default=0.05,
                   help="fraction of device memory kept free for allocator fragmentation")
    p.set_defaults(fn=cmd_plan)


def cmd_plan(args: argparse.Namespace, overrides: list[str]) -> None:
    """Print the plan of ``args.config`` at ``--world-size`` on ``--device``."""
    if args.world_size < 1:
        raise ConfigError(f"--world-size must be >= 1, got {args.world_size}")
    if not 0 <= args.headroom < 1:
        raise ConfigError(f"--headroom must be in [0, 1), got {args.headroom}")
    from shardlm.config import load_config
    from shardlm.plan.devices import get_device
    from shardlm.plan.report import format_plan

    get_device(args.device)
    cfg = load_config(args.config, overrides)
    print(format_plan(cfg, args.world_size, args.device, args.headroom))
