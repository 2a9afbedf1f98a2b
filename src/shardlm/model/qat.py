"""Quantisation-aware training (``train.qat``): torchao's fake quantisation of the linear layers during
fine-tuning, so that the model quantised at export loses less than the same fine-tune quantised afterwards.

Each scheme is a torchao post-training quantisation config (the *base config*); torchao's ``QATConfig(base,
step="prepare")`` swaps each targeted ``nn.Linear`` for a ``FakeQuantizedLinear`` that rounds its weight (and,
for the dynamic-activation schemes, its input) exactly as ``base`` will, in high precision, with the gradient
passed straight through (https://github.com/pytorch/ao/tree/main/torchao/quantization/qat). Parameter names do
not change, so checkpoints and the plain export are those of any run. At export the trained weights are
quantised with ``base`` itself (what torchao's ``step="convert"`` does after swapping the modules back),
through transformers' ``TorchAoConfig`` (:mod:`shardlm.convert.quantized_out`).

=======================================  =====================================================================
``int8_dynamic_activation_int4_weight``  ``Int8DynamicActivationIntxWeightConfig(weight_dtype=int4,
                                         weight_granularity=PerGroup(g))``: int4 weights (symmetric, a scale
                                         per g inputs), int8 activations (asymmetric, per token), "8da4w"
``int8_dynamic_activation_int8_weight``  the same with int8 weights, one scale per output row
``int4_weight_only``                     ``IntxWeightOnlyConfig(weight_dtype=int4, granularity=PerGroup(g))``
``int8_weight_only``                     ``IntxWeightOnlyConfig(weight_dtype=int8, granularity=PerAxis(0))``
=======================================  =====================================================================

All four are torchao's CPU-capable "unpacked to int8" layout (``IntxUnpackedToInt8Tensor``), which torchao
stores in safetensors and transformers loads. Targeted layers: every ``nn.Linear`` of the blocks except
the output projection ``lm_head`` (the chunked loss reads its weight directly, past any module wrapper) and a
mixture of experts' router; g is ``train.qat_group_size`` (torchao's group size, default 32; 0: one scale per
output row, ``PerAxis(0)``), and with g > 0 a layer whose input width is not a multiple of g is left in full
precision. The same rule picks the layers quantised at export (:func:`qat_excluded`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from shardlm.errors import ConfigError

#: ``train.qat`` schemes -> (activation int8 dynamic?, weight bits); int4 weights per group, int8 per row
QAT_SCHEMES: dict[str, tuple[bool, int]] = {
    "int8_dynamic_activation_int4_weight": (True, 4),
    "int8_dynamic_activation_int8_weight": (True, 8),
    "int4_weight_only": (False, 4),
    "int8_weight_only": (False, 8),
}
#: inputs per int4 weight scale unless ``train.qat_group_size`` says otherwise (torchao's QAT examples' 32)
GROUP_SIZE = 32


def check_scheme(scheme: str) -> tuple[bool, int]:
    """The row of :data:`QAT_SCHEMES` for ``scheme``.

    Raises:
        ConfigError: a scheme not in the table (the message lists them).
    """
    if scheme not in QAT_SCHEMES:
        raise ConfigError(f"train.qat: unknown scheme {scheme!r}; torchao's QAT schemes built here: none, "
                          f"{', '.join(QAT_SCHEMES)}")
    return QAT_SCHEMES[scheme]


def group_of(scheme: str, group_size: int = GROUP_SIZE) -> int:
    """Inputs per weight scale of ``scheme``: ``group_size`` for int4 weights, 0 (one per output row) for
    int8."""
    return group_size if check_scheme(scheme)[1] == 4 else 0


def base_config(scheme: str, group_size: int = GROUP_SIZE) -> Any:
    """torchao's post-training quantisation config of ``scheme`` with int4 weights' ``group_size`` (0: one
    scale per output row; see the module docstring's table).

    Raises:
        ConfigError: as :func:`check_scheme`.
    """
    dynamic, bits = check_scheme(scheme)
    group = group_of(scheme, group_size)
    from torchao.quantization import (
        Int8DynamicActivationIntxWeightConfig,
        IntxWeightOnlyConfig,
        PerAxis,
        PerGroup,
    )

    dtype = torch.int4 if bits == 4 else torch.int8
    granularity = PerGroup(group) if group else PerAxis(0)
    if dynamic:
        return Int8DynamicActivationIntxWeightConfig(weight_dtype=dtype, weight_granularity=granularity)
    return IntxWeightOnlyConfig(weight_dtype=dtype, granularity=granularity)


def qat_filter(model: nn.Module, scheme: str,
               group_size: int = GROUP_SIZE) -> Callable[[nn.Module, str], bool]:
    """``(module, name) -> bool``: whether ``scheme`` fake-quantises (and the export quantises) ``module``."""
    group = group_of(scheme, group_size)
    excluded = {"lm_head"} | {f"{name}.{module.router_name}" for name, module in model.named_modules()
                              if hasattr(module, "router_name")}

    def targeted(module: nn.Module, name: str) -> bool:
        if not isinstance(module, nn.Linear) or name in excluded:
            return False
        return not group or module.in_features % group == 0
    return targeted


def qat_excluded(model: nn.Module, scheme: str, group_size: int = GROUP_SIZE) -> list[str]:
    """Names of ``model``'s ``nn.Linear`` layers that ``scheme`` leaves in full precision (``lm_head``,
    routers, unaligned layers): transformers' ``modules_to_not_convert`` at export."""
    targeted = qat_filter(model, scheme, group_size)
    return [name for name, module in model.named_modules()
            if isinstance(module, nn.Linear) and not targeted(module, name)]


def apply_qat(model: nn.Module, scheme: str, group_size: int = GROUP_SIZE) -> list[str]:
    """Fake-quantise ``model``'s targeted linear layers in place for ``scheme`` (torchao's
    ``QATConfig(base_config(scheme), step="prepare")``); return their names. Works on the meta device, before
    ``fully_shard``.

    Raises:
        ConfigError: as :func:`check_scheme`; no layer is targeted.
    """
    targeted = qat_filter(model, scheme, group_size)
    names = [name for name, module in model.named_modules() if targeted(module, name)]
    if not names:
        raise ConfigError(f"train.qat={scheme!r}: no linear layer to fake-quantise (every one is lm_head, a "
                          f"router, or has an input width that is not a multiple of train.qat_group_size="
                          f"{group_size})")
    from torchao.quantization import quantize_
    from torchao.quantization.qat import QATConfig

    quantize_(model, QATConfig(base_config(scheme, group_size), step="prepare"), filter_fn=targeted)
    return names
