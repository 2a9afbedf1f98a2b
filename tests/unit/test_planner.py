"""The planner's formulas in one process: the communication volume, HSDP's cross-replica all-reduce, a MoE
layer's saved bytes against what autograd saves, bad settings, and ``shardlm plan`` for Llama 3 8B. The
prediction against the measured peak is tests/dist/test_planner_measured_peak.py."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from conftest import ROOT, cpu_env
from shardlm.config import ConfigError, load_config
from shardlm.plan import plan_memory
from shardlm.plan.time import ddp_comm_bytes, fsdp_comm_bytes


def test_communication_volume_formula():
    """(N−1)/N · [k·(1+r)·P·b_param + s·P·b_reduce] on a case worked by hand."""
    # N=4, P=1000, k=2, reshard (r=1), reduce on the last micro-batch (s=1), bf16 params, fp32 grads:
    # 3/4 · [2·2·1000·2 + 1·1000·4] = 3/4 · 12000 = 9000 bytes
    assert fsdp_comm_bytes(4, 1000, 2, True, False, 2, 4) == pytest.approx(9000)
    # no reshard after forward (r=0), reduce every micro-batch (s=k=2), fp32: 3/4 · [2·1000·4 + 2·1000·4]
    assert fsdp_comm_bytes(4, 1000, 2, False, True, 4, 4) == pytest.approx(12000)
    assert fsdp_comm_bytes(1, 1000, 2, True, True, 4, 4) == 0
    assert ddp_comm_bytes(2, 1000, 1) == pytest.approx(4000)  # ring all-reduce: 2·(1/2)·1000·4


def test_plan_rejects_bad_settings():
    cfg = load_config(None, [])
    with pytest.raises(ConfigError, match="world-size"):
        plan_memory(cfg, 0)
    cfg.parallel.param_dtype = "float13"
    with pytest.raises(ConfigError, match="parallel.param_dtype"):
        plan_memory(cfg, 2)
    cfg.parallel.param_dtype = "float16"  # the config refuses fp16, and so does the planner (one dtype table)
    with pytest.raises(ConfigError, match="parallel.param_dtype"):
        plan_memory(cfg, 2)
    cfg.parallel.param_dtype = "float32"
    cfg.parallel.reshard_after_forward = 2  # an N-way reshard is refused, not planned as `true`
    with pytest.raises(ConfigError, match="reshard_after_forward=2.*N-way"):
        plan_memory(cfg, 4)


MOE_4 = ["--model.family=qwen3_moe", "--model.n_experts=4", "--model.n_experts_per_token=2",
         "--model.moe_ffn_hidden=32"]


@pytest.mark.parametrize("overrides, message", [
    (MOE_4 + ["--parallel.ep=3"], r"parallel.ep=3 must divide model.n_experts=4"),
    (MOE_4 + ["--parallel.ep=4"], r"parallel.ep=4 must divide the data-parallel ranks \(2\)"),
    (["--parallel.cp=2", "--train.seq_len=1", "--train.global_batch_size=1"],
     r"train.seq_len=1 is shorter than parallel.cp=2"),
    (["--parallel.tp=2", "--model.n_kv_heads=1"], r"parallel.tp=2 must divide the key/value heads"),
    (["--parallel.tp=2", "--model.ffn_hidden=767"], r"parallel.tp=2 must divide the FFN width"),
    (["--parallel.tp=2", "--lora.enabled=true"], r"parallel.tp=2 with lora.enabled is not supported"),
])
def test_plan_refuses_what_training_refuses(overrides, message, capsys):
    """`shardlm plan` on an expert-, tensor- or context-parallel layout that training refuses: one error,
    exit 2 (it printed a plan of a layout that cannot run before)."""
    from shardlm.cli.main import main

    config = str(ROOT / "configs" / "debug-shape.toml")
    assert main(["plan", config, "--world-size", "2", "--device", "cpu", *overrides]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ")
    assert re.search(message, err[0]), err[0]


def test_plan_cli_llama3_8b():
    """`shardlm plan` on Llama 3 8B: a breakdown, 'does not fit' with fixes that do fit, bad input."""
    cmd = [sys.executable, "-m", "shardlm", "plan", str(ROOT / "configs" / "llama3-8b.toml")]
    ok = subprocess.run(cmd + ["--world-size", "8", "--device", "h100-96gb", "--train.micro_batch_size=2",
                               "--train.global_batch_size=16", "--parallel.param_dtype=bfloat16",
                               "--parallel.reduce_dtype=float32",
                               "--parallel.activation_checkpoint=selective"],
                        env=cpu_env(), capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0, ok.stderr
    assert "fits:" in ok.stdout and "activations" in ok.stdout and "step time" in ok.stdout
    # the settings left auto as a new run would choose them (61.7 GiB with the weights kept fits 76.5 GiB)
    assert "reshard_after_forward false, 1 block(s) per FSDP group" in ok.stdout
    assert "  auto       parallel.reshard_after_forward = false (auto: weights kept" in ok.stdout
    assert "; CPU offload off;" in ok.stdout and "cpu_offload False" not in ok.stdout  # words, not a repr
    assert "temporaries (loss in 256-token chunks, backward)" in ok.stdout  # the default chunked loss's row
    big = subprocess.run(cmd + ["--world-size", "8", "--device", "h100", "--train.micro_batch_size=2",
                                "--train.global_batch_size=16", "--parallel.param_dtype=float32",
                                "--parallel.activation_checkpoint=none",
                                "--parallel.grad_sync=last_micro_batch"],
                         env=cpu_env(), capture_output=True, text=True, timeout=120)
    assert big.returncode == 0, big.stderr
    assert "does not fit" in big.stdout and "fits with" in big.stdout and "  --world-size 8 " in big.stdout
    bad = subprocess.run(cmd + ["--world-size", "8", "--device", "tpu"], env=cpu_env(), capture_output=True,
                         text=True, timeout=120)
    assert bad.returncode == 2 and bad.stderr.strip().startswith("error: unknown device 'tpu'")


def test_hsdp_adds_the_cross_replica_all_reduce():
    from shardlm.plan.devices import get_device
    from shardlm.plan.time import hsdp_all_reduce_bytes, plan_time

    assert hsdp_all_reduce_bytes(1, 8, 1000, 4) == 0
    assert hsdp_all_reduce_bytes(4, 8, 8000, 2) == 2 * 3 / 4 * 1000 * 2
    cfg = load_config(str(ROOT / "configs/llama3-8b.toml"))
    # the case worked out below
    cfg.parallel.param_dtype, cfg.parallel.grad_sync = "float32", "last_micro_batch"
    flat = plan_time(cfg, 16, get_device("h100"), 8_030_261_248)
    cfg.parallel.dp_replicate, cfg.parallel.dp_shard = 2, 8
    hsdp = plan_time(cfg, 16, get_device("h100"), 8_030_261_248)
    k = 64 // 16  # global batch 64, micro-batch 1, 16 ranks
    expected = fsdp_comm_bytes(8, 8_030_261_248, k, True, False, 4, 4) + hsdp_all_reduce_bytes(
        2, 8, 8_030_261_248, 4
    )
    assert hsdp.comm_bytes == pytest.approx(expected)
    assert hsdp.comm_bytes < flat.comm_bytes  # the heavy all-gathers now span 8 ranks, not 16


def test_moe_layer_saved_bytes_equal_what_autograd_saves():
    """plan/moe.py's bytes plus the experts' SwiGLU (4·c·N·h) equal the storages a MoE layer's forward hands
    to autograd (``saved_tensors_hooks``; parameters and the layer's input excluded), one process, fp32."""
    import torch

    from shardlm.model.config import ModelConfig
    from shardlm.model.moe import build_moe
    from shardlm.plan.activations import shape_of
    from shardlm.plan.moe import moe_layer_saved

    mcfg = ModelConfig(family="qwen3_moe", dim=64, n_heads=4, n_experts=8, n_experts_per_token=2,
                       moe_ffn_hidden=48, norm_topk_prob=True, vocab_size=128)
    layer = build_moe(mcfg)
    torch.manual_seed(0)
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.1)
    x = torch.randn(4 * 64, 64, requires_grad=True)
    skip = {p.untyped_storage().data_ptr() for p in layer.parameters()} | {x.untyped_storage().data_ptr()}
    saved: dict[int, int] = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in skip:
            saved[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        layer(x)
    s = shape_of(mcfg, 4, 64, 4)
    # the SwiGLU of width f = k · expert width, as plan/activations.py counts it
    experts = 4 * 4 * s.tokens * s.f
    print(f"\nMoE layer: autograd saves {sum(saved.values()):,} bytes; planner "
          f"{experts + moe_layer_saved(s, mcfg):,}")
    assert sum(saved.values()) == experts + moe_layer_saved(s, mcfg)


def test_plan_llama3_2_1b_one_32k_sequence_on_one_h100(capsys):
    """configs/llama3.2-1b-32k.toml: one 32,768-token sequence of Llama 3.2 1B per micro-batch on one H100
    (bf16 compute, 8 micro-batches). Full activation checkpointing with the chunked loss fits with room;
    without checkpointing the activations are over 10 times as large and the peak comes within 3% of the
    budget; with the whole logits too (``train.loss_chunk_tokens = 0``) it does not fit."""
    from shardlm.cli.main import main as shardlm_main

    config = str(ROOT / "configs" / "llama3.2-1b-32k.toml")

    def plan(*extra: str) -> tuple[str, float, float, float]:
        capsys.readouterr()
        assert shardlm_main(["plan", config, "--world-size", "1", "--device", "h100", *extra]) == 0
        out = capsys.readouterr().out
        assert "micro-batch 1 x 32768 tokens, 8 micro-batch(es)/step" in out
        verdict = next(line.strip() for line in out.splitlines() if "GiB usable" in line)
        usable = float(verdict.split(" GiB usable")[0].split()[-1])
        total = float(out.split("\n    total")[1].split()[0])
        return verdict, total, usable, float(out.split("activations (saved for backward)")[1].split()[0])

    verdict, total, usable, ac_acts = plan()  # the config: full checkpointing, the loss in 256-token chunks
    assert verdict.startswith("fits:") and total < 0.4 * usable, verdict
    verdict, total, usable, acts = plan("--parallel.activation_checkpoint=none")
    assert verdict.startswith("fits:") and usable - total < 0.03 * usable and acts > 10 * ac_acts, verdict
    verdict, _, _, _ = plan("--parallel.activation_checkpoint=none", "--train.loss_chunk_tokens=0")
    assert verdict.startswith("does not fit:"), verdict
    verdict, _, _, _ = plan("--train.loss_chunk_tokens=0")  # checkpointing alone, the whole logits
    assert verdict.startswith("fits:"), verdict
