"""The rollout at 4 ranks, FSDP2-sharded, equals one process token for token; the sampler's scoring equals the
training forward bit for bit; and online RL trained at 4 ranks for 3 steps equals one process: the same
completions token for token and rewards at every step, the losses and the weights within 8 fp32 roundings.
One torchrun launch of tests/workers/rollout_worker.py (tiny fp32 models; the RL run through
tests/workers/grpo_worker.py's scenarios in the same launch, its one-process counterpart in this process);
1 vs 2 ranks, with more losses and resumes, is tests/dist/test_grpo_ranks.py."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from conftest import WORKERS, rl_overrides, torchrun
from shardlm.config import load_config
from shardlm.train.trainer import Trainer
from tolerance import EPS, assert_all_close, assert_close

#: 2 completions per prompt, global batch 8: one group per rank at 4 ranks (one micro-batch of 2), four
#: micro-batches in one process; dapo, normalised by the whole global batch's completion tokens, with 2
#: updates per generation (at a ratio of 1 the loss of equal-length completions is -mean(A) = 0: step 2's,
#: after an update, is not)
FOUR = {"rl.num_generations": 2, "rl.num_iterations": 2, "checkpoint.enabled": "false"}
KEYS = ("loss", "reward", "entropy", "completions/mean_length", "grad_norm")


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    """The 4-rank launch: the rollout report, the RL run's rank-0 report and where the runs are."""
    root = tmp_path_factory.mktemp("rollout4")
    spec = {"out": str(root / "grpo"), "scenarios": [{"name": "dapo4", "overrides": rl_overrides(root, extra={
        **FOUR, "parallel.mode": '"fsdp"', "run.dir": f'"{root / "four"}"'})}]}
    (root / "spec.json").write_text(json.dumps(spec))
    torchrun(4, [str(WORKERS / "rollout_worker.py"), str(root / "rollout4.json"), str(root / "spec.json")],
             timeout=300)
    return {"root": root, "rollout": json.loads((root / "rollout4.json").read_text()),
            "rl": json.loads((root / "grpo" / "dapo4" / "rank0.json").read_text())}


@pytest.mark.dist
def test_four_ranks_sample_the_one_process_completions(launched):
    """The same worker at 4 ranks (2, 2, 2 and 1 prompts: 6, 6, 6 and 3 rows, each rank its own generation
    batch size): every completion equals the one-process rollout token for token, each rank's scoring inside
    the gather equals its sharded training forward bit for bit."""
    report = launched["rollout"]
    assert report["world"] == 4 and report["rows_per_rank"] == [6, 6, 6, 3]
    assert report["keys_equal"]
    assert report["tokens_differing"] == 0 and report["completions_equal"]
    assert len(set(report["lengths"])) > 5 and max(report["lengths"]) == 24  # ranks stopped decoding apart
    assert report["gathered_inside"] == [True] * 4 and report["sharded_after"] == [True] * 4
    assert report["step_equal"] == [True] * 4


@pytest.mark.dist
def test_four_ranks_train_as_one_process(launched):
    """3 steps of dapo at 4 FSDP ranks against one process (here): completions and rewards equal at every
    step, each step's loss, reward, entropy, mean length and gradient norm, and the exported weights after
    3 steps, within 8 fp32 roundings of their scale (measured on this CPU: all equal bit for bit, the
    gradient norm within 5.6e-17, its fp64 square root's last bit)."""
    root = launched["root"]
    trainer = Trainer(load_config(None, rl_overrides(root, extra={
        **FOUR, "parallel.mode": '"single"', "run.dir": f'"{root / "one"}"'})), keep_history=True)
    steps = []  # per step: the generation batch's completions and reward table, as the objective gathered
    prepare = trainer.objective.prepare_step

    def recording(*args):
        inputs = prepare(*args)
        steps.append({"completions": inputs.context["completion_ids"],
                      "rewards": inputs.context["rewards"].tolist()})
        return inputs

    trainer.objective.prepare_step = recording
    try:
        one = trainer.train()
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    four = launched["rl"]
    assert [r["step"] for r in four["history"]] == [r["step"] for r in one] == [1, 2, 3]
    assert len(steps) == len(four["steps"]) == 3
    for a, b in zip(four["steps"], steps):
        assert a["completions"] == b["completions"]  # token for token, every step
        assert a["rewards"] == b["rewards"]
    assert any(len(set(map(tuple, s["rewards"]))) > 1 for s in steps)  # groups differ: it learns
    for a, b in zip(four["history"], one):
        for key in KEYS:
            assert_close(a[key], b[key], rtol=8 * EPS, scale=max(abs(b[key]), 1e-3), what=f"4 ranks {key}")
    w1 = load_file(str(root / "one" / "final" / "model.safetensors"))
    w4 = load_file(str(root / "four" / "final" / "model.safetensors"))
    assert w1.keys() == w4.keys() and all(torch.isfinite(v).all() for v in w1.values())
    assert_all_close(w4, w1, rtol=8 * EPS, what="exported weights after 3 steps, 4 ranks vs 1")
