"""What the step needs of a batch of sampled completions besides their rewards: which are truncated, the
loss mask under ``rl.mask_truncated_completions``, and the ``completions/*`` metrics under TRL 1.16's names
(``GRPOTrainer._generate_and_score_completions``).

A completion is *truncated* when its last token is not an end-of-turn id (or the pad id): it reached
``rl.max_completion_length`` first (TRL's ``is_truncated``: ``ids[-1] not in eos_and_pad``).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

import torch
from torch import Tensor


def truncated(completion_ids: Sequence[Sequence[int]], stop_ids: Collection[int]) -> Tensor:
    """(N,) bool: True where a completion does not end with one of ``stop_ids`` (the end-of-turn ids and
    the pad id); an empty completion counts as truncated (it ends with no stop id)."""
    stops = set(stop_ids)
    return torch.tensor([not ids or ids[-1] not in stops for ids in completion_ids], dtype=torch.bool)


def loss_mask(completion_mask: Tensor, is_truncated: Tensor, mask_truncated_completions: bool) -> Tensor:
    """The mask of the tokens the loss counts: ``completion_mask`` (B, T), with the rows of truncated
    completions zeroed under ``mask_truncated_completions`` (DAPO's overlong filtering; TRL multiplies by
    ``~is_truncated``). Its row sums are the ``completion_lengths`` of
    :func:`~shardlm.rl.loss.loss_denominator`. Same dtype as ``completion_mask``."""
    if not mask_truncated_completions:
        return completion_mask
    return completion_mask * (~is_truncated).unsqueeze(1).to(completion_mask.dtype)


def completion_metrics(lengths: Tensor, is_truncated: Tensor) -> dict[str, float]:
    """TRL's ``completions/*`` metrics of the GLOBAL batch (every rank's completions: gather the lengths and
    flags first).

    Args:
        lengths: (N,) int, tokens of each completion (its end-of-turn id included, as sampled).
        is_truncated: (N,) bool, :func:`truncated`.

    Returns:
        ``completions/mean_length``, ``min_length``, ``max_length``, ``clipped_ratio`` (the truncated
        fraction), ``mean_terminated_length``, ``min_terminated_length``, ``max_terminated_length`` (over the
        completions that ended; 0 when none did, as TRL).
    """
    lengths = lengths.float()
    ended = lengths[~is_truncated]
    if ended.numel() == 0:
        ended = torch.zeros(1)
    return {"completions/mean_length": lengths.mean().item(), "completions/min_length": lengths.min().item(),
            "completions/max_length": lengths.max().item(),
            "completions/clipped_ratio": is_truncated.float().mean().item(),
            "completions/mean_terminated_length": ended.mean().item(),
            "completions/min_terminated_length": ended.min().item(),
            "completions/max_terminated_length": ended.max().item()}
