"""Parts of a step's metrics record: its model FLOPs (block-causal attention counted per document), and what
one kind of run adds: a mixture of experts' router losses and tokens per expert, and a data mixture's tokens
and epochs per source. Host arithmetic on values already read (the FLOPs: on the samples'
document indices)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from shardlm.config import Config
from shardlm.data.mixture import MixtureSampler, source_names
from shardlm.data.packing import DocumentWindows, PackedExamples
from shardlm.metrics import device_memory
from shardlm.metrics.flops import model_flops, squared_document_lengths
from shardlm.metrics.memory import expected_shard_bytes, reset_device_peaks
from shardlm.model.config import ModelConfig


def moe_metrics(values: list[float], micro_batches: int, m: ModelConfig, per_layer: bool) -> dict[str, float]:
    """A mixture of experts' record entries: the step's means over its micro-steps, and tokens per expert.

    Args:
        values: summed over the micro-steps, ``[aux loss, z loss, counts...]``, the counts of tokens routed to
            each (MoE layer, expert) pair, layer-major (layers in block order, ``m.n_experts`` each).
        micro_batches: micro-steps of the step (the losses' sums are divided by it).
        m: the model (which blocks are MoE layers, experts per layer).
        per_layer: ``train.log_moe_layers``: also the min and max over each layer's experts
            (``tokens_per_expert_min/layer<i>``, i the block index).
    """
    counts = values[2:]
    record = {"moe_aux_loss": values[0] / micro_batches, "moe_z_loss": values[1] / micro_batches,
              "tokens_per_expert_min": min(counts), "tokens_per_expert_max": max(counts),
              "tokens_per_expert_mean": sum(counts) / len(counts)}
    if per_layer:  # per MoE layer (block index), min and max over its experts
        layers = [i for i in range(m.n_layers) if m.is_moe_layer(i)]
        for j, i in enumerate(layers):
            row = counts[j * m.n_experts:(j + 1) * m.n_experts]
            record[f"tokens_per_expert_min/layer{i}"] = min(row)
            record[f"tokens_per_expert_max/layer{i}"] = max(row)
    return record


def mixture_metrics(sampler: MixtureSampler, step: int, cfg: Config) -> dict[str, Any]:
    """A data mixture's record entries after ``step`` optimizer steps: per source, the tokens seen so far
    (``tokens_seen/<name>``, windows × ``train.seq_len``) and its own epoch (``epoch/<name>``, windows drawn /
    its windows)."""
    record: dict[str, Any] = {}
    drawn = sampler.drawn_before(step * cfg.train.global_batch_size)
    for name, n, source in zip(source_names(cfg.data.sources), drawn, sampler.sources):
        record[f"tokens_seen/{name}"] = int(n) * cfg.train.seq_len
        record[f"epoch/{name}"] = int(n) / source.num_windows
    return record


def step_shapes(sampler: Any, data: Any, step: int, dp_size: int, micro_batch_size: int,
                rows_per_sample: int, seq_len: int) -> list[tuple[int, int]]:
    """(rows, positions per row) of every micro-batch of global batch ``step`` over all data-parallel ranks,
    as the model computes them: samples padded to their micro-batch's longest (``data.width``: instruction
    examples, preference pairs) have their own width, every other kind ``seq_len`` (host arithmetic: the
    sampler's ids and the samples' lengths, no read of the tokens, no collective)."""
    width = getattr(data, "width", None)
    if width is None:
        return [(len(sampler.step_ids(step)) * rows_per_sample, seq_len)]
    return [(len(ids) * rows_per_sample, width(ids) - 1) for r in range(dp_size)
            for ids in sampler.micro_batches(step, r, dp_size, micro_batch_size)]


def step_model_flops(cfg: Config, data: Any, ids: list[int], rows: int,
                     shapes: list[tuple[int, int]] | None = None) -> int:
    """Model FLOPs of one optimizer step over global batch ``ids`` of ``data`` (the run's training samples),
    all ranks together: :func:`shardlm.metrics.flops.model_flops` of its ``rows`` sequences of
    ``train.seq_len`` tokens (2 per preference pair), Σ n² over the documents of each sequence the model is
    given: ``seq_len²`` each under causal attention (or a sample of one document), each document's length
    squared under block-causal attention (packed rows: each example and the padding, from the rows' lengths;
    windows: cut at each document start, read on the host as the step's target count reads them).
    ``shapes`` (:func:`step_shapes`): the (rows, positions) of each micro-batch when rows are padded to
    their micro-batch's longest; the tokens are then Σ rows·T and the attention Σ rows·T²."""
    t = cfg.train.seq_len
    if shapes is not None and any(width != t for _, width in shapes):
        return model_flops(cfg.model, sum(r * w for r, w in shapes), sum(r * w * w for r, w in shapes))
    squared = rows * t * t
    if cfg.model.attention == "block_causal" and rows == len(ids):
        if isinstance(data, PackedExamples):
            squared = data.squared_lengths(ids)
        elif isinstance(data, DocumentWindows):  # the inputs' documents, as ``get`` numbers them
            squared = squared_document_lengths(data.starts(ids)[:, :t].cumsum(dim=1))
    return model_flops(cfg.model, rows * t, squared)


def per_rank_values(
    model: nn.Module, measured: dict[str, int] | None, device: torch.device
) -> dict[str, int]:
    """This rank's figures for the per-rank summaries of a record: its shard bytes (parameters, gradients,
    AdamW state; ``measured`` at the first step, else the same figure expected from ``model`` before it) and
    its device memory in bytes (on CUDA the peaks since the last record, which are then reset so that the next
    record's peaks cover its own logging interval)."""
    shards = measured or expected_shard_bytes(model)
    out = {"shard_bytes": shards["total"], **device_memory(device)}
    reset_device_peaks(device)
    return out
