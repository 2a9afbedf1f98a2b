"""The token loss, one function for training, evaluation and perplexity."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from shardlm.data.instruct import IGNORE_INDEX


def token_loss_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Summed next-token cross-entropy over every target that is not ``IGNORE_INDEX`` (-100).

    Args:
        logits: (B, T, V) in any float dtype; upcast to fp32 before the softmax (as transformers does).
        targets: (B, T) int64 token ids, ``IGNORE_INDEX`` where nothing is scored.

    Returns a 0-dim fp32 tensor: the sum, in nats, over the scored positions. Divide by the number of
    scored targets (summed over ranks and micro-batches) for the mean.
    """
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=IGNORE_INDEX,
                           reduction="sum")
