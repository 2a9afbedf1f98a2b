"""The [parallel] tuning knobs across ranks: which must not change the numbers, which may, and by how much.

Two torchrun launches (4 ranks: reshard N=2; 2 ranks: everything else) of 10 steps each on the
~100k-parameter model, global batch 8 in micro-batches of 2 (so gradient accumulation is on).
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

import conftest
from conftest import run_scenarios, tiny_overrides, torchrun
from test_fsdp_options import COMPILE_TOL
from tolerance import EPS, assert_all_close, assert_close

STEPS = 10
# tolerances relative to the largest loss of the reference run (the losses are ~6 here)
#: bf16 compute with fp32 reduction vs fp32, max loss difference over 10 steps (measured 5e-4 here, 1e-4
#: relative): half a bf16 rounding (2**-8) of the largest loss
BF16_LOSS_TOL = 2 ** -9
DDP_TOL = 64 * EPS
GRAD_SYNC_TOL = 16 * EPS

# options that must reproduce the default bit for bit, at 2 ranks
EXACT_2 = {
    "reshard_false": {"parallel.reshard_after_forward": "false"},
    "fwd_prefetch2": {"parallel.forward_prefetch": 2},
    "bwd_prefetch2": {"parallel.backward_prefetch": 2},
    "async_ag": {"parallel.async_all_gather": "true"},
    "async_ag_prefetch": {"parallel.async_all_gather": "true", "parallel.forward_prefetch": 1,
                          "parallel.backward_prefetch": 1},
    "cpu_offload": {"parallel.cpu_offload": "true"},
    "ac_full": {"parallel.activation_checkpoint": '"full"'},
    "ac_every2": {"parallel.activation_checkpoint": '"every_n"', "parallel.activation_checkpoint_n": 2},
    "ac_selective": {"parallel.activation_checkpoint": '"selective"'},
    "ac_full_async": {"parallel.activation_checkpoint": '"full"', "parallel.async_all_gather": "true"},
    # gloo's own reduce-scatter (an all-reduce) and the all-to-all instead of the shared-memory one that
    # ranks on one host use by default
    "rs_native": {"parallel.reduce_scatter": '"native"'},
    "rs_all_to_all": {"parallel.reduce_scatter": '"all_to_all"'},
    # gloo's own all-gather and the point-to-point sends instead of the shared-memory default
    "ag_native": {"parallel.all_gather": '"native"'},
    "ag_point_to_point": {"parallel.all_gather": '"point_to_point"'},
    # both blocks in one FSDP group: one all-gather and one reduce-scatter for the pair
    "groups2_ac_async": {"parallel.blocks_per_group": 2, "parallel.activation_checkpoint": '"full"',
                         "parallel.async_all_gather": "true", "parallel.reshard_after_forward": "false"},
}
#: three blocks in groups of two (the last group takes the one left), prefetching across groups, against three
#: blocks one per group
LAYERS3 = {"model.n_layers": 3}
GROUPS_OF_2 = {**LAYERS3, "parallel.blocks_per_group": 2, "parallel.forward_prefetch": 1,
               "parallel.backward_prefetch": 1}
#: all-to-all vs gloo's all-reduce reduce-scatter at 4 ranks: another summation order, max loss difference
#: relative to the loss
RS_ORDER_TOL = 16 * EPS
OTHER_2 = {
    "sync_every": {"parallel.grad_sync": '"every_micro_batch"'},
    "sync_rs_every_ar_last": {"parallel.grad_sync": '"reduce_scatter_every_all_reduce_last"'},
    # the fp32-multiply kernel named explicitly: ``auto`` picks it only on CPUs without bf16 instructions
    "bf16": {"parallel.param_dtype": '"bfloat16"', "parallel.cpu_bf16_matmul": '"fp32"'},
    "bf16_reduce_bf16": {"parallel.param_dtype": '"bfloat16"', "parallel.reduce_dtype": '"bfloat16"'},
    "bf16_native": {"parallel.param_dtype": '"bfloat16"', "parallel.cpu_bf16_matmul": '"native"'},
    "bf16_fp32_matmul_selective": {"parallel.param_dtype": '"bfloat16"', "parallel.cpu_bf16_matmul": '"fp32"',
                                   "parallel.activation_checkpoint": '"selective"'},
    "ddp": {"parallel.mode": '"ddp"'},
    "compile": {"parallel.compile": "true"},
}


def scenario(name, data, runs, extra=None, micro=2):
    # the reference ("base") keeps the gradient-sync setting these comparisons were written for (the default
    # before it became every_micro_batch), so every option is still compared against the same run
    return conftest.scenario(name, data, runs, {"train.steps": STEPS, "train.micro_batch_size": micro,
                                                "train.eval_interval": 0,
                                                "parallel.grad_sync": '"last_micro_batch"', **(extra or {})})


@pytest.fixture(scope="module")
def results(small_data, tmp_path_factory):
    runs = tmp_path_factory.mktemp("options")
    out = {}
    out.update(run_scenarios(4, [
        scenario("base4", small_data, runs),
        scenario("reshard2", small_data, runs, {"parallel.reshard_after_forward": 2}),
        scenario("rs_native4", small_data, runs, {"parallel.reduce_scatter": '"native"'}),
        # the shared-memory all-gather with three peers, resharded (gathered again for backward)
        scenario("ag_native4", small_data, runs, {"parallel.all_gather": '"native"'}),
        # the shared-memory reduce-scatter sums each chunk in rank order, as the all-to-all does
        scenario("rs_all_to_all4", small_data, runs, {"parallel.reduce_scatter": '"all_to_all"',
                                                      "parallel.all_gather": '"point_to_point"'}),
    ], runs))
    two = {"base": {}, **EXACT_2, **OTHER_2, "layers3": LAYERS3, "layers3_groups2": GROUPS_OF_2}
    out.update(run_scenarios(2, [scenario(n, small_data, runs, extra) for n, extra in two.items()], runs))
    return out, runs


def losses(results, name):
    return [r["loss"] for r in results[0][name][0]["history"]]


def params(results, name):
    return load_file(str(results[1] / name / "final" / "model.safetensors"))


def max_param_diff(results, a, b):
    p, q = params(results, a), params(results, b)
    assert p.keys() == q.keys()
    return max((p[k] - q[k]).abs().max().item() for k in p)


@pytest.mark.dist
@pytest.mark.parametrize("name,reference", [("reshard2", "base4"), ("ag_native4", "base4"),
                                            ("rs_all_to_all4", "base4"),
                                            ("layers3_groups2", "layers3")]
                         + [(n, "base") for n in EXACT_2])
def test_bit_identical_to_default(results, name, reference):
    got, ref = losses(results, name), losses(results, reference)
    assert len(got) == len(ref) == STEPS
    assert got == ref, (name, got, ref)
    p, q = params(results, name), params(results, reference)
    assert all(torch.equal(p[k], q[k]) for k in q), name
    assert ref[-1] < ref[0] - 0.3  # it learned: the comparison is not vacuous


@pytest.mark.dist
def test_all_to_all_reduce_scatter_at_four_ranks(results):
    """4 ranks: the default (shared-memory) reduce-scatter sums each chunk in rank order, gloo's all-reduce in
    its ring's order; same gradients up to rounding."""
    got, ref = losses(results, "base4"), losses(results, "rs_native4")
    diff = max(abs(a - b) for a, b in zip(got, ref))
    print(f"all-to-all vs gloo reduce-scatter at 4 ranks: loss {diff:.1e}, "
          f"params {max_param_diff(results, 'base4', 'rs_native4'):.1e}")
    assert len(got) == STEPS
    assert_close(got, ref, rtol=RS_ORDER_TOL, what="loss")
    # parameters: relative to the largest (the norms' weights, ~1)
    assert_all_close(params(results, "base4"), params(results, "rs_native4"), rtol=1e-5, what="params")


@pytest.mark.dist
def test_grad_sync_policies(results):
    base = losses(results, "base")
    every = losses(results, "sync_every")
    diff = max(abs(a - b) for a, b in zip(every, base))
    pdiff = max_param_diff(results, "sync_every", "base")
    print(f"grad_sync every_micro_batch vs last_micro_batch: loss {diff:.1e}, params {pdiff:.1e}")
    assert_close(every, base, rtol=GRAD_SYNC_TOL, what="loss")
    assert_all_close(params(results, "sync_every"), params(results, "base"), rtol=1e-4, what="params")
    # without a replicate dimension there is no all-reduce to defer: identical to every_micro_batch
    assert losses(results, "sync_rs_every_ar_last") == every


@pytest.mark.dist
def test_bf16_trains_close_to_fp32(results):
    fp32 = losses(results, "base")
    for name in ("bf16", "bf16_reduce_bf16", "bf16_native"):
        got = losses(results, name)
        diff = max(abs(a - b) for a, b in zip(got, fp32))
        print(f"{name} vs fp32: max loss diff {diff:.2e} (tolerance {BF16_LOSS_TOL} relative)")
        assert all(torch.isfinite(torch.tensor(got)))
        assert got[-1] < got[0] - 0.3
        assert diff > 0  # bf16 compute really ran
        assert_close(got, fp32, rtol=BF16_LOSS_TOL, what=f"{name} loss")
    # shards, and so the exported weights, stay fp32 under bf16 compute
    assert all(t.dtype == torch.float32 for t in params(results, "bf16").values())


@pytest.mark.dist
def test_bf16_matmul_in_fp32_matches_the_bf16_kernel(results):
    """``cpu_bf16_matmul``: the fp32-multiply path trains like PyTorch's bf16 GEMM (same products, another
    summation order), and selective checkpointing keeps its custom operator's output: bit-identical."""
    fp32_matmul, native = losses(results, "bf16"), losses(results, "bf16_native")
    diff = max(abs(a - b) for a, b in zip(fp32_matmul, native))
    print(f"bf16 linear multiplied in fp32 vs the bf16 kernel: max loss diff {diff:.2e}")
    assert_close(fp32_matmul, native, rtol=BF16_LOSS_TOL, what="loss")
    assert losses(results, "bf16_fp32_matmul_selective") == fp32_matmul


@pytest.mark.dist
def test_compile_close_to_eager(results):
    diff = max(abs(a - b) for a, b in zip(losses(results, "compile"), losses(results, "base")))
    pdiff = max_param_diff(results, "compile", "base")
    print(f"compile vs eager: max loss diff {diff:.2e}, params {pdiff:.2e}")
    assert_close(losses(results, "compile"), losses(results, "base"), rtol=COMPILE_TOL, what="loss")
    assert_all_close(params(results, "compile"), params(results, "base"), rtol=10 * COMPILE_TOL,
                     what="params")


@pytest.mark.dist
def test_ddp_matches_fsdp(results):
    diff = max(abs(a - b) for a, b in zip(losses(results, "ddp"), losses(results, "base")))
    pdiff = max_param_diff(results, "ddp", "base")
    print(f"ddp vs fsdp, 2 ranks: max loss diff {diff:.2e}, params {pdiff:.2e}")
    assert_close(losses(results, "ddp"), losses(results, "base"), rtol=DDP_TOL, what="loss")
    assert_all_close(params(results, "ddp"), params(results, "base"), rtol=1e-4, what="params")
    assert not any(p["dtensor"] for p in results[0]["ddp"][0]["params"].values())


@pytest.mark.dist
def test_parameter_and_checkpoint_names_never_change(results):
    out, _ = results
    for reference, others in (("base", [n for n in out if not n.startswith("layers3")]),
                              ("layers3", ["layers3_groups2"])):
        names = list(out[reference][0]["params"])
        keys = set(params(results, reference))
        assert names and keys == set(names)
        for name in others:
            assert list(out[name][0]["params"]) == names, name
            assert set(params(results, name)) == keys, name


@pytest.mark.dist
def test_reshard_n_not_fitting_the_group_under_torchrun(tmp_path, small_data):
    args = ["-m", "shardlm.train", *tiny_overrides(small_data, tmp_path / "run"),
            "--train.micro_batch_size=4", "--parallel.reshard_after_forward=2", "--parallel.timeout_s=60"]
    proc = torchrun(2, args, timeout=120, check=False)
    assert proc.returncode != 0
    assert proc.stderr.count("error: parallel.reshard_after_forward=2 must satisfy 1 < N < 2") == 1, (
        proc.stderr
    )
