"""Perplexity of a model on a text: a sliding window of the model's context moved by a stride, split over ranks.

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
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from shardlm.config import TrainConfig
from shardlm.convert.hf_in import load_model_dir
from shardlm.data import load_tokenizer, read_documents, special_token_ids
from shardlm.data.instruct import IGNORE_INDEX
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
    stream: list[int] = [] if special_ids.get("bos") is None else [special_ids["bos"]]
    for enc in tokenizer.encode_batch(documents, add_special_tokens=False):
        stream.extend(enc.ids)
        if special_ids.get("eod") is not None:
            stream.append(special_ids["eod"])
    return stream


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
                    context: int | None = None, progress: bool = True, stride: int | None = None) -> EvalResult:
    """Loss sums of ``model`` over ``stream`` (token ids), this rank's windows, all-reduced over ranks.

    Every rank must call it (one all-reduce at the end); the model is a whole, unsharded model on
    ``info.device`` (each rank holds a copy; no collectives run inside the forward). ``context``
    defaults to the model's ``max_seq_len``, ``stride`` to half the context (see
    :func:`strided_windows`). Windows of the full context are batched ``batch_size`` at a time.
    Rank 0 shows its progress with loss and tokens/s (a bar on a terminal, else plain lines).

    Raises:
        ValueError: the stream scores no token, batch_size < 1, or a bad context/stride.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    context = context or model.cfg.max_seq_len
    stride = stride or max(1, context // 2)
    windows = strided_windows(len(stream), context, stride)
    if not windows:
        raise ValueError(f"the text has {len(stream)} tokens: at least 2 are needed to predict one")
    mine = windows[info.rank::info.world_size]
    full = [w for w in mine if w[1] - w[0] == context]
    batches = [full[i:i + batch_size] for i in range(0, len(full), batch_size)]
    batches += [[w] for w in mine if w[1] - w[0] != context]  # the short last window, alone
    data = torch.tensor(stream, dtype=torch.long)
    totals = torch.zeros(2, dtype=torch.float64, device=info.device)
    bar = progress_bar(sum(e - f for _, e, f in mine), "eval", "tok", disable=not (progress and info.is_main))
    start = time.perf_counter()
    for batch in batches:
        tokens = torch.stack([data[b:e] for b, e, _ in batch])
        targets = tokens[:, 1:].clone()
        for row, (b, _, f) in enumerate(batch):  # target j is token b + j + 1: scored from ``first`` on
            targets[row, :f - b - 1] = IGNORE_INDEX
        targets = targets.to(info.device)
        # the chunked loss at train.loss_chunk_tokens' default: never the whole logits (shardlm/train/loss.py)
        loss = model_loss_sum(model, tokens[:, :-1].to(info.device), targets, TrainConfig.loss_chunk_tokens)
        n = int((targets != IGNORE_INDEX).sum())
        totals += torch.stack([loss.double(), torch.tensor(float(n), dtype=torch.float64, device=info.device)])
        bar.update(n)
        bar.set_postfix(loss=f"{(totals[0] / totals[1]).item():.3f}",
                        tok_s=f"{bar.n / max(time.perf_counter() - start, 1e-9):.0f}")
    bar.close()
    all_reduce_sum(totals)
    return EvalResult(loss_sum=totals[0].item(), tokens=int(totals[1].item()), windows=len(windows),
                      context=context, stride=stride)


def evaluate_model(model_dir: str, data: str, info: DistInfo, batch_size: int = 8, context: int | None = None,
                   progress: bool = True, stride: int | None = None) -> EvalResult:
    """Perplexity of the HF-style model directory ``model_dir`` on ``data`` (anything
    :func:`shardlm.data.read_documents` reads), tokenized with the directory's ``tokenizer.json``.

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
    stream = token_stream(read_documents(data), tok, special_token_ids(tok))
    if max(stream) >= model.cfg.vocab_size:
        raise DataError(f"the tokenizer produced id {max(stream)} but the model's vocabulary has "
                        f"{model.cfg.vocab_size} ids")
    if len(stream) < 2:
        raise DataError(f"{data}: {len(stream)} token(s), at least 2 are needed")
    return evaluate_tokens(model, stream, info, batch_size, context, progress, stride)
