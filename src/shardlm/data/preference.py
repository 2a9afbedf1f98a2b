"""Preference data: pairs of a prompt with a chosen and a rejected completion, for DPO and its relatives.

Input: a ``.jsonl`` file, one pair per line, in the two formats TRL's ``DPOTrainer`` reads:

* standard: ``{"prompt": str, "chosen": str, "rejected": str}``; the strings are turned into a conversation as
  the instruction path does (:mod:`shardlm.data.instruct`): the prompt a ``user`` message, each completion an
  ``assistant`` message (and an optional ``"system"`` string first). Unlike TRL, which tokenizes standard
  strings as raw text, shardlm always renders with the chat template, so a chat model sees its own format;
* conversational: ``prompt`` a list of ``{"role", "content"}`` messages, ``chosen`` / ``rejected`` the
  assistant continuation (a list of messages, usually one ``assistant`` message).

Tokenization follows TRL 1.16's ``DPOTrainer._prepare_dataset`` for conversational data: ``prompt_ids`` =
``apply_chat_template(prompt, add_generation_prompt=True)``, ``prompt + chosen`` and ``prompt + rejected``
rendered whole; the completion starts where the prompt's ids and both whole conversations stop agreeing
(``trl.data_utils.common_prefix_length``), so everything the template prints after the generation prompt
(the reply, its end-of-turn token and any newline after it) is the completion, and is scored.

Truncation (TRL 1.16's rules: ``max_length`` with ``truncation_mode="keep_start"``; TRL 1.16's ``DPOConfig``
has no ``max_prompt_length`` any more, so neither has shardlm): at load, each sequence prompt + completion is
cut to its first ``max_length = train.seq_len + 1`` tokens (the model reads ``seq_len`` of them, as TRL's
model reads ``max_length`` tokens and drops the last position's logits); a pair whose prompt alone has
``max_length`` tokens or more is left out, as TRL's filter does, and counted (:class:`PreferencePairs`).

Chosen identical to rejected (the same completion ids): the pair teaches nothing to DPO and would count in
every average; it is *counted and skipped* at preparation (``meta.json``'s ``skipped_identical``, printed).

Prepared layout (``"format": "preference"`` in ``meta.json``): ``<split>.bin`` the ids of every pair back to
back (prompt, chosen completion, rejected completion), ``<split>.idx`` int64 (n, 5): start offset, prompt,
chosen and rejected lengths, JSONL line. The last ``max(1, round(n · val_fraction))`` pairs are validation.
"""

from __future__ import annotations

import json
import os
import pathlib
import sys
from typing import Any

import numpy as np
import torch

from shardlm.atomic import atomic_directory
from shardlm.data.chat import ChatTemplate
from shardlm.data.corpus import jsonl_file, jsonl_objects
from shardlm.data.identity import chat_template_identity, corpus_identity, source_identity, tokenizer_identity
from shardlm.data.instruct import IGNORE_INDEX, open_chat_tokenizer, row_width
from shardlm.data.prepare import load_meta, token_dtype, unigram_entropy
from shardlm.data.tokenizer import special_token_ids
from shardlm.data.tokenizer_files import model_special_ids, write_tokenizer_files
from shardlm.errors import DataError

PREFERENCE = "preference"
"""``meta.json``'s ``format`` of prepared preference data (and ``data.format``'s value)."""

Messages = list[dict[str, str]]


def _messages(value: Any, where: str, key: str) -> Messages:
    if not isinstance(value, list) or not value or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in value):
        raise DataError(f"{where}: field {key!r} must be a string or a non-empty list of "
                        "{'role': str, 'content': str}")
    return [{"role": m["role"], "content": m["content"]} for m in value]


def read_preferences(path: str) -> list[tuple[int, Messages, Messages, Messages]]:
    """Read a preference ``.jsonl`` into ``[(line number, prompt messages, chosen messages,
    rejected messages)]``.

    Raises:
        DataError: naming the file and line: the file is missing or not ``.jsonl``, invalid JSON, a row
            without ``prompt``, ``chosen`` or ``rejected``, fields of mixed or wrong types, a completion
            without an ``assistant`` message or with empty content, or no pairs at all.
    """
    p = jsonl_file(path, "preference data")
    pairs = []
    for lineno, row in jsonl_objects(p, "a JSON object with 'prompt', 'chosen' and 'rejected'"):
        where = f"{path}:{lineno}"
        missing = [k for k in ("prompt", "chosen", "rejected") if k not in row]
        if missing:
            raise DataError(f"{where}: missing field {' and '.join(map(repr, missing))}: a preference pair "
                            "needs 'prompt', 'chosen' and 'rejected'")
        if all(isinstance(row[k], str) for k in ("prompt", "chosen", "rejected")):
            system = (
                [{"role": "system", "content": row["system"]}] if isinstance(row.get("system"), str) else []
            )
            prompt = system + [{"role": "user", "content": row["prompt"]}]
            chosen = [{"role": "assistant", "content": row["chosen"]}]
            rejected = [{"role": "assistant", "content": row["rejected"]}]
        elif any(isinstance(row[k], str) for k in ("prompt", "chosen", "rejected")):
            raise DataError(f"{where}: 'prompt', 'chosen' and 'rejected' must all be strings or all be "
                            "message lists")
        else:
            prompt, chosen, rejected = (_messages(row[k], where, k) for k in ("prompt", "chosen", "rejected"))
        for key, completion in (("chosen", chosen), ("rejected", rejected)):
            if not any(m["role"] == "assistant" and m["content"].strip() for m in completion):
                raise DataError(f"{where}: field {key!r} has no 'assistant' message with non-empty content")
        pairs.append((lineno, prompt, chosen, rejected))
    if not pairs:
        raise DataError(f"{path}: no preference pairs")
    return pairs


def encode_pair(chat: ChatTemplate, prompt: Messages, chosen: Messages, rejected: Messages,
                where: str = "") -> tuple[list[int], list[int], list[int], bool]:
    """``(prompt_ids, chosen_ids, rejected_ids, prompt_is_prefix)`` of one pair, by TRL 1.16's rule
    (module docstring).

    ``prompt_is_prefix`` is False when the template renders the prompt alone otherwise than followed by a
    completion (the completion then starts where they diverge, as in TRL).

    Raises:
        DataError: the chat template fails on the pair (see :meth:`ChatTemplate.render`).
    """
    prompt_ids = chat.encode_chat(prompt, True, where).ids
    with_chosen = chat.encode_chat(prompt + chosen, False, where).ids
    with_rejected = chat.encode_chat(prompt + rejected, False, where).ids
    n = min(len(os.path.commonprefix([prompt_ids, with_chosen])),
            len(os.path.commonprefix([prompt_ids, with_rejected])))
    return prompt_ids[:n], with_chosen[n:], with_rejected[n:], n == len(prompt_ids)


def describe_preferences(
    corpus: str, tokenizer_path: str, vocab_size: int, val_fraction: float
) -> dict[str, Any]:
    """The identity :func:`prepare_preferences` records (see :mod:`shardlm.data.identity`): the ``.jsonl``,
    the tokenizer's files, the chat template and the settings that change the prepared ids.

    Raises:
        DataError: the file cannot be read here.
    """
    settings = {"data.format": PREFERENCE, "data.val_fraction": float(val_fraction),
                "model.vocab_size (token dtype)": token_dtype(vocab_size).name}
    return corpus_identity([source_identity(corpus)], "prompt/chosen/rejected",
                           tokenizer_identity(tokenizer_path, vocab_size, 0), settings,
                           chat_template=chat_template_identity(tokenizer_path))


def prepare_preferences(corpus: str, out_dir: str, tokenizer_path: str, vocab_size: int, val_fraction: float,
                        identity: dict[str, Any] | None = None) -> dict[str, Any]:
    """Tokenize a preference ``.jsonl`` into ``out_dir`` (atomically: a failure leaves nothing); return
    the meta.

    One process prepares it; the result does not depend on the world size (nor on ``train.seq_len``:
    truncation happens at load). Prints one summary line: pairs per split, pairs skipped as identical, pairs
    whose prompt is not a prefix of the whole conversation.

    Raises:
        DataError: bad rows (see :func:`read_preferences`), no tokenizer, a tokenizer with more ids than
            ``vocab_size``, fewer than 2 pairs left after skipping identical ones, a failing chat template.
    """
    if not tokenizer_path:
        raise DataError("preference data needs a tokenizer: set data.tokenizer or model.init_from")
    rows = read_preferences(corpus)
    opened, chat = open_chat_tokenizer(tokenizer_path, vocab_size)  # read once
    tok = opened.tokenizer
    if identity is None:
        identity = describe_preferences(corpus, tokenizer_path, vocab_size, val_fraction)
    pairs, identical, not_prefix = [], [], 0
    for line, prompt, chosen, rejected in rows:
        p, c, r, is_prefix = encode_pair(chat, prompt, chosen, rejected, f"{corpus}:{line}")
        if c == r:
            identical.append(line)
            continue
        not_prefix += not is_prefix
        pairs.append((line, p, c, r))
    if len(pairs) < 2:
        raise DataError(f"{corpus}: {len(pairs)} usable pair(s) ({len(identical)} skipped: chosen identical "
                        "to rejected); need at least 2 (train and validation)")
    top = max(max(p + c + r) for _, p, c, r in pairs)
    if top >= vocab_size:
        raise DataError(f"{chat.files.config_path or tokenizer_path}: a special token is not in "
                        f"{tokenizer_path} (the chat gets id {top}, vocab_size is {vocab_size})")
    n_val = max(1, round(len(pairs) * val_fraction))
    dtype = token_dtype(vocab_size)
    out = pathlib.Path(out_dir).expanduser()
    counts: dict[str, int] = {}
    with atomic_directory(out) as tmp:
        for split, part in (("train", pairs[:-n_val]), ("val", pairs[-n_val:])):
            lengths = np.asarray([[len(p), len(c), len(r)] for _, p, c, r in part], dtype=np.int64)
            starts = np.concatenate([[0], np.cumsum(lengths.sum(1))[:-1]]).astype(np.int64)
            idx = np.column_stack([starts, lengths, np.asarray([line for line, *_ in part], dtype=np.int64)])
            np.concatenate([np.asarray(p + c + r, dtype=dtype) for _, p, c, r in part]).tofile(
                tmp / f"{split}.bin"
            )
            idx.astype(np.int64).tofile(tmp / f"{split}.idx")
            counts[split] = len(part)
            counts[f"{split}_tokens"] = int(lengths.sum())
        chosen_ids = np.concatenate([np.asarray(c) for _, _, c, _ in pairs[:-n_val]])
        meta = {"format": PREFERENCE, "dtype": dtype.name, "vocab_size": int(vocab_size),
                "tokenizer_vocab_size": int(tok.get_vocab_size()), "train_pairs": counts["train"],
                "val_pairs": counts["val"], "train_tokens": counts["train_tokens"],
                "val_tokens": counts["val_tokens"], "skipped_identical": len(identical),
                "skipped_identical_lines": identical[:20], "prompt_not_prefix": not_prefix, "corpus": corpus,
                "special_ids": special_token_ids(tok), "model_special_ids": model_special_ids(opened),
                "unigram_entropy_nats": unigram_entropy(chosen_ids), "identity": identity}
        write_tokenizer_files(opened, tmp, chat_template=chat.template)
        (tmp / "meta.json").write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
    print(
        f"prepare: {corpus}: preference pairs train {counts['train']}, val {counts['val']}; skipped "
        f"{len(identical)} with chosen identical to rejected"
        + (
            f" (lines {', '.join(map(str, identical[:5]))}{', ...' if len(identical) > 5 else ''})"
            if identical
            else ""
        )
        + (
            f"; {not_prefix} whose prompt the template renders otherwise alone (completion starts where "
            "they diverge, as in TRL)"
            if not_prefix
            else ""
        ),
        file=sys.stderr,
        flush=True,
    )
    return meta


class PreferencePairs:
    """The pairs of one split of a prepared preference directory, truncated by TRL's rule at ``seq_len +
    1`` tokens.

    Attributes: ``dropped`` (pairs left out because the prompt alone fills ``max_length``, their JSONL lines
    in ``dropped_lines``), ``truncated`` (kept pairs with a sequence cut at ``max_length``), ``chosen_counts``
    / ``rejected_counts`` (int64 (n,): scored completion tokens of each kept pair: completion positions
    in 1..seq_len), ``chosen_sequence_counts`` (int64 (n,): next-token targets of each prompt + chosen
    completion, all of its tokens but the first).

    Raises:
        DataError: not a preference directory, or every pair's prompt fills ``max_length``.
    """

    def __init__(self, out_dir: str, split: str, seq_len: int, pad_multiple: int = 0) -> None:
        meta = load_meta(out_dir)
        if meta.get("format") != PREFERENCE:
            raise DataError(f"{out_dir} is not a prepared preference directory (format "
                            f"{meta.get('format')!r})")
        root = pathlib.Path(out_dir).expanduser()
        self.tokens = np.fromfile(root / f"{split}.bin", dtype=np.dtype(meta["dtype"]))
        idx = np.fromfile(root / f"{split}.idx", dtype=np.int64).reshape(-1, 5)
        self.seq_len = seq_len
        max_length = seq_len + 1
        keep = idx[:, 1] < max_length  # TRL: drop a pair whose prompt alone fills max_length
        self.dropped = int((~keep).sum())
        self.dropped_lines = [int(x) for x in idx[~keep, 4]]
        if not keep.any():
            raise DataError(f"{meta['corpus']} ({split}): every prompt fills max_length = train.seq_len + 1 "
                            f"= {max_length} tokens (first at line {self.dropped_lines[0]}); raise "
                            "train.seq_len")
        self.idx = idx[keep]
        prompt, chosen, rejected = self.idx[:, 1], self.idx[:, 2], self.idx[:, 3]
        self.truncated = int(((prompt + np.maximum(chosen, rejected)) > max_length).sum())
        # scored completion tokens: positions max(prompt, 1) .. min(prompt + completion, max_length) - 1
        first = np.maximum(prompt, 1)
        self.chosen_counts = np.minimum(prompt + chosen, max_length) - first
        # next-token targets of prompt + chosen: positions 1 .. min(prompt + chosen, max_length) - 1
        self.chosen_sequence_counts = np.minimum(prompt + chosen, max_length) - 1
        self.rejected_counts = np.minimum(prompt + rejected, max_length) - first
        self.pad = (meta.get("special_ids") or {}).get("eos") or 0
        #: 0: every row ``seq_len + 1`` tokens; N: the rows of one ``get`` padded to their longest
        #: (:func:`~shardlm.data.instruct.row_width`)
        self.pad_multiple = pad_multiple

    def __len__(self) -> int:
        """Number of pairs (after dropping those whose prompt fills ``max_length``)."""
        return len(self.idx)

    def summary(self) -> str:
        """One line: pairs, truncated, dropped (TRL's rules)."""
        return (f"{len(self):,} pairs; {self.truncated} truncated to max_length {self.seq_len + 1} "
                f"(keep_start); {self.dropped} dropped: prompt fills max_length"
                + (f" (lines {', '.join(map(str, self.dropped_lines[:5]))})" if self.dropped else ""))

    def num_chosen_targets(self, ids: list[int], prompt: bool = False) -> int:
        """Scored chosen-completion tokens of pairs ``ids`` or, with ``prompt``, the next-token targets of
        their whole chosen sequences (prompt and completion: every token but the first) (host arithmetic, no
        read of the tokens)."""
        counts = self.chosen_sequence_counts if prompt else self.chosen_counts
        return int(counts[np.asarray(ids, dtype=np.int64)].sum()) if len(ids) else 0

    def row_lengths(self) -> np.ndarray:
        """Tokens of each pair's longer sequence (prompt and the longer completion, cut at ``seq_len + 1``):
        int64 (len(self),), what length-grouped sampling sorts by."""
        return np.minimum(self.idx[:, 1] + np.maximum(self.idx[:, 2], self.idx[:, 3]), self.seq_len + 1)

    def width(self, ids: list[int], rejected: bool = True) -> int:
        """Tokens per row of ``get(ids)`` (chosen and, with ``rejected``, rejected sequences): the longest
        sequence (cut at ``seq_len + 1``) through :func:`~shardlm.data.instruct.row_width` (host
        arithmetic)."""
        rows = self.idx[np.asarray(ids, dtype=np.int64)]
        longest = rows[:, 1] + (np.maximum(rows[:, 2], rows[:, 3]) if rejected else rows[:, 2])
        top = int(min(longest.max(), self.seq_len + 1)) if len(ids) else 1
        return row_width(top, self.seq_len, self.pad_multiple)

    def _row(self, out: torch.Tensor, row: int, start: int, prompt: int, offset: int, length: int) -> None:
        n = min(prompt + length, out.shape[2])
        ids = np.concatenate([self.tokens[start:start + prompt],
                              self.tokens[start + offset:start + offset + length]])
        toks = torch.from_numpy(ids[:n].astype(np.int64))
        out[row, 0, :n] = toks
        out[row, 1, prompt:n] = toks[prompt:]

    def get(self, ids: list[int], rejected: bool = True) -> torch.Tensor:
        """Tokens and labels of pairs ``ids``: int64 (2·len(ids), 2, :meth:`width`), the chosen sequences
        first, then the rejected ones in the same order (TRL's concatenated batch); labels ``IGNORE_INDEX``
        off the completion, tokens padded with ``eos`` (or 0) on the right. Without ``rejected``: the chosen
        rows only, (len(ids), 2, ``width(ids, rejected=False)``)."""
        b = len(ids)
        out = torch.full(((2 if rejected else 1) * b, 2, self.width(ids, rejected)), IGNORE_INDEX,
                         dtype=torch.int64)
        out[:, 0] = self.pad
        for row, i in enumerate(ids):
            start, prompt, chosen, rejected_length, _ = (int(x) for x in self.idx[i])
            self._row(out, row, start, prompt, prompt, chosen)
            if rejected:
                self._row(out, b + row, start, prompt, prompt + chosen, rejected_length)
        return out

    def chosen_examples(self) -> ChosenExamples:
        """This split as instruction examples of the chosen completions (the validation loss: NLL of
        the chosen)."""
        return ChosenExamples(self)


class ChosenExamples:
    """The chosen sequences of :class:`PreferencePairs` as instruction examples (``get`` (B, 2, seq_len + 1),
    ``num_targets``): the validation loss of a preference run is the mean NLL of the chosen completions."""

    def __init__(self, pairs: PreferencePairs) -> None:
        self.pairs = pairs

    def __len__(self) -> int:
        """Number of pairs."""
        return len(self.pairs)

    def num_targets(self, ids: list[int]) -> int:
        """Scored chosen tokens of pairs ``ids``."""
        return self.pairs.num_chosen_targets(ids)

    def width(self, ids: list[int]) -> int:
        """Tokens per row of ``get(ids)``."""
        return self.pairs.width(ids, rejected=False)

    def get(self, ids: list[int]) -> torch.Tensor:
        """Chosen tokens and labels of pairs ``ids``: int64 (len(ids), 2, :meth:`width`)."""
        return self.pairs.get(ids, rejected=False)
