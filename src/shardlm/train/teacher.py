"""The teacher of knowledge distillation (``[distill]``) and one micro-batch's distillation loss.

The teacher is built as the student is (the same parallel mode, mesh and FSDP groups, no LoRA, freezing or
activation checkpointing) from ``distill.teacher_from``, in that directory's shape, then frozen
(``requires_grad=False``) and put in eval mode: per rank it stores its parameter shards and nothing else (no
gradients, no optimizer state). Each micro-batch runs the teacher's forward under ``torch.no_grad`` first,
keeping only its final hidden states and a copy of its output projection (:func:`teacher_outputs`), then the
student's forward, whose output head computes the loss chunk by chunk from both
(:func:`shardlm.train.distill_loss.distill_hidden_sum`).
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh

from shardlm.config import Config, apply_init_from
from shardlm.errors import ConfigError
from shardlm.model.cpu_matmul import Fp32MatmulLinear
from shardlm.model.lora import LoRALinear
from shardlm.parallel.dist import DistInfo
from shardlm.train.build import build_model
from shardlm.train.distill_loss import DistillSpec, Head, distill_hidden_sum
from shardlm.train.reference import check_reference_tokenizer


def distill_spec(cfg: Config) -> DistillSpec:
    """The loss of ``[distill]`` (:meth:`DistillSpec.of`)."""
    d = cfg.distill
    return DistillSpec.of(d.loss, d.beta, d.temperature, d.alpha, d.top_k)


def teacher_config(cfg: Config) -> Config:
    """The teacher's config: the student's (parallelism, mesh, dtypes, seed) without LoRA, freezing or
    activation checkpointing, in the shape of ``distill.teacher_from`` and loading its weights.

    Raises:
        ModelDirError: ``distill.teacher_from`` has no readable ``config.json`` (:func:`apply_init_from`).
    """
    t = copy.deepcopy(cfg)
    t.lora = type(cfg.lora)()
    t.train.trainable = t.train.frozen = ""
    t.parallel.activation_checkpoint = "none"  # no backward: nothing to recompute
    t.model.init_from = cfg.distill.teacher_from
    apply_init_from(t)
    return t


def build_teacher(cfg: Config, info: DistInfo, mesh: DeviceMesh | None) -> nn.Module:
    """The frozen teacher (see the module docstring), FSDP-sharded like the student (a collective under FSDP).

    Raises:
        ConfigError: the teacher's tokenizer differs from the student's ``data.tokenizer``
            (:func:`~shardlm.train.reference.check_reference_tokenizer`).
    """
    check_reference_tokenizer(cfg.distill.teacher_from, cfg.data.tokenizer, key="distill.teacher_from",
                              role="teacher", of="student")
    model, _ = build_model(teacher_config(cfg), info, mesh)
    model.requires_grad_(False)
    return model.eval()


def head_of(llama: nn.Module, dtype: torch.dtype, copy_weight: bool = False) -> Head:
    """The output projection of a :class:`~shardlm.model.decoder.CausalLM` as the chunked loss reads it, read
    inside its forward (where FSDP has gathered it): the weight in the compute ``dtype`` (a bf16 or NF4 base
    cast once, as :func:`shardlm.train.loss.output_loss_sum`), the final logit soft-cap and the CPU bf16
    kernel's flag. ``copy_weight``: a copy that outlives the forward (FSDP frees the gathered weight when it
    reshards).

    Raises:
        ConfigError: adapters on the output projection (LoRA's ``lm_head`` target), not built for
            distillation.
    """
    head = llama.lm_head
    if isinstance(head, LoRALinear):
        raise ConfigError("distillation with LoRA adapters on lm_head is not built yet: leave lm_head out of "
                          "lora.targets")
    weight = head.weight
    fp32_matmul = isinstance(head, Fp32MatmulLinear) and dtype == torch.bfloat16
    if weight.dtype != dtype or type(weight).__name__ == "NF4Tensor":
        weight = weight.to(dtype)
    elif copy_weight:
        weight = weight.detach().clone()
    return Head(weight, llama.cfg.final_logit_softcap, fp32_matmul)


@torch.no_grad()
def teacher_outputs(teacher: nn.Module, inputs: Tensor, documents: Tensor | None = None,
                    **model_kwargs: Any) -> tuple[Tensor, Head]:
    """The teacher's final hidden states on a micro-batch and its output projection, without gradients.

    Args:
        teacher: the frozen teacher (FSDP-sharded or plain). inputs: (B, T) int64 token ids; documents: (B,
        T) int64 for block-causal attention, or None; model_kwargs: passed to the forward (``real_tokens``).

    Returns ``(hidden, head)``: (B, T, D_t) in the teacher's compute dtype (the final norm's output) and
    its :class:`Head` with a copy of the output weight (V, D_t), alive after the forward.
    """
    def keep(llama: nn.Module, hidden: Tensor) -> tuple[Tensor, Head]:
        return hidden, head_of(llama, hidden.dtype, copy_weight=True)

    return teacher(inputs, documents=documents, head=keep, **model_kwargs)


def distill_model_loss_sum(model: nn.Module, teacher: nn.Module, inputs: Tensor, targets: Tensor,
                           spec: DistillSpec, chunk_tokens: int, documents: Tensor | None = None,
                           **model_kwargs: Any) -> tuple[Tensor, Tensor]:
    """One micro-batch's distillation loss: the teacher's forward (no gradient), then the student's, whose
    head computes :func:`~shardlm.train.distill_loss.distill_hidden_sum` over the scored targets.

    Args:
        model: the student (FSDP-sharded or plain), called once so every wrapper's hooks run. inputs,
        targets: (B, T) int64, targets ``IGNORE_INDEX`` off the responses. chunk_tokens:
        ``train.loss_chunk_tokens``; 0 = one chunk of every scored token.

    Returns ``(loss, stats)``: the 0-dim fp32 sum in nats over the scored targets (with gradient) and the
    (3,) fp64 sums of :data:`~shardlm.train.distill_loss.STAT_NAMES`.
    """
    t_hidden, t_head = teacher_outputs(teacher, inputs, documents, **model_kwargs)
    chunk = chunk_tokens or max(1, targets.numel())

    def head(llama: nn.Module, hidden: Tensor) -> tuple[Tensor, Tensor]:
        student_head = head_of(llama, hidden.dtype)
        return distill_hidden_sum(hidden, student_head, t_hidden, t_head, targets, spec, chunk)

    return model(inputs, documents=documents, head=head, **model_kwargs)
