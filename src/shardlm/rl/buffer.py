"""One rank's buffer of a generation cycle as tensors and back, for a checkpoint saved inside the cycle
(:mod:`shardlm.checkpoint.rank_state` writes it as safetensors; :mod:`shardlm.train.objectives.grpo` says what
the buffer is): the rollout of this rank's prompts, its advantages and old log-probs, the generation batch's
completions (every rank's, as gathered), reward table and metrics, and the per-step loss denominator. The
round trip is exact: the same tensors (dtypes, shapes, bits) and the same Python floats.
"""

from __future__ import annotations

import json
from typing import Any

import torch
from torch import Tensor

from shardlm.rl.rollout import Rollout

#: the :class:`~shardlm.rl.rollout.Rollout` tensors saved as they are
ROLLOUT_TENSORS = ("completion_ids", "completion_mask", "lengths", "truncated", "logps", "prompt_index",
                   "generation_index")


def _ragged(lists: list[list[int]]) -> tuple[Tensor, Tensor]:
    """Token-id lists as (Σ lengths,) int64 ids and (n,) int64 lengths."""
    flat = [t for ids in lists for t in ids]
    return torch.tensor(flat, dtype=torch.long), torch.tensor([len(ids) for ids in lists], dtype=torch.long)


def _lists(flat: Tensor, lengths: Tensor) -> list[list[int]]:
    """:func:`_ragged`'s inverse."""
    return [part.tolist() for part in torch.split(flat, lengths.tolist())]


def pack_buffer(context: dict[str, Any], denominator: float) -> tuple[dict[str, Tensor], dict[str, str]]:
    """The tensors and the string header of a generation's buffer.

    Args:
        context: the generation's context (:meth:`~shardlm.train.objectives.grpo.GRPOObjective.generate`):
            ``rollout`` (this rank's :class:`~shardlm.rl.rollout.Rollout`, B rows), ``advantages`` (B,) fp32,
            ``old_logps`` (B, Tc) fp32 or None, ``completion_ids`` (N token-id lists, the generation batch),
            ``rewards`` (N, F) fp32, ``metrics`` (name -> float).
        denominator: each step's loss denominator (:func:`shardlm.rl.loss.loss_denominator`).
    """
    ro: Rollout = context["rollout"]
    tensors = {f"rollout.{name}": getattr(ro, name) for name in ROLLOUT_TENSORS}
    tensors["rollout.prompts"], tensors["rollout.prompt_lengths"] = _ragged(ro.prompts)
    tensors["completions"], tensors["completion_lengths"] = _ragged(context["completion_ids"])
    names = sorted(context["metrics"])
    values = [float(context["metrics"][k]) for k in names]
    tensors.update({"advantages": context["advantages"], "rewards": context["rewards"],
                    "metrics": torch.tensor(values, dtype=torch.float64),
                    "denominator": torch.tensor([denominator], dtype=torch.float64)})
    if context["old_logps"] is not None:
        tensors["old_logps"] = context["old_logps"]
    return tensors, {"metric_names": json.dumps(names)}


def unpack_buffer(tensors: dict[str, Tensor], header: dict[str, str]) -> tuple[dict[str, Any], float]:
    """:func:`pack_buffer`'s inverse: the context (its times 0: the generation ran before the resume) and
    the denominator.

    Raises:
        KeyError: a tensor or the header's ``metric_names`` missing (not a buffer of this shardlm).
    """
    ro = Rollout(prompts=_lists(tensors["rollout.prompts"], tensors["rollout.prompt_lengths"]),
                 **{name: tensors[f"rollout.{name}"] for name in ROLLOUT_TENSORS})
    names = json.loads(header["metric_names"])
    context = {"rollout": ro, "advantages": tensors["advantages"], "old_logps": tensors.get("old_logps"),
               "completion_ids": _lists(tensors["completions"], tensors["completion_lengths"]),
               "rewards": tensors["rewards"], "metrics": dict(zip(names, tensors["metrics"].tolist())),
               "logps_s": 0.0, "rollout_s": 0.0, "reward_s": 0.0}
    return context, float(tensors["denominator"].item())
