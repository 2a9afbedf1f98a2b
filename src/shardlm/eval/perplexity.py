"""Perplexity of a model on a text: a sliding window of the model's context moved by a stride, split
over ranks.

The text is tokenized as training data is (``BOS doc0 EOD doc1 EOD ...``, see
:func:`shardlm.data.prepare_corpus`). Windows of ``context`` tokens start every ``stride`` tokens
(the last one ends at the end of the text); each window scores only the tokens the previous window
did not reach, so every token after the first is scored exactly once, with at least
``context - stride`` tokens before it (all of them near the start). This is the sliding-window
procedure of the ``transformers`` guide "Perplexity of fixed-length models"; ``stride = context``
gives non-overlapping windows (the first token of each window is then not scored). Window i is
evaluated by rank i mod world size; the per-rank sums of cross-entropy (nats, float64) and token
counts are all-reduced, so the result does not depend on the world size.
Perplexity = exp(total loss / total tokens) (Jelinek et al., 1977).

Under block-causal attention (``shardlm eval --attention block_causal``) each document is evaluated alone:
its own windows, none reaching into the previous document, packed several to a row with a document index
(:func:`evaluate_tokens`).
"""

from __future__ import annotations

import hashlib
import math
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from shardlm.config.auto import FIXED
from shardlm.convert.hf_in import load_model_dir
from shardlm.data import load_tokenizer, read_documents, special_token_ids
from shardlm.data.instruct import IGNORE_INDEX
from shardlm.data.loader import TokenStream
from shardlm.data.packing import best_fit_decreasing
from shardlm.data.prepare import FORMAT, is_prepared, load_meta
from shardlm.errors import DataError, ModelDirError
from shardlm.metrics.progress import progress as progress_bar
from shardlm.model.decoder import CausalLM
from shardlm.parallel import DistInfo, all_reduce_sum
from shardlm.train.loss import model_loss_sum


@dataclass(frozen=True)
class EvalResult:
    """Totals over every rank: ``loss_sum`` (nats), ``tokens`` (predicted tokens), ``windows``; and the
    window length ``context`` and ``stride`` (tokens) used."""

    loss_sum: float
    tokens: int
    windows: int
    context: int = 0
    stride: int = 0

    @property
    def mean_loss(self) -> float:
        """Mean cross-entropy per predicted token, nats."""
        return self.loss_sum / self.tokens

    @property
    def perplexity(self) -> float:
        """exp(mean loss)."""
        return math.exp(self.mean_loss)


def token_stream(documents: list[str], tokenizer, special_ids: dict[str, int | None]) -> list[int]:
    """``BOS doc0 EOD doc1 EOD ...`` token ids, as :func:`shardlm.data.prepare_corpus` builds them.

    BOS is left out when ``special_ids["bos"]`` is None, EOD when ``special_ids["eod"]`` is None.
    """
    return document_stream(documents, tokenizer, special_ids)[0]


def document_stream(
    documents: list[str], tokenizer, special_ids: dict[str, int | None]
) -> tuple[list[int], list[int]]:
    """:func:`token_stream` and where each document starts in it (0 first: BOS belongs to document 0; a
    document's EOD is its last token), as the preparation records them (``meta["document_starts"]``)."""
    stream: list[int] = [] if special_ids.get("bos") is None else [special_ids["bos"]]
    starts = []
    for enc in tokenizer.encode_batch(documents, add_special_tokens=False):
        starts.append(0 if not starts else len(stream))
        stream.extend(enc.ids)
        if special_ids.get("eod") is not None:
            stream.append(special_ids["eod"])
    return stream, starts


def document_windows(
    starts: list[int], n_tokens: int, context: int, stride: int
) -> list[tuple[int, int, int]]:
    """:func:`strided_windows` of each document alone (tokens ``[starts[i], starts[i + 1])``), in stream
    positions: per-document evaluation, where no window reaches into another document and each document's
    first token is not scored."""
    bounds = [*starts, n_tokens]
    return [(s + b, s + e, s + f) for s, t in zip(bounds[:-1], bounds[1:]) if t > s
            for b, e, f in strided_windows(t - s, context, stride)]


def _rows(windows: list[tuple[int, int, int]], context: int, block_causal: bool) -> list[list[int]]:
    """Windows (indices) per forward row: one each, or under block-causal attention packed into rows of
    ``context`` tokens by best-fit decreasing (:func:`shardlm.data.packing.best_fit_decreasing`)."""
    if not block_causal:
        return [[i] for i in range(len(windows))]
    return best_fit_decreasing(np.asarray([e - b for b, e, _ in windows]), context, seed=0)


def strided_windows(n_tokens: int, context: int, stride: int) -> list[tuple[int, int, int]]:
    """``(begin, end, first)`` of each window: tokens [begin, end) go in, tokens [first, end) are scored.

    Windows start at 0, stride, 2·stride, ... and hold up to ``context`` tokens; the last one ends at
    ``n_tokens``. ``first`` is where the previous window ended (never before ``begin + 1``: a window's
    first token has nothing to be predicted from). Windows that score nothing are dropped.

    Raises:
        ValueError: ``context`` < 2, or ``stride`` not in [1, context].
    """
    if context < 2:
        raise ValueError(f"the context must be at least 2 tokens, got {context}")
    if not 1 <= stride <= context:
        raise ValueError(f"the stride must be between 1 and the context ({context}) tokens, got {stride}")
    windows, prev_end = [], 0
    for begin in range(0, n_tokens, stride):
        end = min(begin + context, n_tokens)
        first = max(prev_end, begin + 1)
        if end > first:
            windows.append((begin, end, first))
        prev_end = end
        if end == n_tokens:
            break
    return windows


def context_windows(n_tokens: int, context: int) -> list[tuple[int, int]]:
    """[start, end) of consecutive non-overlapping windows of ``context`` tokens (``stride = context``)."""
    return [(b, e) for b, e, _ in strided_windows(n_tokens, context, context)]


@torch.no_grad()
def evaluate_tokens(model: CausalLM, stream: list[int], info: DistInfo, batch_size: int = 8,
                    context: int | None = None, progress: bool = True, stride: int | None = None,
                    starts: list[int] | None = None) -> EvalResult:
    """Loss sums of ``model`` over ``stream`` (token ids), this rank's windows, all-reduced over ranks.

    Every rank must call it (one all-reduce at the end); the model is a whole, unsharded model on
    ``info.device`` (each rank holds a copy; no collectives run inside the forward). ``context``
    defaults to the model's ``max_seq_len``, ``stride`` to half the context (see
    :func:`strided_windows`). Windows of the full context are batched ``batch_size`` at a time.
    Rank 0 shows its progress with loss and tokens/s (a bar on a terminal, else plain lines).

    ``starts`` (where each document starts, ascending from 0; :func:`document_stream`): per-document
    evaluation under block-causal attention: each document's own windows (:func:`document_windows`), packed
    several to a row of ``context`` tokens with a document index per token, so a window sees only itself. The
    result equals evaluating each document alone (tested within 1e-6) at a fraction of the forward passes.

    Raises:
        ValueError: the stream scores no token, batch_size < 1, or a bad context/stride.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    context = context or model.cfg.max_seq_len
    stride = stride or max(1, context // 2)
    windows = (strided_windows(len(stream), context, stride) if starts is None
               else document_windows(starts, len(stream), context, stride))
    if not windows:
        raise ValueError(f"the text has {len(stream)} tokens: at least 2 are needed to predict one")
    rows = _rows(windows, context, starts is not None)[info.rank::info.world_size]
    if starts is None:
        full = [r for r in rows if sum(windows[i][1] - windows[i][0] for i in r) == context]
        batches = [full[i:i + batch_size] for i in range(0, len(full), batch_size)]
        # the short one
        batches += [[r] for r in rows if sum(windows[i][1] - windows[i][0] for i in r) != context]
    else:  # padding is a document of its own: rows of any length share a batch
        batches = [rows[i:i + batch_size] for i in range(0, len(rows), batch_size)]
    attention, model.cfg.attention = model.cfg.attention, "causal" if starts is None else "block_causal"
    try:
        totals = _score(model, stream, windows, batches, info, progress, rows, starts is not None)
    finally:
        model.cfg.attention = attention  # the caller's model as it was
    all_reduce_sum(totals)
    return EvalResult(loss_sum=totals[0].item(), tokens=int(totals[1].item()), windows=len(windows),
                      context=context, stride=stride)


def _score(model: CausalLM, stream: list[int], windows: list[tuple[int, int, int]],
           batches: list[list[list[int]]], info: DistInfo, progress: bool, rows: list[list[int]],
           documents: bool) -> torch.Tensor:
    """This rank's (loss sum, scored tokens), float64 on ``info.device``, over ``batches`` of rows
    of windows."""
    data = torch.tensor(stream, dtype=torch.long)
    totals = torch.zeros(2, dtype=torch.float64, device=info.device)
    bar = progress_bar(sum(windows[i][1] - windows[i][2] for r in rows for i in r), "eval", "tok",
                       disable=not (progress and info.is_main))
    start = time.perf_counter()
    for batch in batches:
        length = max(sum(windows[i][1] - windows[i][0] for i in r) for r in batch)
        tokens = torch.zeros((len(batch), length), dtype=torch.long)
        document_index = torch.full((len(batch), length), len(windows), dtype=torch.long)  # padding: its own
        targets = torch.full((len(batch), length - 1), IGNORE_INDEX, dtype=torch.long)
        for row, members in enumerate(batch):
            pos = 0
            for d, i in enumerate(members):  # target j is the row's token j + 1: scored from ``first`` on
                b, e, f = windows[i]
                tokens[row, pos:pos + e - b] = data[b:e]
                document_index[row, pos:pos + e - b] = d
                targets[row, pos + f - b - 1:pos + e - b - 1] = data[f:e]
                pos += e - b
        targets = targets.to(info.device)
        docs = document_index[:, :-1].to(info.device) if documents else None
        # the chunked loss at train.loss_chunk_tokens' fixed default: never the whole logits (train/loss.py)
        chunk = FIXED["train.loss_chunk_tokens"]
        loss = model_loss_sum(model, tokens[:, :-1].to(info.device), targets, chunk,
                              docs)
        n = int((targets != IGNORE_INDEX).sum())
        totals += torch.stack(
            [loss.double(), torch.tensor(float(n), dtype=torch.float64, device=info.device)]
        )
        bar.update(n)
        bar.set_postfix(loss=f"{(totals[0] / totals[1]).item():.3f}",
                        tok_s=f"{bar.n / max(time.perf_counter() - start, 1e-9):.0f}")
    bar.close()
    return totals


def prepared_val_stream(data: str, tokenizer_path: Path) -> tuple[list[int], list[int]]:
    """The validation split of the prepared directory ``data`` (token ids) and where its documents start (0
    first: the split may begin inside one), from the preparation's record, else after each
    end-of-document token.

    Raises:
        DataError: the directory was prepared with another ``tokenizer.json`` than ``tokenizer_path``.
    """
    def sha(path: Path) -> str:
        return hashlib.sha256(path.read_bytes()).hexdigest()
    if sha(Path(data) / "tokenizer.json") != sha(Path(tokenizer_path)):
        raise DataError(f"{data} was prepared with another tokenizer.json than the model's "
                        f"({tokenizer_path}): its token ids would mean other tokens; evaluate on the text "
                        "itself, or on data prepared with the model's tokenizer")
    split = TokenStream(data, "val")
    stream = split.read(0, split.num_tokens).astype(np.int64)
    recorded = split.starts_in(0, split.num_tokens)
    if recorded is None:
        eod = (load_meta(data).get("special_ids") or {}).get("eod")
        recorded = np.flatnonzero(stream[:-1] == eod) + 1 if eod is not None else np.zeros(0, dtype=np.int64)
    return stream.tolist(), [0] + [int(i) for i in recorded if i > 0]


def evaluate_model(model_dir: str, data: str, info: DistInfo, batch_size: int = 8, context: int | None = None,
                   progress: bool = True, stride: int | None = None, attention: str = "causal") -> EvalResult:
    """Perplexity of the HF-style model directory ``model_dir`` on ``data`` (anything
    :func:`shardlm.data.read_documents` reads), tokenized with the directory's ``tokenizer.json``, or on the
    validation split of a prepared pre-training directory (:func:`prepared_val_stream`);
    ``attention = "block_causal"``: each document alone (see :func:`evaluate_tokens`' ``starts``).

    Raises:
        ModelDirError: bad model directory or no ``tokenizer.json`` in it.
        DataError: unreadable or empty text; a token id beyond the model's vocabulary.
        ValueError: ``context`` larger than the model's ``max_seq_len`` (see also :func:`evaluate_tokens`).
    """
    tok_path = Path(model_dir) / "tokenizer.json"
    model = load_model_dir(model_dir, info.device)
    if not tok_path.is_file():
        raise ModelDirError(f"{model_dir}: tokenizer.json not found")
    if context is not None and context > model.cfg.max_seq_len:
        raise ValueError(f"context {context} exceeds the model's max_seq_len={model.cfg.max_seq_len}")
    model.eval()
    tok = load_tokenizer(str(tok_path))
    if is_prepared(data) and load_meta(data).get("format") == FORMAT:
        # prepared pre-training data: its val split
        stream, starts = prepared_val_stream(data, tok_path)
    else:
        stream, starts = document_stream(read_documents(data), tok, special_token_ids(tok))
    if max(stream) >= model.cfg.vocab_size:
        raise DataError(f"the tokenizer produced id {max(stream)} but the model's vocabulary has "
                        f"{model.cfg.vocab_size} ids")
    if len(stream) < 2:
        raise DataError(f"{data}: {len(stream)} token(s), at least 2 are needed")
    return evaluate_tokens(model, stream, info, batch_size, context, progress, stride,
                           starts if attention == "block_causal" else None)
