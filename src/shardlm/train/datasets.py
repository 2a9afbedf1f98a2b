"""A run's training and validation data and its sampler, per data format: text windows, instruction examples
(one per sample, or packed into rows), preference pairs, prompts of online RL, or a mixture of text sources
drawn by weight."""

from __future__ import annotations

import math
from typing import Any, NamedTuple

from shardlm.checkpoint.resume_config import BEFORE_RECORDED
from shardlm.config import Config, steps_per_generation
from shardlm.data import GlobalBatchSampler, TokenWindows
from shardlm.data.attention_choice import AUTO, AttentionChoice, choose_attention, may_be_block_causal
from shardlm.data.build import data_dir
from shardlm.data.instruct import InstructionExamples
from shardlm.data.length_groups import LengthGroupedSampler
from shardlm.data.mixture import MixtureSampler, MixtureWindows, source_names
from shardlm.data.packing import DocumentWindows, PackedExamples
from shardlm.data.preference import PREFERENCE, PreferencePairs
from shardlm.data.prompts import PROMPTS, CompletionSampler, PromptsDataset
from shardlm.errors import ConfigError
from shardlm.model.attention import resolve_backend


class RunData(NamedTuple):
    """What a training step and an evaluation read: samples by id, and the ids of each global batch."""

    train: Any
    """The training samples: ``get(ids)``, int64 (len(ids), seq_len + 1) text windows or (len(ids), 2, seq_len
    + 1) tokens and labels (preference pairs: 2·len(ids) rows, chosen then rejected), and
    ``num_targets(ids)``, the target tokens those samples hold (known on the host)."""
    val: Any
    """The validation samples (one per row; the chosen completions of preference pairs; the validation
    prompts of RL, which nothing evaluates)."""
    sampler: GlobalBatchSampler
    """The world-size-independent order of the training samples (:class:`~shardlm.data.mixture.MixtureSampler`
    for a mixture)."""


def row_multiple(cfg: Config) -> int:
    """What the positions of a row padded to its micro-batch's longest are rounded up to:
    ``data.pad_multiple`` (0: no trimming, every row ``seq_len + 1`` tokens), times what the parallel layout
    needs of a row's length: a multiple of ``tp`` (sequence parallel splits the tokens) and, under context
    parallelism, of ``2 · cp · tp`` (two chunks per CP rank, each split by sequence parallel) so no CP
    padding is added."""
    m, p = cfg.data.pad_multiple, cfg.parallel
    if m <= 0:
        return 0
    need = p.tp * (2 * p.cp if p.cp > 1 else 1)
    return m * need // math.gcd(m, need)


def sample_order(cfg: Config, train_data: InstructionExamples | PreferencePairs) -> GlobalBatchSampler:
    """The order of unpacked examples or pairs: grouped by length ``data.group_by_length_steps`` steps at a
    time when set (by each sample's tokens, its longest row's: ``row_lengths()``), else the plain order."""
    t, k = cfg.train, cfg.data.group_by_length_steps
    if not k:
        return GlobalBatchSampler(len(train_data), t.global_batch_size, t.seed)
    return LengthGroupedSampler(train_data.row_lengths(), t.global_batch_size, t.seed, k)


def build_datasets(cfg: Config, meta: dict[str, Any], document_masking: bool) -> RunData:
    """The training and validation data of ``cfg``'s prepared data directory and the sampler over it.

    Args:
        cfg: the run's config (``data.format``, ``data.sources``, ``data.pack``, ``train.seq_len``,
            ``train.global_batch_size``, ``train.seed``).
        meta: the prepared data's ``meta.json`` (its ``special_ids``' ``eod`` cuts documents when the data
            records no document starts).
        document_masking: block-causal attention: text windows then carry their documents
            (:class:`~shardlm.data.packing.DocumentWindows`).
    """
    t = cfg.train
    multiple = row_multiple(cfg)  # unpacked examples and pairs: each micro-batch padded to its longest
    if cfg.data.sources:  # a mixture: one dataset per source, drawn by weight
        names = source_names(cfg.data.sources)
        train_data = MixtureWindows([TokenWindows(str(data_dir(cfg) / n), "train", t.seq_len) for n in names])
        val_data = MixtureWindows([TokenWindows(str(data_dir(cfg) / n), "val", t.seq_len) for n in names],
                                  interleave=True)
        sampler = MixtureSampler([len(w) for w in train_data.windows],
                                 [s.weight for s in cfg.data.sources], t.global_batch_size, t.seed)
    elif cfg.data.format == PREFERENCE:  # pairs: the global batch counts pairs; validation: the chosen's NLL
        train_data = PreferencePairs(str(data_dir(cfg)), "train", t.seq_len, multiple)
        val_data = PreferencePairs(str(data_dir(cfg)), "val", t.seq_len, multiple).chosen_examples()
        sampler = sample_order(cfg, train_data)
    elif cfg.data.format == PROMPTS:  # online RL: the global batch counts completions, G per prompt
        train_data = PromptsDataset(str(data_dir(cfg)), "train")
        val_data = PromptsDataset(str(data_dir(cfg)), "val")  # not evaluated (GRPOObjective.val_loss)
        sampler = CompletionSampler(len(train_data), t.global_batch_size, cfg.rl.num_generations, t.seed,
                                    steps_per_generation(cfg), cfg.rl.num_iterations)
    elif cfg.data.pack:  # rows of several examples (shardlm/data/packing.py); validation stays one per sample
        train_data = PackedExamples(InstructionExamples(str(data_dir(cfg)), "train", t.seq_len,
                                                        skip_untrainable=True), t.seed)
        val_data = InstructionExamples(str(data_dir(cfg)), "val", t.seq_len, pad_multiple=multiple)
        sampler = GlobalBatchSampler(len(train_data), t.global_batch_size, t.seed)
    elif cfg.data.format == "instruct":
        train_data = InstructionExamples(str(data_dir(cfg)), "train", t.seq_len, pad_multiple=multiple)
        val_data = InstructionExamples(str(data_dir(cfg)), "val", t.seq_len, pad_multiple=multiple)
        sampler = sample_order(cfg, train_data)
    else:
        train_data = TokenWindows(str(data_dir(cfg)), "train", t.seq_len)
        val_data = TokenWindows(str(data_dir(cfg)), "val", t.seq_len)
        sampler = GlobalBatchSampler(len(train_data), t.global_batch_size, t.seed)
    if document_masking and cfg.data.format == "text":  # pre-training: document masking inside windows
        eod = (meta.get("special_ids") or {}).get("eod")  # when the data records no document starts
        train_data, val_data = (
            DocumentWindows(d, eod, plain_within_one_document=True) for d in (train_data, val_data)
        )
    return RunData(train_data, val_data, sampler)


def resolve_attention(cfg: Config, resumed: dict[str, Any] | None) -> AttentionChoice:
    """Resolve ``model.attention = "auto"`` once, in place in ``cfg`` (what the run's checkpoints and
    ``config.json`` then record), and return the choice: a resumed run (``resumed``, the checkpoint's config,
    see :meth:`~shardlm.checkpoint.resume.Resuming.resumed_config`) keeps the value it was trained with
    (``causal`` for a checkpoint from before the field existed), a new one takes its data's
    (:func:`~shardlm.data.attention_choice.choose_attention`). A value that is set is kept (a resume that
    changes it is refused later, by the resume rules)."""
    if cfg.model.attention == AUTO and resumed is not None:
        value = (resumed.get("model") or {}).get("attention", BEFORE_RECORDED["model.attention"])
        choice = AttentionChoice(value, "auto: the resumed checkpoint's")
    else:
        choice = choose_attention(cfg)
    cfg.model.attention = choice.attention
    return choice


def training_attention_backend(cfg: Config, device: Any) -> str | None:
    """The kernel block-causal attention trains with on ``device`` (``model.attention_backend`` resolved:
    :func:`shardlm.model.attention.resolve_backend`), or None when the run cannot be block-causal.

    Raises:
        ConfigError: a backend this device or PyTorch lacks, or one that cannot train there (flex on CPU);
            called before any data is prepared, so the refusal comes first."""
    if not may_be_block_causal(cfg):
        return None
    try:
        return resolve_backend(cfg.model.attention_backend, device, training=True)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
