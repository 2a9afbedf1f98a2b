"""``shardlm plan``: per-rank peak memory and step time of a config, before launching it; the values a new
run would take for the settings left ``"auto"`` (``shardlm/plan/defaults.py``); when it does not fit, the
combinations of settings that do (``shardlm/plan/search.py``)."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from shardlm.errors import ConfigError

if TYPE_CHECKING:
    from shardlm.config import Config
    from shardlm.train.defaults import DefaultChoice


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register ``plan`` on the ``shardlm`` command's subparsers."""
    p = sub.add_parser(
        "plan", help="predict per-rank peak memory and step time of a config, with the values a new run "
                     "would choose for settings left auto; what fits if it does not"
    )
    p.add_argument("config", nargs="?", help="TOML config (overrides follow as --section.key=value)")
    p.add_argument("--world-size", type=int, help="number of ranks N (required with a config)")
    p.add_argument("--device", default="h100",
                   help="h100 (SXM), h100-pcie, h100-96gb, h200, a100-80gb, b200 or cpu")
    p.add_argument("--headroom", type=float, default=0.05,
                   help="fraction of device memory kept free for allocator fragmentation")
    shape = p.add_mutually_exclusive_group()
    shape.add_argument("--model-preset", metavar="NAME",
                       help="the model shape of a public model (e.g. llama3.1-70b, qwen3-8b, gemma3-27b, "
                            "smollm2-135m; 'list' prints them all), replacing the config's [model] shape "
                            "(and its model.init_from)")
    shape.add_argument("--model-config", metavar="FILE",
                       help="the model shape from a Hugging Face config.json (or a directory holding one), "
                            "replacing the config's [model] shape (and its model.init_from)")
    p.set_defaults(fn=cmd_plan, takes_overrides=True)


def cmd_plan(args: argparse.Namespace, overrides: list[str]) -> None:
    """Print the plan of ``args.config`` at ``--world-size`` on ``--device``.

    Raises:
        ConfigError: a bad world size or headroom, an unknown device or preset, ``--model.*`` overrides
            together with a preset or ``--model-config`` (which replace the config's shape and its
            ``model.init_from``), ``parallel.async_tp`` with ``--device cpu``, a pipeline layout training
            refuses (:func:`shardlm.config.layout.check_pp`).
        ModelDirError: an unreadable ``--model-config`` or a model the decoder does not build.
    """
    if args.model_preset == "list":
        from shardlm.plan.presets import PRESETS, preset_config

        for name, (repo, _) in PRESETS.items():
            m = preset_config(name)
            print(f"{name:<15} {m.family:<8} {m.n_layers:>3} layers, dim {m.dim:>5}  ({repo})")
        return
    if args.config is None or args.world_size is None:
        raise ConfigError("shardlm plan needs a config and --world-size N (or --model-preset list)")
    if args.world_size < 1:
        raise ConfigError(f"--world-size must be >= 1, got {args.world_size}")
    if not 0 <= args.headroom < 1:
        raise ConfigError(f"--headroom must be in [0, 1), got {args.headroom}")
    from shardlm.config import load_config
    from shardlm.plan.devices import get_device
    from shardlm.plan.report import format_plan

    get_device(args.device)
    shape_flag = "--model-preset" if args.model_preset else "--model-config" if args.model_config else None
    if shape_flag:
        given = [o.split("=", 1)[0] for o in overrides if o.startswith("--model.")]
        if given:
            raise ConfigError(f"{' '.join(given)} and {shape_flag} both set the model's shape: give one of "
                              "them")
        from shardlm.plan.presets import config_json_config, preset_config, shape_overrides

        shape = (
            preset_config(args.model_preset) if args.model_preset else config_json_config(args.model_config)
        )
        overrides = shape_overrides(shape) + overrides
    cfg = load_config(args.config, overrides)
    model = (f"{args.model_preset} (--model-preset)" if args.model_preset
             else f"{args.model_config} (--model-config)" if args.model_config else "")
    if cfg.parallel.pp > 1:  # per pipeline rank: its stages' memory, the bubble (shardlm/plan/pipeline.py)
        from shardlm.plan.pipeline import format_pp_plan

        print(format_pp_plan(cfg, args.world_size, args.device, args.headroom, model))
        return
    from shardlm.parallel.dist import check_async_tp_device

    check_async_tp_device(cfg.parallel, "cpu" if args.device == "cpu" else "cuda", "the planned device")
    auto = auto_choices(cfg, args.world_size, args.device)  # resolved in cfg: the plan is of what would run
    notes = [preference_note(cfg)] if cfg.data.format == "preference" else []
    from shardlm.plan.preference import preference_rows

    print(format_plan(preference_rows(cfg), args.world_size, args.device, args.headroom, model, notes, auto))


def auto_choices(cfg: Config, world_size: int, device_name: str) -> list[DefaultChoice]:
    """Resolve ``cfg``'s settings left ``"auto"`` in place as ``shardlm train`` would for a new run of
    ``world_size`` ranks on ``device_name`` (the same chooser, :func:`shardlm.plan.defaults.choose_defaults`,
    printed as the run's summary prints them, :func:`shardlm.train.defaults.describe_defaults`); the
    choices, one per setting left ``"auto"``.

    On a CPU the budget is the RAM available now over the ranks, as at launch; on a GPU the memory of
    ``device_name`` (the trainer reads the GPU's own, a little different on some). A resumed run keeps its
    checkpoint's values instead; the data must be prepared for the choices to count its documents as the
    trainer does (it prepares before choosing).

    Raises:
        ConfigError: an unknown device.
    """
    from functools import partial

    import torch

    from shardlm.parallel.dist import DistInfo
    from shardlm.plan.defaults import choose_defaults
    from shardlm.train.defaults import resolve_defaults

    cpu = device_name == "cpu"
    info = DistInfo(0, 0, world_size, torch.device("cpu" if cpu else "cuda"), "gloo" if cpu else "nccl")
    return resolve_defaults(cfg, None, partial(choose_defaults, device_name=device_name), info)


def preference_note(cfg: Config) -> str:
    """What the plan of a preference config counts (``data.format = "preference"``): both rows of each pair,
    and the reference in the peak (its row of the breakdown, :mod:`shardlm.plan.preference`)."""
    from shardlm.plan.preference import reference_memory

    ref = reference_memory(cfg)
    text = (f"  preference: planned as {2 * cfg.train.micro_batch_size} rows per micro-batch (chosen and "
            f"rejected of {cfg.train.micro_batch_size} pairs); reference: {ref.kind}")
    if ref.live_model:
        text += (", a frozen copy in the peak (its fp32 shards, its final norm + output unsharded after its "
                 "first forward, one group all-gathered at a time in its no-grad forward; no gradients or "
                 "AdamW state)")
    elif cfg.preference.precompute_reference and ref.kind != "none":
        text += (", precomputed: no second model during training (the reference pass runs before step 1); "
                 f"the table in the peak ({ref.table_bytes:,} bytes" + (")" if ref.table_bytes else
                                                                    ", the data not prepared yet)"))
    elif ref.policy_forward:
        text += (": the policy with its adapters off (no second copy; its no-grad forward's transients in "
                 "the plan)")
    return text
