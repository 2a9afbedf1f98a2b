"""The chunked (fused) output projection + cross-entropy equals the plain loss: loss and every gradient."""

from __future__ import annotations

import copy
import importlib.util

import pytest
import torch
import torch.nn.functional as F

import shardlm.train.loss as loss_module
from conftest import ROOT, cli_error
from shardlm.config import Config, ConfigError, validate
from shardlm.data.instruct import IGNORE_INDEX
from shardlm.model.config import ModelConfig
from shardlm.model.cpu_matmul import apply_fp32_matmul
from shardlm.model.decoder import CausalLM
from shardlm.model.freeze import apply_freeze
from shardlm.model.lora import LoRASpec, apply_lora, set_fp32_matmul
from shardlm.parallel.ac import apply_ac
from shardlm.plan import plan_memory
from shardlm.plan.loss import loss_peak_bytes
from shardlm.plan.report import format_plan
from shardlm.train.loss import linear_cross_entropy_sum, model_loss_sum, token_loss_sum
from tolerance import EPS, check

#: fp32: ||chunked - plain|| / ||plain|| (2-norm over the tensor), for the loss and each gradient: 32
#: roundings (a norm weight's gradient, a sum over every token, measured up to 7.7e-7 = 6.5 roundings)
REL = 32 * EPS
VOCAB, B, T = 300, 3, 23  # 69 tokens: no chunk size below divides it


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def tiny(family: str = "llama", tied: bool = False, softcap: float = 0.0, seed: int = 0) -> CausalLM:
    cfg = ModelConfig(family=family, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=64,
                      vocab_size=VOCAB, max_seq_len=64, tie_embeddings=tied, final_logit_softcap=softcap)
    model = CausalLM(cfg)
    model.init_weights(seed)
    with torch.no_grad():
        # Gemma's zero-initialised norms and small logits would hide errors: perturb everything
        gen = torch.Generator().manual_seed(seed + 1)
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.1)
    return model


def batch(ignored: slice | None = slice(5, 9), seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    inputs = torch.randint(0, VOCAB, (B, T), generator=gen)
    targets = torch.randint(0, VOCAB, (B, T), generator=gen)
    targets[0, ::4] = IGNORE_INDEX
    if ignored is not None:
        targets.view(-1)[ignored] = IGNORE_INDEX
    return inputs, targets


def loss_and_grads(
    model: CausalLM, inputs, targets, chunk: int
) -> tuple[torch.Tensor, dict[str, torch.Tensor | None]]:
    model.zero_grad(set_to_none=True)
    loss = model_loss_sum(model, inputs, targets, chunk)
    (loss * 0.37).backward()  # a scale, as the trainer's 1 / target count
    return loss.detach(), {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}


def assert_same(model: CausalLM, inputs, targets, chunk: int, tol: float = REL) -> dict[str, float]:
    loss0, grads0 = loss_and_grads(model, inputs, targets, 0)
    loss1, grads1 = loss_and_grads(model, inputs, targets, chunk)
    errors = {"loss": rel(loss1, loss0)}
    assert grads0.keys() == grads1.keys()
    for name in grads0:
        assert (grads0[name] is None) == (grads1[name] is None), name
        if grads0[name] is not None:
            assert grads0[name].abs().max() > 0, name  # a real gradient: the comparison is not vacuous
            errors[name] = rel(grads1[name], grads0[name])
    worst = max(errors, key=errors.get)
    check(errors[worst], tol, what=f"chunk {chunk}, worst: {worst} (relative norm)")
    return errors


@pytest.mark.parametrize("case", ["untied", "tied", "gemma_softcap", "chunk_1", "chunk_above_tokens"])
def test_chunked_equals_plain_every_parameter(case):
    """fp32, 69 tokens (8 ignored, one run of 4 together), chunk 16 unless said: loss and every gradient."""
    model = {"untied": lambda: tiny(), "tied": lambda: tiny(tied=True),
             "gemma_softcap": lambda: tiny("gemma3", tied=True, softcap=3.0),
             "chunk_1": lambda: tiny(), "chunk_above_tokens": lambda: tiny()}[case]()
    chunk = {"chunk_1": 1, "chunk_above_tokens": 1000}.get(case, 16)
    errors = assert_same(model, *batch(), chunk)
    print(f"\n{case}: worst relative difference {max(errors.values()):.1e}")


@pytest.mark.parametrize("rows", ["gathered", "masked"])
def test_hidden_state_and_weight_gradients_and_ignored_chunks(rows, monkeypatch):
    """At the function: gradients of the hidden states and the output weight, with a soft-cap, chunks of 7
    over 40 tokens of which tokens 7..20 (two whole chunks) and every target of one row are ignored; and all
    ignored. ``masked``: the ignored rows projected and masked, as on a GPU (no host read), instead of
    gathered out."""
    if rows == "masked":
        monkeypatch.setattr(loss_module, "GATHER_SCORED_ROWS_ON", ())
    gen = torch.Generator().manual_seed(3)
    h = (torch.randn(4, 10, 24, generator=gen) * 2).requires_grad_()
    w = torch.randn(VOCAB, 24, generator=gen).requires_grad_()
    targets = torch.randint(0, VOCAB, (4, 10), generator=gen)
    targets.view(-1)[7:21] = IGNORE_INDEX
    targets[3] = IGNORE_INDEX
    for cap in (0.0, 5.0):
        logits = F.linear(h, w)
        if cap:
            logits = torch.tanh(logits / cap) * cap
        plain = token_loss_sum(logits, targets)
        gh, gw = torch.autograd.grad(plain * 0.5, (h, w))
        chunked = linear_cross_entropy_sum(h, w, targets, 7, cap)
        ch, cw = torch.autograd.grad(chunked * 0.5, (h, w))
        for what, (a, b) in {"loss": (chunked, plain), "dh": (ch, gh), "dw": (cw, gw)}.items():
            check(rel(a, b), REL, what=f"softcap {cap} {what} (relative norm)")
        # nothing scored: no gradient
        assert ch[3].abs().max() == 0 and ch.view(-1, 24)[7:21].abs().max() == 0
    # every target ignored: loss 0, zero gradients (as the plain loss)
    none = torch.full_like(targets, IGNORE_INDEX)
    loss = linear_cross_entropy_sum(h, w, none, 7)
    ch, cw = torch.autograd.grad(loss, (h, w))
    assert loss.item() == 0 == token_loss_sum(F.linear(h, w), none).item()
    assert ch.abs().max() == 0 and cw.abs().max() == 0


def test_forward_only_equals_plain_and_backward_runs_once():
    model = tiny("gemma3", softcap=3.0)
    inputs, targets = batch()
    with torch.no_grad():  # evaluation and perplexity: no gradient is made
        check(rel(model_loss_sum(model, inputs, targets, 5), model_loss_sum(model, inputs, targets, 0)), REL,
              what="forward-only loss (relative)")
    loss = model_loss_sum(model, inputs, targets, 16)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="backward ran twice"):
        loss.backward()


def test_frozen_output_weight_gets_no_gradient_and_the_rest_equals():
    model = tiny()
    apply_freeze(model, "", "lm_head")
    errors = assert_same(model, *batch(), 16)
    assert "lm_head.weight" not in errors and model.lm_head.weight.grad is None


@pytest.mark.parametrize("base", ["float32", "bfloat16"])
def test_lora_on_the_output_projection(base):
    """LoRA on lm_head and q_proj (frozen base, trained adapters; B made non-zero); a bf16 base too."""
    model = tiny()
    apply_lora(model, LoRASpec(4, 8.0, 0.0, "lm_head,q_proj", base))
    init = tiny()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))) * 0.2)
            else:
                p.copy_(init.get_parameter(name).to(p.dtype))
    errors = assert_same(model, *batch(), 16)
    assert {
        "model.layers.0.self_attn.q_proj.lora_A.weight",
        "lm_head.lora_A.weight",
        "lm_head.lora_B.weight",
    } <= errors.keys() and "lm_head.weight" not in errors


def test_qlora_nf4_output_projection():
    """QLoRA: an NF4 ``lm_head`` base (torchao's NF4Tensor, dequantised to the compute dtype) with trained
    adapters on it and on q_proj: the chunked loss and every gradient equal the plain loss's (fp32 compute, 32
    fp32 roundings, relative); the NF4 base is really used (its loss differs from the unquantised head's)."""
    pytest.importorskip("torchao", reason="pip install -e '.[test]'")
    from shardlm.model.lora import is_nf4, to_nf4

    cfg = ModelConfig(family="llama", dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=64,
                      vocab_size=320, max_seq_len=64)  # 320 x 32 values: whole NF4 scaler blocks
    init = CausalLM(cfg)
    init.init_weights(0)
    model = CausalLM(cfg)
    apply_lora(model, LoRASpec(4, 8.0, 0.0, "lm_head,q_proj", "nf4"))
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(
                torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))) * 0.2
                if "lora_" in name
                else init.get_parameter(name).to(p.dtype)
            )
    model.lm_head.weight = torch.nn.Parameter(to_nf4(init.lm_head.weight.detach()), requires_grad=False)
    assert is_nf4(model.lm_head.weight)
    inputs, targets = batch()
    errors = assert_same(model, inputs, targets, 16)
    assert {
        "lm_head.lora_A.weight",
        "lm_head.lora_B.weight",
    } <= errors.keys() and "lm_head.weight" not in errors
    with torch.no_grad():
        nf4 = model_loss_sum(model, inputs, targets, 16)
        model.lm_head.weight = torch.nn.Parameter(init.lm_head.weight.detach().clone(), requires_grad=False)
        full = model_loss_sum(model, inputs, targets, 16)
    assert rel(nf4, full) > 1e-4, (nf4, full)


def test_activation_checkpointing():
    model = tiny()
    apply_ac(model.model.layers, "full")
    assert_same(model, *batch(), 16)


@pytest.mark.parametrize("kernel", ["native", "fp32"])
def test_bf16_within_bf16_noise_of_the_plain_bf16_loss(kernel):
    """bf16 parameters (fp32 softmax): chunked and plain bf16 are both compared with the fp32 model; the
    chunked loss's error is at most 1.5x the plain bf16 loss's (+ 2e-3 of the scale) for the loss and
    every gradient."""
    ref = tiny(tied=True)
    model = copy.deepcopy(ref).to(torch.bfloat16)
    if kernel == "fp32":
        assert apply_fp32_matmul(model) > 0
        set_fp32_matmul(model)
    inputs, targets = batch()
    loss32, grads32 = loss_and_grads(ref, inputs, targets, 0)
    loss0, grads0 = loss_and_grads(model, inputs, targets, 0)
    loss1, grads1 = loss_and_grads(model, inputs, targets, 16)
    assert loss1.dtype == torch.float32
    worst = []
    for name, g32 in [("loss", loss32), *grads32.items()]:
        a, b = (loss0, loss1) if name == "loss" else (grads0[name].float(), grads1[name].float())
        err_plain, err_chunked = rel(a, g32), rel(b, g32)
        worst.append((err_chunked, err_plain, name))
        assert err_chunked <= 1.5 * err_plain + 2e-3, (name, err_chunked, err_plain)
    print(f"\nbf16 ({kernel}): worst relative error vs fp32, chunked / plain: "
          f"{max(worst)[0]:.1e} / {max(w[1] for w in worst):.1e}")


def test_negative_chunk_is_one_clear_error(capsys):
    err = cli_error(capsys, ["plan", str(ROOT / "configs" / "shakespeare-tiny.toml"), "--world-size", "1",
                             "--train.loss_chunk_tokens=-1"])
    assert "train.loss_chunk_tokens must be >= 0" in err and "got -1" in err, err
    cfg = Config()
    cfg.train.loss_chunk_tokens = -1
    with pytest.raises(ConfigError,
                       match=r"train.loss_chunk_tokens must be >= 0 .*0 = the plain loss.*got -1"):
        validate(cfg)
    with pytest.raises(ValueError, match="must be >= 0"):
        model_loss_sum(tiny(), *batch(), -3)


@pytest.mark.parametrize("dtype,softcap", [(torch.float32, 0.0), (torch.float32, 30.0), (torch.bfloat16, 0.0),
                                           (torch.bfloat16, 30.0)])
def test_planned_loss_peak_equals_the_allocators(dtype, softcap):
    """plan/loss.py's peak against PyTorch's CPU allocator (profiler events, as bench/bench_loss.py measures),
    300 tokens, vocab 20,000: plain and chunks of 128, within 3%; the chunked peak is below half the
    plain one."""
    spec = importlib.util.spec_from_file_location("bench_loss", ROOT / "bench" / "bench_loss.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    peak_bytes, step = bench.peak_bytes, bench.step

    gen = torch.Generator().manual_seed(0)
    h = torch.randn(300, 64, generator=gen).to(dtype).requires_grad_()
    w = (torch.randn(20_000, 64, generator=gen) * 0.1).to(dtype).requires_grad_()
    targets = torch.randint(0, 20_000, (300,), generator=gen)
    peaks = {}
    for chunk in (0, 128):
        h.grad = w.grad = None  # freed before the measurement starts
        measured = peak_bytes(lambda c=chunk: step(h, w, targets, c, softcap))
        planned = loss_peak_bytes(300, 20_000, 64, dtype.itemsize, chunk, bool(softcap))
        assert abs(planned / measured - 1) <= 0.03, (chunk, planned, measured)
        peaks[chunk] = measured
    assert peaks[128] < peaks[0] / 2


def test_planned_chunk_peak_counts_the_hidden_gradient_product():
    """A vocabulary small against the width (V = 512, D = 256: one rank's rows under tensor parallel look like
    this): each chunk's hidden-state gradient ``g @ w`` (k, D) is alive beside its (k, V) gradient, and the
    plan counts it: chunks of 128 within 1 % of the allocator's peak (10.9 % under before it was
    counted), fp32."""
    spec = importlib.util.spec_from_file_location("bench_loss", ROOT / "bench" / "bench_loss.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    gen = torch.Generator().manual_seed(0)
    h = torch.randn(300, 256, generator=gen).requires_grad_()
    w = (torch.randn(512, 256, generator=gen) * 0.1).requires_grad_()
    targets = torch.randint(0, 512, (300,), generator=gen)
    measured = bench.peak_bytes(lambda: bench.step(h, w, targets, 128, 0.0))
    planned = loss_peak_bytes(300, 512, 256, 4, 128)
    assert abs(planned / measured - 1) <= 0.01, (planned, measured)
    assert measured - (planned - 4 * 128 * 256) > 0.09 * measured  # the product is a tenth of the peak here


def test_planner_counts_the_loss_by_chunk_size():
    """shardlm plan: vocab 151,936, 4,096 tokens per micro-batch: the temporaries at the peak are the plain
    loss's three fp32 (tokens, vocab) buffers when off, and far less with chunks of 256."""
    cfg = Config()
    cfg.model.vocab_size, cfg.model.dim, cfg.model.n_layers = 151_936, 576, 2
    cfg.model.n_heads, cfg.model.n_kv_heads, cfg.model.max_seq_len = 9, 3, 4096
    cfg.train.seq_len, cfg.train.micro_batch_size, cfg.train.global_batch_size = 4096, 1, 1
    plans = {}
    for chunk in (0, 256):
        cfg.train.loss_chunk_tokens = chunk
        plans[chunk] = plan_memory(cfg, 1)
        row = "whole logits, log-softmax, grads" if chunk == 0 else "loss in 256-token chunks, backward"
        # the report names what is counted
        assert f"    temporaries ({row})" in format_plan(cfg, 1, "h100", 0.05)
    logits = 4 * 4096 * 151_936
    assert plans[0].breakdown["temporaries"] >= 3 * logits and "loss backward" in plans[0].phase
    assert plans[256].breakdown["temporaries"] < logits / 2
    assert plans[0].peak - plans[256].peak > 2.5 * logits
