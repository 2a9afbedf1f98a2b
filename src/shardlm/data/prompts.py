"""Prompts data: the prompts of online reinforcement learning (``data.format = "prompts"``, the ``[rl]``
objective), each with the fields its reward functions read.

Input: a ``.jsonl`` file (as instruction and preference data), one prompt per line, in TRL's two prompt-only
formats:

* standard: ``{"prompt": str, ...}``: rendered as one ``user`` message (after a ``system`` message when the
  row has a ``"system"`` string), like the instruction path; TRL tokenizes a standard string as raw text,
  shardlm renders every prompt with the chat template so that a chat model sees its own format;
* conversational: ``{"prompt": [{"role", "content"}, ...], ...}``.

Every prompt is rendered with the chat template and the generation prompt
(``apply_chat_template(messages, add_generation_prompt=True)``): the completion is sampled right after it.
The row's other fields (``answer``, ...) are kept, with ``prompt`` as written, in a JSON lines sidecar and
handed to the reward functions as keywords (:mod:`shardlm.rl.rewards`).

Prompts of more than ``rl.max_prompt_length`` tokens are left out at preparation, counted (``meta.json``'s
``skipped_long``, their lines in ``skipped_long_lines``) and printed; ``rl.max_prompt_length`` is part of the
data's identity, so changing it prepares again. Prepared once, by one process: nothing depends on the world
size.

Prepared layout (``"format": "prompts"`` in ``meta.json``): ``<split>.bin`` the rendered prompts' ids back to
back; ``<split>.idx`` int64 (n, 3): start offset, length, JSONL line; ``<split>.fields.jsonl`` one JSON object
per prompt, in the same order: the row's fields (``prompt`` as written included). The last ``max(1, round(n ·
val_fraction))`` prompts are validation.
"""

from __future__ import annotations

import json
import pathlib
import sys
from typing import Any

import numpy as np

from shardlm.atomic import atomic_directory
from shardlm.data.corpus import jsonl_file, jsonl_objects
from shardlm.data.identity import chat_template_identity, corpus_identity, source_identity, tokenizer_identity
from shardlm.data.instruct import open_chat_tokenizer
from shardlm.data.loader import GlobalBatchSampler
from shardlm.data.meta import load_meta, token_dtype
from shardlm.data.tokenizer import special_token_ids
from shardlm.data.tokenizer_files import model_special_ids, write_tokenizer_files
from shardlm.errors import DataError

PROMPTS = "prompts"
"""``meta.json``'s ``format`` of prepared prompts (and ``data.format``'s value)."""

Messages = list[dict[str, str]]


def _messages(row: dict[str, Any], where: str) -> Messages:
    """The messages a row's prompt renders as (module docstring)."""
    prompt = row["prompt"]
    if isinstance(prompt, str):
        if not prompt.strip():
            raise DataError(f"{where}: field 'prompt' is empty")
        system = [{"role": "system", "content": row["system"]}] if isinstance(row.get("system"), str) else []
        return system + [{"role": "user", "content": prompt}]
    if not isinstance(prompt, list) or not prompt or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in prompt):
        raise DataError(f"{where}: field 'prompt' must be a string or a non-empty list of "
                        "{'role': str, 'content': str}")
    return [{"role": m["role"], "content": m["content"]} for m in prompt]


def read_prompts(path: str) -> list[tuple[int, Messages, dict[str, Any]]]:
    """Read a prompts ``.jsonl`` into ``[(line number, messages to render, the row's fields)]``.

    Raises:
        DataError: naming the file and line: the file is missing or not ``.jsonl``, invalid JSON, a row
            without ``prompt``, a prompt neither a non-empty string nor a list of messages, or no prompts.
    """
    p = jsonl_file(path, "prompts data")
    out = []
    for lineno, row in jsonl_objects(p, "a JSON object with 'prompt'"):
        where = f"{path}:{lineno}"
        if "prompt" not in row:
            raise DataError(f"{where}: missing field 'prompt' (prompts data: 'prompt' and the fields the "
                            "reward functions read)")
        out.append((lineno, _messages(row, where), row))
    if not out:
        raise DataError(f"{path}: no prompts")
    return out


def describe_prompts(corpus: str, tokenizer_path: str, vocab_size: int, val_fraction: float,
                     max_prompt_length: int) -> dict[str, Any]:
    """The identity :func:`prepare_prompts` records (:mod:`shardlm.data.identity`): the ``.jsonl``, the
    tokenizer's files, the chat template and the settings that change the prepared data.

    Raises:
        DataError: the file cannot be read here.
    """
    settings = {"data.format": PROMPTS, "data.val_fraction": float(val_fraction),
                "rl.max_prompt_length": int(max_prompt_length),
                "model.vocab_size (token dtype)": token_dtype(vocab_size).name}
    return corpus_identity([source_identity(corpus)], "prompt",
                           tokenizer_identity(tokenizer_path, vocab_size, 0), settings,
                           chat_template=chat_template_identity(tokenizer_path))


def prepare_prompts(corpus: str, out_dir: str, tokenizer_path: str, vocab_size: int, val_fraction: float,
                    max_prompt_length: int, identity: dict[str, Any] | None = None) -> dict[str, Any]:
    """Render and tokenize a prompts ``.jsonl`` into ``out_dir`` (atomically: a failure leaves nothing);
    return the meta.

    Prints one line: prompts per split, and those left out for exceeding ``max_prompt_length`` tokens.

    Raises:
        DataError: bad rows (:func:`read_prompts`), no tokenizer, a tokenizer with more ids than
            ``vocab_size``, a failing chat template, fewer than 2 prompts within ``max_prompt_length``.
    """
    if not tokenizer_path:
        raise DataError("prompts data needs a tokenizer: set data.tokenizer or model.init_from")
    rows = read_prompts(corpus)
    opened, chat = open_chat_tokenizer(tokenizer_path, vocab_size)
    if identity is None:
        identity = describe_prompts(corpus, tokenizer_path, vocab_size, val_fraction, max_prompt_length)
    kept, long_lines = [], []
    for line, messages, fields in rows:
        ids = chat.encode_chat(messages, True, f"{corpus}:{line}").ids
        if len(ids) > max_prompt_length:
            long_lines.append(line)
            continue
        kept.append((line, ids, fields))
    if len(kept) < 2:
        raise DataError(f"{corpus}: {len(kept)} prompt(s) within rl.max_prompt_length = "
                        f"{max_prompt_length} tokens ({len(long_lines)} longer, left out); need at least 2 "
                        "(train and validation)")
    top = max(max(ids) for _, ids, _ in kept)
    if top >= vocab_size:
        raise DataError(f"{chat.files.config_path or tokenizer_path}: a special token is not in "
                        f"{tokenizer_path} (the chat gets id {top}, vocab_size is {vocab_size})")
    n_val = max(1, round(len(kept) * val_fraction))
    dtype = token_dtype(vocab_size)
    out = pathlib.Path(out_dir).expanduser()
    counts: dict[str, int] = {}
    with atomic_directory(out) as tmp:
        for split, part in (("train", kept[:-n_val]), ("val", kept[-n_val:])):
            lengths = np.asarray([len(ids) for _, ids, _ in part], dtype=np.int64)
            starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
            lines = np.asarray([line for line, _, _ in part], dtype=np.int64)
            idx = np.column_stack([starts, lengths, lines])
            np.concatenate([np.asarray(ids, dtype=dtype) for _, ids, _ in part]).tofile(
                tmp / f"{split}.bin")
            idx.astype(np.int64).tofile(tmp / f"{split}.idx")
            sidecar = "".join(json.dumps(fields, ensure_ascii=False) + "\n" for _, _, fields in part)
            (tmp / f"{split}.fields.jsonl").write_text(sidecar, encoding="utf-8")
            counts[split], counts[f"{split}_tokens"] = len(part), int(lengths.sum())
        meta = {"format": PROMPTS, "dtype": dtype.name, "vocab_size": int(vocab_size),
                "tokenizer_vocab_size": int(opened.tokenizer.get_vocab_size()),
                "train_prompts": counts["train"], "val_prompts": counts["val"],
                "train_tokens": counts["train_tokens"], "val_tokens": counts["val_tokens"],
                "max_prompt_length": int(max_prompt_length),
                "skipped_long": len(long_lines), "skipped_long_lines": long_lines[:20], "corpus": corpus,
                "special_ids": special_token_ids(opened.tokenizer),
                "model_special_ids": model_special_ids(opened), "identity": identity}
        write_tokenizer_files(opened, tmp, chat_template=chat.template)
        (tmp / "meta.json").write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
    shown = ", ".join(map(str, long_lines[:5])) + (", ..." if len(long_lines) > 5 else "")
    print(f"prepare: {corpus}: prompts train {counts['train']}, val {counts['val']}; left out "
          f"{len(long_lines)} longer than rl.max_prompt_length = {max_prompt_length} tokens"
          + (f" (lines {shown})" if long_lines else ""), file=sys.stderr, flush=True)
    return meta


class PromptsDataset:
    """The prompts of one split of a prepared prompts directory: token ids by index, and each prompt's fields.

    Attributes: ``meta`` (the directory's ``meta.json``), ``lines`` (int64 (n,), each prompt's JSONL line).

    Raises:
        DataError: not a prepared prompts directory.
    """

    def __init__(self, out_dir: str, split: str) -> None:
        meta = load_meta(out_dir)
        if meta.get("format") != PROMPTS:
            raise DataError(f"{out_dir} is not a prepared prompts directory (format {meta.get('format')!r})")
        root = pathlib.Path(out_dir).expanduser()
        self.meta = meta
        self.tokens = np.fromfile(root / f"{split}.bin", dtype=np.dtype(meta["dtype"]))
        self.idx = np.fromfile(root / f"{split}.idx", dtype=np.int64).reshape(-1, 3)
        self.lines = self.idx[:, 2]
        text = (root / f"{split}.fields.jsonl").read_text(encoding="utf-8")
        self._fields = [json.loads(line) for line in text.splitlines() if line.strip()]
        if len(self._fields) != len(self.idx):
            raise DataError(f"{root / f'{split}.fields.jsonl'}: {len(self._fields)} rows for {len(self.idx)} "
                            "prompts; prepare the data again")

    def __len__(self) -> int:
        """Number of prompts."""
        return len(self.idx)

    def get(self, ids: list[int]) -> list[list[int]]:
        """The rendered prompts ``ids``' token ids (chat template and generation prompt included), each at
        most ``rl.max_prompt_length`` long."""
        out = []
        for i in ids:
            start, length, _ = (int(x) for x in self.idx[i])
            out.append(self.tokens[start:start + length].astype(np.int64).tolist())
        return out

    def fields(self, ids: list[int]) -> list[dict[str, Any]]:
        """The fields of prompts ``ids`` (``prompt`` as written and the others, e.g. ``answer``): what the
        reward functions receive (:func:`shardlm.rl.rewards.score`). Fresh dicts: the caller may change
        them."""
        return [dict(self._fields[i]) for i in ids]


class CompletionSampler(GlobalBatchSampler):
    """The world-size-independent order of the completions of online RL: global batch ``step`` holds the
    ``global_batch_size / num_generations`` prompts that a :class:`GlobalBatchSampler` over the prompts draws
    for its prompt batch :meth:`prompt_batch` (seeded, epoch after epoch), each with its ``num_generations``
    completions. A sample id is a completion id, ``prompt id · G + generation``, so a global batch lists every
    group whole, prompt after prompt; the inherited :meth:`rank_ids` and :meth:`micro_batches` cut it into
    ranks' contiguous shares and micro-batches of completions.

    Several updates per generation batch (TRL 1.16's ``GRPOTrainer``: its ``RepeatSampler`` yields each
    generation batch ``steps_per_generation × num_iterations`` times, ``_prepare_inputs`` samples at every
    ``steps_per_generation × num_iterations``-th step and trains on slice ``step % steps_per_generation``):
    the cycle of ``S × I`` steps starting at step ``c·S·I`` samples prompt batches ``c·S .. c·S + S - 1``
    (one generation batch: TRL's chunk ``c`` of the prompt order) and step ``s`` trains on prompt batch
    ``c·S + s % S``. TRL shuffles the generation batch on each process before slicing it (an order that
    depends on the world size); here slice j is prompt batch ``c·S + j`` as drawn, groups whole.

    Args:
        num_prompts: the training prompts (>= 1). global_batch_size: completions per step, a multiple of
        ``num_generations``. num_generations: G. seed: the order's seed. steps_per_generation: S (>= 1),
        num_iterations: I (>= 1).

    Raises:
        ValueError: ``global_batch_size`` not a multiple of ``num_generations``, S or I < 1, or as
        :class:`GlobalBatchSampler`.
    """

    def __init__(self, num_prompts: int, global_batch_size: int, num_generations: int, seed: int,
                 steps_per_generation: int = 1, num_iterations: int = 1) -> None:
        if num_generations < 1 or global_batch_size % num_generations:
            raise ValueError(f"global_batch_size={global_batch_size} completions is not a whole number of "
                             f"groups of num_generations={num_generations}")
        if steps_per_generation < 1 or num_iterations < 1:
            raise ValueError(f"steps_per_generation={steps_per_generation} and num_iterations="
                             f"{num_iterations} must be >= 1")
        super().__init__(num_prompts, global_batch_size, seed)
        self.num_generations = int(num_generations)
        self.steps_per_generation, self.num_iterations = int(steps_per_generation), int(num_iterations)
        #: optimizer steps per generation batch (TRL's ``generate_every``)
        self.cycle = self.steps_per_generation * self.num_iterations
        self.prompts = GlobalBatchSampler(num_prompts, global_batch_size // num_generations, seed)

    def prompt_batch(self, step: int) -> int:
        """The prompt batch global batch ``step`` trains on: ``(step // (S·I))·S + step % S`` (``step`` at
        S = I = 1)."""
        return step // self.cycle * self.steps_per_generation + step % self.steps_per_generation

    def generation_steps(self, step: int) -> list[int]:
        """The S steps whose global batches make the generation batch of ``step``'s cycle, in slice order:
        ``c0 .. c0 + S - 1`` with ``c0`` the cycle's first step (they hold prompt batches ``c·S + j``)."""
        c0 = step - step % self.cycle
        return list(range(c0, c0 + self.steps_per_generation))

    def epoch_of(self, step: int) -> float:
        """Fractional epoch over the prompts reached at the start of ``step``."""
        return self.prompts.epoch_of(self.prompt_batch(step))

    def step_ids(self, step: int) -> list[int]:
        """Completion ids of global batch ``step``: ``p · G + g`` for each prompt p of its prompt batch
        (:meth:`prompt_batch`), g in 0..G-1."""
        g = self.num_generations
        return [p * g + k for p in self.prompts.step_ids(self.prompt_batch(step)) for k in range(g)]
