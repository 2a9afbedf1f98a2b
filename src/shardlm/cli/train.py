"""The training command: parse ``--config`` and dotted overrides, run the :class:`Trainer`.

``--resume=auto`` (the canonical spelling; ``--checkpoint.resume=auto`` is the same setting) with no
``--config`` continues the run in ``--run.dir`` (or ``runs/<--run.name>``) with the settings its
``config.json`` records; any other override given then is a change to them, taken or refused by
:mod:`shardlm.checkpoint.resume_config`.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from shardlm.cli.errors import run_cli
from shardlm.config import Config, ConfigError, load_config, parse_cli_value
from shardlm.errors import STOPPED_EXIT_CODE
from shardlm.json_file import read_json


def build_parser() -> argparse.ArgumentParser:
    """The parser of ``python -m shardlm.train`` (under torchrun); what it does not know are the
    ``--section.key=value`` overrides."""
    parser = argparse.ArgumentParser(
        prog="torchrun --nproc_per_node=N -m shardlm.train",
        description="Train a Llama model with FSDP2. Overrides: --section.key=value, e.g. --train.steps=50.")
    parser.add_argument("--config", action="append",
                        help="TOML config file (see configs/); repeat it to layer " "files, later ones "
                                                                                    "overriding earlier ones "
                                                                                    "(e.g. the overrides "
                                                                                    "shardlm tune writes)")
    parser.add_argument(
        "--resume",
        help="'auto' (the newest checkpoint of the run directory's run) or a checkpoint "
        "directory; the same as --checkpoint.resume. --resume=auto --run.dir=DIR without --config "
        "continues that run with the settings of its config.json",
    )
    return parser


def parse_args(argv: list[str]) -> tuple[list[str] | None, list[str]]:
    """Split ``argv`` into the config paths and the ``--section.key=value`` overrides."""
    args, overrides = build_parser().parse_known_args(argv)
    if args.resume is not None:
        overrides.append(f"--checkpoint.resume={json.dumps(args.resume)}")  # a TOML basic string
    return args.config, overrides


def _override(overrides: list[str], dotted: str) -> object | None:
    """The value of the last ``--<dotted>=VALUE`` among ``overrides`` (parsed as on the command line),
    or None."""
    values = [parse_cli_value(o.split("=", 1)[1]) for o in overrides if o.startswith(f"--{dotted}=")]
    return values[-1] if values else None


def train_config(config_paths: list[str] | None, overrides: list[str]) -> Config:
    """The run's :class:`Config`: ``load_config(config_paths, overrides)``, except for a resume from the
    run directory.

    With ``checkpoint.resume = auto`` and no config file the base is the run directory's ``config.json`` (the
    run directory from ``--run.dir``, else ``runs/<--run.name>``, else ``runs/default``), and ``overrides``
    apply on top. When that directory holds no ``config.json`` yet and other overrides are given, they alone
    make the config (as before: ``auto`` then starts fresh).

    Raises:
        ConfigError: no config file and the run directory has no readable ``config.json`` (names the path), or
            what :func:`shardlm.config.load_config` raises.
    """
    if config_paths or _override(overrides, "checkpoint.resume") != "auto":
        return load_config(config_paths, overrides)
    run_dir = _override(overrides, "run.dir") or f"runs/{_override(overrides, 'run.name') or 'default'}"
    path = Path(str(run_dir)) / "config.json"
    own = ("--checkpoint.resume=", "--run.dir=", "--run.name=")
    if not path.exists() and any(not o.startswith(own) for o in overrides):
        # no run recorded there yet: the flags alone, as a fresh start takes them
        return load_config(None, overrides)
    recorded = read_json(path, ConfigError, expect=object, message=(
        "--resume=auto without --config resumes the run recorded in {path}, which cannot be read ({cause}): "
        "pass --run.dir=DIR of a run, or --config FILE"))
    if not isinstance(recorded, dict):
        raise ConfigError(f"{path} is not a run's config (not a JSON object): pass --config FILE")
    recorded.pop("run_id", None)
    run = recorded.get("run") if isinstance(recorded.get("run"), dict) else {}
    if not run.get("dir") and Path(str(run_dir)).resolve() == Path(f"runs/{run.get('name')}").resolve():
        # the run's default directory named explicitly: the same setting, not a change
        overrides = [o for o in overrides if not o.startswith("--run.dir=")]
    return load_config(None, overrides, base=recorded, base_name=str(path))


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m shardlm.train``; returns the process exit code (:data:`STOPPED_EXIT_CODE`
    when a signal stopped the run after a checkpoint)."""
    config_path, overrides = parse_args(sys.argv[1:] if argv is None else argv)

    def run() -> int:
        from shardlm.plan.defaults import choose_defaults
        from shardlm.train.trainer import Trainer

        # the settings left "auto" are chosen by the planner (a resumed run keeps its checkpoint's)
        trainer = Trainer(train_config(config_path, overrides), defaults=choose_defaults)
        trainer.train()
        return STOPPED_EXIT_CODE if trainer.preempted else 0

    return run_cli(run)
