"""Knowledge distillation as an objective of the training step (``[distill]``): on instruction data, each
response token's loss mixes a divergence from a frozen teacher with the student's cross-entropy
(:mod:`shardlm.train.distill_loss`), the teacher beside the student (:mod:`shardlm.train.teacher`); the mean
over the global batch's response tokens. Offline only: the responses are the dataset's (GKD's λ = 0)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from shardlm.config import Config
from shardlm.data.instruct import split_batch
from shardlm.data.packing import batch_documents, batch_real_tokens
from shardlm.metrics import format_bytes, local_bytes
from shardlm.parallel.dist import to_device
from shardlm.train.distill_loss import STAT_NAMES
from shardlm.train.objectives.objective import Objective, ObjectiveContext, StepInputs
from shardlm.train.teacher import build_teacher, distill_model_loss_sum, distill_spec


class DistillationObjective(Objective):
    """The distillation loss of a run, normalised by the global batch's response tokens (counted on the host,
    as the token objective's).

    Args:
        cfg: the run's config (``[distill]``, ``model.attention``, ``train.loss_chunk_tokens``). data: the
        instruction samples (``get(ids)``, ``num_targets(ids)``). teacher: the frozen teacher
        (:func:`~shardlm.train.teacher.build_teacher`). device: where the micro-batches go.
    """

    name = "distillation"
    stat_names = STAT_NAMES

    def __init__(self, cfg: Config, data: Any, teacher: nn.Module, device: torch.device) -> None:
        self.cfg, self.data, self.teacher, self.device = cfg, data, teacher, device
        self.spec = distill_spec(cfg)

    @classmethod
    def build(cls, ctx: ObjectiveContext) -> DistillationObjective:
        """The run's objective with its teacher built (FSDP-sharded on the run's mesh: a collective).

        Raises:
            ConfigError: a teacher whose tokenizer differs from the student's.
        """
        return cls(ctx.cfg, ctx.train_data, build_teacher(ctx.cfg, ctx.info, ctx.mesh), ctx.info.device)

    def prepare_step(self, step: int, micro_ids: list[list[int]], step_ids: list[int]) -> StepInputs:
        """The micro-batches (on the device) and the global batch's response tokens."""
        batches = [to_device(self.data.get(ids), self.device) for ids in micro_ids]
        return StepInputs(batches, self.data.num_targets(step_ids))

    def loss(self, model: nn.Module, batch: torch.Tensor, ids: list[int], inputs: StepInputs
             ) -> tuple[torch.Tensor, torch.Tensor]:
        """The summed mixed loss of this rank's micro-batch and its sums of :data:`STAT_NAMES`."""
        tokens, targets = split_batch(batch)
        real = batch_real_tokens(batch)
        documents = batch_documents(batch) if self.cfg.model.attention == "block_causal" else None
        extra = {} if real is None else {"real_tokens": real}
        return distill_model_loss_sum(model, self.teacher, tokens, targets, self.spec,
                                      self.cfg.train.loss_chunk_tokens, documents, **extra)

    def metrics(self, sums: list[float], inputs: StepInputs) -> dict[str, float]:
        """Per response token of the global batch: the divergence (``distill/divergence``: the forward or
        reverse KL or the JSD), the student's and the teacher's cross-entropy."""
        n = inputs.denominator
        return {"distill/divergence": sums[0] / n, "distill/student_ce": sums[1] / n,
                "distill/teacher_ce": sums[2] / n}

    def describe(self) -> str:
        """One line for the run summary."""
        d = self.cfg.distill
        shards = format_bytes(sum(local_bytes(p) for p in self.teacher.parameters()))
        loss = d.loss + (f" (beta {d.beta:g})" if d.loss == "jsd" else "")
        return (f"{loss}, temperature {d.temperature:g}, alpha {d.alpha:g}"
                + (f", top-{d.top_k} teacher tokens" if d.top_k else "")
                + f"; teacher {d.teacher_from} ({shards} of shards on this rank), offline")
