"""The token loss of pre-training and supervised fine-tuning: the mean cross-entropy over every target token
of the global batch (instruction data: the response tokens; packed rows: each example's own), computed in
chunks so the whole logits never exist (:func:`shardlm.train.loss.model_loss_sum`)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from shardlm.config import Config
from shardlm.data.instruct import split_batch
from shardlm.data.packing import batch_documents, batch_real_tokens
from shardlm.parallel.cp import ContextParallel
from shardlm.parallel.dist import to_device
from shardlm.train.loss import model_loss_sum
from shardlm.train.objectives.objective import Objective, ObjectiveContext, StepInputs


class TokenObjective(Objective):
    """Next-token cross-entropy, normalised by the global batch's target tokens (counted on the host: every
    rank knows every id of the batch; windows count ``seq_len`` each, instruction examples their precomputed
    response tokens).

    Args:
        cfg: the run's config (``model.attention``, ``train.loss_chunk_tokens``). data: the samples
        (``get(ids)``, ``num_targets(ids)``). cp: the context-parallel group (each rank its sequence chunks).
        device: where the micro-batches go.
    """

    name = "token cross-entropy"

    def __init__(self, cfg: Config, data: Any, cp: ContextParallel, device: torch.device) -> None:
        self.cfg, self.data, self.cp, self.device = cfg, data, cp, device

    @classmethod
    def build(cls, ctx: ObjectiveContext) -> TokenObjective:
        """The run's token objective over its training samples."""
        return cls(ctx.cfg, ctx.train_data, ctx.cp, ctx.info.device)

    def prepare_step(self, step: int, micro_ids: list[list[int]], step_ids: list[int]) -> StepInputs:
        """The micro-batches (pinned, async on CUDA) and the global batch's target tokens."""
        batches = [to_device(self.data.get(ids), self.device) for ids in micro_ids]
        return StepInputs(batches, self.data.num_targets(step_ids))

    def loss(self, model: nn.Module, batch: torch.Tensor, ids: list[int], inputs: StepInputs
             ) -> tuple[torch.Tensor, None]:
        """The summed token loss of this rank's share of the micro-batch (no statistics)."""
        return self.loss_sum(model, batch)[0], None

    def pipeline_batch(self, batch: torch.Tensor
                       ) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        """Inputs, targets and, under block-causal attention, the documents (every stage masks by them)."""
        inputs, targets = split_batch(batch)
        documents = batch_documents(batch) if self.cfg.model.attention == "block_causal" else None
        return inputs, targets, {} if documents is None else {"documents": documents}

    def loss_sum(self, model: nn.Module, batch: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The summed token loss of this rank's share of ``batch`` (its sequence chunks under ``parallel.cp``)
        and the targets it scored: (0-dim fp32, (B, T / cp) int64, -100 where nothing is scored). A mixture of
        experts' router statistics count the batch's real tokens (not padding: :func:`batch_real_tokens`)."""
        inputs, targets = split_batch(batch)  # instruction data: targets are -100 off-response
        real = batch_real_tokens(batch)  # instruction rows' documents channel: only block-causal reads it
        documents = batch_documents(batch) if self.cfg.model.attention == "block_causal" else None
        extra = {} if real is None else {"real_tokens": real}
        if self.cp.size > 1:
            # this rank's head and tail chunks, rotary positions, masks and real tokens by global position
            inputs, targets, extra = self.cp.shard_batch(inputs, targets, documents, real)
            documents = None
        loss = model_loss_sum(model, inputs, targets, self.cfg.train.loss_chunk_tokens, documents, **extra)
        return loss, targets
