"""The [parallel] tuning knobs in one process: the bf16 linear's fp32 operator, the CPU bf16 matmul setting,
compile with activation checkpointing, the backend choice, the start-up summary, and the checks of bad input.
The knobs' effect on the numbers at 2 and 4 ranks is in tests/dist/test_fsdp_options_parity.py."""

from __future__ import annotations

import pytest
import torch

from conftest import tiny_overrides
from shardlm.cli.train import main as train_main
from shardlm.config import ConfigError, ModelConfig, load_config
from shardlm.model.cpu_matmul import (
    Fp32MatmulLinear,
    apply_fp32_matmul,
    bf16_linear_fp32,
    cpu_has_bf16_instructions,
    use_fp32_matmul,
)
from shardlm.model.decoder import CausalLM
from shardlm.parallel import apply_ac, apply_compile, pick_backend
from shardlm.parallel.options import check_reshard_after_forward, describe, dtype_from_name
from tolerance import EPS, assert_all_close, assert_close, check

#: compiled vs eager training over 10 steps (tests/dist): different kernel fusion, the same math; relative to
#: the largest loss (the parameters: 10x, relative to the largest parameter)
COMPILE_TOL = 1e-4


def test_bf16_linear_fp32_operator():
    """Forward and both gradients are the fp64 reference correctly rounded to bf16, except where the reference
    lies within the fp32 sum's rounding error of a tie (there the other neighbour is right too), and no
    further from it than PyTorch's bf16 kernel; ``auto`` follows the CPU's flags; names stay those of
    ``nn.Linear``."""
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
    dyb = dy.double()
    ref = (xb @ wb.T, dyb @ wb, dyb.reshape(-1, 80).T @ xb.reshape(-1, 96))
    # the sums of |terms| and the lengths of the fp32 sums, for their rounding error (Higham: <= K·u·Σ|terms|)
    sums = ((xb.abs() @ wb.abs().T, 96), (dyb.abs() @ wb.abs(), 80),
            (dyb.abs().reshape(-1, 80).T @ xb.abs().reshape(-1, 96), 111))
    for got_fp32, got_bf16, exact, (terms, k) in zip(*results.values(), ref, sums):
        # the bf16 products are exact in fp32, so only the fp32 sum and the final bf16 rounding err: the
        # result is the correctly rounded one (measured: 1 element of 27216 differs, a tie), or, where the
        # sum's error can cross a tie, the other neighbour: the reference then sits at the midpoint of the two
        rounded = exact.float().bfloat16()
        off = got_fp32 != rounded
        midpoint = (got_fp32.double() + rounded.double()) / 2
        near_tie = ((exact - midpoint).abs() / (k * EPS * terms))[off]
        check(near_tie.max().item() if off.any() else 0.0, 1.0,
              what="distance from a tie / the fp32 sum's error")
        err_fp32 = ((got_fp32.double() - exact).abs() / exact.abs().clamp_min(1e-3)).max().item()
        err_bf16 = ((got_bf16.double() - exact).abs() / exact.abs().clamp_min(1e-3)).max().item()
        assert err_fp32 <= err_bf16 + 2 ** -9, (err_fp32, err_bf16)

    model = torch.nn.Sequential(torch.nn.Linear(4, 4, bias=False), torch.nn.Linear(4, 4))
    names = [n for n, _ in model.named_parameters()]
    assert apply_fp32_matmul(model) == 1 and isinstance(model[0], Fp32MatmulLinear)
    assert type(model[1]) is torch.nn.Linear and [n for n, _ in model.named_parameters()] == names


@pytest.mark.parametrize("flags,setting,device,dtype,expected", [
    ("avx512f avx2", "auto", "cpu", "bfloat16", True),
    ("avx512f avx512_bf16", "auto", "cpu", "bfloat16", False),
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
    cfg = ModelConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=128, vocab_size=512,
                      max_seq_len=64)
    tokens = torch.randint(0, 512, (2, 32), generator=torch.Generator().manual_seed(0))
    results = []
    for compiled in (False, True):
        model = CausalLM(cfg)
        model.init_weights(0)
        if compiled:
            assert apply_ac(model.model.layers, mode, 2) == ([1] if mode == "every_n" else [0, 1])
            apply_compile(model.model.layers)
        loss = model(tokens).float().logsumexp(-1).mean()
        loss.backward()
        results.append((loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    (eager_loss, eager_grads), (loss, grads) = results
    assert_close(loss, eager_loss, rtol=64 * EPS, what="compiled loss")
    assert_all_close(grads, eager_grads, rtol=64 * EPS, what="compiled gradients")


# ---- unit tests and bad input ------------------------------------------------------------------
def test_backend_choice():
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    assert pick_backend(cuda, "auto", cpu_collectives=True) == "cuda:nccl,cpu:gloo"
    assert pick_backend(cuda, "auto") == "nccl"
    assert pick_backend(cpu, "auto", cpu_collectives=True) == "gloo"
    assert pick_backend(cpu, "gloo") == "gloo"


def test_start_up_summary_names_the_settings():
    """The summary's settings line names what runs: ``reduce_scatter`` and ``all_gather = "auto"`` resolved
    per device type, the block grouping; FSDP-only settings are not named for DDP."""
    pcfg = load_config(None, ["--parallel.blocks_per_group=2", "--parallel.forward_prefetch=1",
                              "--parallel.reshard_after_forward=false"]).parallel
    assert describe(pcfg, "cpu") == ("reshard after forward false, prefetch 1/0, 2 block(s) per group, "
                                     "float32 compute / float32 reduce, reduce-scatter all_to_all, "
                                     "all-gather point_to_point, "
                                     "activation checkpointing none, compile false")
    assert "reduce-scatter native, all-gather native" in describe(pcfg, "cuda")
    # ranks on one host with room in /dev/shm: both through shared memory (CPU only)
    assert "reduce-scatter shared_memory, all-gather shared_memory" in describe(pcfg, "cpu", True)
    assert "reduce-scatter native, all-gather native" in describe(pcfg, "cuda", True)
    native = load_config(None, ['--parallel.all_gather="native"']).parallel
    assert "all-gather native" in describe(native, "cpu")
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
    (["--parallel.mode=ddp", "--parallel.cpu_offload=true"],
     "parallel.cpu_offload applies to parallel.mode='fsdp'"),
    (["--parallel.blocks_per_group=3"], "parallel.blocks_per_group must be between 1 and model.n_layers=2"),
    (["--parallel.mode=ddp", "--parallel.blocks_per_group=2"],
     "parallel.blocks_per_group applies to parallel.mode='fsdp'"),
    (["--parallel.compile=true"],
     "parallel.compile=true needs a C++ compiler for TorchInductor, and '/nope/g++'"),
])
def test_bad_input_one_clear_error(overrides, needle, tmp_path, small_data, capsys, monkeypatch):
    monkeypatch.setenv("CXX", "/nope/g++")  # TorchInductor's compiler, absent
    code = train_main(tiny_overrides(small_data, tmp_path / "run") + overrides)
    err = capsys.readouterr().err
    assert code == 2
    assert err.count("error:") == 1 and needle in err, err
    assert "Traceback" not in err


def test_activation_checkpointing_saves_less_and_keeps_names():
    from shardlm.config import ModelConfig
    from shardlm.model.decoder import CausalLM
    from shardlm.parallel import apply_ac
    from shardlm.parallel.saved_activations import SavedActivationCounter

    cfg = ModelConfig(dim=64, n_layers=4, n_heads=4, ffn_hidden=128, vocab_size=256, max_seq_len=32)
    tokens = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    saved, grads, names = {}, {}, {}
    for mode in ("none", "full", "every_n", "selective"):
        model = CausalLM(cfg)
        model.init_weights(0)
        assert apply_ac(model.model.layers, mode, 2) == {"none": [], "every_n": [1, 3]}.get(
            mode, [0, 1, 2, 3]
        )
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
