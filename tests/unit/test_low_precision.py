"""Float8 training and quantisation-aware training (torchao) in one process: which layers convert, the
refusals (one message each), the emulated float8 numerics against fp32 at torchao's own bound, and QAT's fake
quantisation against torchao's real quantisation of the same weights.

torchao's float8 numerics test (``test/float8/test_numerics_integration.py``) asks the output and every
gradient of a float8 feed-forward to stay above 20 dB SQNR against the high-precision one; that is the bound
used here and in tests/dist/test_float8_parity.py.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from shardlm.config import load_config
from shardlm.errors import ConfigError
from shardlm.model.config import ModelConfig
from shardlm.model.decoder import CausalLM
from shardlm.model.qat import QAT_SCHEMES, apply_qat, base_config, check_scheme, qat_excluded
from shardlm.parallel.float8 import (
    apply_float8,
    check_float8_device,
    float8_layers,
    has_fsdp_float8_weights,
)
from tolerance import EPS, assert_close

#: torchao's float8 numerics bound (dB): output and gradients against high precision
SQNR_DB = 20.0
TINY = dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=128, vocab_size=512, max_seq_len=64)


def sqnr(ref: torch.Tensor, actual: torch.Tensor) -> float:
    """Signal-to-quantisation-noise ratio, dB: 20·log10(‖ref‖ / ‖ref − actual‖) (torchao's compute_error)."""
    return 20 * math.log10(ref.norm().item() / (ref - actual).norm().item())


def tiny(**fields) -> CausalLM:
    torch.manual_seed(0)
    model = CausalLM(ModelConfig(**{**TINY, **fields}))
    model.init_weights(0)
    return model


def test_float8_converts_the_blocks_linears_but_not_lm_head_routers_or_unaligned_layers():
    names = float8_layers(tiny(), "tensorwise")
    per_block = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                 "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"]
    assert names == [f"model.layers.{i}.{n}" for i in range(2) for n in per_block]
    # ffn 72: gate/up (72, 64) and down (64, 72) are not multiples of 16; mxfp8 needs 32: k/v (32) still are
    assert not any("mlp" in n for n in float8_layers(tiny(ffn_hidden=72), "tensorwise"))
    moe = tiny(family="qwen3_moe", n_experts=4, n_experts_per_token=2, moe_ffn_hidden=32)
    assert not any(n.endswith("mlp.gate") for n in float8_layers(moe, "tensorwise"))  # routers stay
    assert any(n.endswith("mlp.gate") for n, m in moe.named_modules() if isinstance(m, nn.Linear))


def test_emulated_float8_forward_and_gradients_stay_within_torchaos_bound_of_fp32():
    """One forward/backward (cross-entropy, 1,024 tokens) of the tiny model on CPU: float8 (tensorwise and
    rowwise, emulated) against fp32. The output is far above torchao's 20 dB (measured 36 dB tensorwise) and
    the converted weights' gradients are 20 dB on average; single layers' gradients reach 19.5 dB
    (tensorwise), just under torchao's bound, which it measures on Llama 3 70B feed-forward shapes (8,192
    tokens, 4,096 x 14,336): each weight gradient here sums over 1,024 tokens of e5m2 gradients (2 mantissa
    bits), so its rounding averages out less. The names of the weights do not change."""
    tokens = torch.randint(0, 512, (16, 64), generator=torch.Generator().manual_seed(1))
    ref = tiny()
    out_ref = ref(tokens)
    nn.functional.cross_entropy(out_ref[:, :-1].flatten(0, 1), tokens[:, 1:].flatten()).backward()
    for recipe in ("tensorwise", "rowwise"):
        model = tiny()
        names = apply_float8(model, recipe, torch.device("cpu"), fsdp=False)
        assert type(model.get_submodule(names[0])).__name__ == "Float8Linear"
        assert [n for n, _ in model.named_parameters()] == [n for n, _ in ref.named_parameters()]
        out = model(tokens)
        nn.functional.cross_entropy(out[:, :-1].flatten(0, 1), tokens[:, 1:].flatten()).backward()
        assert not torch.equal(out, out_ref)  # float8 rounding ran
        assert sqnr(out_ref, out) > SQNR_DB, recipe
        grads = {n: p.grad for n, p in ref.named_parameters()}
        each = [sqnr(grads[f"{n}.weight"], model.get_submodule(n).weight.grad) for n in names]
        print(f"{recipe}: output SQNR {sqnr(out_ref, out):.1f} dB, weight gradients {min(each):.1f} to "
              f"{max(each):.1f} dB, mean {sum(each) / len(each):.1f} dB")
        assert sum(each) / len(each) > SQNR_DB, recipe
        assert min(each) > SQNR_DB - 1.0, recipe  # measured 19.5 dB (tensorwise): see the docstring
        assert not has_fsdp_float8_weights(model)  # no FSDP: nothing to precompute after a step


def test_float8_on_a_gpu_without_float8_tensor_cores_is_refused(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    with pytest.raises(ConfigError, match=r"train.float8='tensorwise' needs a GPU with float8 tensor "
                                          r"cores \(compute capability 8.9 or later\), but NVIDIA "
                                          r"A100-SXM4-80GB is 8.0: set train.float8 = 'none'$"):
        check_float8_device("tensorwise", torch.device("cuda", 0))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    check_float8_device("rowwise", torch.device("cuda", 0))  # Hopper: float8, not MXFP8
    with pytest.raises(ConfigError, match=r"compute capability 10.0 or later.*or 'tensorwise'"):
        check_float8_device("mxfp8", torch.device("cuda", 0))
    check_float8_device("mxfp8", torch.device("cpu"))  # a CPU runs every recipe emulated


@pytest.mark.parametrize("overrides,message", [
    (["--train.qat=int3_weight_only"], r"train.qat: 'int3_weight_only' is not one of \['none', "
                                       r"'int8_dynamic_activation_int4_weight'"),
    (["--train.float8=fp4"],
     r"train.float8: 'fp4' is not one of \['none', 'tensorwise', 'rowwise', 'mxfp8'\]"),
    (["--train.float8=tensorwise", "--lora.enabled=true"],
     r"train.float8='tensorwise' with lora.enabled is not built"),
    (["--train.qat=int4_weight_only", "--lora.enabled=true"],
     r"train.qat='int4_weight_only' with lora.enabled is not built"),
    (["--train.float8=rowwise", "--train.qat=int8_weight_only"],
     r"train.float8='rowwise' and train.qat='int8_weight_only' both replace the linear layers: choose one"),
    (["--train.float8=tensorwise", "--parallel.tp=2"],
     r"train.float8='tensorwise' with parallel.tp=2 is not built yet"),
    (["--train.float8=mxfp8"], r"train.float8='mxfp8' computes in bf16: it needs .*param_dtype is 'float32'"),
])
def test_low_precision_settings_that_cannot_run_are_refused_with_one_message(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)


def test_an_unknown_qat_scheme_names_the_ones_built():
    with pytest.raises(ConfigError, match=r"train.qat: unknown scheme 'nf4'; torchao's QAT schemes built "
                                          r"here: none, int8_dynamic_activation_int4_weight, "):
        check_scheme("nf4")


@pytest.mark.parametrize("scheme", sorted(QAT_SCHEMES))
def test_qat_fake_quantisation_equals_torchaos_quantised_model(scheme):
    """The fake-quantised model (what QAT trains) computes what torchao's real quantisation of the same
    weights computes (``quantize_`` with the scheme's base config, the export's form) to float rounding, and
    differs from the unquantised model; ``lm_head`` stays in full precision; names do not change."""
    from torchao.quantization import quantize_

    from shardlm.model.qat import qat_filter

    tokens = torch.randint(0, 512, (2, 32), generator=torch.Generator().manual_seed(2))
    plain, fake, real = tiny(), tiny(), tiny()
    names = apply_qat(fake, scheme)
    assert len(names) == 14 and "lm_head" not in names and qat_excluded(fake, scheme) == ["lm_head"]
    assert type(fake.get_submodule(names[0])).__name__ == "FakeQuantizedLinear"
    assert [n for n, _ in fake.named_parameters()] == [n for n, _ in plain.named_parameters()]
    quantize_(real, base_config(scheme), filter_fn=qat_filter(real, scheme))
    assert type(real.get_submodule(names[0]).weight).__name__ == "IntxUnpackedToInt8Tensor"
    with torch.no_grad():
        a, b, c = fake(tokens), real(tokens), plain(tokens)
    scale = c.abs().max().item()
    assert (a - b).abs().max().item() <= 1e-5 * scale  # measured: 0 for the dynamic schemes
    assert (a - c).abs().max().item() > 1e-3 * scale  # the quantisation is visible


def test_the_planner_all_gathers_float8_weights_at_one_byte_and_runs_their_gemms_at_the_float8_peak():
    """``shardlm plan`` under ``train.float8``: the converted layers' P8 weights all-gather at 1 byte instead
    of 2 (tensorwise only) and their 6·P8 FLOPs per token run at the float8 peak (H100 1979 TFLOP/s against
    989 bf16); an A100 has no float8 peak and plans as bf16."""
    from shardlm.devices import get_device
    from shardlm.plan.time import float8_params, fsdp_comm_bytes, plan_time

    # N = 4, P = 1000 of which 600 float8, k = 2, resharded, synced every micro-batch, bf16/fp32
    assert_close(fsdp_comm_bytes(4, 1000, 2, True, True, 2, 4, float8_params=600),
                 0.75 * (2 * 2 * (400 * 2 + 600) + 2 * 1000 * 4), rtol=4 * EPS)
    flags = ["--parallel.param_dtype=bfloat16", "--train.global_batch_size=8", "--train.micro_batch_size=1",
             "--train.seq_len=64"] + [f"--model.{k}={v}" for k, v in TINY.items()]
    plans = {f: load_config(None, flags + [f"--train.float8={f}"]) for f in ("none", "tensorwise", "rowwise")}
    p8 = float8_params(plans["tensorwise"])
    assert p8 == 2 * (64 * 64 * 2 + 32 * 64 * 2 + 3 * 64 * 128)  # q, o; k, v; gate, up, down per block
    h100, a100 = get_device("h100"), get_device("a100-80gb")
    params = sum(p.numel() for p in tiny().parameters())
    base, tw, rw = (plan_time(cfg, 8, h100, params) for cfg in plans.values())
    # 8 ranks, 1 micro-batch of 64 tokens each; all-gathered for forward and again for backward
    assert_close(base.comm_bytes - tw.comm_bytes, 7 / 8 * 2 * p8 * (2 - 1), rtol=4 * EPS,
                 scale=base.comm_bytes)
    assert rw.comm_bytes == base.comm_bytes  # rowwise weights travel in bf16
    f8 = 6 * p8 * 64
    assert tw.float8_flops == rw.float8_flops == f8 and base.float8_flops == 0
    assert_close(tw.compute_s, (base.flops - f8) / 989e12 + f8 / 1979e12, rtol=4 * EPS)
    assert tw.compute_s < 0.8 * base.compute_s
    assert plan_time(plans["tensorwise"], 8, a100, params).compute_s == \
        plan_time(plans["none"], 8, a100, params).compute_s
