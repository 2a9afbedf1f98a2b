"""``shardlm import``: a GGUF file or an HF directory -> an HF model directory to fine-tune from.

``shardlm export`` (all sources, ``--format hf``) lives in cli/checkpoint.py."""

from __future__ import annotations

import argparse


def cmd_import(args: argparse.Namespace, overrides: list[str]) -> None:
    """Convert ``--gguf FILE`` or an HF model directory into ``OUT_DIR``.

    Every failure is one error line: shardlm's own errors as they are, and any other exception raised while
    reading the source (by ``gguf``, ``safetensors`` or ``transformers``) as a ModelDirError naming
    the source.
    """
    from shardlm.errors import USER_ERRORS, ModelDirError

    try:
        _import(args, overrides)
    except (*USER_ERRORS, OSError, ImportError, KeyboardInterrupt):
        raise
    except Exception as e:  # a reader library's own exception on a damaged or unusual source
        source = args.gguf or args.source
        raise ModelDirError(f"{source}: cannot be imported ({type(e).__name__}: "
                            f"{str(e).splitlines()[0] if str(e) else ''})"
                            ) from None


def _import(args: argparse.Namespace, overrides: list[str]) -> None:
    """:func:`cmd_import`'s work."""
    from shardlm.config import ConfigError

    if overrides:
        raise ConfigError(f"unknown arguments: {' '.join(overrides)}")
    if args.gguf:
        if args.source:
            raise ConfigError("give either --gguf FILE or a source directory, not both")
        from shardlm.convert.gguf_in import import_gguf

        try:
            out = import_gguf(args.gguf, args.out_dir)
        except ImportError as e:
            raise ConfigError(f"shardlm import --gguf needs {e.name}: pip install 'shardlm[gguf]'") from None
    else:
        if not args.source:
            raise ConfigError("shardlm import needs --gguf FILE or a source directory: shardlm import SRC "
                              "OUT_DIR")
        from shardlm.convert.hf_out import copy_model_dir

        out = copy_model_dir(args.source, args.out_dir)
    print(f"imported -> {out} (start training from it with --model.init_from={out})")


def add_parsers(sub: argparse._SubParsersAction) -> None:
    """Register ``import`` on the ``shardlm`` command's subparsers; the families it names are the registry's
    (:data:`shardlm.model.families.FAMILIES`), so a new family is listed without an edit here."""
    from shardlm.model.families import FAMILIES  # no torch: the help stays fast

    hf = ", ".join(f.name for f in FAMILIES.values())
    gguf = ", ".join(f.name for f in FAMILIES.values() if f.gguf_architecture)
    p = sub.add_parser("import", help=f"convert a GGUF file (--gguf) or an HF model directory (families: "
                       f"{hf}) into an HF directory to start training from (model.init_from)")
    p.add_argument("source", nargs="?", help="HF model directory (config.json + *.safetensors)")
    p.add_argument("out_dir", help="output directory")
    p.add_argument("--gguf",
                   help=f"GGUF file (families: {gguf}; needs: pip install 'shardlm[gguf]')")
    p.set_defaults(fn=cmd_import)
