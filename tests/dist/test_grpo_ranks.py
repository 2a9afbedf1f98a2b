"""Online RL at 2 FSDP ranks equals one process over 3 steps (one torchrun launch per world size): the same
completions token for token and the same rewards at every step, the losses and the exported weights within
the tolerance of tests/tolerance.py; plain dapo, LoRA with a KL term to the base (the adapters off), and
several updates per generation batch: rl.num_iterations = 2 (grpo, clip-higher) and rl.steps_per_generation =
2 (dapo), where the first update of each cycle of 2 steps has an importance ratio of exactly 1 (the old
log-probs are the trainer's forward at generation) and the second does not; the exact rollout
(rl.rollout = "exact", num_iterations 2, a chunked head), whose sampler's log-probs are the old ones and
equal the trainer's bit for bit (sampling/logprob_diff_max 0 at every step; the key-value cache's dapo run's
is not). A run resumed at step 2 samples,
scores and loses at step 3 exactly what the uninterrupted run did (dapo, and num_iterations 2: a new
cycle); inside a cycle of 4 steps (steps_per_generation 2 x num_iterations 2, 2 ranks only), a run resumed
after step 1 from the checkpoint's buffer trains steps 2 and 3 on the uninterrupted run's completions,
rewards, old log-probs and losses, to the same weights, bit for bit (exact rollout)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from conftest import ROOT, rl_overrides, torchrun
from tolerance import EPS, assert_all_close, assert_close

TOL = 8 * EPS  # ~1e-6 relative
SCENARIOS = {"dapo": {},
             "lora_kl": {"lora.enabled": "true", "lora.rank": 4, "lora.alpha": 8.0, "rl.beta": 0.1,
                         "rl.loss_type": '"grpo"'},
             "iter2": {"rl.num_iterations": 2, "rl.loss_type": '"grpo"', "rl.epsilon": 0.05,
                       "rl.epsilon_high": 0.08, "rl.scale_rewards": '"batch"'},
             "spg2": {"rl.steps_per_generation": 2},  # with iter2 and exact: cycles of 2 steps
             "exact": {"rl.rollout": '"exact"', "rl.num_iterations": 2, "train.loss_chunk_tokens": 8}}
#: a generation cycle of 4 steps, at 2 ranks only: saved after every step (inside the cycle), resumed after step 1;
#: sampled by the exact rollout (its log-probs are the buffer's old ones; the unit test resumes the KV cache's)
CYCLE4 = {"rl.steps_per_generation": 2, "rl.num_iterations": 2, "rl.loss_type": '"grpo"', "checkpoint.interval": 1,
          "rl.rollout": '"exact"'}
KEYS = ("loss", "reward", "entropy", "completions/mean_length", "grad_norm")


@pytest.mark.dist
def test_two_ranks_equal_one_process(tmp_path):
    reports = {}
    for nproc, mode in ((1, "single"), (2, "fsdp")):
        out = tmp_path / f"out{nproc}"
        runs = tmp_path / f"runs{nproc}"
        scenarios = [{"name": name, "overrides": rl_overrides(tmp_path, extra={
            **extra, "parallel.mode": f'"{mode}"', "checkpoint.interval": 2, "checkpoint.keep": 0,
            "run.dir": f'"{runs / name}"'})} for name, extra in SCENARIOS.items()]
        if nproc == 2:  # resumed at step 2: step 3 samples and scores what the uninterrupted run did
            for name in ("dapo", "iter2"):
                scenarios.append({"name": f"resumed_{name}", "overrides": rl_overrides(tmp_path, extra={
                    **SCENARIOS[name], "parallel.mode": '"fsdp"', "checkpoint.interval": 2,
                    "checkpoint.keep": 0, "run.dir": f'"{runs / name}"',
                    "checkpoint.resume": f'"{runs / name / "checkpoints" / "step-2"}"'})})
            for name, run_dir, resume in (("cycle4", runs / "cycle4", ""),
                                          ("resumed_cycle4", runs / "resumed_cycle4",
                                           runs / "cycle4" / "checkpoints" / "step-1")):
                scenarios.append({"name": name, "overrides": rl_overrides(tmp_path, extra={
                    **CYCLE4, "parallel.mode": '"fsdp"', "checkpoint.keep": 0, "run.dir": f'"{run_dir}"',
                    "checkpoint.resume": f'"{resume}"'})})
        out.mkdir()
        (out / "spec.json").write_text(json.dumps({"out": str(out), "scenarios": scenarios}))
        torchrun(nproc, [str(ROOT / "tests" / "workers" / "grpo_worker.py"), str(out / "spec.json")],
                 timeout=600)
        reports[nproc] = {s["name"]: json.loads((out / s["name"] / "rank0.json").read_text())
                          for s in scenarios}
    for name in ("dapo", "iter2"):
        resumed, whole = reports[2][f"resumed_{name}"], reports[2][name]
        assert [r["step"] for r in resumed["history"]] == [3]
        assert resumed["steps"][0] == whole["steps"][2]  # the same completions, rewards (and ratio of 1)
        assert resumed["history"][0]["loss"] == whole["history"][2]["loss"]
    whole, resumed = reports[2]["cycle4"], reports[2]["resumed_cycle4"]
    assert [r["step"] for r in resumed["history"]] == [2, 3]
    assert resumed["steps"] == whole["steps"][1:]  # completions, rewards, |ratio - 1| of steps 2 and 3
    assert [s["ratio"]["exact"] for s in whole["steps"]] == [True, False, False]  # old log-probs at work
    assert whole["steps"][0]["completions"] == whole["steps"][2]["completions"]  # one generation batch
    for key in (*KEYS, "clip_ratio/region_mean", "lr"):
        assert [r[key] for r in resumed["history"]] == [r[key] for r in whole["history"][1:]], key
    assert resumed["logits"] == whole["logits"]  # the trained weights, bit for bit
    finals = [load_file(str(tmp_path / "runs2" / name / "final" / "model.safetensors"))
              for name in ("cycle4", "resumed_cycle4")]
    assert finals[0].keys() == finals[1].keys() and all(torch.equal(finals[0][k], finals[1][k])
                                                        for k in finals[0])
    for nproc in (1, 2):  # the exact rollout's log-probs are the trainer's; the key-value cache's are not
        assert [r["sampling/logprob_diff_max"] for r in reports[nproc]["exact"]["history"]] == [0.0] * 3
        assert max(r["sampling/logprob_diff_max"] for r in reports[nproc]["dapo"]["history"]) > 0.0
    for name in ("iter2", "spg2", "exact"):
        for nproc in (1, 2):
            steps, history = reports[nproc][name]["steps"], reports[nproc][name]["history"]
            # step 1 and 3 start a cycle: the ratio is exactly 1; step 2 trains after an update: it is not
            for rank in range(nproc):
                mine = json.loads((tmp_path / f"out{nproc}" / name / f"rank{rank}.json").read_text())["steps"]
                assert [s["ratio"]["exact"] for s in mine] == [True, False, True], (name, nproc, rank)
                assert mine[0]["ratio"]["gap"] == mine[2]["ratio"]["gap"] == 0.0 < mine[1]["ratio"]["gap"]
            # one generation batch per cycle: step 2 reports step 1's completions, step 3 new ones
            assert steps[1]["completions"] == steps[0]["completions"] != steps[2]["completions"]
            assert len(steps[0]["completions"]) == 8 * (2 if name == "spg2" else 1)
            rollout_s = [r["time/rollout_s"] for r in history]
            assert rollout_s[0] > 0.0 == rollout_s[1] < rollout_s[2]
    for nproc in (1, 2):  # a small clip range: tokens clipped after one update, none at a ratio of 1
        clipped = [r["clip_ratio/region_mean"] for r in reports[nproc]["iter2"]["history"]]
        assert clipped[0] == clipped[2] == 0.0 < clipped[1], clipped
    for name in SCENARIOS:
        one, two = reports[1][name], reports[2][name]
        assert [r["step"] for r in two["history"]] == [1, 2, 3]
        for a, b in zip(two["steps"], one["steps"]):
            assert a["completions"] == b["completions"]  # token for token, every step
            assert a["rewards"] == b["rewards"]
        assert any(len(set(map(tuple, s["rewards"]))) > 1 for s in one["steps"])  # groups differ: it learns
        for a, b in zip(two["history"], one["history"]):
            for key in KEYS:
                assert_close(a[key], b[key], rtol=TOL, scale=max(abs(b[key]), 1e-3), what=f"{name} {key}")
        if name == "lora_kl":
            assert one["history"][0]["kl"] == 0.0 < one["history"][2]["kl"]  # the base, then a policy apart
        w1 = load_file(str(tmp_path / "runs1" / name / "final" / "model.safetensors"))
        w2 = load_file(str(tmp_path / "runs2" / name / "final" / "model.safetensors"))
        assert_all_close(w2, w1, rtol=TOL, what=f"{name} exported weights, 2 ranks vs 1")
        assert all(torch.isfinite(v).all() for v in w1.values())
        for nproc in (1, 2):
            assert_export_loads_in_transformers(tmp_path / f"runs{nproc}" / name / "final", reports[nproc][name],
                                                what=f"{name} at {nproc} rank(s)")


def assert_export_loads_in_transformers(final, report: dict, what: str) -> None:
    """The run's export ``final/`` loads in transformers with no missing or unexpected weight, and its logits
    on the worker's probe tokens equal those of the trained policy in the training processes (the LoRA run's
    export has the adapters merged into the base) within 64 fp32 roundings."""
    import transformers
    hf, info = transformers.AutoModelForCausalLM.from_pretrained(str(final), dtype=torch.float32,
                                                                 output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], (what, info)
    with torch.no_grad():
        theirs = hf.eval()(torch.tensor(report["probe"])).logits
    ours = torch.tensor(report["logits"])
    assert ours.shape == theirs.shape == (2, 16, 400), (what, ours.shape, theirs.shape)
    assert_close(theirs, ours, rtol=64 * EPS, what=f"{what}: transformers' logits of the export vs the policy's")
