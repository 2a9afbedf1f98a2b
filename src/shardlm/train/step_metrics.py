"""Parts of a step's metrics record that one kind of run adds: a mixture of experts' router losses and tokens per
expert, and a data mixture's tokens and epochs per source. Host arithmetic on values already read."""

from __future__ import annotations

from typing import Any

from shardlm.config import Config
from shardlm.data.mixture import MixtureSampler, source_names
from shardlm.model.config import ModelConfig


def moe_metrics(values: list[float], micro_batches: int, m: ModelConfig, per_layer: bool) -> dict[str, float]:
    """A mixture of experts' record entries: the step's means over its micro-steps, and tokens per expert.

    Args:
        values: summed over the micro-steps, ``[aux loss, z loss, counts...]``, the counts of tokens routed to each
            (MoE layer, expert) pair, layer-major (layers in block order, ``m.n_experts`` each).
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
