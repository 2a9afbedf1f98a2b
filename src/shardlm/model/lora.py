"""Low-rank adapters (LoRA, Hu et al., 2021) on linear layers, optionally on a 4-bit NF4 base (QLoRA,
Dettmers et al., 2023). No distributed code: :func:`shardlm.train.build.build_model` applies them before FSDP.

A :class:`LoRALinear` replaces an ``nn.Linear`` of shape ``(out, in)``, with or without a bias b (Qwen2's
q/k/v projections have one):

    y = x · Wᵀ + b + (alpha / r) · dropout(x) · Aᵀ · Bᵀ,
    W (out, in) and b (out,) frozen, A (r, in), B (out, r) trained.

The frozen base keeps its names (``...q_proj.weight``, ``...q_proj.bias``), so pretrained weights load
unchanged; the adapters are ``...q_proj.lora_A.weight`` and ``...q_proj.lora_B.weight``, PEFT's names. A is
drawn like PEFT's default (Kaiming-uniform, a = √5) and B is zero, so at step 0 the model equals its base.

The base may be stored in a narrower dtype than the adapters: ``bfloat16`` (the targeted layers' weights, cast
to the input's dtype in forward), or ``nf4`` (QLoRA: every frozen weight matrix of the model, the targeted
layers', any other linear layer's and the token embedding, tied output projection included, becomes torchao's
``NF4Tensor``: 4-bit NormalFloat codes in blocks of 64 values with double-quantised scales, dequantised in
forward, one layer at a time; the embedding lookup dequantises only the rows it reads, :class:`NF4Embedding`).
Norm weights (and biases) stay fp32: a few thousand values per layer.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from shardlm.errors import ConfigError
from shardlm.model.cpu_matmul import bf16_linear_fp32

#: values per NF4 block (QLoRA's block size)
NF4_BLOCK = 64
#: NF4 scaler blocks must split evenly over up to this many ranks (and any power of two below it)
NF4_MAX_SHARDS = 8


@dataclass(frozen=True)
class LoRASpec:
    """What :func:`apply_lora` needs: rank r, scale numerator alpha, dropout probability, the targeted module
    names (comma-separated; a name matches a module's last name component, e.g. ``q_proj``) and the base's
    storage dtype (``float32``, ``bfloat16`` or ``nf4``)."""

    rank: int
    alpha: float
    dropout: float
    targets: str
    base_dtype: str = "float32"


class NF4Embedding(nn.Embedding):
    """A frozen token embedding whose table may be an NF4 tensor (QLoRA); ``(...,) int64 -> (..., dim)``.

    With an NF4 ``weight`` (vocab, dim) the lookup dequantises only the rows of the given tokens
    (:func:`nf4_rows`, bit-equal to dequantising the whole table and indexing it) and returns them in
    ``compute_dtype`` (the model's compute dtype, ``parallel.param_dtype``; set by
    :func:`quantize_base_meta_`). A tied output projection (``nn.Linear`` sharing the tensor) dequantises the
    whole table in its own forward and backward (torchao's ``linear_nf4``). Any other
    weight: ``nn.Embedding``.
    """

    compute_dtype: torch.dtype = torch.float32

    def forward(self, tokens: Tensor) -> Tensor:
        if not is_nf4(self.weight):
            return super().forward(tokens)
        return nf4_rows(self.weight, tokens).to(self.compute_dtype)


class LoRALinear(nn.Module):
    """A frozen linear map plus a trained low-rank update; ``(..., in_features) -> (..., out_features)``.

    Parameters: ``weight`` (out, in), frozen, fp32 / bf16 / NF4; with ``bias``, ``bias`` (out,), frozen, fp32
    (PEFT's ``bias="none"``: the base's bias, untrained); ``lora_A.weight`` (r, in) and ``lora_B.weight``
    (out, r), fp32, trained. ``scaling = alpha / r``. With ``fp32_matmul`` set (the CPU
    bf16 kernel, :mod:`shardlm.model.cpu_matmul`) a bf16 base is multiplied in fp32.
    """

    def __init__(self, in_features: int, out_features: int, rank: int, alpha: float, dropout: float = 0.0,
                 bias: bool = False) -> None:
        super().__init__()
        self.in_features, self.out_features, self.rank = in_features, out_features, rank
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None
        self.lora_A = nn.Linear(in_features, rank, bias=False)
        self.lora_B = nn.Linear(rank, out_features, bias=False)
        self.scaling = alpha / rank
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.fp32_matmul = False
        self.adapters_enabled = True
        """False: the layer is its base alone (a preference run's reference pass,
        shardlm/train/preference.py)."""

    def base(self, x: Tensor) -> Tensor:
        """The frozen map x · Wᵀ (+ b) in ``x``'s dtype (an NF4 or narrower base is dequantised /
        upcast first)."""
        w, b = self.weight, None if self.bias is None else self.bias.to(x.dtype)
        if is_nf4(w):
            y = F.linear(x, w)  # torchao's LinearNF4: dequantise to x.dtype, multiply; no grad for W
        elif self.fp32_matmul and x.dtype == torch.bfloat16:
            y = bf16_linear_fp32(x, w.to(x.dtype))
        else:
            return F.linear(x, w.to(x.dtype), b)  # as nn.Linear computes it (bias added in the same kernel)
        return y if b is None else y + b

    def delta(self, x: Tensor) -> Tensor:
        """The adapters' term (alpha / r) · dropout(x) · Aᵀ · Bᵀ, computed in the adapters' dtype, returned
        in x's."""
        a = self.lora_A.weight
        h = self.dropout(x).to(a.dtype)
        return (F.linear(F.linear(h, a), self.lora_B.weight) * self.scaling).to(x.dtype)

    def forward(self, x: Tensor) -> Tensor:
        if not self.adapters_enabled:
            return self.base(x)
        return self.base(x) + self.delta(x)

    def initial_adapters(self, name: str, seed: int) -> tuple[Tensor, Tensor]:
        """Full initial (A, B), fp32: A ~ U(-1/√in, 1/√in) (Kaiming-uniform with a = √5, PEFT's default), B
        = 0.

        A comes from a generator seeded by (seed, ``name``): the same at any sharding or construction order.
        """
        gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(f"{name}.lora_A".encode()))
        bound = 1.0 / math.sqrt(self.in_features)
        a = (torch.rand(self.rank, self.in_features, generator=gen) * 2 - 1) * bound
        return a, torch.zeros(self.out_features, self.rank)


def is_nf4(t: Tensor) -> bool:
    """Whether ``t`` (or a DTensor's local tensor) is torchao's NF4Tensor (checked by class name: torchao
    is optional)."""
    local = getattr(t, "_local_tensor", t)
    return type(local).__name__ == "NF4Tensor"


def nf4_rows(weight: Tensor, ids: Tensor) -> Tensor:
    """Rows ``ids`` of a 2-D NF4 tensor ``weight`` (rows, cols), dequantised: ``ids.shape + (cols,)``, bf16.

    Decodes only the selected rows' 4-bit codes and their block scales (the scales of all blocks are
    dequantised first: one value per 64). Equal, bit for bit, to ``weight.get_original_weight()[ids]`` (the
    same bf16 products); when ``cols`` is not a multiple of the block size a row shares blocks with its
    neighbours and the whole table is dequantised instead.
    """
    rows, cols = weight.shape
    if cols % weight.block_size:
        return weight.get_original_weight()[ids]
    codes = weight.quantized_data.view(rows, cols // 2)[ids]  # two codes per byte, the first in the high half
    scales = weight.dequantize_scalers(weight.quantized_scalers, weight.quantization_factor,
                                       weight.scaler_block_size)
    scales = scales.view(rows, cols // weight.block_size)[ids].repeat_interleave(weight.block_size, dim=-1)
    values = torch.stack((weight.nf4[(codes >> 4).long()], weight.nf4[(codes & 0b1111).long()]), dim=-1)
    return values.flatten(-2) * scales


def nf4_scaler_block(numel: int) -> int:
    """NF4 second-level block (number of first-level scales quantised together) for a tensor of
    ``numel`` values.

    The largest power of two <= 256 (torchao's default) that leaves a multiple of :data:`NF4_MAX_SHARDS`
    scaler blocks, so the quantised tensor splits evenly over 1, 2, 4 or 8 ranks; it depends on the tensor
    only, so the quantised values are the same at every world size.

    Raises:
        ConfigError: ``numel`` is not a multiple of 64 · 8 values.
    """
    if numel % (NF4_BLOCK * NF4_MAX_SHARDS):
        raise ConfigError(f"NF4 needs weights whose size is a multiple of {NF4_BLOCK * NF4_MAX_SHARDS} "
                          f"values, got {numel}")
    blocks = numel // NF4_BLOCK
    s = 256
    while blocks % (s * NF4_MAX_SHARDS):
        s //= 2
    return s


def to_nf4(full: Tensor) -> Tensor:
    """Quantise a full 2-D weight to torchao's NF4Tensor (bf16 nominal dtype), blocks of 64, scaler block from
    :func:`nf4_scaler_block`.

    Raises:
        ConfigError: torchao is not installed (names the ``qlora`` extra).
    """
    try:
        from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import to_nf4 as torchao_to_nf4
    except ImportError:
        raise ConfigError(
            "lora.base_dtype = 'nf4' (QLoRA) needs torchao: pip install 'shardlm[qlora]'"
        ) from None
    return torchao_to_nf4(full.to(torch.bfloat16).contiguous(), NF4_BLOCK, nf4_scaler_block(full.numel()))


def target_names(targets: str) -> list[str]:
    """The comma-separated target names, stripped, empty items dropped."""
    return [t.strip() for t in targets.split(",") if t.strip()]


def apply_lora(model: nn.Module, spec: LoRASpec) -> list[str]:
    """Replace the targeted ``nn.Linear`` modules of ``model`` by :class:`LoRALinear` and freeze the rest.

    Works on the meta device (before FSDP); every parameter except the adapters gets ``requires_grad=False``.
    A bf16 base is stored in bf16; an NF4 base stays bf16 here and is quantised when its values are set
    (:func:`shardlm.train.build.build_model`). Returns the replaced modules' names.

    Raises:
        ConfigError: a target name that matches no linear layer (listing the names there are), an MLP name in
            a mixture of experts (LoRA on experts is not built), or a rank < 1 or above a targeted layer's
            smaller dimension.
    """
    names = target_names(spec.targets)
    has_experts = any(n.endswith("mlp.experts") for n, _ in model.named_modules())
    expert_targets = [t for t in names if t in ("gate_proj", "up_proj", "down_proj", "gate_up_proj",
                                                "experts")]
    if has_experts and expert_targets:
        raise ConfigError(f"lora.targets {','.join(expert_targets)}: LoRA on the experts of a mixture of "
                          "experts is not built (one adapter per expert); target the attention projections, "
                          "e.g. lora.targets = \"q_proj,k_proj,v_proj,o_proj\"")
    linears = {n: m for n, m in model.named_modules() if type(m) is nn.Linear}
    leaf = {n: n.rsplit(".", 1)[-1] for n in linears}
    available = sorted(set(leaf.values()))
    unknown = [t for t in names if t not in available]
    if not names or unknown:
        raise ConfigError(f"lora.targets {unknown or spec.targets!r} match no linear layer; the linear "
                          f"layers are named {', '.join(available)}")
    tied = getattr(getattr(model, "cfg", None), "tie_embeddings", False)
    if tied and "lm_head" in names:
        raise ConfigError("lora.targets: lm_head is tied to the token embedding; leave it out")
    for p in model.parameters():
        p.requires_grad_(False)
    replaced = []
    for name, linear in linears.items():
        if leaf[name] not in names:
            continue
        out_f, in_f = linear.weight.shape
        if not 1 <= spec.rank <= min(in_f, out_f):
            raise ConfigError(f"lora.rank={spec.rank} must be between 1 and the layer width min(in, out) = "
                              f"{min(in_f, out_f)} of {name} ({in_f} -> {out_f})")
        with torch.device(linear.weight.device):
            lora = LoRALinear(in_f, out_f, spec.rank, spec.alpha, spec.dropout, bias=linear.bias is not None)
        if spec.base_dtype in ("bfloat16", "nf4"):
            lora.weight.data = lora.weight.data.to(torch.bfloat16)
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, lora)
        replaced.append(name)
    return replaced


def lora_modules(model: nn.Module) -> Iterable[tuple[str, LoRALinear]]:
    """``(name, module)`` of every :class:`LoRALinear` in ``model``."""
    return ((n, m) for n, m in model.named_modules() if isinstance(m, LoRALinear))


def set_fp32_matmul(model: nn.Module) -> None:
    """Let every :class:`LoRALinear`'s bf16 base multiply through the CPU fp32 kernel
    (``parallel.cpu_bf16_matmul``)."""
    for _, m in lora_modules(model):
        m.fp32_matmul = True


def quantize_base_meta_(model: nn.Module, device: torch.device | str,
                        compute_dtype: torch.dtype = torch.float32) -> list[str]:
    """Make every frozen weight matrix of ``model`` an NF4 tensor on the meta device (before FSDP shards it).

    The frozen matrices are the :class:`LoRALinear` bases, any other frozen ``nn.Linear`` weight (layers not
    targeted, an untied output projection) and the token embedding (an ``nn.Embedding`` becomes an
    :class:`NF4Embedding` returning ``compute_dtype``); a tied output projection keeps sharing the embedding's
    (now NF4) parameter. Norm weights and biases keep their dtype. Returns the quantised parameters' names.

    Values are set later, from the full weight, by :func:`set_from_full_`. The two per-tensor items of an NF4
    tensor that FSDP does not shard (the mean of the block scales and the 16-value code book) are allocated on
    ``device`` now: every shard and all-gathered copy refers to these same tensors, so filling them in place
    later reaches all of them.

    Raises:
        ConfigError: a frozen matrix whose size is not a multiple of 512 values (named), or torchao missing.
    """
    for name, module in list(model.named_modules()):
        if type(module) is nn.Embedding and not module.weight.requires_grad:
            embedding = NF4Embedding(module.num_embeddings, module.embedding_dim, device="meta")
            embedding.weight = module.weight
            embedding.compute_dtype = compute_dtype
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, child, embedding)
    quantised: dict[int, nn.Parameter] = {}
    names = {id(p): n for n, p in model.named_parameters()}
    for module in model.modules():
        w = getattr(module, "weight", None)
        if not isinstance(module, (LoRALinear, nn.Linear, nn.Embedding)) or w is None or w.requires_grad:
            continue
        if id(w) not in quantised:
            try:
                nf4_scaler_block(w.numel())
            except ConfigError as e:
                raise ConfigError(f"lora.base_dtype = 'nf4': {names[id(w)]} {tuple(w.shape)}: {e}") from None
            q = to_nf4(torch.empty(w.shape, dtype=torch.bfloat16, device="meta"))
            q.scaler_mean = torch.zeros((), dtype=torch.bfloat16, device=device)
            q.nf4 = torch.zeros(16, dtype=torch.bfloat16, device=device)
            quantised[id(w)] = nn.Parameter(q, requires_grad=False)
        module.weight = quantised[id(w)]
    return [names[i] for i in quantised]


def _local_rows(param: Tensor) -> tuple[int, int]:
    """(first row, rows) of this rank's ``Shard(0)`` piece of a DTensor (the whole for a plain tensor)."""
    if not isinstance(param, DTensor):
        return 0, param.shape[0]
    shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
    return int(offset[0]), int(shape[0])


@torch.no_grad()
def set_from_full_(param: Tensor, full: Tensor) -> None:
    """Fill ``param`` (a plain tensor or a ``Shard(0)`` DTensor; NF4 or not) from its full value, in place.

    A plain local tensor copies its rows of ``full`` (cast to its dtype). An NF4 one is quantised from the
    whole ``full`` first and then takes its rows, so its codes and scales do not depend on the world size.
    """
    local = param.to_local() if isinstance(param, DTensor) else param
    start, rows = _local_rows(param)
    if not is_nf4(local):
        local.copy_(full[start:start + rows].to(local.dtype))
        return
    q = to_nf4(full)
    piece = q if rows == full.shape[0] else torch.split(q, rows, dim=0)[start // rows]
    # codes and scales, and in place the shared per-tensor items
    local.copy_(piece.to(local.quantized_data.device))
