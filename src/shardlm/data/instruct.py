"""Instruction data: chat-formatted examples whose loss counts only the response tokens.

Input: a ``.jsonl`` file, one example per line, either ``{"messages": [{"role": ..., "content": ...}, ...]}``
(at least one ``assistant`` message) or ``{"prompt": ..., "response": ...}`` (optionally ``"system"``).
Each example is rendered and tokenized as ``transformers``' ``apply_chat_template`` does, with the
tokenizer's chat template (``chat_template`` in ``tokenizer_config.json`` or ``chat_template.jinja``
beside ``tokenizer.json``; :data:`~shardlm.data.chat.DEFAULT_CHAT_TEMPLATE` otherwise), see
:class:`~shardlm.data.chat.ChatTemplate`. Text the template adds for an assistant turn after the
generation prompt (the reply and its end-of-turn token, not the text printed after that token) is
*response*; everything else is context (:meth:`~shardlm.data.chat.ChatTemplate.encode_chat`: the
template's own ``{% generation %}`` blocks when it has them). ``meta.json``'s ``assistant_turns`` counts,
per split, the assistant turns found and those supervised (also printed).
The tokenizer's files go into the prepared directory, its ``tokenizer_config.json`` with the
template the data was built with.

Prepared layout (beside the usual ``meta.json`` and ``tokenizer.json``, with ``"format": "instruct"``):
``<split>.bin`` token ids of all examples back to back, ``<split>.mask`` one uint8 per token (1 =
response), ``<split>.idx`` int64 (example start offsets, plus the end; then the JSONL line numbers).
A sample is one example, truncated or padded to ``seq_len + 1`` tokens: :meth:`InstructionExamples.get`
returns tokens, labels and documents stacked as (batch, 3, seq_len + 1), labels = token at response positions,
``IGNORE_INDEX`` (-100) elsewhere, documents 0 on the example and :data:`PADDING_DOCUMENT` (-1) on its padding
(the layout of a packed row holding one example, :mod:`shardlm.data.packing`); the trainer takes inputs =
tokens[:, :-1], targets = labels[:, 1:], and the real-token mask from the documents (the router statistics of
a mixture of experts count only real tokens).
The training step divides the summed loss by the number of response targets of the whole global
batch (all micro-batches and ranks), so the loss does not depend on how the batch is split.
"""

from __future__ import annotations

import json
import pathlib
import sys
from typing import Any

import numpy as np
import torch

from shardlm.atomic import atomic_directory
from shardlm.data.chat import ChatTemplate
from shardlm.data.corpus import jsonl_file, jsonl_objects
from shardlm.data.identity import describe_instructions
from shardlm.data.prepare import load_meta, token_dtype, unigram_entropy
from shardlm.data.tokenizer import special_token_ids
from shardlm.data.tokenizer_files import (
    OpenedTokenizer,
    model_special_ids,
    open_tokenizer,
    write_tokenizer_files,
)
from shardlm.errors import DataError

IGNORE_INDEX = -100
#: the document index of padding tokens in a sample's documents channel (``get`` of instruction examples and
#: packed rows): padding is no document, and a mixture of experts' router statistics leave it out
PADDING_DOCUMENT = -1
"""Label of a position that is not trained (PyTorch's ``cross_entropy`` default ``ignore_index``)."""

def row_width(longest: int, seq_len: int, multiple: int) -> int:
    """Tokens per row of a micro-batch padded to its longest sequence: ``T + 1`` where ``T`` (the positions
    the model computes) is the longest sequence's ``longest - 1`` inputs rounded up to a multiple of
    ``multiple``, at most ``seq_len``; ``multiple`` 0 gives ``seq_len + 1`` (every row padded to the full
    sample, the layout before padding to the longest). A ``seq_len`` that is not a multiple is kept as it is
    when the rounding would pass it (it is valid for every parallel layout already).

    Args:
        longest: tokens of the micro-batch's longest row (1..seq_len + 1). seq_len: ``train.seq_len``.
        multiple: >= 0 (:func:`shardlm.train.datasets.row_multiple` makes it: ``data.pad_multiple`` with
            the divisibility context and tensor parallelism need).
    """
    if multiple <= 0:
        return seq_len + 1
    t = -(-max(longest - 1, 1) // multiple) * multiple
    return min(t, seq_len) + 1


def read_instructions(path: str) -> list[tuple[int, list[dict[str, str]]]]:
    """Read a JSONL instruction file into ``[(line number, messages)]``.

    Raises:
        DataError: naming the file, line and field: invalid JSON, neither ``messages`` nor
            ``prompt``/``response``, a message without string ``role``/``content``, no assistant
            message, an empty response, or no examples at all.
    """
    p = jsonl_file(path, "instruction data")
    examples = []
    for lineno, record in jsonl_objects(p, "a JSON object with 'messages' or 'prompt'/'response'"):
        where = f"{path}:{lineno}"
        if "messages" in record:
            messages = record["messages"]
            if not isinstance(messages, list) or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in messages
            ):
                raise DataError(
                    f"{where}: field 'messages' must be a list of {{'role': str, 'content': str}}"
                )
        elif "prompt" in record or "response" in record:
            for key in ("prompt", "response"):
                if not isinstance(record.get(key), str):
                    raise DataError(f"{where}: field {key!r} must be a string")
            messages = (
                [{"role": "system", "content": record["system"]}]
                if isinstance(record.get("system"), str)
                else []
            ) + [
                {"role": "user", "content": record["prompt"]},
                {"role": "assistant", "content": record["response"]},
            ]
        else:
            raise DataError(f"{where}: missing field 'messages' (or 'prompt' and 'response')")
        replies = [m for m in messages if m["role"] == "assistant"]
        if not replies or not any(m["content"].strip() for m in replies):
            raise DataError(f"{where}: no response: the example needs an 'assistant' message (or 'response') "
                            "with non-empty content")
        examples.append((lineno, messages))
    if not examples:
        raise DataError(f"{path}: no instruction examples")
    return examples



def open_chat_tokenizer(tokenizer_path: str, vocab_size: int) -> tuple[OpenedTokenizer, ChatTemplate]:
    """The tokenizer at ``tokenizer_path``, read once, and its chat template, for chat-formatted data.

    Raises:
        DataError: the tokenizer has more tokens than ``vocab_size`` (the model's embedding must hold every
            id); the errors of :func:`~shardlm.data.tokenizer_files.open_tokenizer` and :class:`ChatTemplate`.
    """
    opened = open_tokenizer(tokenizer_path)
    n = opened.tokenizer.get_vocab_size()
    if n > vocab_size:
        raise DataError(f"tokenizer has {n} tokens but vocab_size is {vocab_size}: the model's "
                        "embedding must hold every token id")
    return opened, ChatTemplate(opened)

def prepare_instructions(corpus: str, out_dir: str, tokenizer_path: str, vocab_size: int,
                         val_fraction: float, identity: dict[str, Any] | None = None) -> dict[str, Any]:
    """Tokenize an instruction ``.jsonl`` into ``out_dir`` (atomically); return the meta dict.

    The last ``max(1, round(n · val_fraction))`` examples are the validation split. ``meta["identity"]``
    records what the data is made from: ``identity`` when given (the caller's, taken before reading), else
    :func:`shardlm.data.identity.describe_instructions` of these arguments.

    Raises:
        DataError: bad data (see :func:`read_instructions`), no tokenizer, a tokenizer with more ids
            than ``vocab_size``, fewer than 2 examples, a chat template that fails (see
            :meth:`shardlm.data.chat.ChatTemplate.encode_chat`: naming the JSONL line, e.g. an assistant
            turn that cannot be located), a special token the tokenizer lacks.
    """
    if not tokenizer_path:
        raise DataError("instruction tuning needs a tokenizer: set data.tokenizer or model.init_from")
    examples = read_instructions(corpus)
    if len(examples) < 2:
        raise DataError(f"{corpus}: {len(examples)} example(s); need at least 2 (train and validation)")
    opened, chat = open_chat_tokenizer(tokenizer_path, vocab_size)  # read once, handed to every step below
    tok = opened.tokenizer
    if identity is None:
        identity = describe_instructions(corpus, tokenizer_path, vocab_size, val_fraction)
    chats = [(line, chat.encode_chat(msgs, False, f"{corpus}:{line}")) for line, msgs in examples]
    encoded = [(line, c.ids, c.mask) for line, c in chats]
    top = max(max(ids) for _, ids, _ in encoded)
    if top >= vocab_size:  # a special token of tokenizer_config.json that tokenizer.json lacks gets a new id
        raise DataError(f"{chat.files.config_path or tokenizer_path}: a special token is not in "
                        f"{tokenizer_path} (the chat gets id {top}, vocab_size is {vocab_size})")
    n_val = max(1, round(len(encoded) * val_fraction))
    turns = {split: {"found": sum(c.turns for _, c in part), "supervised": sum(c.supervised for _, c in part)}
             for split, part in (("train", chats[:-n_val]), ("val", chats[-n_val:]))}
    dtype = token_dtype(vocab_size)
    out = pathlib.Path(out_dir).expanduser()
    counts = {}
    response = np.zeros(0, dtype=np.int64)
    with atomic_directory(out) as tmp:  # a failure never leaves a half-written out_dir
        for split, part in (("train", encoded[:-n_val]), ("val", encoded[-n_val:])):
            offsets = np.cumsum([0] + [len(ids) for _, ids, _ in part]).astype(np.int64)
            np.concatenate([np.asarray(ids, dtype=dtype) for _, ids, _ in part]).tofile(tmp / f"{split}.bin")
            mask = np.concatenate([np.asarray(m, dtype=np.uint8) for _, _, m in part])
            mask.tofile(tmp / f"{split}.mask")
            np.concatenate([offsets, np.asarray([line for line, _, _ in part], dtype=np.int64)]).tofile(
                tmp / f"{split}.idx")
            counts[split] = int(offsets[-1])
            if split == "train":
                response = np.concatenate([np.asarray(ids)[np.asarray(m, dtype=bool)] for _, ids, m in part])
        meta = {"format": "instruct", "dtype": dtype.name, "vocab_size": int(vocab_size),
                "tokenizer_vocab_size": int(tok.get_vocab_size()), "train_tokens": counts["train"],
                "val_tokens": counts["val"], "train_examples": len(encoded) - n_val, "val_examples": n_val,
                "corpus": corpus, "special_ids": special_token_ids(tok),
                "model_special_ids": model_special_ids(opened),
                "unigram_entropy_nats": unigram_entropy(response), "assistant_turns": turns,
                "identity": identity}
        write_tokenizer_files(opened, tmp, chat_template=chat.template)  # the template trained with
        (tmp / "meta.json").write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
    unsupervised = sum(t["found"] - t["supervised"] for t in turns.values())
    print(
        f"prepare: {corpus}: assistant turns found / supervised: "
        + ", ".join(f"{split} {t['found']} / {t['supervised']}" for split, t in turns.items())
        + (f" ({unsupervised} left out by the template's {{% generation %}} blocks)" if unsupervised else ""),
        file=sys.stderr,
        flush=True,
    )
    return meta


class InstructionExamples:
    """The examples of one split of a prepared instruction directory, each one sample of ``seq_len +
    1`` tokens.

    Longer examples are truncated; shorter ones padded (pad token = ``eos`` or 0, label -100).

    ``pad_multiple``: 0 pads every sample to ``seq_len + 1`` tokens; N > 0 pads the examples of one ``get``
    to their longest, rounded up to a multiple of N inputs (:func:`row_width`).

    ``skip_untrainable``: an example with no response token inside its first ``seq_len + 1`` tokens gets
    ``target_counts`` 0 instead of an error (packing leaves it out and counts it:
    :mod:`shardlm.data.packing`).

    Raises:
        DataError: not an instruction directory, or (unless ``skip_untrainable``) an example with no response
            token inside its first ``seq_len + 1`` tokens (names the JSONL line: shorten it or
            raise ``train.seq_len``).
    """

    def __init__(self, out_dir: str, split: str, seq_len: int, skip_untrainable: bool = False,
                 pad_multiple: int = 0) -> None:
        meta = load_meta(out_dir)
        if meta.get("format") != "instruct":
            raise DataError(f"{out_dir} is not a prepared instruction directory")
        root = pathlib.Path(out_dir).expanduser()
        self.tokens = np.fromfile(root / f"{split}.bin", dtype=np.dtype(meta["dtype"]))
        self.mask = np.fromfile(root / f"{split}.mask", dtype=np.uint8)
        idx = np.fromfile(root / f"{split}.idx", dtype=np.int64)
        n = (len(idx) - 1) // 2
        self.offsets, self.lines = idx[:n + 1], idx[n + 1:]
        self.seq_len = seq_len
        self.pad_multiple = pad_multiple
        self.pad = (meta.get("special_ids") or {}).get("eos") or 0
        #: tokens of each example as a sample holds them (cut at seq_len + 1), int64 (n,)
        self.lengths = np.minimum(np.diff(self.offsets), seq_len + 1)
        # response tokens at positions 1..seq_len of each example: the targets the loss counts (int64, (n,))
        self.target_counts = np.zeros(n, dtype=np.int64)
        for i in range(n):  # the first target is position 1: a response token must fall in 1..seq_len
            start, end = int(self.offsets[i]), int(self.offsets[i + 1])
            self.target_counts[i] = int(np.count_nonzero(self.mask[start + 1:min(end, start + seq_len + 1)]))
            if not self.target_counts[i] and not skip_untrainable:
                raise DataError(f"{meta['corpus']}:{int(self.lines[i])}: no response token within the first "
                                f"{seq_len + 1} tokens (train.seq_len={seq_len}); shorten the prompt or "
                                "raise seq_len")

    def __len__(self) -> int:
        """Number of examples."""
        return len(self.offsets) - 1

    def num_targets(self, ids: list[int]) -> int:
        """Target tokens (response tokens within positions 1..seq_len) of examples ``ids``, from counts made
        once at load: every rank can count a whole global batch on the host, without reading the examples."""
        return int(self.target_counts[np.asarray(ids, dtype=np.int64)].sum()) if len(ids) else 0

    def row_lengths(self) -> np.ndarray:
        """Tokens of each example as a row holds them (cut at ``seq_len + 1``): int64 (len(self),), what
        length-grouped sampling sorts by."""
        return self.lengths

    def width(self, ids: list[int]) -> int:
        """Tokens per row of ``get(ids)``: :func:`row_width` of their longest example (host arithmetic)."""
        longest = int(self.lengths[np.asarray(ids, dtype=np.int64)].max()) if len(ids) else 1
        return row_width(longest, self.seq_len, self.pad_multiple)

    def get(self, ids: list[int]) -> torch.Tensor:
        """Tokens, labels and documents of examples ``ids``: int64 (len(ids), 3, :meth:`width`), labels -100
        off-response, documents 0 on the example's tokens and :data:`PADDING_DOCUMENT` on its padding (width
        ``seq_len + 1`` when ``pad_multiple`` is 0)."""
        out = torch.full((len(ids), 3, self.width(ids)), IGNORE_INDEX, dtype=torch.int64)
        out[:, 0] = self.pad
        out[:, 2] = PADDING_DOCUMENT
        for row, i in enumerate(ids):
            start = int(self.offsets[i])
            end = min(int(self.offsets[i + 1]), start + self.seq_len + 1)
            toks = torch.from_numpy(self.tokens[start:end].astype(np.int64))
            keep = torch.from_numpy(self.mask[start:end].astype(bool))
            out[row, 0, :end - start] = toks
            out[row, 1, :end - start] = torch.where(keep, toks, IGNORE_INDEX)
            out[row, 2, :end - start] = 0
        return out


def split_batch(batch: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets) of a batch: (B, T+1) token windows -> next tokens; (B, 2 or 3, T+1) -> the labels
    row.

    Returns two (B, T) int64 tensors; targets hold ``IGNORE_INDEX`` where nothing is trained.
    """
    if batch.dim() == 3:
        return batch[:, 0, :-1], batch[:, 1, 1:]
    return batch[:, :-1], batch[:, 1:]
