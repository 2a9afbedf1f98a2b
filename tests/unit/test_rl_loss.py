"""The GRPO-family losses and advantages equal TRL 1.16's.

The loss and its gradient w.r.t. the per-token log-probs are compared with ``GRPOTrainer._compute_loss``
itself, called on a trainer made with ``object.__new__`` (``__init__`` not run) holding the attributes that
method reads, its ``_get_per_token_logps_and_entropies`` replaced by one returning fixed tensors; one process,
one accumulation step (``steps_per_generation`` = 1). The advantages replicate the lines of TRL 1.16.0's
``_generate_and_score_completions`` (grpo_trainer.py, "sum_then_normalize" branch, lines 2756-2796), which
cannot be called without a model and a generator, with TRL's own ``nanstd``. fp32 throughout, tolerance 1e-6.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from shardlm.config.sections import RLConfig
from shardlm.rl.advantages import combine_rewards, group_advantages, nanstd, reward_metrics
from shardlm.rl.loss import LOSS_TYPES, loss_denominator, metrics_from, policy_loss_sum
from tolerance import assert_close

trl = pytest.importorskip("trl", reason="pip install -e '.[test]' (trl==1.16.0)")
from trl.trainer.grpo_trainer import GRPOTrainer  # noqa: E402
from trl.trainer.utils import nanstd as trl_nanstd  # noqa: E402

TOL = 1e-6
B, T = 8, 7


def loss_scale(adv) -> float:
    """The loss is a weighted mean of per-token terms of size about max|A| (ratios near 1), which may cancel:
    its rounding is relative to that size, not to the (possibly tiny) result."""
    return adv.abs().max().item()


class _Accelerator:
    """What ``_compute_loss`` asks of accelerate on one process."""

    num_processes = 1

    def reduce(self, x, reduction="sum"):
        return x

    def gather(self, x):
        return x


def batch(seed: int = 0, off_policy: bool = True):
    """Fixed per-token log-probs (a leaf), old and reference log-probs, advantages of both signs, entropies,
    and a mask of varied lengths, one completion fully masked (a truncated one under
    mask_truncated_completions)."""
    g = torch.Generator().manual_seed(seed)
    logps = -torch.rand(B, T, generator=g) * 3
    old = logps + 0.4 * torch.randn(B, T, generator=g) if off_policy else None
    ref = logps + 0.3 * torch.randn(B, T, generator=g)
    adv = torch.randn(B, generator=g)
    lengths = torch.tensor([7, 3, 5, 0, 1, 6, 7, 2])
    mask = (torch.arange(T).unsqueeze(0) < lengths.unsqueeze(1)).long()
    entropies = torch.rand(B, T, generator=g) * 2
    return logps, old, ref, adv, mask, entropies


def trl_loss(rl: RLConfig, logps, old, ref, adv, mask, entropies, steps_per_generation=1, rows=slice(None)):
    """TRL's loss, gradient w.r.t. ``logps`` and logged metrics on the whole batch, or on its ``rows`` as one
    of the ``steps_per_generation`` slices of the whole batch as a generation batch (``num_items_in_batch``
    counts the whole's tokens, as ``_generate_and_score_completions`` does)."""
    num_items = mask.sum()
    logps, old, ref, adv, mask, entropies = (None if x is None else x[rows]
                                             for x in (logps, old, ref, adv, mask, entropies))
    B = mask.shape[0]
    leaf = logps.clone().requires_grad_(True)
    t = object.__new__(GRPOTrainer)
    t.loss_type, t.importance_sampling_level, t.beta = rl.loss_type, rl.importance_sampling_level, rl.beta
    t.epsilon_low, t.epsilon_high = rl.epsilon, rl.epsilon_high or rl.epsilon
    t.max_completion_length = rl.max_completion_length
    t.args = SimpleNamespace(delta=rl.delta or None, use_bias_correction_kl=rl.use_bias_correction_kl,
                             sapo_temperature_pos=rl.sapo_temperature_pos,
                             sapo_temperature_neg=rl.sapo_temperature_neg,
                             steps_per_generation=steps_per_generation)
    t.top_entropy_quantile, t.off_policy_mask_threshold, t.use_vllm = 1.0, None, False
    t._entropy_bonus_enabled, t.aux_loss_enabled = False, False
    t.model, t.current_gradient_accumulation_steps = SimpleNamespace(training=True), 1
    t.accelerator = _Accelerator()
    t._metrics = {"train": defaultdict(list), "eval": defaultdict(list)}
    t._get_per_token_logps_and_entropies = lambda *a, **k: (leaf, entropies, None)
    inputs = {"prompt_ids": torch.zeros(B, 2, dtype=torch.long),
              "prompt_mask": torch.ones(B, 2, dtype=torch.long),
              "completion_ids": torch.zeros(B, T, dtype=torch.long), "completion_mask": mask,
              "advantages": adv, "num_items_in_batch": num_items}
    if old is not None:
        inputs["old_per_token_logps"] = old
    if rl.beta:
        inputs["ref_per_token_logps"] = ref
    loss = t._compute_loss(None, inputs)
    loss.backward()
    return loss.detach(), leaf.grad, {k: v[0] for k, v in t._metrics["train"].items()}


def ours(rl: RLConfig, logps, old, ref, adv, mask, entropies, parts=((0, B),), steps_per_generation=1):
    """shardlm's loss over the row ranges ``parts`` (micro-batches of any rank), summed and divided by the
    global denominator (of the whole batch as a generation batch of ``steps_per_generation`` steps); its
    gradient (zero off ``parts``) and metrics."""
    leaf = logps.clone().requires_grad_(True)
    denom = loss_denominator(rl.loss_type, mask.sum(-1), rl.max_completion_length, steps_per_generation)
    total = torch.zeros(())
    sums, mins, maxs = {}, {}, {}
    for lo, hi in parts:
        rows = slice(lo, hi)
        terms = policy_loss_sum(rl, leaf[rows], adv[rows], mask[rows],
                                old_logps=None if old is None else old[rows],
                                ref_logps=ref[rows] if rl.beta else None, entropies=entropies[rows])
        total = total + terms.loss_sum
        for name, v in terms.sums.items():
            sums[name] = sums.get(name, 0) + v
        for name, v in terms.mins.items():
            mins[name] = torch.minimum(mins.get(name, v), v)
        for name, v in terms.maxs.items():
            maxs[name] = torch.maximum(maxs.get(name, v), v)
    loss = total / denom
    loss.backward()
    return loss.detach(), leaf.grad, metrics_from(sums, mins, maxs)


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_each_step_of_a_generation_batch_equals_trl(loss_type):
    """A generation batch of 8 completions in steps_per_generation = 2 optimizer steps of 4 (TRL at one
    process, gradient accumulation 1): each step's loss over its slice, with the denominator of
    :func:`loss_denominator` (dapo and cispo: the generation batch's tokens / 2), equals TRL's."""
    rl = settings(loss_type, "token", 0.0, True)
    data = batch(seed=7, off_policy=True)
    for j in range(2):
        rows = slice(4 * j, 4 * j + 4)
        want_loss, want_grad, _ = trl_loss(rl, *data, steps_per_generation=2, rows=rows)
        loss, grad, _ = ours(rl, *data, parts=((4 * j, 4 * j + 4),), steps_per_generation=2)
        assert_close(loss, want_loss, rtol=TOL, scale=loss_scale(data[3]), what=f"{loss_type} step {j}")
        assert_close(grad[rows], want_grad, rtol=TOL, what=f"{loss_type} step {j} d loss / d logps")
        other = slice(4 - 4 * j, 8 - 4 * j)
        assert grad[rows].abs().sum() > 0 and not grad[other].any()  # the step's slice only
    with pytest.raises(ValueError, match="cannot be split into steps_per_generation=3"):
        loss_denominator(loss_type, data[4].sum(-1), rl.max_completion_length, 3)


def settings(loss_type, level, beta, high, delta=0.0):
    """An ``[rl]`` with the given loss; ``high``: clip-higher (0.28, or cispo's cap 1.2 where the default
    ε = 0.2 would cap every ratio)."""
    eps_high = 0.0 if not high else (1.2 if loss_type == "cispo" else 0.28)
    return RLConfig(loss_type=loss_type, importance_sampling_level=level, beta=beta, epsilon_high=eps_high,
                    max_completion_length=T + 3, delta=delta)


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("beta", [0.0, 0.04])
@pytest.mark.parametrize("high", [False, True], ids=["eps", "clip_higher"])
@pytest.mark.parametrize("off_policy", [False, True], ids=["mu1", "mu2"])
def test_loss_and_gradient_equal_trl(loss_type, level, beta, high, off_policy):
    rl = settings(loss_type, level, beta, high)
    data = batch(seed=hash((loss_type, level)) % 1000, off_policy=off_policy)
    want_loss, want_grad, want_metrics = trl_loss(rl, *data)
    loss, grad, metrics = ours(rl, *data)
    assert_close(loss, want_loss, rtol=TOL, scale=loss_scale(data[3]), what="loss")
    assert_close(grad, want_grad, rtol=TOL, what="d loss / d logps")
    assert grad.abs().sum() > 0
    compared = {k: v for k, v in want_metrics.items() if k in metrics}
    assert set(compared) >= {"entropy"} | ({"kl"} if beta else set())
    assert set(metrics) <= set(want_metrics)
    for name, value in compared.items():
        if value != value:  # NaN: no sequence with a token had the property's denominator
            assert metrics[name] != metrics[name], name
        else:
            assert_close(torch.tensor(metrics[name]), torch.tensor(value), rtol=TOL, what=name)


def test_clipping_happens_in_the_cases_above():
    """The off-policy batch clips on both sides (the comparison above covers the clipped branches)."""
    rl = settings("dapo", "token", 0.0, True)
    _, _, metrics = ours(rl, *batch(off_policy=True))
    assert metrics["clip_ratio/low_mean"] > 0 and metrics["clip_ratio/high_mean"] > 0


@pytest.mark.parametrize("loss_type", ["grpo", "dapo"])
def test_delta_two_sided_clip_equals_trl(loss_type):
    rl = settings(loss_type, "token", 0.04, True, delta=1.3)
    data = batch(seed=3)
    want_loss, want_grad, _ = trl_loss(rl, *data)
    loss, grad, _ = ours(rl, *data)
    assert_close(loss, want_loss, rtol=TOL, scale=loss_scale(data[3]))
    assert_close(grad, want_grad, rtol=TOL)
    free = dataclasses.replace(rl, delta=0.0)
    assert abs(ours(free, *data)[0] - loss) > 1e-4  # the cap changed the loss


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_micro_batches_and_ranks_equal_the_whole_batch(loss_type, level):
    """Two "ranks" of two uneven micro-batches each (row partitions), summed and divided by the global
    denominator: the whole batch's loss, gradient and metrics (N ranks == 1)."""
    rl = settings(loss_type, level, 0.04, True)
    data = batch(seed=7)
    whole = ours(rl, *data)
    split = ours(rl, *data, parts=((0, 1), (1, 4), (4, 5), (5, B)))
    want = trl_loss(rl, *data)
    assert_close(split[0], whole[0], rtol=TOL, scale=loss_scale(data[3]))
    assert_close(split[0], want[0], rtol=TOL, scale=loss_scale(data[3]))
    assert_close(split[1], whole[1], rtol=TOL)
    assert whole[2].keys() == split[2].keys()
    for name in whole[2]:
        assert_close(torch.tensor(split[2][name]), torch.tensor(whole[2][name]), rtol=TOL, what=name)


def test_denominators():
    lengths = torch.tensor([3, 0, 5])
    assert loss_denominator("dapo", lengths, 10) == 8.0
    assert loss_denominator("cispo", [0, 0], 10) == 1.0
    assert loss_denominator("grpo", lengths, 10) == 3.0
    assert loss_denominator("sapo", lengths, 10) == 3.0
    assert loss_denominator("dr_grpo", lengths, 10) == 30.0
    with pytest.raises(ValueError, match="bnpo"):
        loss_denominator("bnpo", lengths, 10)


def test_kl_needs_reference():
    rl = settings("dapo", "token", 0.1, False)
    logps, _, _, adv, mask, _ = batch()
    with pytest.raises(ValueError, match="ref_logps"):
        policy_loss_sum(rl, logps, adv, mask)


def trl_advantages(rewards_per_func, weights, g, scale_rewards):
    """TRL 1.16.0 grpo_trainer.py lines 2756-2796 (sum_then_normalize), replicated: it runs inside
    ``_generate_and_score_completions``, which needs a model and a generator."""
    reward_weights = torch.tensor(weights, dtype=torch.float32)
    unscorable_mask = torch.isnan(rewards_per_func).all(dim=1)
    rewards = (rewards_per_func * reward_weights.unsqueeze(0)).nansum(dim=1)
    rewards[unscorable_mask] = torch.nan
    mean_grouped_rewards = torch.nanmean(rewards.view(-1, g), dim=1).repeat_interleave(g, dim=0)
    if scale_rewards in ["group", "none"]:
        std_rewards = trl_nanstd(rewards.view(-1, g), dim=1).repeat_interleave(g, dim=0)
    else:
        std_rewards = trl_nanstd(rewards).expand_as(rewards)
    advantages = rewards - mean_grouped_rewards
    if scale_rewards != "none":
        advantages = advantages / (std_rewards + 1e-4)
    is_std_zero = torch.isclose(std_rewards, torch.zeros_like(std_rewards))
    return torch.nan_to_num(advantages, nan=0.0), rewards, is_std_zero


def rewards_table(g: int = 4, prompts: int = 5):
    """Rewards of two functions: random, one group all equal, some None (NaN), one completion unscored by
    both."""
    gen = torch.Generator().manual_seed(1)
    r = torch.randn(prompts * g, 2, generator=gen)
    r[0:g, :] = torch.tensor([1.0, 0.5])  # group 0: zero std
    r[g + 1, 1] = float("nan")
    r[2 * g + 2, :] = float("nan")  # unscorable
    r[3 * g:4 * g, 0] = float("nan")  # function 0 skipped a whole group
    return r


@pytest.mark.parametrize("scale_rewards", ["group", "batch", "none"])
def test_advantages_equal_trl(scale_rewards):
    r, weights, g = rewards_table(), [1.0, 0.5], 4
    adv = group_advantages(r, weights, g, scale_rewards)
    want_adv, want_rewards, want_zero = trl_advantages(r, weights, g, scale_rewards)
    assert_close(adv.advantages, want_adv, rtol=TOL)
    assert torch.equal(adv.rewards.isnan(), want_rewards.isnan())
    assert_close(adv.rewards.nan_to_num(), want_rewards.nan_to_num(), rtol=TOL)
    assert torch.equal(adv.is_std_zero, want_zero)
    assert adv.advantages[2 * g + 2] == 0.0  # the unscorable completion
    if scale_rewards != "batch":
        assert adv.is_std_zero[:g].all() and not adv.is_std_zero[g:].any()
    metrics = reward_metrics(r, ["f0", "f1"], adv)
    assert metrics["frac_reward_zero_std"] == want_zero.float().mean().item()
    assert_close(torch.tensor(metrics["reward"]), torch.nanmean(want_rewards), rtol=TOL)
    assert_close(torch.tensor(metrics["reward_std"]), trl_nanstd(want_rewards), rtol=TOL)
    assert_close(torch.tensor(metrics["rewards/f0/mean"]), torch.nanmean(r[:, 0]), rtol=TOL)
    assert_close(torch.tensor(metrics["rewards/f1/std"]), trl_nanstd(r[:, 1]), rtol=TOL)


def test_nanstd_and_combine():
    x = torch.tensor([[1.0, float("nan"), 3.0], [2.0, float("nan"), float("nan")]])
    assert_close(nanstd(x, dim=1)[0], trl_nanstd(x, dim=1)[0], rtol=TOL)
    assert nanstd(x, dim=1)[1].isnan()  # one value: no std
    assert_close(nanstd(x), trl_nanstd(x), rtol=TOL)
    combined = combine_rewards(torch.tensor([[1.0, float("nan")], [float("nan")] * 2]), [2.0, 1.0])
    assert combined[0] == 2.0 and combined[1].isnan()
    with pytest.raises(ValueError, match="weights"):
        combine_rewards(torch.zeros(2, 3), [1.0])
    with pytest.raises(ValueError, match="groups"):
        group_advantages(torch.zeros(5, 1), [1.0], 2)
