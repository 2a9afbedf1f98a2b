"""The training step's micro-batches through pipeline stages (``parallel.pp`` > 1): PyTorch's schedule
(``torch.distributed.pipelining``, built in :mod:`shardlm.parallel.pp`) runs every micro-batch's forward and
backward, and the last stage computes the token loss, chunked as without stages
(:func:`shardlm.train.loss.model_loss_sum`: the output projection and the cross-entropy a chunk of tokens at a
time, inside the stage's forward, so FSDP's all-gather of the output projection serves it and nothing of size
tokens × vocabulary is sent or kept).

Each micro-batch's loss numerator is multiplied by the step's scale (N / the global batch's denominator, the
same as without stages) before the schedule differentiates it, and the schedule does not scale gradients, so
the update equals one process's on the whole batch.

Under tensor parallel (``parallel.tp`` > 1) every stage's part is split over its ``tp`` ranks: a rank sends
and receives only its sequence shard of the hidden states (B, T / tp, D; the rank with the same ``tp``
coordinate on the neighbouring stage is its peer in the ``pp`` group), the later stages are told the whole
length T (the rotary tables, the documents), and the last stage's loss is vocabulary-parallel.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard

from shardlm.config import Config
from shardlm.config.layout import SPLIT_BACKWARD_SCHEDULES
from shardlm.parallel.dist import DistInfo, dp_submesh
from shardlm.parallel.options import dtype_from_name, mixed_precision_policy
from shardlm.parallel.pp import StagePlan, build_schedule, stage_plan
from shardlm.train.loss import model_loss_sum
from shardlm.train.microbatches import MicroBatches, PlainMicroBatches
from shardlm.train.objectives import AuxiliaryTerm, Objective, StepInputs


class StageModule(nn.Module):
    """What the schedule runs for one stage: its part of the model (:func:`shardlm.parallel.pp.apply_pp`),
    and on the last stage the summed token loss of the micro-batch (0-dim fp32) in place of the logits.

    ``forward(x, targets, documents=None)``: x the token ids (B, T) int64 on the first stage, else the
    previous stage's hidden states (B, T / tp, D: under tensor parallel each rank's sequence shard, the
    blocks' residual stream); returns the hidden states (B, T / tp, D), or the loss on the last stage, shape
    (1,).
    """

    def __init__(self, part: nn.Module, first: bool, last: bool, chunk_tokens: int,
                 split_backward: bool = False, tp: int = 1) -> None:
        super().__init__()
        self.part, self.last, self.chunk_tokens, self.split = part, last, chunk_tokens, split_backward
        self.first, self.tp = first, tp

    def forward(self, x: torch.Tensor, targets: torch.Tensor,
                documents: torch.Tensor | None = None) -> torch.Tensor:
        # hidden states of a sequence shard (tensor parallel): the rotary tables cover the whole sequence
        extra = {"seq_len": x.shape[1] * self.tp} if self.tp > 1 and not self.first else {}
        if self.last:  # (1,): the schedule concatenates the micro-batches' outputs
            return model_loss_sum(self.part, x, targets, self.chunk_tokens, documents,
                                  backward_twice=self.split, **extra).reshape(1)
        return self.part(x, documents=documents, **extra)


class PipelineMicroBatches:
    """The micro-batches of a step through this rank's pipeline stages (see the module docstring).

    Args:
        cfg: the run's config (``parallel.pp_schedule``, the micro-batch and sequence sizes, the compute
            dtype, ``train.loss_chunk_tokens``). info: this process. mesh: the device mesh (``pp`` and the
            data-parallel dimensions).
        parts: this rank's stage parts, in ``plan.stage_ids``' order. plan: this rank's stages.
        micro_batches: micro-batches per step (the gradient accumulation steps).
    """

    def __init__(self, cfg: Config, info: DistInfo, mesh: DeviceMesh, parts: list[nn.Module],
                 plan: StagePlan, micro_batches: int) -> None:
        self.plan, self.group, self.device = plan, mesh["pp"].get_group(), info.device
        self.holds_loss = plan.last
        last = plan.n_stages - 1
        split = cfg.parallel.pp_schedule in SPLIT_BACKWARD_SCHEDULES  # input, then weight backward
        self.tp = cfg.parallel.tp
        self.modules = [StageModule(part, s == 0, s == last, cfg.train.loss_chunk_tokens, split, self.tp)
                        for part, s in zip(parts, plan.stage_ids)]
        for module in self.modules:
            # the FSDP root of the stage: PyTorch's stage then defers FSDP's gradient reduction and resharding
            # to the step's last backward (the zero-bubble schedules need the unsharded parameters between a
            # micro-batch's input and weight backward)
            fully_shard(module, mesh=dp_submesh(mesh), mp_policy=mixed_precision_policy(cfg.parallel))
        m, t, d = cfg.train.micro_batch_size, cfg.train.seq_len, cfg.model.dim
        t_local = t // self.tp  # under tensor parallel a rank sends and receives its sequence shard
        self.dtype = dtype_from_name("parallel.param_dtype", cfg.parallel.param_dtype)

        def hidden(grad: bool = False) -> torch.Tensor:
            return torch.empty((m, t_local, d), dtype=self.dtype, device="meta", requires_grad=grad)

        # every stage's input, output and their gradients given (meta): no stage infers them by running
        def meta(stage: int) -> dict[str, tuple[torch.Tensor | None, ...]]:
            first = stage == 0
            return {"input_args": (torch.empty((m, t), dtype=torch.int64, device="meta") if first
                                   else hidden(True),),
                    "output_args": (torch.empty(1, dtype=torch.float32, device="meta") if stage == last
                                    else hidden(),),
                    "input_grads": (None if first else hidden(),),
                    "output_grads": (None if stage == last else hidden(),)}

        self._scale = 1.0
        self._numerators: list[torch.Tensor] = []
        self.schedule = build_schedule(cfg.parallel.pp_schedule, self.modules, plan, micro_batches,
                                       self._loss, self.group, info.device, meta)

    def _loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """The schedule's loss function: the last stage's output is the micro-batch's loss numerator."""
        self._numerators.append(output.detach().reshape(()))
        return (output * self._scale).sum()

    def run(self, objective: Objective, terms: list[AuxiliaryTerm], inputs: StepInputs,
            micro_ids: list[list[int]], scale: float) -> tuple[torch.Tensor, torch.Tensor, list[Any]]:
        """See :meth:`shardlm.train.microbatches.MicroBatches.run`; the numerators are the last stage's (zero
        elsewhere), and the objective has no statistics (:meth:`Objective.pipeline_batch`)."""
        pieces = [objective.pipeline_batch(batch) for batch in inputs.batches]
        tokens = torch.cat([p[0] for p in pieces])
        targets = torch.cat([p[1] for p in pieces])
        kwargs = {}
        if any("documents" in p[2] for p in pieces):  # one tensor for the schedule to split: a micro-batch
            # without a document start comes plain (shardlm/data/packing.py), each row one document (0)
            kwargs["documents"] = torch.cat([p[2].get("documents", torch.zeros_like(p[1])) for p in pieces])
        self._scale, self._numerators = scale, []
        args = (tokens,) if self.plan.first else ()
        self.schedule.step(*args, target=targets, targets=targets, **kwargs)
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        for numerator in self._numerators:
            loss_sum += numerator
        stats = torch.zeros(len(objective.stat_names), dtype=torch.float64, device=self.device)
        return loss_sum, stats, [None] * len(terms)

    @torch.no_grad()
    def eval_loss_sum(self, tokens: Any, batch: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """See :meth:`shardlm.train.microbatches.MicroBatches.eval_loss_sum`: the stages in order, each
        hidden state sent to the next stage's rank (a forward-only walk, one micro-batch)."""
        inputs, targets, kwargs = tokens.pipeline_batch(batch)
        me = dist.get_rank(self.group)
        loss = torch.zeros((), dtype=torch.float32, device=self.device)
        h = inputs
        for s in range(self.plan.n_stages):
            owner = self.plan.owner(s)
            if owner != me:
                continue
            if s > 0 and self.plan.owner(s - 1) != me:
                b, t = inputs.shape  # under tensor parallel: this rank's sequence shard
                h = torch.empty((b, t // self.tp, self.modules[0].part.cfg.dim), dtype=self.dtype,
                                device=self.device)
                dist.recv(h, group=self.group, group_src=self.plan.owner(s - 1))
            out = self.modules[self.plan.stage_ids.index(s)](h, targets, **kwargs)
            if s == self.plan.n_stages - 1:
                loss = out.reshape(())
            elif self.plan.owner(s + 1) != me:
                dist.send(out.contiguous(), group=self.group, group_dst=self.plan.owner(s + 1))
            else:
                h = out
        return loss, targets


def build_micro_batches(cfg: Config, info: DistInfo, mesh: Any, model: nn.Module, parts: list[nn.Module],
                        micro_batches: int) -> MicroBatches:
    """The run's micro-batch runner: through the pipeline stages ``parts`` on ``mesh["pp"]`` when
    ``parallel.pp`` > 1, else :class:`PlainMicroBatches` on ``model``."""
    p = cfg.parallel
    if p.pp == 1:
        return PlainMicroBatches(model, p.grad_sync, info.device)
    plan = stage_plan(cfg.model.n_layers, p.pp, mesh["pp"].get_local_rank(), p.pp_schedule,
                      p.pp_layers_per_stage)
    return PipelineMicroBatches(cfg, info, mesh, parts, plan, micro_batches)
