"""Applying tensor parallel with sequence parallel to the model: the recipe, in one function.

Megatron-LM's layout (Shoeybi et al., "Megatron-LM", 2019; sequence parallel: Korthikanti et al., "Reducing
Activation Recomputation in Large Transformer Models", 2022), built from PyTorch's DTensor parallel styles
(https://pytorch.org/docs/stable/distributed.tensor.parallel.html) as torchtitan's ``apply_tp`` does. On a
tensor-parallel group of T ranks:

- between the blocks the activations (batch, seq, dim) are sharded along the sequence (``Shard(1)``): the
  norms and residual adds run on seq / T tokens per rank (``SequenceParallel``, the norm weights replicated;
  the residual stream itself is each rank's local tensor of seq / T tokens);
- attention and MLP all-gather their input's sequence (``PrepareModuleInput``), multiply by q/k/v and gate/up
  split by output columns (``ColwiseParallel``: each rank holds n_heads / T query heads, n_kv_heads / T
  key/value heads, ffn_dim / T of the FFN width; Qwen2's q/k/v biases split with them), and by o and down
  split by input rows (``RowwiseParallel``), whose partial sums are reduce-scattered back to sequence shards;
- the token embedding is split by vocabulary rows (each rank looks up its ids, the rest are zero, summed and
  scattered along the sequence); the output projection likewise (``ColwiseParallel`` over the vocabulary), and
  the loss is vocabulary-parallel (:mod:`shardlm.train.vocab_parallel_loss`): the full logits never exist.

The model itself is unchanged: attention takes its local head count from the projections' shapes. Per family:
Qwen3 / Gemma 3's q/k norms (over each head's width) run on the local heads with replicated weights; Gemma's
extra norms are sequence parallel like the others, its final soft-cap and sliding windows act on local logits
and local heads; tied embeddings stay one tensor (the embedding and the output projection are split alike).
"""

from __future__ import annotations

from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from shardlm.model.config import ModelConfig
from shardlm.model.decoder import CausalLM

#: the positional arguments of ``Attention.forward`` after x: cos, sin, cache, doc_mask (plain tensors
#: or None)
_ATTENTION_EXTRA_ARGS = 4


def block_plan(cfg: ModelConfig) -> dict:
    """The ``parallelize_module`` plan of one transformer block (names relative to the block)."""
    sequence_in = PrepareModuleInput(input_layouts=(Shard(1), *[None] * _ATTENTION_EXTRA_ARGS),
                                      desired_input_layouts=(Replicate(), *[None] * _ATTENTION_EXTRA_ARGS))
    plan = {
        "input_layernorm": SequenceParallel(),
        "self_attn": sequence_in,
        "self_attn.q_proj": ColwiseParallel(),
        "self_attn.k_proj": ColwiseParallel(),
        "self_attn.v_proj": ColwiseParallel(),
        "self_attn.o_proj": RowwiseParallel(output_layouts=Shard(1)),
        "post_attention_layernorm": SequenceParallel(),
        "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        "mlp.gate_proj": ColwiseParallel(),
        "mlp.up_proj": ColwiseParallel(),
        "mlp.down_proj": RowwiseParallel(output_layouts=Shard(1)),
    }
    if cfg.arch.qk_norm:  # over each head's width, on (batch, local heads, seq, head_dim): heads are dim 1
        plan["self_attn.q_norm"] = SequenceParallel(sequence_dim=1, use_local_output=True)
        plan["self_attn.k_norm"] = SequenceParallel(sequence_dim=1, use_local_output=True)
    if cfg.arch.gemma_norms:
        # norms after attention and MLP too: their outputs join the residual stream (local)
        plan["post_attention_layernorm"] = SequenceParallel(use_local_output=True)
        plan["pre_feedforward_layernorm"] = SequenceParallel()
        plan["post_feedforward_layernorm"] = SequenceParallel(use_local_output=True)
    return plan


#: TorchInductor options that make compiled blocks micro-pipeline their TP collectives with the matrix
#: multiplies beside them (torchtitan's async TP; passed to ``block.compile(options=...)``
#: by ``apply_compile``)
ASYNC_TP_COMPILE_OPTIONS = {"_micro_pipeline_tp": True}


def apply_tp(model: CausalLM, tp_mesh: DeviceMesh) -> CausalLM:
    """Split ``model`` over the 1-D tensor-parallel mesh ``tp_mesh`` (before activation checkpointing, compile
    and FSDP, torchtitan's order); see the module docstring for the layout.

    1. embedding: vocabulary rows, output sharded along the sequence;
    2. each block: :func:`block_plan`;
    3. final norm: sequence parallel; output projection: vocabulary rows, logits left sharded over the
       vocabulary (a DTensor ``Shard(-1)``; the chunked loss reads the projection's weight itself);
    4. tied embeddings: the output projection takes the embedding's (already split) weight back.

    A pipeline stage (:func:`shardlm.parallel.pp.apply_pp`: what it does not hold is ``None``) gets the
    plan of what it holds: the embedding on the first stage only, the final norm and output projection on
    the last, its own blocks; between stages the hidden states travel as each rank's local
    (batch, seq / T, dim) sequence shard.

    Async TP (``parallel.async_tp``, CUDA only) is a compile option of the blocks afterwards:
    :data:`ASYNC_TP_COMPILE_OPTIONS`.

    Returns the same object; its parameters are DTensors on ``tp_mesh``.
    """
    plan = {
        "model.embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "model.norm": SequenceParallel(),
        "lm_head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False),
    }
    held = {name: module for name, module in model.named_modules() if module is not None}
    parallelize_module(model, tp_mesh, {name: style for name, style in plan.items() if name in held})
    for block in model.model.layers:
        if block is not None:  # a pipeline stage holds only its own blocks
            parallelize_module(block, tp_mesh, block_plan(model.cfg))
    if model.cfg.tie_embeddings:  # one Parameter again: both are Shard(0) over the vocabulary
        model.lm_head.weight = model.model.embed_tokens.weight
    return model


def tp_degree(weight) -> int:  # noqa: ANN001 - a tensor or DTensor
    """The size of the ``tp`` dimension of ``weight``'s device mesh (1 for a plain tensor or a mesh
    without one)."""
    mesh = getattr(weight, "device_mesh", None)
    names = (mesh.mesh_dim_names or ()) if mesh is not None else ()
    return mesh.size(names.index("tp")) if "tp" in names else 1
