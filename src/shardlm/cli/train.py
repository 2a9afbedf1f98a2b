"""The training command: parse ``--config`` and dotted overrides, run the :class:`Trainer`."""

from __future__ import annotations

import argparse
import json
import sys

from shardlm.cli.errors import run_cli
from shardlm.config import load_config


def parse_args(argv: list[str]) -> tuple[list[str] | None, list[str]]:
    """Split ``argv`` into the config paths and the ``--section.key=value`` overrides."""
    parser = argparse.ArgumentParser(
        prog="torchrun --nproc_per_node=N -m shardlm.train",
        description="Train a Llama model with FSDP2. Overrides: --section.key=value, e.g. --train.steps=50.")
    parser.add_argument("--config", action="append", help="TOML config file (see configs/); repeat it to layer "
                        "files, later ones overriding earlier ones (e.g. the overrides shardlm tune writes)")
    parser.add_argument("--resume", help="same as --checkpoint.resume: 'auto' or a checkpoint directory")
    args, overrides = parser.parse_known_args(argv)
    if args.resume is not None:
        overrides.append(f"--checkpoint.resume={json.dumps(args.resume)}")  # a TOML basic string
    return args.config, overrides


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m shardlm.train``; returns the process exit code."""
    config_path, overrides = parse_args(sys.argv[1:] if argv is None else argv)

    def run() -> None:
        from shardlm.train import Trainer

        cfg = load_config(config_path, overrides)
        Trainer(cfg).train()

    return run_cli(run)
