"""The hub's on-disk layout of mixture-of-experts weights <-> the model's stacked expert tensors.

In memory (transformers 5.x and shardlm) a MoE layer's experts are two 3-D tensors:
``mlp.experts.gate_up_proj`` (E, 2·hidden, dim), expert e's gate rows then its up rows, and
``mlp.experts.down_proj`` (E, dim, hidden). On disk (what ``save_pretrained`` writes and hub checkpoints hold)
each expert has its own 2-D tensors, named per family (transformers' ``conversion_mapping.py``; the family's
``hf_expert_names``):

=============  ==============================================  ===================================
family         expert e of layer i (prefix ``model.layers.i.``)  router
=============  ==============================================  ===================================
qwen3_moe      ``mlp.experts.e.{gate,up,down}_proj.weight``      ``mlp.gate.weight``
mixtral        ``block_sparse_moe.experts.e.{w1,w3,w2}.weight``  ``block_sparse_moe.gate.weight``
=============  ==============================================  ===================================

Every other tensor has the same name on disk and in memory. Dim 0 of a stacked tensor is the expert, so a rank
whose shard holds experts [a, b) reads only those experts' tensors (:func:`read_rows`).
"""

from __future__ import annotations

import re
from collections.abc import Callable

import torch

from shardlm.model.config import ModelConfig

#: the per-expert names of transformers 5.x's common on-disk layout (Qwen2/3-MoE, DeepSeek V3, Qwen3-Next,
#: GLM-4 MoE...), read for ``model.backend = "transformers"``: (module, gate, up, down) as a family's
#: ``hf_expert_names``
TRANSFORMERS_EXPERT_NAMES = ("mlp", "gate_proj", "up_proj", "down_proj")

_STACKED = re.compile(r"^(model\.layers\.\d+\.)mlp\.experts\.(gate_up_proj|down_proj)$")
_ROUTER = re.compile(r"^(model\.layers\.\d+\.)mlp\.gate\.(weight|bias)$")


def expert_names(cfg: ModelConfig) -> tuple[str, str, str, str] | None:
    """(module, gate, up, down) of the on-disk expert tensors: the family's ``hf_expert_names``, or
    :data:`TRANSFORMERS_EXPERT_NAMES` under the transformers backend; None: no stacked experts."""
    if cfg.backend == "transformers":
        return TRANSFORMERS_EXPERT_NAMES
    return cfg.arch.hf_expert_names


def disk_shapes(cfg: ModelConfig, name: str, shape: tuple[int, ...]) -> dict[str, tuple[int, ...]]:
    """The on-disk tensors (name -> shape) that hold the model's parameter ``name`` of ``shape``, in
    row order.

    A stacked expert tensor (E, rows, cols) is ``E`` (gate_up: ``2E``) per-expert tensors; a Mixtral router is
    renamed; any other parameter is itself.
    """
    if not expert_names(cfg):
        return {name: tuple(shape)}
    module, gate, up, down = expert_names(cfg)
    stacked = _STACKED.match(name)
    if stacked:
        prefix, which = stacked.groups()
        n, rows, cols = shape
        if which == "down_proj":
            return {f"{prefix}{module}.experts.{e}.{down}.weight": (rows, cols) for e in range(n)}
        half = rows // 2
        return {
            f"{prefix}{module}.experts.{e}.{w}.weight": (half, cols) for e in range(n) for w in (gate, up)
        }
    router = _ROUTER.match(name)
    if router:
        return {f"{router.group(1)}{module}.gate.{router.group(2)}": tuple(shape)}
    return {name: tuple(shape)}


def read_rows(cfg: ModelConfig, name: str, shape: tuple[int, ...], start: int, stop: int,
              read: Callable[[str], torch.Tensor]) -> torch.Tensor:
    """Rows ``[start, stop)`` (dim 0) of parameter ``name`` assembled from its on-disk tensors.

    ``read(disk_name)`` returns a whole on-disk tensor; a stacked expert tensor reads only experts
    ``start..stop-1`` (gate and up concatenated on their rows), any other parameter reads its one tensor and
    slices it (callers with row access read plain tensors themselves). Shapes as :func:`disk_shapes`.
    """
    names = list(disk_shapes(cfg, name, shape))
    if not _STACKED.match(name) or not expert_names(cfg):
        return read(names[0])[start:stop]
    per = len(names) // shape[0]  # tensors per expert: 2 (gate, up) or 1 (down)
    experts = [torch.cat([read(n) for n in names[e * per:(e + 1) * per]]) for e in range(start, stop)]
    if not experts:
        return torch.empty((0, *shape[1:]))
    return torch.stack(experts)


def to_disk(cfg: ModelConfig, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The state dict in the on-disk layout: stacked experts split into per-expert tensors (contiguous
    copies), routers renamed per family; other tensors as they are."""
    out: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        names = list(disk_shapes(cfg, name, tuple(t.shape)))
        if not (_STACKED.match(name) and expert_names(cfg)):
            out[names[0]] = t
            continue
        pieces = [piece for e in range(t.shape[0]) for piece in (t[e].chunk(len(names) // t.shape[0]))]
        out.update({n: p.contiguous() for n, p in zip(names, pieces)})
    return out
