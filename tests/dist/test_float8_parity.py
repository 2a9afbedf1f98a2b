"""Emulated float8 training (``train.float8``, torchao, CPU): FSDP at 2 ranks, with float8 all-gathers and the
scales precomputed after each optimizer step, equals one process over 3 steps.

Dynamic tensorwise scales depend on the tensor they scale: an activation's on the micro-batch it belongs to.
So the one-process reference runs the same micro-batches (4 sequences, accumulated twice) that the two ranks
run (4 each); a loss scaled by the rank count changes the gradients' scales by a power of 2, which float8
rounding carries exactly. Evaluation splits its windows over the ranks differently, so under tensorwise scales
the validation loss differs within float8's rounding (measured: 8.5e-5 of 6.1); rowwise scales are per token and
the validation loss is compared too.
"""

from __future__ import annotations

import math

import pytest
import torch
from safetensors.torch import load_file

from conftest import run_scenarios, scenario
from tolerance import assert_all_close, assert_close

#: relative, on the loss (~6) and on the largest parameter (a norm's, ~1): summation order only
LOSS_TOL, PARAM_TOL = 1e-6, 1e-5
LONG = {"parallel.mode": '"single"', "checkpoint.enabled": "false"}
BF16 = {"parallel.param_dtype": '"bfloat16"', "checkpoint.enabled": "false"}
STEPS = {"train.steps": 3, "train.eval_interval": 3, "train.micro_batch_size": 4, "checkpoint.enabled": "false"}


@pytest.fixture(scope="module")
def results(small_data, tmp_path_factory):
    runs = tmp_path_factory.mktemp("float8")
    out = {}
    single = {**STEPS, "parallel.mode": '"single"'}
    out.update(run_scenarios(1, [
        scenario("single_tensorwise", small_data, runs, {**single, "train.float8": '"tensorwise"'}),
        scenario("single_rowwise", small_data, runs, {**single, "train.float8": '"rowwise"'}),
        # 20 steps (tiny_overrides' default) against full precision, and MXFP8 against bf16
        scenario("fp32_20", small_data, runs, LONG),
        scenario("tensorwise_20", small_data, runs, {**LONG, "train.float8": '"tensorwise"'}),
        scenario("rowwise_20", small_data, runs, {**LONG, "train.float8": '"rowwise"'}),
        scenario("bf16_20", small_data, runs, BF16),
        scenario("mxfp8_20", small_data, runs, {**BF16, "train.float8": '"mxfp8"'}),
    ], runs))
    out.update(run_scenarios(2, [
        scenario("fsdp2_tensorwise", small_data, runs, {**STEPS, "train.float8": '"tensorwise"'}),
        scenario("fsdp2_rowwise", small_data, runs, {**STEPS, "train.float8": '"rowwise"'}),
    ], runs))
    return out, runs


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
@pytest.mark.dist
def test_fsdp_two_ranks_equal_one_process(results, recipe):
    out, runs = results
    hist, ref = out[f"fsdp2_{recipe}"][0]["history"], out[f"single_{recipe}"][0]["history"]
    assert len(hist) == len(ref) == 3
    assert_close([h["loss"] for h in hist], [h["loss"] for h in ref], rtol=LOSS_TOL, what=f"{recipe} loss")
    if recipe == "rowwise":  # per-row scales: the evaluation's own batch split (per rank) changes nothing
        assert_close(hist[-1]["val_loss"], ref[-1]["val_loss"], rtol=LOSS_TOL, what=f"{recipe} val loss")
    p = load_file(str(runs / f"fsdp2_{recipe}" / "final" / "model.safetensors"))
    q = load_file(str(runs / f"single_{recipe}" / "final" / "model.safetensors"))
    assert p.keys() == q.keys() and "model.layers.0.mlp.up_proj.weight" in p  # names unchanged by float8
    assert_all_close(p, q, rtol=PARAM_TOL, what=f"{recipe} params")
    assert hist[-1]["loss"] < hist[0]["loss"]  # the steps moved the model: the comparison is not vacuous


@pytest.mark.dist
def test_float8_all_gather_ran_with_precomputed_scales(results):
    """The tensorwise run all-gathered its converted weights in float8 (gloo through the byte view), and the
    two recipes really differ (the float8 path ran: rowwise and tensorwise round differently)."""
    out, _ = results
    report = out["fsdp2_tensorwise"][0]
    # 2 blocks x (q, k, v, o, gate, up, down): every dimension (32, 64, 128) a multiple of 16; lm_head not
    assert report["float8_all_gather_weights"] == 14
    assert report["optimizer_post_hooks"] == 1  # after_optimizer_step: the scales in one all-reduce
    rowwise = out["fsdp2_rowwise"][0]  # torchao all-gathers float8 tensorwise only
    assert rowwise["float8_all_gather_weights"] == rowwise["optimizer_post_hooks"] == 0
    a, b = (out[f"single_{r}"][0]["history"][-1]["loss"] for r in ("tensorwise", "rowwise"))
    assert a != b


@pytest.mark.parametrize("name,reference", [("tensorwise_20", "fp32_20"), ("rowwise_20", "fp32_20"),
                                            ("mxfp8_20", "bf16_20")])
@pytest.mark.dist
def test_emulated_float8_loss_over_20_steps_stays_within_torchaos_bound(results, name, reference):
    """20 steps from the same start on the same batches: the float8 loss curve against full precision (MXFP8
    against bf16, the precision it computes in) above torchao's 20 dB SQNR; measured far above it."""
    out, _ = results
    a = torch.tensor([h["loss"] for h in out[name][0]["history"]], dtype=torch.float64)
    b = torch.tensor([h["loss"] for h in out[reference][0]["history"]], dtype=torch.float64)
    assert len(a) == len(b) == 20 and b[-1] < b[0] - 0.5  # the reference learned
    db = 20 * math.log10(b.norm().item() / (a - b).norm().item())
    print(f"{name} vs {reference}: loss SQNR {db:.1f} dB, largest relative difference "
          f"{((a - b).abs() / b).max().item():.2e}, final loss {a[-1].item():.4f} vs {b[-1].item():.4f}")
    assert db > 20.0
