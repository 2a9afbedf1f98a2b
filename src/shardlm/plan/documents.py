"""What packing and block-causal attention change in a step: its useful tokens, its attention FLOPs, its mask.

Read from the config's prepared data when it is there (the planner runs before any training):

* **tokens per step without padding**: packed instruction rows (``data.pack``) carry ``fill`` of their
  ``seq_len + 1`` tokens as examples, the rest padding; unpacked instruction samples one example each;
  pre-training windows are full. ``targets`` are the trained tokens per sample (response tokens; under
  block-causal pre-training every token but each document's first).
* **attention FLOPs**: PaLM's per-token attention term 12·L·H·Q·T (Chowdhery et al. 2022, appendix B; causal
  masking not discounted) counts a sequence of T tokens as T² score and value products. Under block-causal
  attention each document of length n does n² of them alone, so the term is taken at the *attention
  context* ``Σ n² / T`` per sequence (mean over the samples; padding, a document of its own, included):
  T under causal attention, less when a sequence holds several documents. Mistral's and Gemma 3's sliding
  windows are not discounted, as under causal attention.
* **mask memory** (:func:`document_mask_bytes`): the ``sdpa`` backend's dense additive mask.

Without prepared data, the sequences are counted as full (fill 1, context T) and the report says so.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from shardlm.config import Config
from shardlm.data.attention_choice import AUTO, choose_attention
from shardlm.data.build import data_dir
from shardlm.data.instruct import InstructionExamples
from shardlm.data.meta import lacking_document_starts
from shardlm.data.packing import PackedExamples
from shardlm.data.prepare import is_prepared, load_meta
from shardlm.errors import DataError
from shardlm.model.attention import resolve_backend


@dataclass(frozen=True)
class DocumentShape:
    """The samples of a config's prepared training data, as a step sees them (means over all
    train samples)."""

    source: str
    """Where the figures come from (the prepared directory, or that none was found)."""
    samples: int
    """Train samples (packed rows, examples or windows); 0 when the data is not prepared."""
    fill: float
    """Tokens of examples or documents / tokens of the samples (1 for pre-training windows)."""
    targets: float
    """Trained tokens per sample."""
    context: float
    """Attention context per sequence, tokens: Σ n² / T over its documents (T = ``train.seq_len``
    under causal)."""


def window_context(starts: np.ndarray, windows: int, seq_len: int) -> float:
    """Mean Σ n² / T over the first ``windows`` pre-training windows of ``seq_len + 1`` tokens, given the
    stream positions where documents start (int64, ascending; relative to the split); the inputs of a window
    are its first ``seq_len`` tokens, cut at each start inside them."""
    w = seq_len + 1
    starts = np.asarray(starts, dtype=np.int64)
    inner = starts[(starts < windows * w) & (starts % w < seq_len)]
    cuts = np.union1d(inner, np.arange(windows, dtype=np.int64) * w)
    ends = np.minimum(np.append(cuts[1:], windows * w), cuts // w * w + seq_len)
    return float(((ends - cuts).astype(np.float64) ** 2).sum() / (windows * seq_len))


@functools.lru_cache(maxsize=16)
def _shape(out: str, fmt: str, pack: bool, block_causal: bool, seq_len: int, seed: int,
           version: int = 0) -> DocumentShape:
    # version: meta.json's mtime, so that data prepared again is read again
    full = DocumentShape(f"{out} is not prepared: sequences counted as full", 0, 1.0, float(seq_len),
                         float(seq_len))
    if not is_prepared(out):
        return full
    meta = load_meta(out)
    if fmt == "instruct":
        try:
            examples = InstructionExamples(out, "train", seq_len, skip_untrainable=pack)
            row = seq_len + 1
            if not pack:
                placed = np.minimum(np.diff(examples.offsets), row)
                return DocumentShape(f"the examples of {out}", len(examples), float(placed.mean()) / row,
                                     float(examples.target_counts.mean()), float(seq_len))
            packed = PackedExamples(examples, seed)
        except DataError as exc:  # the trainer stops on it too
            return DocumentShape(f"{exc}; sequences counted as full", 0, 1.0, float(seq_len), float(seq_len))
        # as the trainer counts
        context = packed.squared_lengths(range(len(packed))) / (len(packed) * seq_len)
        return DocumentShape(f"the packed rows of {out}", len(packed), packed.fill,
                             float(packed.row_targets.mean()), context)
    windows = int(meta["train_tokens"]) // (seq_len + 1)
    record = meta.get("document_starts")
    if not block_causal or not windows:
        return DocumentShape(f"the windows of {out}", windows, 1.0, float(seq_len), float(seq_len))
    if not isinstance(record, dict):
        return DocumentShape(f"{out} records no document starts: windows counted as full", windows, 1.0,
                             float(seq_len), float(seq_len))
    starts = np.fromfile(f"{out}/{record['file']}", dtype="<i8")
    lost = np.count_nonzero((starts < windows * (seq_len + 1)) & (starts % (seq_len + 1) != 0))  # not targets
    targets = seq_len - lost / windows
    return DocumentShape(f"the document starts of {out}", windows, 1.0, float(targets),
                         window_context(starts, windows, seq_len))


def document_shape(cfg: Config) -> DocumentShape:
    """The :class:`DocumentShape` of ``cfg``'s prepared training data (cached per directory and settings).
    Mixtures (``data.sources``) are counted as full windows."""
    out = str(data_dir(cfg))
    t = cfg.train
    if cfg.data.sources:
        return DocumentShape("a mixture: windows counted as full", 0, 1.0, float(t.seq_len), float(t.seq_len))
    meta = Path(out) / "meta.json"
    version = meta.stat().st_mtime_ns if meta.is_file() else 0
    return _shape(out, cfg.data.format, cfg.data.pack, planned_attention(cfg) == "block_causal", t.seq_len,
                  t.seed, version)


def planned_attention(cfg: Config) -> str:
    """``cfg``'s attention as training resolves it for a new run: ``model.attention``, or for ``auto`` the
    rule of :func:`shardlm.data.attention_choice.choose_attention` on the prepared data (``block_causal`` for
    text data not prepared yet: its preparation records the document starts)."""
    if cfg.model.attention != AUTO or cfg.data.format != "text":  # known from the config alone
        return choose_attention(cfg).attention
    meta = data_dir(cfg) / "meta.json"
    return _text_attention(str(data_dir(cfg)), meta.stat().st_mtime_ns if meta.is_file() else 0)


@functools.lru_cache(maxsize=16)
def _text_attention(out: str, version: int) -> str:  # version: meta.json's mtime, as for _shape
    return "causal" if lacking_document_starts(out) else "block_causal"


def has_documents(cfg: Config) -> bool:
    """Whether ``cfg``'s samples carry documents that block-causal attention masks: pre-training windows or
    packed rows under block-causal attention (:func:`planned_attention`; an unpacked instruction sample is one
    example). False for prepared text windows none of which crosses a document start: the trainer gives those
    to the model as plain windows (causal attention, no mask;
    :class:`shardlm.data.packing.DocumentWindows`)."""
    if planned_attention(cfg) != "block_causal" or (cfg.data.format == "instruct" and not cfg.data.pack):
        return False
    shape = document_shape(cfg)
    return not (cfg.data.format == "text" and shape.samples and shape.context == cfg.train.seq_len)


def attention_context(cfg: Config) -> float:
    """Tokens at which PaLM's attention term counts a sequence: Σ n² / T when the samples carry documents
    (:func:`has_documents`; from the prepared data, :func:`document_shape`), ``train.seq_len`` otherwise."""
    return document_shape(cfg).context if has_documents(cfg) else float(cfg.train.seq_len)


def document_mask_bytes(cfg: Config, compute_bytes: int, device: str) -> int:
    """Bytes of the block-causal masks of one micro-batch on ``device`` (``cpu`` or a GPU), alive from the
    forward to the end of its backward: under the ``sdpa`` backend one additive mask (batch, 1, T, T) in the
    compute dtype per distinct window (Gemma 3: local and global;
    :func:`shardlm.model.attention.additive_mask`); the flex backend's ``BlockMask`` (a few integers per 128 x
    128 block) is counted as 0. 0 without documents (:func:`has_documents`)."""
    if not has_documents(cfg):
        return 0
    model, micro_batch, seq_len = cfg.model, cfg.train.micro_batch_size, cfg.train.seq_len
    try:
        backend = resolve_backend(model.attention_backend, "cpu" if device == "cpu" else "cuda")
    except ValueError:
        backend = "sdpa"
    if backend != "sdpa":
        return 0
    windows = {model.sliding_window if model.is_local(layer) else 0 for layer in range(model.n_layers)}
    return len(windows) * micro_batch * seq_len * seq_len * compute_bytes
