"""How a training step runs its micro-batches forward and backward: one after the other on the whole model
(:class:`PlainMicroBatches`), or through pipeline stages by a schedule (:class:`shardlm.train.pipeline.
PipelineMicroBatches`). The step calls one of them whatever the objective; which one is a property of the
parallel layout, chosen when the run is built (:func:`shardlm.train.pipeline.build_micro_batches`)."""

from __future__ import annotations

from typing import Any, Protocol

import torch
from torch import nn

from shardlm.parallel import set_gradient_sync
from shardlm.train.objectives import AuxiliaryTerm, Objective, StepInputs


class MicroBatches(Protocol):
    """What the step needs of its micro-batch runner."""

    holds_loss: bool
    """Whether this rank computes losses (every rank, or under pipeline parallelism the last stage's)."""

    def run(self, objective: Objective, terms: list[AuxiliaryTerm], inputs: StepInputs,
            micro_ids: list[list[int]], scale: float) -> tuple[torch.Tensor, torch.Tensor, list[Any]]:
        """Forward and backward of every micro-batch of ``inputs``, each loss numerator × ``scale`` (plus the
        auxiliary terms) differentiated; gradients accumulate in the parameters. Returns this rank's sum of
        the numerators (0-dim fp64), of the objective's statistic sums ((len(stat_names),) fp64), and each
        term's sums (None where it never ran)."""

    def eval_loss_sum(self, tokens: Any, batch: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The summed token loss of ``batch`` (0-dim fp32, zero where this rank computes none) and its targets
        ((B, T) int64), without gradients: :meth:`TokenObjective.loss_sum`'s result."""


class PlainMicroBatches:
    """The micro-batches one after the other through the whole (sharded) model, with
    ``parallel.grad_sync``'s gradient reduction (:func:`shardlm.parallel.set_gradient_sync`)."""

    holds_loss = True

    def __init__(self, model: nn.Module, grad_sync: str, device: torch.device) -> None:
        self.model, self.grad_sync, self.device = model, grad_sync, device

    def run(self, objective: Objective, terms: list[AuxiliaryTerm], inputs: StepInputs,
            micro_ids: list[list[int]], scale: float) -> tuple[torch.Tensor, torch.Tensor, list[Any]]:
        """See :meth:`MicroBatches.run`."""
        model, device = self.model, self.device
        loss_sum = torch.zeros((), dtype=torch.float64, device=device)
        stats = torch.zeros(len(objective.stat_names), dtype=torch.float64, device=device)
        term_sums: list[torch.Tensor | None] = [None] * len(terms)  # already global (e.g. MoE's)
        for i, (batch, ids) in enumerate(zip(inputs.batches, micro_ids)):
            # parallel.grad_sync: reduce-scatter on every micro-batch or on the last only
            set_gradient_sync(model, last_micro_batch=(i == len(inputs.batches) - 1), policy=self.grad_sync)
            # per block: all-gather shards, compute, reshard; then the loss (chunked: never the whole logits)
            loss, batch_stats = objective.loss(model, batch, ids, inputs)
            if batch_stats is not None:
                stats += batch_stats
            total = loss * scale
            for j, term in enumerate(terms):  # after the forward: e.g. MoE load balancing over all ranks
                value, sums = term(model, len(inputs.batches))
                total = total + value
                term_sums[j] = sums if term_sums[j] is None else term_sums[j] + sums
            total.backward()  # per block: all-gather, grads, reduce-scatter (per grad_sync)
            loss_sum += loss.detach()
        return loss_sum, stats, term_sums

    def eval_loss_sum(self, tokens: Any, batch: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """See :meth:`MicroBatches.eval_loss_sum`."""
        return tokens.loss_sum(self.model, batch)
