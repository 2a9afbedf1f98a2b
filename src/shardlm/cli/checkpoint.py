"""``shardlm export SOURCE OUT_DIR`` and ``shardlm inspect CHECKPOINT``: one process, no process group.

``export`` takes a training checkpoint (``runs/NAME/checkpoints/step-N``), a run directory (its
``final/``) or a model directory, and writes a Hugging Face model directory that transformers loads; a LoRA
checkpoint is merged, or written as a PEFT adapter with ``--format peft``.
"""

from __future__ import annotations

import argparse

from shardlm.errors import ConfigError


def add_parsers(sub: argparse._SubParsersAction) -> None:
    """Register the ``export`` and ``inspect`` subcommands on the ``shardlm`` parser."""
    e = sub.add_parser("export", help="write a training checkpoint, run directory or model directory as a "
                       "Hugging Face model directory (safetensors)")
    e.add_argument("source", help="checkpoint (runs/NAME/checkpoints/step-300), run directory "
                   "(runs/NAME -> its final/) or model directory")
    e.add_argument("out_dir", help="output directory (new, or empty; --overwrite replaces an existing one)")
    e.add_argument("--overwrite", action="store_true", help="replace an existing non-empty output directory")
    e.add_argument("--format", default="hf", choices=["hf", "peft"], help="output format: hf (safetensors + "
                   "config.json + tokenizer; a LoRA checkpoint merged) or peft (a LoRA checkpoint's adapter, "
                   "for peft's AutoPeftModelForCausalLM)")
    e.add_argument("--merge-into", choices=["training_base", "original_base"],
                   help="LoRA checkpoint, --format hf: merge into the base as training held it (exact; an "
                   "NF4 base dequantised) or into model.init_from's original weights (approximate for an NF4 "
                   "/ bf16 base); default: the run's lora.merge_into")
    e.add_argument("--dtype", choices=["float32", "bfloat16", "float16"],
                   help="cast the weights of a model directory (default: keep the source dtype)")
    e.set_defaults(fn=cmd_export)
    i = sub.add_parser("inspect",
                       help="show a checkpoint's step, world size, tensors, size and checksum status")
    i.add_argument("checkpoint", help="checkpoint directory")
    i.set_defaults(fn=cmd_inspect)


def cmd_export(args: argparse.Namespace, overrides: list[str]) -> None:
    """Export ``args.source`` to ``args.out_dir``.

    A model directory (``config.json``) or run directory (its ``final/``) is checked and copied
    (optionally cast to ``--dtype``); anything else is treated as a checkpoint, verified against its
    manifest, and its full weights read once.
    """
    from pathlib import Path

    import torch

    from shardlm.convert.hf_out import copy_model_dir
    from shardlm.train.export import export_checkpoint

    if overrides:
        raise ConfigError(f"unknown arguments: {' '.join(overrides)}")
    src, out = Path(args.source), Path(args.out_dir)
    if out.resolve() == src.resolve() or out.resolve() in src.resolve().parents:
        # replacing it would delete src
        raise ConfigError(f"the output directory {out} contains the source {src}: choose another one")
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not args.overwrite:
        raise ConfigError(f"{out} exists and is not empty: choose a new directory or pass --overwrite to "
                          "replace it")
    if (src / "config.json").is_file() or (src / "final" / "config.json").is_file():  # model or run directory
        if args.format != "hf" or args.merge_into:
            raise ConfigError("--format peft and --merge-into export a LoRA checkpoint "
                              f"({src}/checkpoints/step-N); {src} is a model or run directory (a LoRA run's "
                              "adapter is its final-adapter/)")
        out = copy_model_dir(src, args.out_dir, getattr(torch, args.dtype) if args.dtype else None)
    else:  # a checkpoint: verified against its manifest (the error says what is missing)
        if args.dtype:
            raise ConfigError("--dtype applies to model directories; a checkpoint is exported in its own "
                              "dtype")
        out = export_checkpoint(src, args.out_dir, args.format, args.merge_into)
    if args.format == "peft":
        print(f"exported {args.source} -> {out} (PEFT adapter; peft: "
              f"AutoPeftModelForCausalLM.from_pretrained({str(out)!r}))")
        return
    print(f"exported {args.source} -> {out} (transformers: "
          f"AutoModelForCausalLM.from_pretrained({str(out)!r}))")


def cmd_inspect(args: argparse.Namespace, overrides: list[str]) -> int:
    """Print the checkpoint summary; exit code 1 when a checksum fails."""
    from shardlm.checkpoint.inspect import format_inspection, inspect_checkpoint

    if overrides:
        raise ConfigError(f"unknown arguments: {' '.join(overrides)}")
    report = inspect_checkpoint(args.checkpoint)
    print(format_inspection(report))
    return 0 if report["checksums"] == "ok" else 1
