"""Settings left ``"auto"`` (reshard after forward, blocks per FSDP group, activation checkpointing, the
loss's chunking): the planner chooses them for a new run by the memory it plans, a user's setting wins, a
resume keeps the checkpoint's values, the summary says what was chosen and why."""

from __future__ import annotations

import platform

import pytest
import torch

from conftest import tiny_overrides
from shardlm.checkpoint.resume_config import config_changes
from shardlm.cli.main import main as shardlm_main
from shardlm.config import load_config
from shardlm.config.auto import FIXED, unresolved, with_fixed_defaults
from shardlm.parallel import init_distributed
from shardlm.parallel.dist import DistInfo
from shardlm.parallel.host_memory import allocator_set_by_user
from shardlm.plan import plan_memory, tune_candidates
from shardlm.plan.defaults import choose_defaults
from shardlm.train.defaults import describe_defaults, resolve_defaults
from shardlm.train.trainer import Trainer

KEYS = list(FIXED)


def info(world: int) -> DistInfo:
    return DistInfo(0, 0, world, torch.device("cpu"), "gloo")


def tiny(small_data, tmp_path, extra: dict | None = None):
    extra = {"train.micro_batch_size": 4, **(extra or {})}
    return load_config(None, tiny_overrides(small_data, tmp_path, extra))


def test_defaults_are_auto_and_read_as_the_fixed_ones_until_chosen(small_data, tmp_path):
    cfg = tiny(small_data, tmp_path)
    assert unresolved(cfg) == KEYS
    fixed = with_fixed_defaults(cfg)
    assert unresolved(fixed) == [] and unresolved(cfg) == KEYS  # a copy
    assert (fixed.parallel.reshard_after_forward, fixed.parallel.blocks_per_group,
            fixed.parallel.activation_checkpoint, fixed.train.loss_chunk_tokens) == (True, 1, "none", 256)
    assert plan_memory(cfg, 2).peak == plan_memory(fixed, 2).peak  # the planner reads auto as fixed


def test_the_planner_chooses_the_fastest_settings_that_fit(small_data, tmp_path):
    cfg = tiny(small_data, tmp_path)
    roomy = choose_defaults(cfg, KEYS, info(2), budget_bytes=64 * 2**30)
    assert roomy["parallel.activation_checkpoint"][0] == "none"
    assert roomy["parallel.reshard_after_forward"][0] is False
    assert roomy["parallel.blocks_per_group"][0] == cfg.model.n_layers  # tiny blocks: one group of all
    # 4 x 32 x 512 fp32 logits, 0.25 MiB: one chunk of the micro-batch's 128 tokens
    assert roomy["train.loss_chunk_tokens"][0] == cfg.train.micro_batch_size * cfg.train.seq_len == 128
    assert "no backward all-gather" in roomy["parallel.reshard_after_forward"][1]
    assert unresolved(cfg) == KEYS  # cfg untouched
    # a budget between the planned peaks: resharding fits, keeping the weights does not
    fixed = with_fixed_defaults(cfg)
    kept = with_fixed_defaults(cfg)
    kept.parallel.reshard_after_forward = False
    low, high = plan_memory(fixed, 2).peak, plan_memory(kept, 2).peak
    assert low < high
    tight = choose_defaults(cfg, ["parallel.reshard_after_forward"], info(2), budget_bytes=(low + high) / 2)
    assert tight["parallel.reshard_after_forward"][0] is True
    assert "does not fit" in tight["parallel.reshard_after_forward"][1]
    starved = choose_defaults(cfg, ["parallel.activation_checkpoint"], info(2), budget_bytes=1.0)
    assert starved["parallel.activation_checkpoint"][0] == "full"
    one = choose_defaults(cfg, KEYS, info(1), budget_bytes=64 * 2**30)
    assert one["parallel.reshard_after_forward"][0] is True and one["parallel.blocks_per_group"][0] == 1
    big_vocab = tiny(small_data, tmp_path, {"model.vocab_size": 65536, "train.seq_len": 128,
                                             "model.max_seq_len": 128})
    assert choose_defaults(big_vocab, ["train.loss_chunk_tokens"], info(2), 64 * 2**30)[
        "train.loss_chunk_tokens"][0] == 256  # 4 x 128 x 65536 x 4 = 128 MiB of logits


def test_user_settings_win_and_resume_keeps_the_checkpoints_choices(small_data, tmp_path):
    cfg = tiny(small_data, tmp_path, {"parallel.blocks_per_group": 2, "train.loss_chunk_tokens": 64})
    asked = []

    def chooser(c, keys, _info):
        asked.extend(keys)
        return {"parallel.reshard_after_forward": (False, "auto: test")}

    choices = resolve_defaults(cfg, None, chooser, info(2))
    assert asked == ["parallel.reshard_after_forward", "parallel.activation_checkpoint"]
    assert [(c.key, c.value) for c in choices] == [("parallel.reshard_after_forward", False),
                                                   ("parallel.activation_checkpoint", "none")]
    assert (cfg.parallel.blocks_per_group, cfg.train.loss_chunk_tokens) == (2, 64)  # the user's
    assert "no planner" in choices[1].why
    # resume: the checkpoint's recorded values, never the chooser's
    resumed = tiny(small_data, tmp_path)
    recorded = {"parallel": {"reshard_after_forward": False, "blocks_per_group": 3,
                             "activation_checkpoint": "selective"}, "train": {"loss_chunk_tokens": 0}}

    def refuse(*_):
        raise AssertionError("a resumed run does not choose again")

    choices = resolve_defaults(resumed, recorded, refuse, info(2))
    assert {c.key: c.value for c in choices} == {"parallel.reshard_after_forward": False,
                                                 "parallel.blocks_per_group": 3,
                                                 "parallel.activation_checkpoint": "selective",
                                                 "train.loss_chunk_tokens": 0}
    assert all(c.why == "auto: the resumed checkpoint's" for c in choices)
    # an "auto" in the new config is no change against the checkpoint; a value set is one
    new = tiny(small_data, tmp_path).to_dict()
    old = {**new, "parallel": {**new["parallel"], **recorded["parallel"]},
           "train": {**new["train"], **recorded["train"]}}
    assert not [c for c in config_changes(old, new) if c.key in FIXED]
    new["train"]["loss_chunk_tokens"] = 128
    assert [c.key for c in config_changes(old, new) if c.key in FIXED] == ["train.loss_chunk_tokens"]


@pytest.mark.parametrize("planner", [False, True])
def test_the_summary_says_what_was_chosen_and_why(small_data, tmp_path, planner):
    cfg = tiny(small_data, tmp_path / "run", {"parallel.mode": '"single"'})
    started = torch.distributed.is_initialized()
    try:
        trainer = Trainer(cfg, init_distributed(cfg.parallel), defaults=choose_defaults if planner else None)
        summary = trainer.summary()
        record = trainer.train_step()
    finally:
        if not started and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    assert unresolved(trainer.cfg) == [] and record["loss"] > 0
    lines = [line for line in summary.splitlines() if line.startswith("  auto ")]
    assert len(lines) == 4, summary
    settings = next(line for line in summary.splitlines() if line.startswith("  settings "))
    # a CPU run keeps freed host memory (parallel.cpu_keep_freed_memory) unless glibc is not the allocator
    glibc = platform.libc_ver()[0] == "glibc" and allocator_set_by_user() is None
    assert settings.endswith(", freed host memory kept for reuse") == glibc, settings
    if planner:
        assert trainer.cfg.train.loss_chunk_tokens == 128  # 4 rows x 32 tokens
        assert "train.loss_chunk_tokens = 128 (auto: one chunk, a micro-batch's 128 tokens" in summary
        assert "parallel.reshard_after_forward = true (auto: one rank or not FSDP" in summary
    else:
        assert trainer.cfg.train.loss_chunk_tokens == 256
        assert "parallel.blocks_per_group = 1 (auto: the fixed default (no planner ran))" in summary


def auto_lines(text: str) -> list[str]:
    """The ``auto`` lines of a run summary or a plan, without their indent and label."""
    return [line.split("auto", 1)[1].strip() for line in text.splitlines() if line.startswith("  auto ")]


def test_plan_prints_the_choices_the_trainer_makes(small_data, tmp_path, capsys, monkeypatch):
    """``shardlm plan`` resolves the settings left auto with the trainer's chooser, prints them as the run's
    summary does, and plans the step with them."""
    monkeypatch.setattr(tune_candidates, "available_host_memory", lambda: 16 * 2**30)  # the budget's RAM
    extra = {"train.micro_batch_size": 4}
    overrides = tiny_overrides(small_data, tmp_path / "run", extra)
    toml = tmp_path / "run.toml"
    toml.write_text("")

    def plan(world: int, *more: str) -> str:
        capsys.readouterr()
        assert shardlm_main(["plan", str(toml), "--world-size", str(world), "--device", "cpu", *overrides,
                             *more]) == 0
        return capsys.readouterr().out

    one = plan(1)
    cfg = load_config(None, overrides)
    started = torch.distributed.is_initialized()
    try:  # the trainer at one rank in this process (FSDP over one rank): its summary's lines
        summary = Trainer(cfg, init_distributed(cfg.parallel), defaults=choose_defaults).summary()
    finally:
        if not started and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    assert len(auto_lines(summary)) == 4 and auto_lines(one) == auto_lines(summary), (one, summary)
    assert "train.loss_chunk_tokens = 128 (auto: one chunk, a micro-batch's 128 tokens" in one
    # two ranks: the chooser as the trainer calls it (resolve_defaults, its DistInfo), no second process
    two = plan(2)
    fresh = load_config(None, overrides)
    assert auto_lines(two) == describe_defaults(resolve_defaults(fresh, None, choose_defaults, info(2))), two
    assert "parallel.reshard_after_forward = false (auto: weights kept" in two
    assert f"parallel.blocks_per_group = {cfg.model.n_layers} (auto: " in two
    # the plan is of the chosen settings; a value the user sets is kept, printed in the settings, not as auto
    assert f"reshard_after_forward false, {cfg.model.n_layers} block(s) per FSDP group" in two
    assert "temporaries (loss in 128-token chunks" in two  # one chunk: the micro-batch's 4 x 32 tokens
    mine = plan(2, "--parallel.reshard_after_forward=true", "--train.loss_chunk_tokens=64")
    assert [line.split(" =")[0] for line in auto_lines(mine)] == ["parallel.blocks_per_group",
                                                                  "parallel.activation_checkpoint"]
    assert "reshard_after_forward true" in mine and "temporaries (loss in 64-token chunks" in mine
