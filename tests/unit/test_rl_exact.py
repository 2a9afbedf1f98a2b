"""The exact rollout (shardlm/rl/exact.py), one process, the tiny fp32 model of test_rollout.py: its log-probs
equal the training step's forward of the same micro-batches bit for bit (with gradients, chunked or not,
softcapped or not), so the importance ratio is exactly 1 with no old-log-prob forward; its completions do not
depend on how the rows are split into calls (ranks) and mostly equal the key-value cache's; bad micro-batches
are refused."""

from __future__ import annotations

import pytest
import torch

from shardlm.rl.exact import exact_rollout
from shardlm.rl.logps import logprob_diff_max, token_logps, trainer_batch
from shardlm.rl.rollout import rollout
from test_rollout import KW, by_key, prompts_of, tiny_model

MAX_NEW = KW["max_completion_length"]


def micro_batches(n: int, size: int) -> list[list[int]]:
    return [list(range(a, min(a + size, n))) for a in range(0, n, size)]


@pytest.mark.parametrize("softcap,chunk", [(0.0, 0), (30.0, 16)])
def test_sampler_log_probs_are_the_training_steps_bit_for_bit(softcap, chunk):
    model = tiny_model(softcap)
    prompts, ids = prompts_of(6), [5 * i + 1 for i in range(6)]
    micro = micro_batches(18, 4)  # a last micro-batch of 2 rows
    ro = exact_rollout(model, prompts, ids, 3, micro, **KW, chunk_tokens=chunk)
    assert ro.completion_ids.shape == (18, MAX_NEW)
    assert 1 < len(set(ro.lengths.tolist())) and ro.truncated.any() and not ro.truncated.all()
    model.train()
    for rows in micro:
        batch = trainer_batch(ro, rows, window=MAX_NEW)
        logps, entropy = token_logps(model, batch, KW["temperature"], chunk)
        mask = batch.completion_mask
        assert torch.equal(logps.detach()[mask], ro.logps[batch.rows][mask])
        assert logprob_diff_max(ro.logps[batch.rows], logps.detach(), mask) == 0.0
        ratio = torch.exp(logps - ro.logps[batch.rows])[mask]
        assert torch.equal(ratio, torch.ones_like(ratio))
        assert (entropy[mask] > 0).all()
        (logps * mask).sum().backward()
    assert model.lm_head.weight.grad.abs().sum() > 0


def test_the_key_value_caches_rollout_is_not_bit_for_bit_with_the_training_step():
    """The contrast the exact rollout exists for (measured: up to a few 1e-6 here)."""
    model = tiny_model()
    ro = rollout(model, prompts_of(6), list(range(6)), 3, **KW)
    rows = list(range(18))
    batch = trainer_batch(ro, rows)
    with torch.no_grad():
        logps, _ = token_logps(model, batch, KW["temperature"])
    gap = logprob_diff_max(ro.logps, logps, batch.completion_mask)
    assert 0 < gap < 1e-4


def test_completions_do_not_depend_on_the_split_into_ranks_and_mostly_match_the_cache():
    model = tiny_model()
    prompts, ids = prompts_of(8), [3 * i for i in range(8)]
    whole = exact_rollout(model, prompts, ids, 2, micro_batches(16, 4), **KW)
    # two "ranks", each with its prompts and its micro-batches of the same completions
    first = exact_rollout(model, prompts[:4], ids[:4], 2, micro_batches(8, 4), **KW)
    second = exact_rollout(model, prompts[4:], ids[4:], 2, micro_batches(8, 4), **KW)
    for part, rows in ((first, slice(0, 8)), (second, slice(8, 16))):
        assert torch.equal(part.completion_ids, whole.completion_ids[rows])
        assert torch.equal(part.logps, whole.logps[rows])
    cache = by_key(rollout(model, prompts, ids, 2, **KW))
    exact = by_key(whole)
    same = sum(cache[k] == exact[k] for k in exact)
    assert same >= len(exact) - 2, f"only {same} of {len(exact)} completions equal the cache's"


def test_micro_batches_must_hold_every_row_once():
    model = tiny_model()
    with pytest.raises(ValueError, match="each of the 4 rollout rows once"):
        exact_rollout(model, prompts_of(2), [0, 1], 2, [[0, 1], [1, 2]], **KW)
    ro = exact_rollout(model, prompts_of(2), [0, 1], 2, [[0, 1, 2, 3]], **KW)
    with pytest.raises(ValueError, match="window of 5 positions"):
        trainer_batch(ro, [0, 1], window=5)
