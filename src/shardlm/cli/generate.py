"""``shardlm generate``: sample continuations of one or more prompts from a model directory.

One prompt streams its text to the terminal as it is generated; several prompts (repeat
``--prompt``, or ``--prompt-file`` with one prompt per line) run as one batch and are printed
when done, separated by a line of dashes. A row stops at any of the model's end-of-sequence ids
(``config.json`` / ``generation_config.json`` ``eos_token_id``, the tokenizer's ``eos_token``), or
after the first ``--stop`` string it produces (which is not printed). ``--chat`` sends each prompt as
a user message through the model's chat template, with the generation prompt.
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
    g.add_argument("--stop", action="append", default=[], metavar="STRING",
                   help="stop a prompt's generation after this text (repeatable; not printed)")
    g.add_argument("--chat", action="store_true",
                   help="render each prompt as a user message with the model's chat template (generation prompt on)")
    g.add_argument("--system", default=None, help="with --chat: a system message before each prompt")
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


def cut_at_stop(text: str, stops: list[str]) -> tuple[str, bool]:
    """``text`` up to the earliest stop string, and whether one was found."""
    cuts = [text.find(s) for s in stops if s and s in text]
    return (text[:min(cuts)], True) if cuts else (text, False)


def prompt_ids(args: argparse.Namespace, texts: list[str], tok_path: Path) -> list[list[int]]:
    """Token ids of each prompt: the chat template's rendering with ``--chat``, else ``[BOS] + text``
    (BOS as in training data, when the tokenizer has one).

    Raises:
        DataError: the chat template fails on the prompt.
    """
    from shardlm.data import load_tokenizer, special_token_ids

    if args.chat:
        from shardlm.data.chat import ChatTemplate

        chat = ChatTemplate(tok_path)
        system = [{"role": "system", "content": args.system}] if args.system is not None else []
        return [chat.encode(system + [{"role": "user", "content": t}], True, f"prompt {i}")[0]
                for i, t in enumerate(texts)]
    tok = load_tokenizer(str(tok_path))
    bos = special_token_ids(tok).get("bos")
    return [([bos] if bos is not None else []) + tok.encode(t, add_special_tokens=False).ids for t in texts]


def cmd_generate(args: argparse.Namespace, overrides: list[str]) -> None:
    """Load the model and tokenizer, generate, print."""
    import torch

    from shardlm.convert.hf_in import load_model_dir, model_dir_special_ids
    from shardlm.data import load_tokenizer
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
    if any(not s for s in args.stop):
        raise ConfigError("--stop needs a non-empty string")
    if args.system is not None and not args.chat:
        raise ConfigError("--system needs --chat")
    tok_path = Path(args.model) / "tokenizer.json"
    if (Path(args.model) / "config.json").is_file() and not tok_path.is_file():
        raise ModelDirError(f"{args.model}: tokenizer.json not found")
    eos_ids = model_dir_special_ids(args.model)["eos"]  # checked before the weights are read
    model = load_model_dir(args.model, "cuda" if torch.cuda.is_available() else "cpu")
    model.eval()
    tok = load_tokenizer(str(tok_path))
    prompts = prompt_ids(args, texts, tok_path)
    for i, p in enumerate(prompts):
        if len(p) >= model.cfg.max_seq_len:
            raise ConfigError(f"prompt {i} has {len(p)} tokens; the model's context is {model.cfg.max_seq_len} tokens")
    if args.no_cache and len({len(p) for p in prompts}) > 1:
        raise ConfigError("--no-cache needs prompts of equal token length")
    stop = (lambda row, new: cut_at_stop(tok.decode(new), args.stop)[1]) if args.stop else None
    shown_prompt = [tok.decode(p, skip_special_tokens=False) if args.chat else t for p, t in zip(prompts, texts)]
    if len(prompts) == 1:  # stream: print the decoded text as it grows (whole characters only)
        new: list[int] = []
        shown = ""
        hold = max((len(s) for s in args.stop), default=1) - 1  # text that may yet begin a stop string
        print(shown_prompt[0], end="", flush=True)

        def on_token(row: int, token: int) -> None:
            nonlocal shown
            new.append(token)
            text, _ = cut_at_stop(tok.decode(new), args.stop)
            text = text[:len(text) - hold] if hold else text
            if not text.endswith("\ufffd") and text.startswith(shown) and len(text) > len(shown):
                print(text[len(shown):], end="", flush=True)
                shown = text

        out = generate(model, prompts, args.max_new_tokens, sampling, eos_ids, not args.no_cache, on_token, stop)
        rest, _ = cut_at_stop(tok.decode(out[0]), args.stop)
        print(rest[len(shown):] if rest.startswith(shown) else "", flush=True)
        return
    outs = generate(model, prompts, args.max_new_tokens, sampling, eos_ids, not args.no_cache, stop=stop)
    for i, (text, new_ids) in enumerate(zip(shown_prompt, outs)):
        if i:
            print("-" * 40)
        print(text + cut_at_stop(tok.decode(new_ids), args.stop)[0], flush=True)
    sys.stdout.flush()
