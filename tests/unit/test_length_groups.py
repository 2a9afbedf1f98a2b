"""Length-grouped sampling (``data.group_by_length_steps``): each run of k steps trains the samples the
plain order gives those k steps, sorted by length into its global batches, and each epoch stays a
permutation; the order depends on (seed, G, k, step) only, never on the ranks or on which steps were asked
for before; rows pad less; the settings it cannot serve are refused by name, and a resume may not change
it."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import prepare_chat_examples, tiny_overrides
from shardlm.checkpoint.resume_config import REFUSED, config_changes
from shardlm.config import load_config
from shardlm.data.instruct import row_width
from shardlm.data.length_groups import LengthGroupedSampler
from shardlm.data.loader import GlobalBatchSampler
from shardlm.errors import ConfigError
from shardlm.parallel import init_distributed
from shardlm.train.trainer import Trainer

LENGTHS = np.random.default_rng(3).integers(5, 1025, size=203)


def test_each_run_of_k_steps_trains_the_plain_orders_samples_sorted_into_its_batches():
    g, k, n = 8, 5, len(LENGTHS)  # 203 samples: 25 whole steps an epoch, then a step across two epochs
    grouped, plain = LengthGroupedSampler(LENGTHS, g, 11, k), GlobalBatchSampler(n, g, 11)
    for epoch in range(3):  # every epoch still a permutation of the samples
        assert sorted(grouped.epoch_permutation(epoch).tolist()) == list(range(n))
    # the runs: steps 0-24 of epoch 0 in fives, step 25 across the epochs (203 = 25 · 8 + 3; epoch 1's first
    # 5 samples fill it), then epoch 1's runs from step 26 on
    runs = [range(0, 5), range(5, 10), range(20, 25), range(25, 26), range(26, 31), range(31, 36)]
    for steps in runs:
        assert sorted(i for s in steps for i in grouped.step_ids(s)) == sorted(
            i for s in steps for i in plain.step_ids(s))
    for steps in runs[:3] + runs[4:]:
        batches = [grouped.step_ids(s) for s in steps]
        tops = sorted((int(LENGTHS[b].max()), int(LENGTHS[b].min())) for b in batches)
        for (_, low), (high, _) in zip(tops[1:], tops[:-1]):
            assert low >= high  # the batches are disjoint length ranges: sorted, then cut
        for b in batches:
            assert list(LENGTHS[b]) == sorted(LENGTHS[b], reverse=True)  # longest first within a batch
    # the batches take their run's steps in a seeded order, not longest (or shortest) first every time
    firsts = [int(LENGTHS[grouped.step_ids(r.start)].max()) for r in runs[:3] + runs[4:]]
    longest = [max(int(LENGTHS[grouped.step_ids(s)].max()) for s in r) for r in runs[:3] + runs[4:]]
    assert firsts != longest


def test_data_smaller_than_a_run_is_sorted_an_epoch_at_a_time_never_twice_in_a_step():
    lengths = np.array([50, 10, 40, 20, 30, 60, 70, 15, 25, 35])  # 10 samples, runs of 50 · 4 = 200
    grouped = LengthGroupedSampler(lengths, 4, 0, 50)
    for epoch in range(6):
        assert sorted(grouped.epoch_permutation(epoch).tolist()) == list(range(10))
    for step in range(30):
        first, last = step * 4 // 10, (step * 4 + 3) // 10
        ids = grouped.step_ids(step)
        if first == last:  # a step inside one epoch: distinct samples, neighbours in length
            assert len(set(ids)) == 4 and list(lengths[ids]) == sorted(lengths[ids], reverse=True)
    assert sorted(lengths[grouped.step_ids(0) + grouped.step_ids(1)].tolist())[4:] == [40, 50, 60, 70]


def test_the_order_is_a_function_of_the_step_alone():
    a = LengthGroupedSampler(LENGTHS, 8, 0, 4)
    forward = [a.step_ids(s) for s in range(20)]
    b = LengthGroupedSampler(LENGTHS, 8, 0, 4)  # a resumed run asks for step 13 first, then goes back
    assert [b.step_ids(s) for s in (13, 2, 19, 0)] == [forward[s] for s in (13, 2, 19, 0)]
    assert LengthGroupedSampler(LENGTHS, 8, 1, 4).step_ids(0) != forward[0]  # another seed, another order
    for world in (1, 2, 4, 8):  # the ranks' contiguous shares and micro-batches cut the same global batch
        for step in (0, 7):
            shares = [a.rank_ids(step, r, world) for r in range(world)]
            assert [i for s in shares for i in s] == forward[step]
            micro = [m for r in range(world) for m in a.micro_batches(step, r, world, 8 // world // 2 or 1)]
            assert [i for m in micro for i in m] == forward[step]


def test_micro_batches_pad_far_less_than_the_plain_order():
    g, micro, seq, k = 16, 4, 1024, 10
    lengths = np.random.default_rng(4).integers(5, 1025, size=2003)  # 2 runs of 160 inside the first epoch
    grouped, plain = LengthGroupedSampler(lengths, g, 0, k), GlobalBatchSampler(len(lengths), g, 0)

    def positions(sampler: GlobalBatchSampler) -> int:  # computed positions over 2 runs' steps
        return sum(micro * (row_width(int(lengths[m].max()), seq, 8) - 1)
                   for s in range(2 * k) for m in sampler.micro_batches(s, 0, 1, micro))

    tokens = sum(int(lengths[i]) for s in range(2 * k) for i in plain.step_ids(s))
    assert tokens / positions(plain) < 0.7  # uniform lengths: the longest of 4 wastes a third
    assert tokens / positions(grouped) > 0.95  # neighbours in length: almost nothing padded


def test_the_sampler_refuses_groups_of_fewer_than_two_steps():
    with pytest.raises(ValueError, match="at least 2 steps"):
        LengthGroupedSampler(LENGTHS, 8, 0, 1)


@pytest.mark.parametrize("fields, message", [
    ({"data.group_by_length_steps": 1}, "0 \\(off\\) or at least 2"),
    ({"data.group_by_length_steps": -3}, "0 \\(off\\) or at least 2"),
    ({"data.group_by_length_steps": 50}, "data.format = 'text' has no per-sample lengths"),
    ({"data.group_by_length_steps": 50, "data.format": '"instruct"', "data.pack": "true"},
     "packed rows are already full"),
    ({"data.group_by_length_steps": 50, "data.format": '"instruct"', "data.pad_multiple": 0},
     "needs data.pad_multiple > 0"),
])
def test_settings_it_cannot_serve_are_refused_by_name(fields, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, [f"--{k}={v}" for k, v in fields.items()])


def test_a_resume_may_not_change_it():
    old = load_config(None, ["--data.format=instruct"]).to_dict()
    new = load_config(None, ["--data.format=instruct", "--data.group_by_length_steps=50"]).to_dict()
    changes = {c.key: c for c in config_changes(old, new)}
    assert changes["data.group_by_length_steps"].rule == REFUSED
    old["data"].pop("group_by_length_steps")  # a checkpoint from before the field: compared as 0 (off)
    assert {c.key: c.rule for c in config_changes(old, new)}["data.group_by_length_steps"] == REFUSED
    off = {**new, "data": {**new["data"], "group_by_length_steps": 0}}
    assert "data.group_by_length_steps" not in {c.key for c in config_changes(old, off)}


def test_a_grouped_run_trains_the_groups_batches_and_says_so(small_data, tmp_path):
    chat = prepare_chat_examples(tmp_path, small_data, n=60, max_prompt_words=12, max_response_words=30)
    base = {"parallel.mode": '"single"', "data.format": '"instruct"', "train.global_batch_size": 8,
            "train.micro_batch_size": 4, "train.seq_len": 64, "train.steps": 4}
    cfg = load_config(None, tiny_overrides(chat, tmp_path / "run", {**base, "data.group_by_length_steps": 4}))
    started = torch.distributed.is_initialized()
    try:
        trainer = Trainer(cfg, init_distributed(cfg.parallel))
        assert isinstance(trainer.sampler, LengthGroupedSampler)
        assert "grouped by length 4 steps at a time" in trainer.summary()
        plain = GlobalBatchSampler(len(trainer.train_data), 8, cfg.train.seed)
        lengths = trainer.train_data.row_lengths()

        def widths(sampler: GlobalBatchSampler) -> list[int]:
            return [trainer.train_data.width(m) for s in range(4) for m in sampler.micro_batches(s, 0, 1, 4)]

        assert sum(widths(trainer.sampler)) < sum(widths(plain))
        assert sorted(i for s in range(4) for i in trainer.sampler.step_ids(s)) == sorted(
            i for s in range(4) for i in plain.step_ids(s))
        assert len(set(lengths.tolist())) > 10
        records = [trainer.train_step() for _ in range(4)]
        assert all(np.isfinite(r["loss"]) for r in records)
    finally:
        if not started and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
