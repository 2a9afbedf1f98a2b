"""``shardlm generate``: sample continuations of one or more prompts from a model directory.

One prompt streams its text to the terminal as it is generated; several prompts (repeat
``--prompt``, or ``--prompt-file`` with one prompt per line) run as one batch and are printed
when done, separated by a line of dashes. A row stops at any of the model's end-of-sequence ids
(``config.json`` / ``generation_config.json`` ``eos_token_id``, the tokenizer's ``eos_token``), or
after the first ``--stop`` string it produces (which is not printed). ``--chat`` sends each prompt as
a user message through the model's chat template, with the generation prompt, and prints only the reply
(``--show-prompt`` prints the rendered prompt before it).

``shardlm chat`` is a conversation on the terminal: each line read from standard input is a user
message; the whole conversation so far (the ``--system`` message, every earlier message and reply) is
rendered with the chat template and the reply streamed until an end-of-sequence id. ``/reset`` clears
the history, ``/exit`` or end of input (Ctrl-D) ends it.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from shardlm.errors import ConfigError


def _sampling_options(p: argparse.ArgumentParser, max_new_tokens: int) -> None:
    """The options ``generate`` and ``chat`` share: the model directory and how tokens are sampled."""
    p.add_argument("--model", required=True, help="model directory (e.g. runs/NAME/final)")
    p.add_argument("--max-new-tokens", type=int, default=max_new_tokens, help="tokens to generate per reply")
    p.add_argument("--temperature", type=float, default=0.8, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=50, help="keep the k most likely tokens (0 = all)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling threshold (1 = off)")
    p.add_argument("--seed", type=int, default=0, help="seed of the sampling generator")


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register the ``generate`` and ``chat`` sub-commands (they share the sampling options)."""
    g = sub.add_parser("generate",
                       help="sample text from a trained model directory (KV cache, batched prompts)")
    _sampling_options(g, 200)
    g.add_argument("--prompt", action="append", default=[],
                   help="text to continue (repeat for a batch); \\n is a line break")
    g.add_argument("--prompt-file",
                   help="a text file with one prompt per line (blank lines skipped; \\n is a line break)")
    g.add_argument("--stop", action="append", default=[], metavar="STRING",
                   help="stop a prompt's generation after this text (repeatable; not printed)")
    g.add_argument("--chat", action="store_true",
                   help="render each prompt as a user message with the model's chat template (generation "
                        "prompt on) and print only the reply")
    g.add_argument("--system", default=None, help="with --chat: a system message before each prompt")
    g.add_argument("--show-prompt", action="store_true",
                   help="with --chat: print the rendered prompt (role headers, special tokens) before the "
                        "reply")
    g.add_argument("--no-cache", action="store_true",
                   help="recompute the whole sequence each step (slow; testing)")
    g.set_defaults(fn=cmd_generate)
    c = sub.add_parser("chat",
                       help="a multi-turn conversation with a model directory, through its chat template")
    _sampling_options(c, 512)
    c.add_argument("--system", default=None, help="a system message at the start of the conversation")
    c.add_argument("--show-prompt", action="store_true",
                   help="print the whole rendered conversation (the model's input) before each reply")
    c.set_defaults(fn=cmd_chat)


def read_prompts(args: argparse.Namespace) -> list[str]:
    """The prompts from ``--prompt`` and ``--prompt-file``, in that order, with each ``\\n`` turned into a
    line break (so a prompt can end with a speaker's name on its own line, as the corpus writes it).

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
        return [
            chat_ids(chat, system + [{"role": "user", "content": t}], f"prompt {i}")
            for i, t in enumerate(texts)
        ]
    tok = load_tokenizer(str(tok_path))
    bos = special_token_ids(tok).get("bos")
    return [([bos] if bos is not None else []) + tok.encode(t, add_special_tokens=False).ids for t in texts]


def chat_ids(chat: object, messages: list[dict[str, str]], where: str) -> list[int]:
    """Token ids of ``messages`` rendered by ``chat`` (a :class:`shardlm.data.chat.ChatTemplate`) with the
    generation prompt: those of transformers' ``apply_chat_template(messages, add_generation_prompt=True)``.

    Raises:
        DataError: the template fails on the messages (``where`` names them).
    """
    return chat.tokenize(chat.render(messages, True, where))[0]


def check_sampling(args: argparse.Namespace, overrides: list[str]):
    """The :class:`~shardlm.model.generate.SamplingConfig` of the command line.

    Raises:
        ConfigError: unknown arguments, bad sampling settings, ``--max-new-tokens`` < 1.
    """
    from shardlm.model.generate import SamplingConfig

    if overrides:
        raise ConfigError(f"unknown arguments: {' '.join(overrides)}")
    sampling = SamplingConfig(args.temperature, args.top_k, args.top_p, args.seed)
    try:
        sampling.check()
    except ValueError as e:
        raise ConfigError(str(e)) from e
    if args.max_new_tokens < 1:
        raise ConfigError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    return sampling


def run_dir_model(path: Path) -> None:
    """Refuse a training run's directory given as ``--model`` (its ``config.json`` is the run's, not a
    model's), naming the model directory to pass: the run's ``final/`` (as Hugging Face's ``from_pretrained``
    and vLLM, shardlm does not guess a subdirectory), or, before the run has finished, ``shardlm export`` of
    its newest checkpoint.

    Raises:
        ModelDirError: ``path`` is a run directory (:func:`shardlm.checkpoint.run.is_run_dir`).
    """
    from shardlm.checkpoint.run import is_run_dir, run_checkpoints, run_dir_run_id
    from shardlm.errors import ModelDirError

    if not is_run_dir(path):
        return
    final, what = path / "final", f"{path} is a training run's directory, not a model directory"
    if (final / "config.json").is_file():
        raise ModelDirError(f"{what}: its trained model is {final}: pass --model {final}")
    saved = run_checkpoints(path / "checkpoints", run_dir_run_id(path))
    if saved:
        raise ModelDirError(f"{what}, and it has no final model yet: export its newest checkpoint with "
                            f"`shardlm export {saved[0].path} OUT` and pass --model OUT")
    raise ModelDirError(f"{what}, and it has no final model or checkpoint yet")


def load_for_generation(model_dir: str):
    """``(model, tokenizer.json path, eos ids)`` of a model directory, the model in eval mode on CUDA when
    there is one.

    Raises:
        ModelDirError: a run directory (:func:`run_dir_model`), no ``tokenizer.json`` beside ``config.json``,
        or an invalid model directory.
    """
    import torch

    from shardlm.convert.hf_in import load_model_dir, model_dir_special_ids
    from shardlm.errors import ModelDirError

    run_dir_model(Path(model_dir))
    tok_path = Path(model_dir) / "tokenizer.json"
    if (Path(model_dir) / "config.json").is_file() and not tok_path.is_file():
        raise ModelDirError(f"{model_dir}: tokenizer.json not found")
    eos_ids = model_dir_special_ids(model_dir)["eos"]  # checked before the weights are read
    model = load_model_dir(model_dir, "cuda" if torch.cuda.is_available() else "cpu")
    model.eval()
    return model, tok_path, eos_ids


def stream(model: object, tok: object, prompt: list[int], max_new_tokens: int, sampling: object,
           eos_ids: object, stops: list[str], use_cache: bool = True) -> str:
    """Generate after one prompt, printing the decoded text as it grows (whole characters only, nothing that
    may yet begin a stop string), then a line break; returns the text up to the first stop string."""
    from shardlm.model.generate import generate

    new: list[int] = []
    shown = ""
    hold = max((len(s) for s in stops), default=1) - 1  # text that may yet begin a stop string

    def on_token(row: int, token: int) -> None:
        nonlocal shown
        new.append(token)
        text, _ = cut_at_stop(tok.decode(new), stops)
        text = text[:len(text) - hold] if hold else text
        if not text.endswith("\ufffd") and text.startswith(shown) and len(text) > len(shown):
            print(text[len(shown):], end="", flush=True)
            shown = text

    stop = (lambda row, ids: cut_at_stop(tok.decode(ids), stops)[1]) if stops else None
    out = generate(model, [prompt], max_new_tokens, sampling, eos_ids, use_cache, on_token, stop)
    rest, _ = cut_at_stop(tok.decode(out[0]), stops)
    print(rest[len(shown):] if rest.startswith(shown) else "", flush=True)
    return rest


def cmd_generate(args: argparse.Namespace, overrides: list[str]) -> None:
    """Load the model and tokenizer, generate, print."""
    from shardlm.data import load_tokenizer
    from shardlm.model.generate import generate

    sampling = check_sampling(args, overrides)
    texts = read_prompts(args)
    if any(not s for s in args.stop):
        raise ConfigError("--stop needs a non-empty string")
    for flag, given in (("--system", args.system is not None), ("--show-prompt", args.show_prompt)):
        if given and not args.chat:
            raise ConfigError(f"{flag} needs --chat")
    model, tok_path, eos_ids = load_for_generation(args.model)
    tok = load_tokenizer(str(tok_path))
    prompts = prompt_ids(args, texts, tok_path)
    for i, p in enumerate(prompts):
        if len(p) >= model.cfg.max_seq_len:
            raise ConfigError(f"prompt {i} has {len(p)} tokens; the model's context is "
                              f"{model.cfg.max_seq_len} tokens")
    if args.no_cache and len({len(p) for p in prompts}) > 1:
        raise ConfigError("--no-cache needs prompts of equal token length")
    if args.chat:  # the reply only, unless the rendered prompt is asked for
        shown_prompt = [tok.decode(p, skip_special_tokens=False) if args.show_prompt else "" for p in prompts]
    else:
        shown_prompt = texts
    if len(prompts) == 1:  # stream: print the decoded text as it grows (whole characters only)
        print(shown_prompt[0], end="", flush=True)
        stream(model, tok, prompts[0], args.max_new_tokens, sampling, eos_ids, args.stop, not args.no_cache)
        return
    stop = (lambda row, new: cut_at_stop(tok.decode(new), args.stop)[1]) if args.stop else None
    outs = generate(model, prompts, args.max_new_tokens, sampling, eos_ids, not args.no_cache, stop=stop)
    for i, (text, new_ids) in enumerate(zip(shown_prompt, outs)):
        if i:
            print("-" * 40)
        print(text + cut_at_stop(tok.decode(new_ids), args.stop)[0], flush=True)
    sys.stdout.flush()


def cmd_chat(args: argparse.Namespace, overrides: list[str]) -> None:
    """A conversation: read user lines from standard input, stream each reply (module docstring).

    Raises:
        ConfigError: bad sampling settings; with standard input not a terminal, a conversation longer than the
            model's context (on a terminal the message is printed and the turn dropped).
        DataError: the chat template fails on the conversation.
    """
    from dataclasses import replace

    from shardlm.data.chat import ChatTemplate

    sampling = check_sampling(args, overrides)
    model, tok_path, eos_ids = load_for_generation(args.model)
    chat = ChatTemplate(tok_path)
    tok = chat.tokenizer
    system = [{"role": "system", "content": args.system}] if args.system is not None else []
    messages = list(system)
    interactive = sys.stdin.isatty()
    if interactive:
        try:
            import readline  # noqa: F401  (line editing and history for input())
        except ImportError:  # pragma: no cover - not on every platform
            pass
        print(f"chat with {args.model} ({chat.source}); /reset clears the history, /exit or Ctrl-D ends",
              file=sys.stderr)
    turn = 0
    while True:
        try:
            line = input("> " if interactive else "")
        except EOFError:
            if interactive:
                print(file=sys.stderr)
            break
        text = line.strip()
        if not text:
            continue
        if text in ("/exit", "/quit"):
            break
        if text == "/reset":
            messages = list(system)
            continue
        messages.append({"role": "user", "content": text})
        ids = chat_ids(chat, messages, f"turn {turn + 1}")
        if len(ids) + 1 > model.cfg.max_seq_len:
            message = (f"the conversation has {len(ids)} tokens and the model's context is "
                       f"{model.cfg.max_seq_len}: nothing can be generated after it")
            if not interactive:
                raise ConfigError(message)
            print(f"error: {message}; /reset starts over", file=sys.stderr)
            messages.pop()
            continue
        if args.show_prompt:
            print(tok.decode(ids, skip_special_tokens=False), end="", flush=True)
        reply = stream(model, tok, ids, args.max_new_tokens, replace(sampling, seed=sampling.seed + turn),
                       eos_ids, [])
        messages.append({"role": "assistant", "content": reply})
        turn += 1
