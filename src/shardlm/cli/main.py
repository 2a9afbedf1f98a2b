"""The ``shardlm`` command and its subcommands (``shardlm train`` starts torchrun for ``-m
shardlm.train``)."""

from __future__ import annotations

import argparse
import sys

from shardlm.cli.errors import run_cli


class DefaultsFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Help that ends each option with ``(default: X)``, except flags, options without a default, and help
    texts that already say their default in words."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if action.default is None or action.default is False or action.default == [] or "(default" in text \
                or action.default is argparse.SUPPRESS:
            return text
        return super()._get_help_string(action)


class HelpParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose help shows every option's default (:class:`DefaultsFormatter`)."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("formatter_class", DefaultsFormatter)
        super().__init__(*args, **kwargs)


def cmd_prepare(args: argparse.Namespace, overrides: list[str]) -> None:
    """Prepare the config's data (again when data.dir holds a preparation of other inputs or settings, saying
    what differs); under torchrun every rank takes its share of the pieces."""
    import os

    from shardlm.config import load_config
    from shardlm.data.build import data_dir, prepare_data

    cfg = load_config(args.config, overrides)
    if args.workers is not None:
        if args.workers < 1:
            from shardlm.config import ConfigError

            raise ConfigError(f"--workers must be >= 1, got {args.workers}")
        cfg.data.workers = args.workers
    info = None
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        from shardlm.parallel import init_distributed

        info = init_distributed(cfg.parallel)
    try:
        meta = prepare_data(cfg, info, on_stale="prepare")  # its job: make data.dir what the config describes
    except KeyboardInterrupt:
        raise KeyboardInterrupt(f"{data_dir(cfg)} is unchanged; the pieces encoded so far are kept beside "
                                "it, and the same shardlm prepare continues from them") from None
    if info is None or info.is_main:
        skipped = meta.get("skipped_files") or {}
        print(
            f"prepared {data_dir(cfg)}: {meta['train_tokens']:,} train / {meta['val_tokens']:,} val tokens "
            f"({meta['dtype']}), tokenizer vocabulary {meta['tokenizer_vocab_size']}, "
            f"unigram entropy {meta['unigram_entropy_nats']:.3f} nats"
            + (
                f"; {skipped['count']} files not read: {', '.join(skipped['first'])}"
                + (" ..." if skipped["count"] > len(skipped["first"]) else "")
                if skipped.get("count")
                else ""
            )
        )
        print_data_layout(cfg, meta)


def print_data_layout(cfg, meta: dict) -> None:
    """The preparation summary's packing line (``data.pack``: rows, fill, padding saved at ``train.seq_len``)
    or document line (text data that records its document starts: documents and their mean length)."""
    from shardlm.data.build import data_dir

    if cfg.data.pack:
        from shardlm.data.instruct import InstructionExamples
        from shardlm.data.packing import PackedExamples

        examples = InstructionExamples(str(data_dir(cfg)), "train", cfg.train.seq_len, skip_untrainable=True)
        print(f"  packing   {PackedExamples(examples, cfg.train.seed).summary()}")
    elif (meta.get("document_starts") or {}).get("count"):
        n = int(meta["document_starts"]["count"])
        tokens = int(meta["train_tokens"]) + int(meta["val_tokens"])
        print(f"  documents {n:,} (mean {tokens / n:,.1f} tokens; their starts recorded in "
              f"{meta['document_starts']['file']}, for model.attention = 'block_causal': "
              f"{cfg.train.seq_len / (tokens / n):.3g} documents per window of {cfg.train.seq_len} on "
              "average)")


def build_parser() -> argparse.ArgumentParser:
    """The ``shardlm`` command's parser with every subcommand (imports no torch). A subcommand whose
    parser has the default ``takes_overrides=True`` passes the arguments it does not know to
    :func:`shardlm.config.load_config` as ``--section.key=value`` overrides; the others refuse them."""
    parser = HelpParser(prog="shardlm", description="FSDP2 training of Llama-style models. "
                        "Train with: shardlm train --nproc-per-node N --config FILE "
                        "(or torchrun --nproc_per_node=N -m shardlm.train --config FILE)")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=HelpParser)
    p = sub.add_parser("prepare", help="tokenize a corpus into token-id files (train/val split)")
    p.add_argument("--config", required=True, help="TOML config; its [data] section says what to prepare")
    p.add_argument("--workers", type=int, default=None,
                   help="encoding processes per rank (default data.workers: 0 = the cores this process may "
                        "use); under torchrun (torchrun ... -m shardlm.data --config FILE) every rank takes "
                        "a share")
    p.set_defaults(fn=cmd_prepare, takes_overrides=True)
    from shardlm.cli import checkpoint, eval, generate, launch, plan, pretrained, profile, report, tune

    launch.add_parser(sub)  # train
    generate.add_parser(sub)
    eval.add_parser(sub)
    report.add_parser(sub)
    checkpoint.add_parsers(sub)  # export, inspect
    pretrained.add_parsers(sub)  # import
    plan.add_parser(sub)
    profile.add_parser(sub)
    tune.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``shardlm`` console script; returns the exit code."""
    args, overrides = build_parser().parse_known_args(sys.argv[1:] if argv is None else argv)
    return run_cli(lambda: args.fn(args, overrides))


def entry() -> None:
    """The ``shardlm`` console script: :func:`main`, then :func:`shardlm.parallel.dist.exit_process` when the
    command used it (a process group can only have been started through that module); otherwise a plain exit,
    so that ``shardlm --help`` never imports torch."""
    code = main()
    dist_module = sys.modules.get("shardlm.parallel.dist")
    if dist_module is None:
        sys.exit(code)
    dist_module.exit_process(code)


if __name__ == "__main__":
    entry()
