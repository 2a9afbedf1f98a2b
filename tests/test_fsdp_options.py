"""The [parallel] tuning knobs: which must not change the numbers, which may, by how much, and bad input.

Two torchrun launches (4 ranks: reshard N=2; 2 ranks: everything else) of 10 steps each on the
~100k-parameter model, global batch 8 in micro-batches of 2 (so gradient accumulation is on).
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

import conftest
from conftest import run_scenarios, tiny_overrides, torchrun
from shardlm.cli.train import main as train_main
from shardlm.config import ConfigError, ModelConfig, load_config
from shardlm.model.cpu_matmul import (
    Fp32MatmulLinear,
    apply_fp32_matmul,
    bf16_linear_fp32,
    cpu_has_bf16_instructions,
    use_fp32_matmul,
)
from shardlm.model.llama import Llama
from shardlm.parallel import apply_ac, apply_compile, pick_backend
from shardlm.parallel.options import check_reshard_after_forward, describe, dtype_from_name

STEPS = 10
#: bf16 compute with fp32 reduction vs fp32, max loss difference over 10 steps (measured 5e-4 here)
BF16_LOSS_TOL = 5e-3
COMPILE_TOL = 1e-4  # compiled vs eager: different kernel fusion, same math
DDP_TOL = 1e-5
GRAD_SYNC_TOL = 1e-6

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
    # gloo's own reduce-scatter (an all-reduce) instead of the all-to-all that gloo uses by default
    "rs_native": {"parallel.reduce_scatter": '"native"'},
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
RS_ORDER_TOL = 1e-6
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
                                                "train.eval_interval": 0, "parallel.grad_sync": '"last_micro_batch"',
                                                **(extra or {})})


@pytest.fixture(scope="module")
def results(small_data, tmp_path_factory):
    runs = tmp_path_factory.mktemp("options")
    out = {}
    out.update(run_scenarios(4, [
        scenario("base4", small_data, runs),
        scenario("reshard2", small_data, runs, {"parallel.reshard_after_forward": 2}),
        scenario("rs_native4", small_data, runs, {"parallel.reduce_scatter": '"native"'}),
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
@pytest.mark.parametrize("name,reference", [("reshard2", "base4"), ("layers3_groups2", "layers3")]
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
    """4 ranks: the default all-to-all reduce-scatter sums each chunk in rank order, gloo's all-reduce in its
    ring's order; same gradients up to rounding."""
    got, ref = losses(results, "base4"), losses(results, "rs_native4")
    diff = max(abs(a - b) for a, b in zip(got, ref))
    print(f"all-to-all vs gloo reduce-scatter at 4 ranks: loss {diff:.1e}, "
          f"params {max_param_diff(results, 'base4', 'rs_native4'):.1e}")
    assert len(got) == STEPS and diff <= RS_ORDER_TOL
    assert max_param_diff(results, "base4", "rs_native4") <= 1e-5


@pytest.mark.dist
def test_grad_sync_policies(results):
    base = losses(results, "base")
    every = losses(results, "sync_every")
    diff = max(abs(a - b) for a, b in zip(every, base))
    pdiff = max_param_diff(results, "sync_every", "base")
    print(f"grad_sync every_micro_batch vs last_micro_batch: loss {diff:.1e}, params {pdiff:.1e}")
    assert diff <= GRAD_SYNC_TOL and pdiff <= 1e-4
    # without a replicate dimension there is no all-reduce to defer: identical to every_micro_batch
    assert losses(results, "sync_rs_every_ar_last") == every


@pytest.mark.dist
def test_bf16_trains_close_to_fp32(results):
    fp32 = losses(results, "base")
    for name in ("bf16", "bf16_reduce_bf16", "bf16_native"):
        got = losses(results, name)
        diff = max(abs(a - b) for a, b in zip(got, fp32))
        print(f"{name} vs fp32: max loss diff {diff:.2e} (tolerance {BF16_LOSS_TOL})")
        assert all(torch.isfinite(torch.tensor(got)))
        assert got[-1] < got[0] - 0.3
        assert 0 < diff <= BF16_LOSS_TOL  # > 0: bf16 compute really ran
    # shards, and so the exported weights, stay fp32 under bf16 compute
    assert all(t.dtype == torch.float32 for t in params(results, "bf16").values())


@pytest.mark.dist
def test_bf16_matmul_in_fp32_matches_the_bf16_kernel(results):
    """``cpu_bf16_matmul``: the fp32-multiply path trains like PyTorch's bf16 GEMM (same products, another
    summation order), and selective checkpointing keeps its custom operator's output: bit-identical."""
    fp32_matmul, native = losses(results, "bf16"), losses(results, "bf16_native")
    diff = max(abs(a - b) for a, b in zip(fp32_matmul, native))
    print(f"bf16 linear multiplied in fp32 vs the bf16 kernel: max loss diff {diff:.2e}")
    assert diff <= BF16_LOSS_TOL
    assert losses(results, "bf16_fp32_matmul_selective") == fp32_matmul


def test_bf16_linear_fp32_operator():
    """Forward and both gradients equal an fp64 reference within bf16 rounding, and are no further from it
    than PyTorch's bf16 kernel; ``auto`` follows the CPU's flags; names stay those of ``nn.Linear``."""
    g = torch.Generator().manual_seed(0)
    x64 = torch.randn(3, 37, 96, generator=g, dtype=torch.float64)
    w64 = torch.randn(80, 96, generator=g, dtype=torch.float64) / 10
    dy = torch.randn(3, 37, 80, generator=g, dtype=torch.bfloat16)
    results = {}
    for name, fn in (("fp32 multiply", bf16_linear_fp32), ("bf16 kernel", torch.nn.functional.linear)):
        x = x64.bfloat16().requires_grad_()
        w = w64.bfloat16().requires_grad_()
        y = fn(x, w)
        y.backward(dy)
        assert y.dtype == x.grad.dtype == w.grad.dtype == torch.bfloat16
        results[name] = (y, x.grad, w.grad)
    xb, wb = x64.bfloat16().double(), w64.bfloat16().double()  # the exact bf16 operands
    ref = (xb @ wb.T, dy.double() @ wb, dy.double().reshape(-1, 80).T @ xb.reshape(-1, 96))
    for got_fp32, got_bf16, exact in zip(*results.values(), ref):
        err_fp32 = ((got_fp32.double() - exact).abs() / exact.abs().clamp_min(1e-3)).max().item()
        err_bf16 = ((got_bf16.double() - exact).abs() / exact.abs().clamp_min(1e-3)).max().item()
        # one bf16 rounding of the fp32 sum (unit roundoff 2^-8), plus a little for fp32 accumulation
        assert err_fp32 <= 1.01 * 2 ** -8 and err_fp32 <= err_bf16 + 2 ** -9, (err_fp32, err_bf16)

    model = torch.nn.Sequential(torch.nn.Linear(4, 4, bias=False), torch.nn.Linear(4, 4))
    names = [n for n, _ in model.named_parameters()]
    assert apply_fp32_matmul(model) == 1 and isinstance(model[0], Fp32MatmulLinear)
    assert type(model[1]) is torch.nn.Linear and [n for n, _ in model.named_parameters()] == names


@pytest.mark.parametrize("flags,setting,device,dtype,expected", [
    ("avx512f avx2", "auto", "cpu", "bfloat16", True), ("avx512f avx512_bf16", "auto", "cpu", "bfloat16", False),
    ("amx_bf16 amx_tile", "auto", "cpu", "bfloat16", False), ("avx2", "native", "cpu", "bfloat16", False),
    ("avx512_bf16", "fp32", "cpu", "bfloat16", True), ("avx2", "auto", "cpu", "float32", False),
    ("avx2", "fp32", "cuda", "bfloat16", False),
])
def test_cpu_bf16_matmul_setting(tmp_path, flags, setting, device, dtype, expected):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(f"processor\t: 0\nflags\t\t: fpu {flags}\n\nprocessor\t: 1\nflags\t\t: fpu {flags}\n")
    assert use_fp32_matmul(setting, torch.device(device), dtype, cpuinfo) is expected
    assert cpu_has_bf16_instructions(tmp_path / "missing")  # unknown CPU: keep PyTorch's kernels


@pytest.mark.parametrize("mode", ["full", "every_n", "selective"])
def test_compile_with_activation_checkpointing(mode):
    """compile = true combines with every checkpointing mode (TorchDynamo rejected an explicit default
    context_fn, so ``full`` and ``every_n`` failed at the first step): same loss and gradients as eager."""
    cfg = ModelConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=128, vocab_size=512, max_seq_len=64)
    tokens = torch.randint(0, 512, (2, 32), generator=torch.Generator().manual_seed(0))
    results = []
    for compiled in (False, True):
        model = Llama(cfg)
        model.init_weights(0)
        if compiled:
            assert apply_ac(model.model.layers, mode, 2) == ([1] if mode == "every_n" else [0, 1])
            apply_compile(model.model.layers)
        loss = model(tokens).float().logsumexp(-1).mean()
        loss.backward()
        results.append((loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    (eager_loss, eager_grads), (loss, grads) = results
    assert abs(loss - eager_loss) <= COMPILE_TOL and grads.keys() == eager_grads.keys()
    assert max((grads[n] - eager_grads[n]).abs().max().item() for n in grads) <= COMPILE_TOL


@pytest.mark.dist
def test_compile_close_to_eager(results):
    diff = max(abs(a - b) for a, b in zip(losses(results, "compile"), losses(results, "base")))
    pdiff = max_param_diff(results, "compile", "base")
    print(f"compile vs eager: max loss diff {diff:.2e}, params {pdiff:.2e}")
    assert diff <= COMPILE_TOL and pdiff <= 10 * COMPILE_TOL


@pytest.mark.dist
def test_ddp_matches_fsdp(results):
    diff = max(abs(a - b) for a, b in zip(losses(results, "ddp"), losses(results, "base")))
    pdiff = max_param_diff(results, "ddp", "base")
    print(f"ddp vs fsdp, 2 ranks: max loss diff {diff:.2e}, params {pdiff:.2e}")
    assert diff <= DDP_TOL and pdiff <= 1e-4
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


# ---- unit tests and bad input ------------------------------------------------------------------
def test_backend_choice():
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    assert pick_backend(cuda, "auto", cpu_collectives=True) == "cuda:nccl,cpu:gloo"
    assert pick_backend(cuda, "auto") == "nccl"
    assert pick_backend(cpu, "auto", cpu_collectives=True) == "gloo"
    assert pick_backend(cpu, "gloo") == "gloo"


def test_start_up_summary_names_the_settings():
    """The summary's settings line names what runs: ``reduce_scatter = "auto"`` resolved per device type, the
    block grouping; FSDP-only settings are not named for DDP."""
    pcfg = load_config(None, ["--parallel.blocks_per_group=2", "--parallel.forward_prefetch=1",
                              "--parallel.reshard_after_forward=false"]).parallel
    assert describe(pcfg, "cpu") == ("reshard after forward false, prefetch 1/0, 2 block(s) per group, float32 compute "
                                     "/ float32 reduce, reduce-scatter all_to_all, activation checkpointing none, "
                                     "compile false")
    assert "reduce-scatter native" in describe(pcfg, "cuda")
    ddp = load_config(None, ["--parallel.mode=ddp", '--parallel.activation_checkpoint="full"']).parallel
    assert describe(ddp, "cpu") == "activation checkpointing full, compile false"


def test_reshard_and_dtype_checks():
    assert check_reshard_after_forward(2, 4) == 2
    assert check_reshard_after_forward(False, 2) is False
    for n, size in ((3, 4), (2, 2), (4, 4), (3, 6 + 1)):
        with pytest.raises(ConfigError, match="parallel.reshard_after_forward"):
            check_reshard_after_forward(n, size)
    assert dtype_from_name("parallel.param_dtype", "bfloat16") == torch.bfloat16
    with pytest.raises(ConfigError, match="parallel.reduce_dtype"):
        dtype_from_name("parallel.reduce_dtype", "float8")
    cfg = load_config(None, ["--parallel.reshard_after_forward=false", "--parallel.forward_prefetch=2"])
    assert cfg.parallel.reshard_after_forward is False and cfg.parallel.forward_prefetch == 2


@pytest.mark.parametrize("overrides,needle", [
    (["--parallel.param_dtype=fp8"], "parallel.param_dtype: 'fp8' is not one of"),
    (["--parallel.reshard_after_forward=yes"], "parallel.reshard_after_forward: expected bool or int"),
    (["--parallel.activation_checkpoint=some"], "parallel.activation_checkpoint: 'some' is not one of"),
    (["--parallel.mode=ddp", "--parallel.cpu_offload=true"], "parallel.cpu_offload applies to parallel.mode='fsdp'"),
    (["--parallel.blocks_per_group=3"], "parallel.blocks_per_group must be between 1 and model.n_layers=2"),
    (["--parallel.mode=ddp", "--parallel.blocks_per_group=2"],
     "parallel.blocks_per_group applies to parallel.mode='fsdp'"),
    (["--parallel.compile=true"], "parallel.compile=true needs a C++ compiler for TorchInductor, and '/nope/g++'"),
])
def test_bad_input_one_clear_error(overrides, needle, tmp_path, small_data, capsys, monkeypatch):
    monkeypatch.setenv("CXX", "/nope/g++")  # TorchInductor's compiler, absent
    code = train_main(tiny_overrides(small_data, tmp_path / "run") + overrides)
    err = capsys.readouterr().err
    assert code == 2
    assert err.count("error:") == 1 and needle in err, err
    assert "Traceback" not in err


@pytest.mark.dist
def test_reshard_n_not_fitting_the_group_under_torchrun(tmp_path, small_data):
    args = ["-m", "shardlm.train", *tiny_overrides(small_data, tmp_path / "run"), "--train.micro_batch_size=4",
            "--parallel.reshard_after_forward=2", "--parallel.timeout_s=60"]
    proc = torchrun(2, args, timeout=120, check=False)
    assert proc.returncode != 0
    assert proc.stderr.count("error: parallel.reshard_after_forward=2 must satisfy 1 < N < 2") == 1, proc.stderr


def test_activation_checkpointing_saves_less_and_keeps_names():
    from shardlm.config import ModelConfig
    from shardlm.model.llama import Llama
    from shardlm.parallel import apply_ac
    from shardlm.parallel.saved_activations import SavedActivationCounter

    cfg = ModelConfig(dim=64, n_layers=4, n_heads=4, ffn_hidden=128, vocab_size=256, max_seq_len=32)
    tokens = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    saved, grads, names = {}, {}, {}
    for mode in ("none", "full", "every_n", "selective"):
        model = Llama(cfg)
        model.init_weights(0)
        assert apply_ac(model.model.layers, mode, 2) == {"none": [], "every_n": [1, 3]}.get(mode, [0, 1, 2, 3])
        with SavedActivationCounter() as counter:
            loss = model(tokens).logsumexp(-1).mean()
        loss.backward()
        saved[mode], names[mode] = counter.bytes, [n for n, _ in model.named_parameters()]
        grads[mode] = torch.cat([p.grad.flatten() for p in model.parameters()])
    print("saved activation bytes:", saved)
    assert saved["none"] > saved["every_n"] > saved["full"] > 0
    assert saved["none"] > saved["selective"] > saved["full"]
    for mode in saved:
        assert names[mode] == names["none"]
        assert torch.equal(grads[mode], grads["none"]), mode
