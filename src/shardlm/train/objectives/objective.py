"""The interface between the training step and what it optimises.

The step (:meth:`shardlm.train.trainer.Trainer.train_step`) runs the same algorithm for every objective:

1. ``inputs = objective.prepare_step(step, micro_ids, step_ids)``: the micro-batches on the device and the
   global batch's *denominator* (its target tokens, pairs or sequences), known on every rank before any
   micro-batch runs. It runs on every rank, in the same order, once per step, so it may run collectives:
   the token and preference objectives run none (their denominators are host counts); online RL
   (``grpo.py``) samples its completions there (the rollout: one all-gather per FSDP group) and all-gathers
   them (one all-gather) so that every rank scores the whole global batch;
2. per micro-batch: ``numerator, sums = objective.loss(model, batch, ids, inputs)``, plus each
   :class:`AuxiliaryTerm`; ``(numerator · N / denominator + terms).backward()`` (N the ranks that FSDP
   averages gradients over);
3. one all-reduce (the gradient norm's) that also carries the numerators' and ``sums``' totals, the update,
   and, on logging steps, one host read: ``loss = Σ numerators / denominator`` and
   ``objective.metrics(sums, inputs)``.

Because the denominator is the whole global batch's, N ranks compute the same update as one process that
sees the global batch at once. An objective adds itself to a run in one file: a subclass of
:class:`Objective` (and, for the built-in ones, a line in :func:`shardlm.train.objectives.build_objective`;
the Python API also takes a factory, ``Trainer(cfg, objective=...)``). Besides the calls above, the run reads
three class attributes: ``rows_per_sample`` (throughput and MFU), ``progress_keys`` (record entries the
console's progress line shows) and ``val_loss`` (False: evaluation, the token loss on the validation samples,
is skipped).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from shardlm.checkpoint.rank_state import RankState
from shardlm.config import Config
from shardlm.errors import CheckpointError, ConfigError
from shardlm.parallel.cp import ContextParallel
from shardlm.parallel.dist import DistInfo


@dataclass
class StepInputs:
    """What one optimizer step reads, built by :meth:`Objective.prepare_step` before its micro-batches run."""

    batches: list[Any]
    """One per micro-batch of this rank, on the device (what :meth:`Objective.loss` takes)."""
    denominator: float
    """The global batch's normaliser (> 0), the same on every rank: the reported loss is the sum over ranks
    and micro-batches of the numerators divided by it (target tokens for the token loss, 1 for an
    objective whose numerators are already shares of the mean)."""
    context: Any = None
    """Whatever else the objective's ``loss`` and ``metrics`` need of this step (host values)."""


@dataclass
class ObjectiveContext:
    """What an objective may need from the run when it is built: the config, this process, the device mesh,
    the (sharded) policy model, the training samples, the context-parallel group, the run directory and the
    training samples' order (the step's sampler: online RL reads the global batches of a whole generation
    cycle from it)."""

    cfg: Config
    info: DistInfo
    mesh: DeviceMesh | None
    model: nn.Module
    train_data: Any
    cp: ContextParallel
    run_dir: Path
    extra: dict[str, Any] = field(default_factory=dict)
    sampler: Any = None


class Objective(ABC):
    """An objective of the training step (see the module docstring for the order of the calls).

    Attributes:
        name: what the run summary and the docs call it (``token cross-entropy``, ``preference``...).
        stat_names: the names of the fp64 sums :meth:`loss` returns per micro-batch, in order; the step sums
            them over micro-batches and ranks (inside its one all-reduce) and hands them to :meth:`metrics`.
        rows_per_sample: sequences the model runs per sample of the global batch (a preference pair: 2),
            for the summary, the throughput and MFU.
    """

    name: str = "objective"
    stat_names: tuple[str, ...] = ()
    rows_per_sample: int = 1
    progress_keys: tuple[str, ...] = ()
    """Entries of the step's record (from :meth:`metrics`) the console's progress line shows beside the loss
    (online RL: ``reward``)."""
    val_loss: bool = True
    """Whether evaluation (``train.eval_interval``) computes the token loss on the validation samples; an
    objective without one (online RL: the validation prompts are kept aside, not scored) sets False and the
    run evaluates nothing."""

    @abstractmethod
    def prepare_step(self, step: int, micro_ids: list[list[int]], step_ids: list[int]) -> StepInputs:
        """This rank's micro-batches of global batch ``step`` (0-based) and the batch's denominator.

        Args:
            step: the optimizer steps done so far (the batch's index).
            micro_ids: this rank's sample ids, one list per micro-batch.
            step_ids: every sample id of the global batch (all ranks), for host-side counts.
        """

    @abstractmethod
    def loss(self, model: nn.Module, batch: Any, ids: list[int], inputs: StepInputs
             ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One micro-batch: its loss numerator (0-dim fp32, with gradient; this rank's part only) and its
        statistic sums ((len(stat_names),) fp64, no gradient) or None when ``stat_names`` is empty."""

    def metrics(self, sums: list[float], inputs: StepInputs) -> dict[str, float]:
        """The step record's entries from the statistic sums over every micro-batch and rank."""
        return {}

    def pipeline_batch(self, batch: Any) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        """One micro-batch as a pipeline of stages runs it (:mod:`shardlm.train.pipeline`): the first stage's
        input (B, T) int64, the last stage's targets (B, T) int64 (-100: not scored) for the token loss, and
        tensors every stage's forward takes, (B, ...) each. Only an objective whose loss is the token loss of
        one forward has one.

        Raises:
            ConfigError: this objective cannot run through pipeline stages (named).
        """
        raise ConfigError(f"pipeline parallel (parallel.pp > 1) runs the token loss of pre-training and SFT; "
                          f"the {self.name} objective is not built for it: set parallel.pp = 1")

    def describe(self) -> str | None:
        """One line for the run summary (after the objective's name), or None."""
        return None

    def rank_state(self, step: int) -> RankState | None:
        """What a checkpoint saved after ``step`` optimizer steps must hold of this rank's objective, beyond
        the model, the optimizer and the step, for a resume there to continue exactly (tensors and a string
        header, :mod:`shardlm.checkpoint.rank_state`); None (the default, and online RL at a generation
        cycle's start): nothing. Called on every rank at every save."""
        return None

    def load_rank_state(self, step: int, state: RankState | None) -> None:
        """At a resume after ``step`` steps: take back what :meth:`rank_state` returned there (None: the
        checkpoint holds nothing of this rank).

        Raises:
            CheckpointError: state this objective does not read.
        """
        if state is not None:
            raise CheckpointError(f"the checkpoint after step {step} holds per-rank state "
                                  f"({state[1].get('what', 'of another objective')}) that the {self.name} "
                                  "objective does not read")


class AuxiliaryTerm(ABC):
    """A term added to any objective's loss after each micro-batch's forward (a mixture of experts' router
    losses). Its sums are read on the host with the step's record (already global: no all-reduce)."""

    @abstractmethod
    def __call__(self, model: nn.Module, micro_batches: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The term to add to this micro-batch's objective (0-dim, with gradient; this rank's share of it)
        and its sums ((n,) fp64, no gradient)."""

    @abstractmethod
    def metrics(self, sums: list[float], micro_batches: int) -> dict[str, float]:
        """The record's entries from the sums over the step's micro-batches."""
