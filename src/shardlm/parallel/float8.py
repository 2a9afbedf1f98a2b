"""Float8 training (``train.float8``): torchao's float8 linear layers, applied from outside the model before
FSDP, with float8 all-gathers under FSDP2, as torchtitan does it.

Recipes (torchao's names, https://github.com/pytorch/ao/tree/main/torchao/float8):

==============  ==============================================================================================
``tensorwise``  one dynamic scale per tensor (``Float8LinearConfig()``); under FSDP2 the weights are cast to
                float8 *before* the all-gather (``enable_fsdp_float8_all_gather``: 1 byte per weight element
                on the wire instead of 2 in bf16), with all the weights' scales computed in one all-reduce
                after each optimizer step (:func:`after_optimizer_step`,
                ``precompute_float8_dynamic_scale_for_fsdp``)
``rowwise``     one scale per row (``Float8LinearConfig.from_recipe_name("rowwise")``, power-of-2 scales);
                torchao's float8 all-gather is tensorwise only, so the weights travel in ``param_dtype``
``mxfp8``       MX blocks of 32 elements with an e8m0 scale each (torchao's prototype
                ``MXFP8TrainingOpConfig``): Blackwell (compute capability 10.0) only on a GPU; weights travel
                in ``param_dtype``
==============  ==============================================================================================

Which layers: every ``nn.Linear`` of the blocks whose two dimensions are multiples of 16 (32 for ``mxfp8``:
the float8 GEMMs' alignment, and the MX block), except the output projection ``lm_head`` (the loss reads its
weight directly, and the logits are the most precision-sensitive product) and a mixture of experts' router
(float8 noise would change which experts are chosen). The experts' 3-D weights are not ``nn.Linear`` and stay
in ``param_dtype``. :func:`float8_layers` lists the converted ones.

Devices: a CUDA GPU needs float8 tensor cores (compute capability 8.9: Ada, Hopper; 10.0 for ``mxfp8``),
else :func:`apply_float8` refuses. On a CPU float8 always runs *emulated* (``emulate=True``: the same casts
and scales, the products in high precision): the numerics and the FSDP wiring, never speed. ``torch.compile``
(``parallel.compile``) is recommended on a GPU: without it the casts run as separate kernels and float8 is
rarely faster than bf16 (torchao's and torchtitan's measurements are all compiled).

Gloo (CPU) cannot all-gather a float8 tensor ("Invalid scalar type"); when a group holds only float8 weights
FSDP2 would hand it one, so on gloo every group all-gathers through :class:`ByteAllGather`, which sends 1-byte
floats as ``uint8`` (the same bytes).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule

from shardlm.errors import ConfigError

#: ``train.float8`` values that convert layers, and the CUDA compute capability each needs
FLOAT8_MIN_CAPABILITY: dict[str, tuple[int, int]] = {"tensorwise": (8, 9), "rowwise": (8, 9),
                                                      "mxfp8": (10, 0)}
#: the alignment of a converted layer's two dimensions, per recipe (float8 GEMMs: 16; MX blocks: 32)
FLOAT8_ALIGNMENT: dict[str, int] = {"tensorwise": 16, "rowwise": 16, "mxfp8": 32}


def float8_emulated(device: torch.device) -> bool:
    """Whether float8 runs emulated on ``device``: everywhere but CUDA (see the module docstring)."""
    return device.type != "cuda"


def check_float8_device(recipe: str, device: torch.device) -> None:
    """Refuse ``recipe`` on a CUDA ``device`` without the float8 tensor cores it needs (a CPU runs it
    emulated).

    Raises:
        ConfigError: an unknown recipe, or a GPU below :data:`FLOAT8_MIN_CAPABILITY` (naming the GPU and both
            capabilities).
    """
    if recipe not in FLOAT8_MIN_CAPABILITY:
        raise ConfigError(f"train.float8: unknown recipe {recipe!r} (known: none, "
                          f"{', '.join(FLOAT8_MIN_CAPABILITY)})")
    if float8_emulated(device):
        return
    have, need = torch.cuda.get_device_capability(device), FLOAT8_MIN_CAPABILITY[recipe]
    if tuple(have) < need:
        raise ConfigError(
            f"train.float8={recipe!r} needs a GPU with float8 tensor cores (compute capability "
            f"{need[0]}.{need[1]} or later), but {torch.cuda.get_device_name(device)} is "
            f"{have[0]}.{have[1]}: set train.float8 = 'none'"
            + (" or 'tensorwise'" if recipe == "mxfp8" and have >= (8, 9) else ""))


def routers(model: nn.Module) -> set[str]:
    """Names of the mixture-of-experts routers of ``model`` (``<layer>.mlp.gate``; gpt-oss ``.router``)."""
    return {f"{name}.{module.router_name}" for name, module in model.named_modules()
            if hasattr(module, "router_name")}


def float8_filter(model: nn.Module, recipe: str) -> Callable[[nn.Module, str], bool]:
    """``(module, name) -> bool``: whether float8 converts ``module`` (the rule: the module docstring)."""
    excluded = routers(model) | {"lm_head"}
    align = FLOAT8_ALIGNMENT[recipe]

    def convert(module: nn.Module, name: str) -> bool:
        if not isinstance(module, nn.Linear) or name in excluded:
            return False
        return module.in_features % align == 0 and module.out_features % align == 0
    return convert


def float8_layers(model: nn.Module, recipe: str) -> list[str]:
    """Names of the ``nn.Linear`` layers :func:`apply_float8` converts for ``recipe``, in module order."""
    keep = float8_filter(model, recipe)
    return [name for name, module in model.named_modules() if keep(module, name)]


def apply_float8(model: nn.Module, recipe: str, device: torch.device, fsdp: bool) -> list[str]:
    """Convert ``model``'s eligible linear layers to float8 training in place (before ``fully_shard``, on the
    meta device or not); return their names.

    ``tensorwise`` and ``rowwise`` swap each ``nn.Linear`` for torchao's ``Float8Linear`` (same parameter
    names: checkpoints and exports do not change); ``mxfp8`` wraps the weights in torchao's MXFP8 training
    tensor. Under ``fsdp`` the ``tensorwise`` weights all-gather in float8. On a CPU the emulated kernels run.

    Raises:
        ConfigError: as :func:`check_float8_device`; no layer qualifies (all dimensions unaligned).
    """
    check_float8_device(recipe, device)
    names = float8_layers(model, recipe)
    if not names:
        raise ConfigError(f"train.float8={recipe!r}: no linear layer has both dimensions a multiple of "
                          f"{FLOAT8_ALIGNMENT[recipe]} (model.dim, model.ffn_dim, the head sizes): nothing "
                          "to convert")
    emulate = float8_emulated(device)
    keep = float8_filter(model, recipe)
    if recipe == "mxfp8":
        from torchao.prototype.moe_training.config import MXFP8TrainingOpConfig, MXFP8TrainingRecipe
        from torchao.quantization import quantize_

        name = "MXFP8_EMULATED_RCEIL" if emulate else "MXFP8_RCEIL"
        quantize_(model, MXFP8TrainingOpConfig.from_recipe(MXFP8TrainingRecipe[name]), filter_fn=keep)
        return names
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    config = Float8LinearConfig.from_recipe_name(recipe)
    config = dataclasses.replace(config, emulate=emulate,
                                 enable_fsdp_float8_all_gather=fsdp and recipe == "tensorwise")
    convert_to_float8_training(model, module_filter_fn=keep, config=config)
    return names


def after_optimizer_step(model: nn.Module) -> None:
    """After each optimizer step: the float8 scales of every FSDP-sharded ``tensorwise`` weight in one
    all-reduce (torchao's ``precompute_float8_dynamic_scale_for_fsdp``); a collective, so every rank calls it.

    Without it each weight's scale is computed at its own all-gather (one small all-reduce per weight): the
    same values, more collectives. Nothing happens (and nothing is imported) for a model without such weights.
    """
    if not has_fsdp_float8_weights(model):
        return
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    precompute_float8_dynamic_scale_for_fsdp(model)


def has_fsdp_float8_weights(model: nn.Module) -> bool:
    """Whether ``model`` holds a weight that FSDP2 all-gathers in float8 (torchao's
    ``WeightWithDynamicFloat8CastTensor`` under a DTensor; checked by class name, not importing torchao)."""
    for param in model.parameters():
        local = getattr(param, "_local_tensor", None)
        if type(local).__name__ == "WeightWithDynamicFloat8CastTensor":
            return True
    return False


class ByteAllGather:
    """FSDP2's all-gather (``all_gather_single``), with a 1-byte float buffer (float8) sent as ``uint8``: gloo
    has no float8 type. The two methods of FSDP2's ``AllGather`` interface, exported only privately."""

    def allocate(self, size: Sequence[int | torch.SymInt], *, dtype: torch.dtype,
                 device: torch.device) -> torch.Tensor:
        """A plain uninitialised tensor of ``size`` (FSDP's default allocation)."""
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 async_op: bool = False) -> dist.Work | None:
        """``output_tensor`` (W·n,) = every rank's ``input_tensor`` (n,) in rank order."""
        if output_tensor.element_size() == 1 and output_tensor.is_floating_point():
            output_tensor, input_tensor = output_tensor.view(torch.uint8), input_tensor.view(torch.uint8)
        return dist.all_gather_single(output_tensor, input_tensor, group=group, async_op=async_op)


def use_byte_all_gather(model: nn.Module) -> None:
    """Every FSDP group of ``model`` all-gathers through :class:`ByteAllGather` (gloo with float8 weights)."""
    comm = ByteAllGather()
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_custom_all_gather(comm)
