"""Activation checkpointing and compilation of the transformer blocks, applied before sharding.

The order follows torchtitan's ``parallelize_llama``: activation checkpointing, then compile, then
FSDP. Both keep parameter names. Checkpointing replaces each chosen block's ``forward`` with one
that runs the original under ``torch.utils.checkpoint.checkpoint(use_reentrant=False)``: the
effect of torchtitan's ``checkpoint_wrapper`` without a wrapper module (which would add
``_checkpoint_wrapped_module.`` to every name). FSDP's hooks stay outside the checkpointed region,
so recomputation in backward runs only the block's own operators (the hook-based composable
``checkpoint`` recomputes through the hooks, which operator-level selective checkpointing rejects).
Compilation uses ``nn.Module.compile()`` (compiles the module's call in place; ``torch.compile(block)``
would add an ``_orig_mod.`` prefix).
"""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Callable

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts, noop_context_fn
from torch.utils.checkpoint import checkpoint as torch_checkpoint

from shardlm.errors import ConfigError
from shardlm.model.cpu_matmul import bf16_linear_fp32
from shardlm.parallel.saved_activations import note_saved

#: operators whose outputs selective checkpointing keeps: the matrix multiplies and attention
#: (torchtitan's ``_save_list``, without the float8 and collective entries); everything else
#: (norms, rotary, SiLU, products, adds) is recomputed in backward.
SAVE_OPS: frozenset = frozenset(
    getattr(torch.ops.aten, name).default
    for name in ("mm", "addmm", "bmm", "_scaled_dot_product_flash_attention_for_cpu",
                 "_scaled_dot_product_efficient_attention", "_scaled_dot_product_flash_attention",
                 "_scaled_dot_product_cudnn_attention")
    if hasattr(torch.ops.aten, name)
) | {bf16_linear_fp32._opoverload}  # the bf16 linear multiplied in fp32 on CPUs (cpu_matmul.py)


def _save_matmul_policy(ctx, func, *args, **kwargs) -> CheckpointPolicy:
    """Selective-checkpoint policy: save the outputs of :data:`SAVE_OPS`, recompute the rest."""
    if func in SAVE_OPS:
        if not ctx.is_recompute:
            note_saved(ctx.op_output)  # for the saved-activation count (invisible to saved_tensors_hooks)
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def selective_context_fn() -> tuple:
    """The (forward, recompute) context managers of operator-level selective checkpointing."""
    return create_selective_checkpoint_contexts(_save_matmul_policy)


def apply_ac(blocks: nn.ModuleList, mode: str, every_n: int = 2) -> list[int]:
    """Activation-checkpoint ``blocks`` in place; return the indices of the checkpointed blocks.

    Args:
        blocks: the transformer blocks (their parameter names are left unchanged).
        mode: ``none``; ``full`` (every block keeps only its input, recomputes the rest in backward);
            ``every_n`` (blocks with 1-based index divisible by ``every_n``, torchtitan's
            "selective layer"); ``selective`` (every block, keeping matmul/attention outputs).
        every_n: the n of ``every_n``.

    Raises:
        ConfigError: unknown mode.
    """
    if mode == "none":
        return []
    if mode not in ("full", "every_n", "selective"):
        raise ConfigError(f"parallel.activation_checkpoint: unknown mode {mode!r}")
    chosen = [i for i in range(len(blocks)) if mode != "every_n" or (i + 1) % every_n == 0]
    context_fn = selective_context_fn if mode == "selective" else noop_context_fn
    for i in chosen:
        _checkpoint_forward(blocks[i], context_fn)
    return chosen


def _checkpoint_forward(block: nn.Module, context_fn: Callable[[], tuple]) -> None:
    """Make ``block.forward`` keep only its inputs and recompute the rest in backward (names unchanged)."""
    inner = block.forward
    # passed only when it is not the default: TorchDynamo (compile) rejects an explicit noop_context_fn
    extra = {} if context_fn is noop_context_fn else {"context_fn": context_fn}

    def forward(*args, **kwargs):
        note_saved((args, kwargs))  # the inputs kept for recomputation (for the saved-activation count)
        return torch_checkpoint(inner, *args, use_reentrant=False, **extra, **kwargs)

    block.forward = forward


def cxx_compiler_name() -> str:
    """The C++ compiler TorchInductor builds CPU kernels with (``torch._inductor.config.cpp.cxx``): ``$CXX``
    if set, else ``g++`` (``clang++`` on macOS)."""
    return os.environ.get("CXX") or ("clang++" if sys.platform == "darwin" else "g++")


def find_cxx_compiler() -> str | None:
    """Path of :func:`cxx_compiler_name`'s compiler; None when it is not found."""
    return shutil.which(cxx_compiler_name())


def apply_compile(blocks: nn.ModuleList, options: dict | None = None) -> None:
    """Compile each block in place with ``block.compile()`` (TorchInductor), keeping parameter names.

    ``options``: TorchInductor options for ``torch.compile(options=...)`` (async TP's, ``parallel/tp.py``);
    None: none.

    Raises:
        ConfigError: TorchInductor's C++ compiler (``$CXX``, else ``g++``) is not found; checked here, at
            start-up, not at the first step.
    """
    if find_cxx_compiler() is None:
        raise ConfigError("parallel.compile=true needs a C++ compiler for TorchInductor, and "
                          f"{cxx_compiler_name()!r} was not found (set CXX or install g++), or set "
                          "parallel.compile=false")
    for block in blocks:
        block.compile(**({"options": options} if options else {}))


