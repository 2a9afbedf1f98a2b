"""Online RL at 2 FSDP ranks equals one process over 3 steps (one torchrun launch per world size): the same
completions token for token and the same rewards at every step, the losses and the exported weights within
the tolerance of tests/tolerance.py; plain dapo, and LoRA with a KL term to the base (the adapters off). A
run resumed at step 2 samples, scores and loses at step 3 exactly what the uninterrupted run did."""

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
                         "rl.loss_type": '"grpo"'}}
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
            scenarios.append({"name": "resumed", "overrides": rl_overrides(tmp_path, extra={
                "parallel.mode": '"fsdp"', "checkpoint.interval": 2, "checkpoint.keep": 0,
                "run.dir": f'"{runs / "dapo"}"',
                "checkpoint.resume": f'"{runs / "dapo" / "checkpoints" / "step-2"}"'})})
        out.mkdir()
        (out / "spec.json").write_text(json.dumps({"out": str(out), "scenarios": scenarios}))
        torchrun(nproc, [str(ROOT / "tests" / "workers" / "grpo_worker.py"), str(out / "spec.json")],
                 timeout=600)
        reports[nproc] = {s["name"]: json.loads((out / s["name"] / "rank0.json").read_text())
                          for s in scenarios}
    resumed, whole = reports[2]["resumed"], reports[2]["dapo"]
    assert [r["step"] for r in resumed["history"]] == [3]
    assert resumed["steps"][0] == whole["steps"][2]  # the same completions and rewards
    assert resumed["history"][0]["loss"] == whole["history"][2]["loss"]
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
