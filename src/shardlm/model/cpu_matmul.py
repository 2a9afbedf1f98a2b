"""bf16 linear layers on CPUs without bf16 instructions: multiply in fp32, keep everything else bf16.

With ``parallel.param_dtype = "bfloat16"`` FSDP2 all-gathers bf16 weights and every linear layer
multiplies bf16 by bf16. On x86 CPUs with AVX512-BF16 or AMX, PyTorch's bf16 GEMM runs on those
instructions; without them (this project's 2-core Xeon has AVX-512 but neither) it converts inside
its inner loop and was measured 4.1x slower than the fp32 GEMM (1024x256 @ 256x768, one thread:
15.5 ms against 3.8 ms; the same product with both operands upcast to fp32 first: 4.7 ms).

:func:`bf16_linear_fp32` computes ``x @ weight.T`` by upcasting the two bf16 operands, multiplying
in fp32 and rounding the result to bf16. Every product of two bf16 numbers is exact in fp32 and a
bf16 GEMM accumulates in fp32 too, so the result differs from the bf16 kernel only in summation
order. It is a custom operator (``torch.library.custom_op``) so that autograd saves the bf16
operands (not fp32 copies: FSDP's resharding still frees the gathered weight after forward),
selective activation checkpointing sees one operator with a bf16 output, and ``torch.compile``
treats it as opaque. Applied in one place, :func:`shardlm.train.build.build_model`, on CPU devices only.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

#: CPU flags (``/proc/cpuinfo``) of instructions that run bf16 GEMMs natively
BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16")
CPUINFO = Path("/proc/cpuinfo")


@torch.library.custom_op("shardlm::bf16_linear_fp32", mutates_args=())
def bf16_linear_fp32(x: Tensor, weight: Tensor) -> Tensor:
    """``x @ weight.T`` multiplied in fp32 and rounded to ``x.dtype``.

    Args:
        x: ``(..., in_features)``, bf16.
        weight: ``(out_features, in_features)``, bf16 (``nn.Linear``'s layout).

    Returns:
        ``(..., out_features)`` in ``x.dtype``.
    """
    return F.linear(x.float(), weight.float()).to(x.dtype)


@bf16_linear_fp32.register_fake
def _(x: Tensor, weight: Tensor) -> Tensor:
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


def _setup_context(ctx, inputs: tuple[Tensor, Tensor], output: Tensor) -> None:  # noqa: ANN001 - autograd's ctx
    ctx.save_for_backward(*inputs)  # the bf16 operands: half the bytes of fp32 copies


def _backward(ctx, grad: Tensor) -> tuple[Tensor | None, Tensor | None]:  # noqa: ANN001 - autograd's ctx
    x, weight = ctx.saved_tensors
    g = grad.float()
    grad_x = (g @ weight.float()).to(x.dtype) if ctx.needs_input_grad[0] else None
    grad_w = None
    if ctx.needs_input_grad[1]:
        grad_w = (g.reshape(-1, g.shape[-1]).t() @ x.reshape(-1, x.shape[-1]).float()).to(weight.dtype)
    return grad_x, grad_w


bf16_linear_fp32.register_autograd(_backward, setup_context=_setup_context)


class Fp32MatmulLinear(nn.Linear):
    """``nn.Linear`` whose bf16 forward (without bias) goes through :func:`bf16_linear_fp32`.

    Same parameters and names as ``nn.Linear``; any other dtype or a bias takes ``nn.Linear``'s path.
    """

    def forward(self, x: Tensor) -> Tensor:
        if x.dtype == torch.bfloat16 and self.weight.dtype == torch.bfloat16 and self.bias is None:
            return bf16_linear_fp32(x, self.weight)
        return super().forward(x)


def cpu_has_bf16_instructions(cpuinfo: Path = CPUINFO) -> bool:
    """Whether this CPU runs bf16 GEMMs natively (a flag of :data:`BF16_CPU_FLAGS` in ``cpuinfo``).

    Where ``cpuinfo`` cannot be read (not Linux) the answer is True: PyTorch's own kernels are kept.
    """
    try:
        text = cpuinfo.read_text()
    except OSError:
        return True
    flags = set()
    for line in text.splitlines():
        if line.startswith("flags"):
            flags.update(line.partition(":")[2].split())
    return any(flag in flags for flag in BF16_CPU_FLAGS)


def use_fp32_matmul(setting: str, device: torch.device, param_dtype: str, cpuinfo: Path = CPUINFO) -> bool:
    """Whether bf16 linear layers should multiply in fp32 (``parallel.cpu_bf16_matmul``).

    ``native`` never; ``fp32`` whenever the compute dtype is bf16 on a CPU device; ``auto`` as ``fp32`` but
    only on CPUs without bf16 instructions (:func:`cpu_has_bf16_instructions` of ``cpuinfo``). Never on CUDA.
    """
    if device.type != "cpu" or param_dtype != "bfloat16" or setting == "native":
        return False
    return setting == "fp32" or not cpu_has_bf16_instructions(cpuinfo)


def apply_fp32_matmul(model: nn.Module) -> int:
    """Turn every bias-free ``nn.Linear`` of ``model`` with a plain weight into :class:`Fp32MatmulLinear` in
    place (a tensor subclass keeps its own kernel: torchao's NF4 of QLoRA, its MXFP8 training weights).

    Parameter names and values are unchanged (only the class, hence ``forward``, changes). Returns how
    many layers were changed.
    """
    changed = 0
    for module in model.modules():
        # an NF4 weight (QLoRA, nominally bf16) keeps torchao's dequantising linear, an MXFP8 one its MX GEMMs
        if type(module) is nn.Linear and module.bias is None and type(module.weight) is nn.Parameter:
            module.__class__ = Fp32MatmulLinear
            changed += 1
    return changed
