"""``shardlm eval --model DIR --data PATH``: perplexity and mean loss of a model directory on a text.

Runs in one process, or data-parallel under torchrun:
``torchrun --nproc_per_node=N -m shardlm.eval --model DIR --data PATH`` (each rank loads the whole
model and scores its share of the windows; the sums are all-reduced).
"""

from __future__ import annotations

import argparse
import json
import sys

from shardlm.cli.errors import run_cli


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register the ``eval`` sub-command."""
    p = sub.add_parser("eval", help="perplexity and mean loss of a model directory on a text file or corpus")
    _add_arguments(p)
    p.set_defaults(fn=cmd_eval)


def _add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True,
                   help="model directory (config.json, *.safetensors, tokenizer.json)")
    p.add_argument("--data", required=True,
                   help="a .txt/.md/.jsonl file, a directory of them, 'shakespeare', or a "
                                                 "prepared pre-training directory (its validation split)")
    p.add_argument("--batch-size", type=int, default=8, help="windows per forward pass, per rank")
    p.add_argument("--context", type=int, default=None,
                   help="window length in tokens (default: the model's max_seq_len)")
    p.add_argument("--stride", type=int, default=None,
                   help="tokens the window moves each step; each window scores only the tokens the previous "
                        "did not (default: half the window; the window length gives non-overlapping windows)")
    p.add_argument("--attention", choices=("causal", "block_causal"), default="causal",
                   help="block_causal: each document alone (no window reaches into the previous document; "
                        "windows of short documents packed into one row with document masking)")
    p.add_argument("--json", action="store_true", help="print the result as one JSON object")


def cmd_eval(args: argparse.Namespace, overrides: list[str]) -> None:
    """Evaluate and print ``mean loss`` (nats/token) and perplexity on rank 0."""
    from shardlm.config import ConfigError, ParallelConfig
    from shardlm.eval import evaluate_model
    from shardlm.parallel import init_distributed

    if overrides:
        raise ConfigError(f"unknown arguments: {' '.join(overrides)}")
    if args.batch_size < 1:
        raise ConfigError(f"--batch-size must be >= 1, got {args.batch_size}")
    if args.context is not None and args.context < 2:
        raise ConfigError(f"--context must be >= 2 tokens, got {args.context}")
    if args.stride is not None and args.stride < 1:
        raise ConfigError(f"--stride must be >= 1 token, got {args.stride}")
    info = init_distributed(ParallelConfig())
    try:
        result = evaluate_model(args.model, args.data, info, args.batch_size, args.context,
                                stride=args.stride, attention=args.attention)
    except ValueError as e:
        if type(e) is ValueError:  # the evaluator's own checks (context too long...): user input
            raise ConfigError(str(e)) from e
        raise
    if info.is_main:
        out = {"model": args.model, "data": args.data, "mean_loss": result.mean_loss,
               "perplexity": result.perplexity, "tokens": result.tokens, "windows": result.windows,
               "stride": result.stride, "context": result.context, "attention": args.attention,
               "world_size": info.world_size}
        if args.json:
            print(json.dumps(out))
        else:
            print(
                f"{args.data}: mean loss {result.mean_loss:.4f} nats/token, perplexity "
                f"{result.perplexity:.3f} ({result.tokens:,} tokens predicted, "
                f"{_count(result.windows, 'window')} of {result.context} tokens every {result.stride}, "
                + ("each document alone, " if args.attention != "causal" else "")
                + f"{_count(info.world_size, 'rank')})"
            )


def build_parser() -> argparse.ArgumentParser:
    """The parser of ``python -m shardlm.eval`` (under torchrun): the options of ``shardlm eval``."""
    parser = argparse.ArgumentParser(prog="torchrun --nproc_per_node=N -m shardlm.eval",
                                     description="Perplexity of a model directory on a text, split over "
                                                 "ranks.")
    _add_arguments(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m shardlm.eval``; returns the exit code."""
    args, overrides = build_parser().parse_known_args(sys.argv[1:] if argv is None else argv)
    return run_cli(lambda: cmd_eval(args, overrides))


def _count(n: int, noun: str) -> str:
    """``1 window``, ``2 windows``."""
    return f"{n:,} {noun}{'' if n == 1 else 's'}"
