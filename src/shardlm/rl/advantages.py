"""Group-relative advantages of the GRPO family, as TRL 1.16's ``GRPOTrainer._generate_and_score_completions``
computes them (its default ``multi_objective_aggregation = "sum_then_normalize"``), and the reward metrics it
logs under the same names.

With ``r[i, k]`` the k-th reward function's value for completion i (NaN where the function returned None),
``w`` the reward weights, G completions per prompt laid out group after group (``[p0 g0, p0 g1, ..., p1 g0,
...]``)::

    R[i]     = Σ_k w[k]·r[i, k] over the k where r[i, k] is not NaN   (NaN when every r[i, k] is NaN)
    mean[i]  = nanmean of R over i's group
    std[i]   = nanstd of R over i's group (Bessel-corrected)         scale_rewards "group" and "none"
             = nanstd of R over the whole batch                      scale_rewards "batch"
    A[i]     = (R[i] - mean[i]) / (std[i] + 1e-4)                    "group", "batch"
             = R[i] - mean[i]                                        "none"
    A[i]     = 0 where A[i] is NaN (an unscorable completion)

Every function here takes the GLOBAL batch: all ranks' completions, ``num_prompts * G`` rows. Rewards are
cheap, so every rank computes (or gathers) the rewards of the whole global batch and then calls these
functions on identical inputs: the advantages, and so the step, do not depend on the world size. Each rank
then keeps the rows of its own completions (TRL does the same: it gathers ``rewards_per_func`` across
processes, normalises, and slices ``process_slice``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

#: the ``rl.scale_rewards`` values (TRL's names)
SCALE_REWARDS = ("group", "batch", "none")
#: added to the standard deviation before dividing (TRL's constant)
STD_EPS = 1e-4


def nanstd(x: Tensor, dim: int | None = None) -> Tensor:
    """Standard deviation ignoring NaNs, with Bessel's correction (n - 1), as ``trl.trainer.utils.nanstd``:
    NaN where fewer than two values are not NaN.

    Args:
        x: float tensor. dim: the dimension reduced; None reduces all.

    Returns:
        x's dtype; ``x`` with ``dim`` removed (a 0-d tensor when dim is None).
    """
    mean = torch.nanmean(x, dim=dim, keepdim=True)
    var = torch.nanmean((x - mean) ** 2, dim=dim, keepdim=True)
    count = (~torch.isnan(x)).sum(dim=dim, keepdim=True)
    correction = torch.where(count > 1, count / (count - 1), torch.full_like(var, float("nan")))
    std = torch.sqrt(var * correction)
    return std.squeeze() if dim is None else std.squeeze(dim)


def combine_rewards(rewards_per_func: Tensor, weights: Sequence[float] | Tensor) -> Tensor:
    """The weighted sum over the reward functions, NaN-aware (TRL: ``(r * w).nansum(1)``, and NaN for a
    completion every function returned None for: "unscorable").

    Args:
        rewards_per_func: (N, F) float32, NaN where a function returned None.
        weights: F weights (``rl.reward_weights``; 1 each when empty is resolved by the caller).

    Returns:
        (N,) float32.

    Raises:
        ValueError: when the number of weights is not F.
    """
    w = torch.as_tensor(weights, dtype=rewards_per_func.dtype, device=rewards_per_func.device)
    if w.shape != (rewards_per_func.shape[1],):
        raise ValueError(f"{w.numel()} reward weights for {rewards_per_func.shape[1]} reward functions")
    rewards = (rewards_per_func * w.unsqueeze(0)).nansum(dim=1)
    rewards[torch.isnan(rewards_per_func).all(dim=1)] = float("nan")
    return rewards


@dataclass
class Advantages:
    """The advantages of a global batch and what the metrics need of them; every tensor (N,) on the rewards'
    device, N = num_prompts × G."""

    advantages: Tensor
    """float32: A above, 0 for unscorable completions."""
    rewards: Tensor
    """float32: R above (NaN for unscorable completions)."""
    std: Tensor
    """float32: the standard deviation of each completion's group ("group", "none") or of the batch
    ("batch"): what ``frac_reward_zero_std`` tests."""
    is_std_zero: Tensor
    """bool: ``torch.isclose(std, 0)`` (TRL's test; NaN, a single scored completion, is not zero)."""


def group_advantages(rewards_per_func: Tensor, weights: Sequence[float] | Tensor, num_generations: int,
                     scale_rewards: Literal["group", "batch", "none"] = "group") -> Advantages:
    """Group-relative advantages of the whole global batch (formulas in the module docstring).

    Args:
        rewards_per_func: (num_prompts × G, F) float32, every rank's completions, group after group; NaN
            where a function returned None.
        weights: F reward weights.
        num_generations: G, completions per prompt (the group size); 1 gives std 0 (TRL's eval case).
        scale_rewards: "group", "batch" or "none".

    Returns:
        :class:`Advantages`.

    Raises:
        ValueError: an unknown ``scale_rewards``, or N not a multiple of G.
    """
    if scale_rewards not in SCALE_REWARDS:
        raise ValueError(f"scale_rewards must be one of {SCALE_REWARDS}, got {scale_rewards!r}")
    n = rewards_per_func.shape[0]
    if num_generations < 1 or n % num_generations:
        raise ValueError(f"{n} completions are not a whole number of groups of {num_generations}")
    rewards = combine_rewards(rewards_per_func, weights)
    grouped = rewards.view(-1, num_generations)
    mean = torch.nanmean(grouped, dim=1).repeat_interleave(num_generations)
    if scale_rewards == "batch":
        std = nanstd(rewards).expand_as(rewards) if n > 1 else torch.zeros_like(rewards)
    elif num_generations > 1:
        std = nanstd(grouped, dim=1).repeat_interleave(num_generations)
    else:
        std = torch.zeros_like(rewards)
    advantages = rewards - mean
    if scale_rewards != "none":
        advantages = advantages / (std + STD_EPS)
    return Advantages(advantages=torch.nan_to_num(advantages, nan=0.0), rewards=rewards, std=std,
                      is_std_zero=torch.isclose(std, torch.zeros_like(std)))


def reward_metrics(rewards_per_func: Tensor, names: Sequence[str], adv: Advantages) -> dict[str, float]:
    """The reward metrics of a global batch under TRL's names: ``reward`` and ``reward_std`` (nanmean and
    nanstd of R), ``rewards/<name>/mean`` and ``/std`` (each function's values, NaN-aware: over the
    completions it scored), ``frac_reward_zero_std`` (the fraction of completions whose group std is zero: for
    "group" / "none" the fraction of groups with equal rewards).

    Args:
        rewards_per_func: (N, F) float32 as given to :func:`group_advantages`.
        names: F function names (the ``rl.rewards`` entries' function names).
        adv: :func:`group_advantages`' result on the same rewards.

    Returns:
        name -> float (NaN where nothing was scored or fewer than two values for a std).
    """
    out: dict[str, float] = {}
    for k, name in enumerate(names):
        out[f"rewards/{name}/mean"] = torch.nanmean(rewards_per_func[:, k]).item()
        out[f"rewards/{name}/std"] = nanstd(rewards_per_func[:, k]).item()
    out["reward"] = torch.nanmean(adv.rewards).item()
    out["reward_std"] = nanstd(adv.rewards).item()
    out["frac_reward_zero_std"] = adv.is_std_zero.float().mean().item()
    return out
