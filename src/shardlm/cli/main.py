"""The ``shardlm`` command: ``prepare`` and ``generate`` (training runs under torchrun: ``-m shardlm.train``)."""

from __future__ import annotations

import argparse
import sys

from shardlm.cli.errors import run_cli


def cmd_prepare(args: argparse.Namespace, overrides: list[str]) -> None:
    from shardlm.config import load_config
    from shardlm.train import data_dir, prepare_data

    cfg = load_config(args.config, overrides)
    meta = prepare_data(cfg)
    print(f"prepared {data_dir(cfg)}: {meta['train_tokens']:,} train / {meta['val_tokens']:,} val tokens "
          f"({meta['dtype']}), tokenizer vocabulary {meta['tokenizer_vocab_size']}, "
          f"unigram entropy {meta['unigram_entropy_nats']:.3f} nats")


def cmd_generate(args: argparse.Namespace, overrides: list[str]) -> None:
    from pathlib import Path

    from shardlm.checkpoint import load_model_dir
    from shardlm.config import ConfigError
    from shardlm.data import load_tokenizer, special_token_ids
    from shardlm.model.generate import sample

    if overrides:
        raise ConfigError(f"unknown arguments: {' '.join(overrides)}")
    model = load_model_dir(args.model)
    tok = load_tokenizer(str(Path(args.model) / "tokenizer.json"))
    ids = special_token_ids(tok)
    prompt = tok.encode(args.prompt).ids
    if not prompt:
        raise ConfigError("--prompt is empty")
    if ids.get("bos") is not None:
        prompt = [ids["bos"]] + prompt
    if len(prompt) >= model.cfg.max_seq_len:
        raise ConfigError(f"the prompt has {len(prompt)} tokens; the model's context is {model.cfg.max_seq_len}")
    new = sample(model, prompt, args.max_new_tokens, args.temperature, args.top_k, ids.get("eod"), args.seed)
    print(args.prompt + tok.decode(new))


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``shardlm`` console script; returns the exit code."""
    parser = argparse.ArgumentParser(prog="shardlm", description="FSDP2 training of Llama-style models. "
                                     "Train with: torchrun --nproc_per_node=N -m shardlm.train --config FILE")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("prepare", help="tokenize a corpus into token-id files (train/val split)")
    p.add_argument("--config", required=True, help="TOML config; its [data] section says what to prepare")
    p.set_defaults(fn=cmd_prepare)
    g = sub.add_parser("generate", help="sample text from a trained model directory")
    g.add_argument("--model", required=True, help="model directory (e.g. runs/NAME/final)")
    g.add_argument("--prompt", required=True, help="text to continue")
    g.add_argument("--max-new-tokens", type=int, default=200)
    g.add_argument("--temperature", type=float, default=0.8)
    g.add_argument("--top-k", type=int, default=50)
    g.add_argument("--seed", type=int, default=0)
    g.set_defaults(fn=cmd_generate)
    from shardlm.cli import plan as plan_cli
    plan_cli.add_parser(sub)
    from shardlm.cli import profile as profile_cli
    profile_cli.add_parser(sub)
    args, overrides = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
    return run_cli(lambda: args.fn(args, overrides))


if __name__ == "__main__":
    raise SystemExit(main())
