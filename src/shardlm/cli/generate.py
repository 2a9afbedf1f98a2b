"""``shardlm generate``: sample continuations of one or more prompts from a model directory.

One prompt streams its text to the terminal as it is generated; several prompts (repeat
``--prompt``, or ``--prompt-file`` with one prompt per line) run as one batch and are printed
when done, separated by a line of dashes.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from shardlm.errors import ConfigError


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register the ``generate`` sub-command."""
    g = sub.add_parser("generate", help="sample text from a trained model directory (KV cache, batched prompts)")
    g.add_argument("--model", required=True, help="model directory (e.g. runs/NAME/final)")
    g.add_argument("--prompt", action="append", default=[], help="text to continue (repeat for a batch); \\n is a line break")
    g.add_argument("--prompt-file", help="a text file with one prompt per line (blank lines skipped; \\n is a line break)")
    g.add_argument("--max-new-tokens", type=int, default=200, help="tokens to generate per prompt")
    g.add_argument("--temperature", type=float, default=0.8, help="0 = greedy")
    g.add_argument("--top-k", type=int, default=50, help="keep the k most likely tokens (0 = all)")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling threshold (1 = off)")
    g.add_argument("--seed", type=int, default=0, help="seed of the sampling generator")
    g.add_argument("--no-cache", action="store_true", help="recompute the whole sequence each step (slow; testing)")
    g.set_defaults(fn=cmd_generate)


def read_prompts(args: argparse.Namespace) -> list[str]:
    """The prompts from ``--prompt`` and ``--prompt-file``, in that order, with each ``\\n`` turned into a line
    break (so a prompt can end with a speaker's name on its own line, as the corpus writes it).

    Raises:
        ConfigError: no prompt at all, an empty prompt, or an unreadable prompt file.
    """
    prompts = list(args.prompt)
    if args.prompt_file:
        try:
            text = Path(args.prompt_file).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError(f"--prompt-file {args.prompt_file}: {e}") from e
        prompts += [line for line in text.splitlines() if line.strip()]
    if not prompts:
        raise ConfigError("no prompts: give --prompt TEXT (repeatable) or --prompt-file FILE")
    for i, p in enumerate(prompts):
        if not p:
            raise ConfigError(f"prompt {i} is empty")
    return [p.replace("\\n", "\n") for p in prompts]


def cmd_generate(args: argparse.Namespace, overrides: list[str]) -> None:
    """Load the model and tokenizer, generate, print."""
    import torch

    from shardlm.convert.hf_in import load_model_dir
    from shardlm.data import load_tokenizer, special_token_ids
    from shardlm.errors import ModelDirError
    from shardlm.model.generate import SamplingConfig, generate

    if overrides:
        raise ConfigError(f"unknown arguments: {' '.join(overrides)}")
    texts = read_prompts(args)
    sampling = SamplingConfig(args.temperature, args.top_k, args.top_p, args.seed)
    try:
        sampling.check()
    except ValueError as e:
        raise ConfigError(str(e)) from e
    if args.max_new_tokens < 1:
        raise ConfigError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    tok_path = Path(args.model) / "tokenizer.json"
    model = load_model_dir(args.model, "cuda" if torch.cuda.is_available() else "cpu")
    if not tok_path.is_file():
        raise ModelDirError(f"{args.model}: tokenizer.json not found")
    model.eval()
    tok = load_tokenizer(str(tok_path))
    ids = special_token_ids(tok)
    prompts = []
    for i, text in enumerate(texts):
        p = tok.encode(text, add_special_tokens=False).ids
        if ids.get("bos") is not None:
            p = [ids["bos"]] + p
        if len(p) >= model.cfg.max_seq_len:
            raise ConfigError(f"prompt {i} has {len(p)} tokens; the model's context is {model.cfg.max_seq_len} tokens")
        prompts.append(p)
    if args.no_cache and len({len(p) for p in prompts}) > 1:
        raise ConfigError("--no-cache needs prompts of equal token length")
    if len(prompts) == 1:  # stream: print the decoded text as it grows (whole characters only)
        new: list[int] = []
        shown = ""
        print(texts[0], end="", flush=True)

        def on_token(row: int, token: int) -> None:
            nonlocal shown
            new.append(token)
            text = tok.decode(new)
            if not text.endswith("\ufffd") and text.startswith(shown):
                print(text[len(shown):], end="", flush=True)
                shown = text

        out = generate(model, prompts, args.max_new_tokens, sampling, ids.get("eod"), not args.no_cache, on_token)
        rest = tok.decode(out[0])
        print(rest[len(shown):] if rest.startswith(shown) else "", flush=True)
        return
    outs = generate(model, prompts, args.max_new_tokens, sampling, ids.get("eod"), not args.no_cache)
    for i, (text, new_ids) in enumerate(zip(texts, outs)):
        if i:
            print("-" * 40)
        print(text + tok.decode(new_ids), flush=True)
    sys.stdout.flush()
