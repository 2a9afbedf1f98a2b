"""``shardlm import`` (GGUF file or HF directory -> HF Llama directory) and ``shardlm export --format hf``."""

from __future__ import annotations

import argparse

_DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}


def cmd_import(args: argparse.Namespace, overrides: list[str]) -> None:
    """Convert ``--gguf FILE`` or an HF Llama directory into ``OUT_DIR``."""
    from shardlm.config import ConfigError

    if overrides:
        raise ConfigError(f"unknown arguments: {' '.join(overrides)}")
    if args.gguf:
        if args.source:
            raise ConfigError("give either --gguf FILE or a source directory, not both")
        from shardlm.checkpoint.gguf_import import import_gguf

        try:
            out = import_gguf(args.gguf, args.out_dir)
        except ImportError as e:
            raise ConfigError(f"shardlm import --gguf needs {e.name}: pip install 'shardlm[gguf]'") from None
    else:
        if not args.source:
            raise ConfigError("shardlm import needs --gguf FILE or a source directory: shardlm import SRC OUT_DIR")
        from shardlm.checkpoint.hf_export import copy_model_dir

        out = copy_model_dir(args.source, args.out_dir)
    print(f"imported -> {out} (start training from it with --model.init_from={out})")


def cmd_export(args: argparse.Namespace, overrides: list[str]) -> None:
    """Write a model directory or a run's ``final/`` model as an HF directory that transformers loads."""
    import torch

    from shardlm.checkpoint.hf_export import copy_model_dir
    from shardlm.config import ConfigError

    if overrides:
        raise ConfigError(f"unknown arguments: {' '.join(overrides)}")
    if args.format != "hf":
        raise ConfigError(f"--format {args.format!r} is not supported (only 'hf')")
    dtype = getattr(torch, args.dtype) if args.dtype else None
    out = copy_model_dir(args.source, args.out_dir, dtype)
    print(f"exported -> {out} (transformers: AutoModelForCausalLM.from_pretrained({str(out)!r}))")


def add_parsers(sub: argparse._SubParsersAction) -> None:
    """Register ``import`` and ``export`` on the ``shardlm`` command's subparsers."""
    p = sub.add_parser("import", help="convert a GGUF Llama file (--gguf) or an HF Llama directory into an "
                       "HF Llama directory to start training from (model.init_from)")
    p.add_argument("source", nargs="?", help="HF Llama directory (config.json + *.safetensors)")
    p.add_argument("out_dir", help="output directory")
    p.add_argument("--gguf", help="GGUF Llama file (needs: pip install 'shardlm[gguf]')")
    p.set_defaults(fn=cmd_import)
    e = sub.add_parser("export", help="write a model directory or run directory (runs/NAME -> its final/) "
                       "as a Hugging Face directory")
    e.add_argument("source", help="model directory or run directory")
    e.add_argument("out_dir", help="output directory")
    e.add_argument("--format", default="hf", help="output format: hf (safetensors + config.json + tokenizer)")
    e.add_argument("--dtype", choices=sorted(_DTYPES), help="cast the weights (default: keep the source dtype)")
    e.set_defaults(fn=cmd_export)
