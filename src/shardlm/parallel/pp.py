"""Pipeline parallelism (``parallel.pp``): the model cut into stages of consecutive blocks, each stage held by
the ranks of one ``pp`` coordinate, the micro-batches run by a schedule of ``torch.distributed.pipelining``.

The model stays free of distributed code: a stage is the :class:`~shardlm.model.decoder.CausalLM` with what
it does not hold set to ``None`` (the embedding outside the first stage, the blocks of other stages, the final
norm and output projection outside the last), every parameter name unchanged, as torchtitan cuts its models
(``torchtitan/distributed/pipeline_parallel.py``). So a stage's state dict is a subset of the whole model's,
and checkpoints do not depend on the layout.

Stages per rank: one (``gpipe``, ``1f1b``), or two (``interleaved_1f1b``: stage s on pipeline rank s mod pp;
``zbv`` and ``dualpipev``: a V, rank r holding stages r and 2·pp - 1 - r, so the first rank holds the first
and the last stage). A rank with two stages keeps one *rank model* (the union of its stages, what the
optimizer, the checkpoint and the export read) and one *part* per stage, a shell sharing the rank model's
modules, which the schedule runs and FSDP wraps.

Measured here (torch 2.13, CPU, gloo; 2 and 4 ranks, an 8-layer MLP, 4 micro-batches): all five schedules of
:data:`SCHEDULES` run and give gradients equal to one process within 1e-6; ``dualpipev`` refuses fewer
micro-batches than stages (PyTorch's ``ValueError``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleDualPipeV,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleZBVZeroBubble,
)

from shardlm.config.layout import VIRTUAL_STAGES, pp_stage_layers
from shardlm.model.decoder import CausalLM, Decoder

#: ``parallel.pp_schedule`` -> PyTorch's schedule class
SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved_1f1b": ScheduleInterleaved1F1B,
             "zbv": ScheduleZBVZeroBubble, "dualpipev": ScheduleDualPipeV}


@dataclass(frozen=True)
class StagePlan:
    """Which stages a pipeline rank holds and the blocks of every stage."""

    n_stages: int
    """Stages in all: ``pp`` × stages per rank."""
    stage_ids: tuple[int, ...]
    """This rank's stages, in the order the schedule takes them."""
    layers: tuple[range, ...]
    """The blocks of every stage (indexed by stage)."""
    pp: int
    """Pipeline ranks."""
    v_shape: bool = False
    """Stages in a V (``zbv``, ``dualpipev``): rank r holds r and 2·pp - 1 - r; else looped, s mod pp."""

    def owner(self, stage: int) -> int:
        """The pipeline rank that holds ``stage``."""
        if self.v_shape and stage >= self.pp:
            return 2 * self.pp - 1 - stage
        return stage % self.pp

    @property
    def first(self) -> bool:
        """Whether this rank holds stage 0 (the embedding)."""
        return 0 in self.stage_ids

    @property
    def last(self) -> bool:
        """Whether this rank holds the last stage (the final norm, the output projection and the loss)."""
        return self.n_stages - 1 in self.stage_ids


def stage_plan(n_layers: int, pp: int, pp_rank: int, schedule: str,
               layers_per_stage: tuple[int, ...] = ()) -> StagePlan:
    """The stages of pipeline rank ``pp_rank`` of ``pp`` under ``schedule`` (see the module docstring).

    Raises:
        ConfigError: stages that do not divide the blocks (:func:`shardlm.config.layout.pp_stage_layers`).
    """
    per_rank = VIRTUAL_STAGES[schedule]
    n_stages = pp * per_rank
    layers = pp_stage_layers(n_layers, n_stages, layers_per_stage)
    v_shape = schedule in ("zbv", "dualpipev")
    if v_shape:  # a V: down the ranks, then back up
        ids = (pp_rank, 2 * pp - 1 - pp_rank)
    else:  # looped: stage s on rank s mod pp
        ids = tuple(pp_rank + k * pp for k in range(per_rank))
    return StagePlan(n_stages, ids, tuple(layers), pp, v_shape)


def prune_(model: CausalLM, keep: set[int], first: bool, last: bool) -> CausalLM:
    """Set to ``None`` what ``model`` does not hold (in place): the blocks outside ``keep``, the embedding
    unless ``first``, the final norm and output projection unless ``last``. Returns ``model``."""
    decoder = model.model
    for i in range(len(decoder.layers)):
        if i not in keep:
            decoder.layers[i] = None
    if not first:
        decoder.embed_tokens = None
    if not last:
        decoder.norm = None
        model.lm_head = None
    return model


def stage_part(model: CausalLM, layers: range, first: bool, last: bool) -> CausalLM:
    """A new :class:`CausalLM` shell holding ``model``'s own modules for one stage (the same module objects,
    so the same parameters; new containers, hooks and rotary buffers of its own)."""
    decoder = Decoder.__new__(Decoder)
    nn.Module.__init__(decoder)
    decoder.embed_tokens = model.model.embed_tokens if first else None
    decoder.layers = nn.ModuleList()
    for i, layer in enumerate(model.model.layers):
        decoder.layers.add_module(str(i), layer if i in layers else None)
    decoder.norm = model.model.norm if last else None
    for name, buf in model.model.named_buffers(recurse=False):
        decoder.register_buffer(name, buf, persistent=False)
    part = CausalLM.__new__(CausalLM)
    nn.Module.__init__(part)
    part.cfg = model.cfg
    part.model = decoder
    part.lm_head = model.lm_head if last else None
    return part


def apply_pp(model: CausalLM, plan: StagePlan) -> list[CausalLM]:
    """Cut ``model`` to this rank's stages (in place: it becomes the rank model) and return one part per stage
    of ``plan.stage_ids`` (the model itself when the rank holds one stage). Run on the meta device, before
    tensor parallel, activation checkpointing, compile and FSDP, which then apply to each part (torchtitan's
    order)."""
    keep = {i for s in plan.stage_ids for i in plan.layers[s]}
    prune_(model, keep, plan.first, plan.last)
    if len(plan.stage_ids) == 1:
        return [model]
    return [stage_part(model, plan.layers[s], s == 0, s == plan.n_stages - 1) for s in plan.stage_ids]


def build_schedule(schedule: str, parts: list[nn.Module], plan: StagePlan, micro_batches: int,
                   loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                   group: torch.distributed.ProcessGroup,
                   device: torch.device, meta: Callable[[int], dict[str, tuple[torch.Tensor | None, ...]]]):
    """PyTorch's ``schedule`` over this rank's ``parts`` (one :class:`PipelineStage` each, on the ``pp``
    process ``group``).

    ``meta(stage)``: ``PipelineStage``'s ``input_args``, ``output_args``, ``input_grads`` and ``output_grads``
    for one micro-batch, meta tensors (shapes and dtypes), so that no stage infers them by running a forward
    and backward of its own (which would call ``loss_fn`` once more). Measured here: without the gradients'
    metas the static mode sends no input gradient back. ``loss_fn(output, target)`` maps the
    last stage's output to the value to differentiate. Gradients are not scaled by the schedule
    (``scale_grads=False``): the caller's loss carries the step's normalisation.
    """
    stages = [PipelineStage(part, s, plan.n_stages, device, group=group, **meta(s))
              for part, s in zip(parts, plan.stage_ids)]
    cls = SCHEDULES[schedule]
    if VIRTUAL_STAGES[schedule] == 1:
        return cls(stages[0], n_microbatches=micro_batches, loss_fn=loss_fn, scale_grads=False)
    return cls(stages, n_microbatches=micro_batches, loss_fn=loss_fn, scale_grads=False)
