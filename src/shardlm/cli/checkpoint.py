"""``shardlm export CHECKPOINT OUT_DIR`` and ``shardlm inspect CHECKPOINT``: one process, no process group."""

from __future__ import annotations

import argparse

from shardlm.config import ConfigError


def add_parsers(sub: argparse._SubParsersAction) -> None:
    """Register the ``export`` and ``inspect`` subcommands on the ``shardlm`` parser."""
    e = sub.add_parser("export", help="write a training checkpoint as a Hugging Face Llama directory (safetensors)")
    e.add_argument("checkpoint", help="checkpoint directory, e.g. runs/NAME/checkpoints/step-300")
    e.add_argument("out_dir", help="output directory (replaced if it exists)")
    e.set_defaults(fn=cmd_export)
    i = sub.add_parser("inspect", help="show a checkpoint's step, world size, tensors, size and checksum status")
    i.add_argument("checkpoint", help="checkpoint directory")
    i.set_defaults(fn=cmd_inspect)


def cmd_export(args: argparse.Namespace, overrides: list[str]) -> None:
    """Verify the checkpoint, read its full weights (one copy) and write ``args.out_dir``."""
    from shardlm.checkpoint.export import export_checkpoint

    if overrides:
        raise ConfigError(f"unknown arguments: {' '.join(overrides)}")
    out = export_checkpoint(args.checkpoint, args.out_dir)
    print(f"exported {args.checkpoint} -> {out}")


def cmd_inspect(args: argparse.Namespace, overrides: list[str]) -> int:
    """Print the checkpoint summary; exit code 1 when a checksum fails."""
    from shardlm.checkpoint.export import format_inspection, inspect_checkpoint

    if overrides:
        raise ConfigError(f"unknown arguments: {' '.join(overrides)}")
    report = inspect_checkpoint(args.checkpoint)
    print(format_inspection(report))
    return 0 if report["checksums"] == "ok" else 1
