"""Online RL as an objective of the training step (shardlm/train/objectives/grpo.py), one process, a tiny
random model on seeded arithmetic prompts: TRL's metrics in every record, the loss of the step equal to
dapo's at an importance ratio of 1 from the step's own rollout and advantages, a no-grad scoring of the same
rows giving the step's log-probs bit for bit (the ratio with recomputed old log-probs would be exactly 1),
and the bad inputs refused with one message each."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import rl_overrides
from shardlm.config import load_config
from shardlm.errors import ConfigError
from shardlm.rl.tasks import write_jsonl
from shardlm.train.objectives import grpo
from shardlm.train.trainer import Trainer
from tolerance import EPS, assert_close

NAMES = ["reward", "reward_std", "rewards/accuracy/mean", "rewards/accuracy/std", "rewards/format/mean",
         "rewards/format/std", "frac_reward_zero_std", "completions/mean_length", "completions/min_length",
         "completions/max_length", "completions/clipped_ratio", "completions/mean_terminated_length",
         "entropy", "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean",
         "sampling/logprob_diff_max",
         "rewards/all_equal_steps", "time/rollout_s", "time/reward_s", "time/logps_s"]


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("grpo")


@pytest.fixture
def one_rank_group():
    """The one-rank process group a Trainer opens, destroyed after the test."""
    yield
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def test_three_steps_record_trls_metrics_and_dapos_loss(root, monkeypatch, capsys, one_rank_group):
    cfg = load_config(None, rl_overrides(root, extra={"checkpoint.enabled": "false"}))
    steps = []  # each step's inputs, as the objective prepared them
    scored = []  # (the step's log-probs, a no-grad scoring of the same rows) per micro-batch
    real_token_logps = grpo.token_logps

    def spy(model, batch, temperature, chunk_tokens=0):
        out = real_token_logps(model, batch, temperature, chunk_tokens)
        if torch.is_grad_enabled():
            with torch.no_grad():
                scored.append((out[0].detach().clone(), real_token_logps(model, batch, temperature,
                                                                         chunk_tokens)[0]))
        return out

    monkeypatch.setattr(grpo, "token_logps", spy)
    trainer = Trainer(cfg, keep_history=True)
    prepare = trainer.objective.prepare_step
    trainer.objective.prepare_step = lambda *a: steps.append(prepare(*a)) or steps[-1]
    before = [p.detach().clone() for p in trainer.model.parameters()]
    history = trainer.train()
    printed = capsys.readouterr()
    assert "rl         dapo, 4 completions per prompt" in printed.out
    assert f"reward={history[-1]['reward']:.3f}" in printed.err  # the console's progress line
    assert [r["step"] for r in history] == [1, 2, 3] and all("val_loss" not in r for r in history)
    for record, inputs in zip(history, steps):
        assert set(NAMES) <= set(record), set(NAMES) - set(record)
        ro = inputs.context["rollout"]
        assert ro.completion_ids.shape[0] == 8 and len(inputs.batches) == 4
        # at ratio 1 dapo's per-token loss is -A: the loss is -Σ_i A_i·n_i / Σ_i n_i over the global batch
        lengths = ro.lengths.double()
        adv = inputs.context["advantages"].double()
        assert inputs.denominator == lengths.sum().item()
        expected = -(adv * lengths).sum() / lengths.sum()  # cancels: scale Σ|A_i|·n_i / Σ n_i
        assert_close(record["loss"], expected.item(), rtol=64 * EPS,
                     scale=((adv.abs() * lengths).sum() / lengths.sum()).item(), what="loss")
        assert record["clip_ratio/low_mean"] == record["clip_ratio/high_mean"] == 0.0
        assert record["clip_ratio/region_mean"] == 0.0
        assert record["completions/mean_length"] == lengths.mean().item()
        assert record["completions/max_length"] == lengths.max().item() <= 12
        assert 0.0 <= record["sampling/logprob_diff_max"] < 1e-3  # the decode's forwards vs the step's
        assert 0.0 < record["entropy"] <= torch.log(torch.tensor(400.0)).item()
        assert 0.0 <= record["reward"] <= 2.0
    assert any(r["reward_std"] > 0 for r in history)  # some groups differ: the update is not zero
    assert len(scored) == 12 and all(torch.equal(a, b) for a, b in scored)
    after = list(trainer.model.parameters())
    assert any(not torch.equal(a, b.detach()) for a, b in zip(before, after))


def test_bad_inputs_one_message_each(root, tmp_path, one_rank_group):
    with pytest.raises(ConfigError, match="rl.num_generations = 1 with rl.scale_rewards = 'group'"):
        load_config(None, rl_overrides(root, extra={"rl.num_generations": 1}))
    with pytest.raises(ConfigError, match="cannot fit train.seq_len"):
        load_config(None, rl_overrides(root, extra={"rl.max_completion_length": 20}))
    bad = rl_overrides(root, extra={"rl.rewards": "['shardlm.rl.nowhere:accuracy']",
                                    "run.dir": f'"{tmp_path / "run"}"'})
    with pytest.raises(ConfigError, match=r"rl.rewards\[0\] = 'shardlm.rl.nowhere:accuracy': cannot load"):
        Trainer(load_config(None, bad))
    # a prompt without the field a reward needs: refused when the run starts, naming it
    rows = [{"prompt": f"What is {i} + 1?", "answer": str(i + 1)} for i in range(9)] + [{"prompt": "Hi?"}]
    write_jsonl(tmp_path / "p.jsonl", [rows[9], *rows[:9]])
    extra = {"data.corpus": f'"{tmp_path / "p.jsonl"}"', "data.dir": f'"{tmp_path / "d"}"',
             "run.dir": f'"{tmp_path / "run2"}"'}
    with pytest.raises(ConfigError, match="needs the field 'answer', which prompt 0 .'Hi.'. does not have"):
        Trainer(load_config(None, rl_overrides(root, extra=extra)))
    # each rank samples whole groups: 8 completions over 1 rank in groups of 3 is refused by the config
    with pytest.raises(ConfigError, match="whole groups"):
        load_config(None, rl_overrides(root, extra={"rl.num_generations": 3}))
    assert json.loads((root / "data" / "meta.json").read_text())["format"] == "prompts"


def test_a_checkpoint_inside_a_cycle_holds_its_buffer(root, tmp_path, one_rank_group):
    """A run of 2 steps at num_iterations 2 saving after each step: the checkpoint after step 1 (inside the
    cycle of steps 1-2) holds the rank's buffer, the one after step 2 (a cycle's start) nothing more. The
    buffer round-trips bit for bit (rollout, advantages, old log-probs, completions, rewards, metrics,
    denominator) through the safetensors file into a resumed run's objective, which trains step 2 to the
    uninterrupted run's loss bit for bit (within 64 roundings in micro-batches of 1 instead of 2); a resume
    at another world size is refused by name (the buffer is per rank). The saves run in the background
    (checkpoint.async; the 2-rank resume of tests/dist/test_grpo_ranks.py saves synchronously)."""
    run = tmp_path / "run"
    extra = {"rl.num_iterations": 2, "train.steps": 2, "checkpoint.interval": 1, "run.dir": f'"{run}"',
             "checkpoint.async": "true"}  # the buffer's file written before the background save, recorded
    trainer = Trainer(load_config(None, rl_overrides(root, extra=extra)), keep_history=True)
    held = []  # the buffer after each step, as rank_state gives it to the save
    rank_state = trainer.objective.rank_state
    trainer.objective.rank_state = lambda step: held.append(rank_state(step)) or held[-1]
    whole = trainer.train()
    assert [r["step"] for r in whole] == [1, 2]
    ckpts = run / "checkpoints"
    assert held[1] is None and not (ckpts / "step-2" / "rank-0.state.safetensors").exists()
    manifest = json.loads((ckpts / "step-1" / "manifest.json").read_text())
    assert "rank-0.state.safetensors" in manifest["files"]  # hashed and verified with the rest
    saved, header = held[0]
    assert header["cycle_start"] == "0" and "old_logps" in saved and len(saved["completion_lengths"]) == 8
    resume = {**extra, "run.overwrite": "false", "checkpoint.resume": f'"{ckpts / "step-1"}"'}
    resumed = Trainer(load_config(None, rl_overrides(root, extra=resume)), keep_history=True)
    assert resumed.step == 1 and resumed.objective.generation[0] == 0
    back, back_header = resumed.objective.rank_state(1)
    assert back_header == header and back.keys() == saved.keys()
    for name, tensor in saved.items():
        assert back[name].dtype == tensor.dtype and torch.equal(back[name], tensor), name
    ours, theirs = resumed.objective.generation[1][0], trainer.objective.generation[1][0]
    assert ours["ids"] == theirs["ids"] and ours["denominator"] == theirs["denominator"]
    assert ours["context"]["metrics"] == theirs["context"]["metrics"]
    assert ours["context"]["completion_ids"] == theirs["context"]["completion_ids"]
    assert [torch.equal(a.inputs, b.inputs) and torch.equal(a.targets, b.targets)
            for a, b in zip(ours["batches"], theirs["batches"])] == [True] * 4
    again = resumed.train()  # step 2 on the buffer taken back: the uninterrupted run's, bit for bit
    assert [r["step"] for r in again] == [2] and again[0]["loss"] == whole[1]["loss"] != 0.0
    assert again[0]["reward"] == whole[1]["reward"] and again[0]["grad_norm"] == whole[1]["grad_norm"]
    torch.distributed.destroy_process_group()
    # another micro-batch size: the buffer's rows split into 8 micro-batches of 1, the same loss but its bits
    finer = Trainer(load_config(None, rl_overrides(root, extra={**resume, "train.micro_batch_size": 1})),
                    keep_history=True)
    assert len(finer.objective.generation[1][0]["batches"]) == 8
    loss = finer.train()[0]["loss"]
    assert_close(loss, whole[1]["loss"], rtol=64 * EPS, what="step 2's loss in micro-batches of 1")
    torch.distributed.destroy_process_group()
    # the same checkpoint as if saved at 2 ranks: its buffer is not this layout's
    manifest["world_size"] = 2
    (ckpts / "step-1" / "manifest.json").write_text(json.dumps(manifest))
    refused = (r"cannot resume from .*step-1 at 1 rank\(s\): it was saved after step 1 at 2 rank\(s\) with "
               r"per-rank state \(the buffer of the generation cycle of steps 1 \.\. 2.*resume with 2 "
               r"rank\(s\) \(the same layout\), or from a checkpoint at the start of a generation cycle")
    with pytest.raises(ConfigError, match=refused):
        Trainer(load_config(None, rl_overrides(root, extra=resume)))
