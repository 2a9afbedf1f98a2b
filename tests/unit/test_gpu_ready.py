"""Ready for GPUs, checked on this CPU machine: shipped GPU configs fit, device-choice rules, GQA
attention, MFU.

The device-choice rules (TF32 on CUDA, one rank per GPU, ``device_id`` for NCCL, pinned host batches) are
decision functions in ``shardlm/parallel/dist.py``; here they are called with CUDA devices described, not
present. What only a GPU can show is run by ``bench/gpu_check.py`` (see docs/gpu.md).
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest
import torch

from conftest import ROOT, cpu_env
from shardlm.config import ConfigError, ParallelConfig, load_config
from shardlm.parallel import dist as shardlm_dist
from shardlm.parallel.dist import (
    compute_precision,
    pick_device,
    pin_host_batches,
    process_group_kwargs,
    set_matmul_precision,
    use_tf32,
)
from shardlm.plan.devices import DEVICES, device_for_cuda_name
from shardlm.plan.time import plan_time
from tolerance import EPS, assert_all_close, assert_close

GPU_CONFIGS = {"llama3-8b.toml", "llama3.2-1b.toml", "llama3.2-1b-32k.toml", "llama3-70b.toml",
               "qwen3-30b-a3b.toml"}


def plan_line(path) -> list[str]:
    """The arguments of a file's ``# plan: ...`` comment line."""
    for line in path.read_text().splitlines():
        if line.startswith("# plan:"):
            return shlex.split(line.removeprefix("# plan:"))
    raise AssertionError(f"{path} has no '# plan:' line")


def slurm_plan_command() -> list[str]:
    """``shardlm plan`` arguments for scripts/slurm.sbatch as written: its default config, node count, GPUs
    per node and every ``--parallel.*`` / ``--train.*`` argument it passes to ``shardlm.train``."""
    text = (ROOT / "scripts" / "slurm.sbatch").read_text()
    nodes = int(re.search(r"^#SBATCH --nodes=(\d+)", text, re.M).group(1))
    gpus = int(re.search(r"^GPUS_PER_NODE=\$\{GPUS_PER_NODE:-(\d+)\}", text, re.M).group(1))
    config = re.search(r"^CONFIG=\$\{CONFIG:-(\S+)\}", text, re.M).group(1)
    command = text[text.rindex("\nsrun "):].replace("\\\n", " ").replace("$GPUS_PER_NODE", str(gpus))
    args = [a for a in shlex.split(command) if a.startswith(("--parallel.", "--train."))]
    return [
        str(ROOT / config),
        "--world-size",
        str(nodes * gpus),
        *plan_line(ROOT / "scripts" / "slurm.sbatch"),
        *args,
    ]


def shipped_gpu_plans() -> dict[str, list[str]]:
    plans = {p.name: [str(p), *plan_line(p)] for p in sorted((ROOT / "configs").glob("*.toml"))
             if p.name in GPU_CONFIGS}
    plans["scripts/slurm.sbatch"] = slurm_plan_command()
    return plans


def test_every_shipped_gpu_config_fits():
    """`shardlm plan` at each GPU config's documented world size and device says "fits" (and the Slurm
    script's own command line, HSDP on 2 nodes x 8 GPUs)."""
    plans = shipped_gpu_plans()
    assert set(plans) == GPU_CONFIGS | {"scripts/slurm.sbatch"}
    for name, args in plans.items():
        proc = subprocess.run([sys.executable, "-m", "shardlm", "plan", *args], env=cpu_env(),
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, (name, proc.stderr)
        verdict = next(line for line in proc.stdout.splitlines() if "fit" in line and "GiB usable" in line)
        print(f"{name}: plan {' '.join(args[1:])}: {verdict.strip()}")
        assert verdict.strip().startswith("fits:"), (name, proc.stdout)
        assert "--device" in args and "--world-size" in args
        if "micro-batch(es)/step" in proc.stdout and " 1 micro-batch(es)" not in proc.stdout:
            # accumulation: both gradient-sync choices are printed, memory and communication
            assert "every_micro_batch" in proc.stdout and "last_micro_batch" in proc.stdout
    slurm = plans["scripts/slurm.sbatch"]
    assert "--world-size" in slurm and slurm[slurm.index("--world-size") + 1] == "16"
    assert "--parallel.dp_shard=8" in slurm


def test_llama3_8b_was_too_big_with_the_old_settings():
    """The settings the config shipped with before (fp32, no checkpointing, last-micro-batch sync) do not fit:
    the test above is not vacuous."""
    proc = subprocess.run([sys.executable, "-m", "shardlm", "plan", str(ROOT / "configs" / "llama3-8b.toml"),
                           "--world-size", "8", "--device", "h100", "--parallel.param_dtype=float32",
                           "--parallel.activation_checkpoint=none", "--parallel.grad_sync=last_micro_batch"],
                          env=cpu_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    need, usable = map(float,
                       re.search(r"does not fit: ([\d.]+) GiB of ([\d.]+) GiB usable", proc.stdout).groups())
    assert need > 1.5 * usable, proc.stdout  # far from fitting, not a rounding matter
    assert "does not fit: 136.4 GiB" in proc.stdout  # 149.2 before the chunked loss became the default


# ---- precision --------------------------------------------------------------------------------------------
def test_tf32_on_cuda_unless_disabled():
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    assert use_tf32(cuda, ParallelConfig()) is True
    assert use_tf32(cuda, ParallelConfig(tf32=False)) is False
    assert use_tf32(cpu, ParallelConfig()) is False
    assert compute_precision(cuda, ParallelConfig()) == "tf32"
    assert compute_precision(cuda, ParallelConfig(tf32=False)) == "fp32"
    assert compute_precision(cuda, ParallelConfig(param_dtype="bfloat16")) == "bf16"
    assert compute_precision(cpu, ParallelConfig()) == "fp32"
    assert compute_precision(cpu, ParallelConfig(param_dtype="bfloat16")) == "bf16"
    assert load_config(None, ["--parallel.tf32=false"]).parallel.tf32 is False


def test_set_matmul_precision_switches_pytorch_flags(tf32_switches):
    """On a (described) CUDA device the PyTorch switches follow parallel.tf32; on CPU they are left alone."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    set_matmul_precision(torch.device("cpu"), ParallelConfig())
    assert torch.backends.cuda.matmul.allow_tf32 is False
    set_matmul_precision(torch.device("cuda", 0), ParallelConfig())
    assert torch.backends.cuda.matmul.allow_tf32 is True and torch.backends.cudnn.allow_tf32 is True
    set_matmul_precision(torch.device("cuda", 0), ParallelConfig(tf32=False))
    assert torch.backends.cuda.matmul.allow_tf32 is False and torch.backends.cudnn.allow_tf32 is False


def test_planner_peak_follows_the_precision_that_runs():
    cfg = load_config(str(ROOT / "configs" / "llama3-8b.toml"))
    h100 = DEVICES["h100"]
    times = {}
    for name, overrides in {"bf16": {"param_dtype": "bfloat16"}, "tf32": {"param_dtype": "float32"},
                            "fp32": {"param_dtype": "float32", "tf32": False}}.items():
        for key, value in overrides.items():
            setattr(cfg.parallel, key, value)
        t = plan_time(cfg, 8, h100, 8_030_261_248)
        assert t.precision == name
        times[name] = t
    assert times["bf16"].peak_flops == 989e12 and times["tf32"].peak_flops == 495e12
    assert times["fp32"].peak_flops == 67e12
    assert times["fp32"].compute_s == pytest.approx(times["tf32"].compute_s * 495 / 67)
    # every known GPU has all three, ordered bf16 > tf32 > fp32
    for d in DEVICES.values():
        if d.name != "cpu":
            assert d.peak_flops("bf16") > d.peak_flops("tf32") > d.peak_flops("fp32") > 0
    with pytest.raises(ValueError, match="unknown precision"):
        h100.peak_flops("fp4")


def test_datasheet_lookup_by_cuda_device_name():
    assert device_for_cuda_name("NVIDIA H100 80GB HBM3").name == "h100"
    assert device_for_cuda_name("NVIDIA H100 PCIe").name == "h100-pcie"
    assert device_for_cuda_name("NVIDIA H200").name == "h200"
    assert device_for_cuda_name("NVIDIA A100-SXM4-80GB").name == "a100-80gb"
    assert device_for_cuda_name("NVIDIA B200").name == "b200"
    assert device_for_cuda_name("NVIDIA GeForce RTX 4090") is None


def test_cpu_mfu_peak_is_a_fixed_nominal_figure(tmp_path, monkeypatch):
    """On a CPU, MFU's peak is cores x nominal clock x FLOPs per cycle of the widest instructions the flags
    name, read from /proc/cpuinfo (here files written for the test): the same on every call, never measured;
    bf16 uses its own instructions' rate only when it multiplies natively; without a readable clock it falls
    back to the measured rate (said so in its source)."""
    from types import SimpleNamespace

    from shardlm.metrics.flops import cpu_clock_ghz, cpu_peak
    from shardlm.train import mfu

    def cpuinfo(
        name: str, flags: str, model: str = "Intel(R) Xeon(R) Gold 6348 CPU @ 2.60GHz", mhz: str = ""
    ) -> Path:
        path = tmp_path / name
        path.write_text("".join(f"processor\t: {i}\nmodel name\t: {model}\n{mhz}flags\t\t: {flags}\n\n"
                                for i in range(2)))
        return path

    no_sysfs = tmp_path / "no-cpufreq"
    avx512 = cpuinfo("avx512", "fpu sse2 avx fma avx2 avx512f avx512_bf16 amx_bf16")
    assert cpu_clock_ghz(avx512, no_sysfs) == 2.6
    vm = cpuinfo("vm", "sse2 avx fma avx2", model="Intel(R) Xeon(R) Processor", mhz="cpu MHz\t\t: 2999.998\n")
    assert cpu_clock_ghz(vm, no_sysfs) == pytest.approx(2.999998)
    assert cpu_clock_ghz(cpuinfo("none", "sse2", model="Some CPU"), no_sysfs) is None
    cases = [(avx512, "fp32", False, 64, "avx512f"), (avx512, "bf16", False, 1024, "amx_bf16"),
             (avx512, "bf16", True, 64, "avx512f"), (vm, "fp32", False, 32, "fma"),
             (vm, "bf16", False, 32, "fma"),
             (cpuinfo("arm", "", model="ARM"), "fp32", False, 16, "no x86 vector flags")]
    for path, precision, fp32_multiply, per_cycle, instructions in cases:
        peak = cpu_peak(precision, fp32_multiply, 2, path, clock_ghz=2.5)
        assert (peak.flops, peak.flops_per_cycle, peak.instructions) == (2 * 2.5e9 * per_cycle, per_cycle,
                                                                         instructions)
    assert cpu_peak("fp32", False, 1, avx512, clock_ghz=2.6).describe() == \
        "nominal CPU peak: 1 core(s) x 2.60 GHz x 64 FLOP/cycle (avx512f)"
    # through the trainer's peak: this machine's own cpuinfo, one rank of two sharing the cores,
    # never measured
    monkeypatch.setattr(mfu, "measure_matmul_flops", lambda *a, **k: pytest.fail("measured"))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setattr(mfu.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(4)
        assert mfu.cpu_cores_per_rank() == 2  # 4 threads, but 4 cores shared by 2 ranks
        info = SimpleNamespace(device=torch.device("cpu"), world_size=2)
        first, second = (mfu.peak_flops_per_rank(load_config(None, []), info) for _ in range(2))
    finally:
        torch.set_num_threads(threads)
    nominal = cpu_peak("fp32", False, 2)
    if nominal is not None:  # a Linux machine with a readable clock
        assert first == second and first.flops == nominal.flops and first.source == nominal.describe()
    monkeypatch.setattr(mfu, "cpu_peak", lambda *a: None)
    monkeypatch.setattr(mfu, "_MEASURED", {})
    monkeypatch.setattr(mfu, "measure_matmul_flops", lambda *a, **k: 1.5e11)
    fallback = mfu.peak_flops_per_rank(load_config(None, ["--parallel.param_dtype=bfloat16",
                                                           "--parallel.cpu_bf16_matmul=native"]), info)
    assert (fallback.flops, fallback.source) == (1.5e11, "measured on cpu")


# ---- one rank per GPU, device_id, pinned batches -----------------------------------------------------------
def test_more_local_ranks_than_gpus_is_one_clear_error(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert pick_device("auto", 1, 2) == torch.device("cuda", 1)
    with pytest.raises(ConfigError, match=r"^4 ranks on this node but only 2 visible GPUs"):
        pick_device("auto", 0, 4)
    with pytest.raises(ConfigError, match="3 ranks on this node"):
        pick_device("cuda", 2, 1)  # LOCAL_WORLD_SIZE unset but a local rank past the GPUs
    assert pick_device("cpu", 3, 4) == torch.device("cpu")  # CPU ranks are not GPUs


def test_init_distributed_refuses_before_any_process_group(monkeypatch):
    """Through init_distributed: the error comes before init_process_group (nothing to hang on)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("WORLD_SIZE", "2")
    called = []
    monkeypatch.setattr(shardlm_dist.dist, "init_process_group", lambda *a, **k: called.append(k))
    monkeypatch.setattr(shardlm_dist.dist, "is_initialized", lambda: False)
    with pytest.raises(ConfigError, match="2 ranks on this node but only 1 visible GPU "):
        shardlm_dist.init_distributed(ParallelConfig())
    assert called == []


def test_device_id_is_passed_to_init_process_group(monkeypatch, tf32_switches):
    kwargs = process_group_kwargs(torch.device("cuda", 3), "nccl", timedelta(seconds=60))
    assert kwargs == {"backend": "nccl", "timeout": timedelta(seconds=60),
                      "device_id": torch.device("cuda", 3)}
    assert "device_id" not in process_group_kwargs(torch.device("cpu"), "gloo", timedelta(seconds=60))
    # and init_distributed really passes them (CUDA described: set_device and the process group are stubbed)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: None)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    for key, value in {"LOCAL_RANK": "5", "LOCAL_WORLD_SIZE": "8", "WORLD_SIZE": "8", "RANK": "5"}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    seen = {}
    monkeypatch.setattr(shardlm_dist.dist, "is_initialized", lambda: False)
    monkeypatch.setattr(shardlm_dist.dist, "init_process_group", lambda **k: seen.update(k))
    monkeypatch.setattr(shardlm_dist.dist, "get_rank", lambda: 5)
    monkeypatch.setattr(shardlm_dist.dist, "get_world_size", lambda: 8)
    monkeypatch.setattr(shardlm_dist, "_started_process_group", False)
    info = shardlm_dist.init_distributed(ParallelConfig(dp_shard=-1))
    assert info.device == torch.device("cuda", 5) and info.backend == "nccl"
    assert seen["device_id"] == torch.device("cuda", 5) and seen["backend"] == "nccl"
    assert torch.backends.cuda.matmul.allow_tf32 is True  # TF32 switched on for the CUDA run


def test_host_batches_are_pinned_for_cuda_only():
    assert pin_host_batches(torch.device("cuda", 0)) is True
    assert pin_host_batches(torch.device("cpu")) is False
    batch = torch.arange(12).view(3, 4)
    assert torch.equal(shardlm_dist.to_device(batch, torch.device("cpu")), batch)

    class HostBatch:  # records what the copy to a (described) GPU does
        calls: list = []

        def pin_memory(self):
            self.calls.append("pin_memory")
            return self

        def to(self, device, non_blocking=False):
            self.calls.append(("to", device, non_blocking))
            return self

    shardlm_dist.to_device(HostBatch(), torch.device("cuda", 1))
    assert HostBatch.calls == ["pin_memory", ("to", torch.device("cuda", 1), True)]


def test_peak_memory_is_reset_after_each_logged_record(monkeypatch):
    """On CUDA the allocator's peaks are reset after each record, so each record's peak is its
    own interval's."""
    from shardlm.metrics.memory import reset_device_peaks

    resets = []
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: resets.append(device))
    reset_device_peaks(torch.device("cpu"))
    assert resets == []
    reset_device_peaks(torch.device("cuda", 2))
    assert resets == [torch.device("cuda", 2)]
    # the trainer resets right after reading the peaks for a record (a described GPU; collectives stubbed)
    from shardlm.train import step_metrics
    from shardlm.train import trainer as trainer_module

    assert trainer_module.per_rank_values is step_metrics.per_rank_values  # what train_step calls
    order = []
    monkeypatch.setattr(step_metrics, "device_memory",
                        lambda d: order.append("read") or {"max_allocated_bytes": 7})
    monkeypatch.setattr(step_metrics, "reset_device_peaks", lambda d: order.append(("reset", d)))
    values = step_metrics.per_rank_values(None, {"total": 1}, torch.device("cuda", 0))
    assert values == {"shard_bytes": 1, "max_allocated_bytes": 7}
    assert order == ["read", ("reset", torch.device("cuda", 0))]


# ---- grouped-query attention without repeated K/V ---------------------------------------------------------
@pytest.mark.parametrize("heads,kv_heads,masked", [(8, 2, False), (9, 3, False), (8, 2, True), (4, 4, False)])
def test_enable_gqa_attention_equals_repeat_interleave(heads, kv_heads, masked):
    """SDPA with ``enable_gqa=True`` (what the model uses on this PyTorch) against the earlier
    ``repeat_interleave`` path, fp32: outputs within 16 fp32 roundings of the largest, gradients within 64."""
    from shardlm.model.decoder import SDPA_ENABLE_GQA, attention

    assert SDPA_ENABLE_GQA  # torch 2.13 has it: the model really takes the enable_gqa path here
    gen = torch.Generator().manual_seed(heads * 10 + kv_heads)
    q = torch.randn(2, heads, 33, 16, generator=gen, requires_grad=True)
    k = torch.randn(2, kv_heads, 33, 16, generator=gen, requires_grad=True)
    v = torch.randn(2, kv_heads, 33, 16, generator=gen, requires_grad=True)
    mask = torch.rand(2, 1, 33, 33, generator=gen) > 0.3 if masked else None
    if mask is not None:
        mask |= torch.eye(33, dtype=torch.bool)  # every query sees at least itself
    grouped = attention(q, k, v, mask, enable_gqa=True)
    repeated = attention(q, k, v, mask, enable_gqa=False)
    diff = (grouped - repeated).abs().max().item()
    print(f"heads {heads}/{kv_heads}{' masked' if masked else ''}: max |enable_gqa - repeat_interleave| = "
          f"{diff:.1e}")
    assert grouped.shape == (2, heads, 33, 16)
    assert_close(grouped, repeated, rtol=16 * EPS, what="attention output")
    g1 = torch.autograd.grad(grouped.square().sum(), (q, k, v))
    g2 = torch.autograd.grad(repeated.square().sum(), (q, k, v))
    assert_all_close(dict(enumerate(g1)), dict(enumerate(g2)), rtol=64 * EPS, what="q, k, v gradients")


def test_model_forward_is_the_same_with_either_attention_path(monkeypatch):
    """A whole GQA Llama: logits with enable_gqa and with repeated K/V agree within 64 fp32 roundings of the
    largest."""
    from shardlm.config import ModelConfig
    from shardlm.model import decoder as decoder_module
    from shardlm.model.decoder import CausalLM

    torch.manual_seed(0)
    model = CausalLM(ModelConfig(dim=64, n_layers=2, n_heads=8, n_kv_heads=2, vocab_size=101, max_seq_len=32))
    tokens = torch.randint(0, 101, (2, 32))
    with torch.no_grad():
        grouped = model(tokens)
        monkeypatch.setattr(
            decoder_module,
            "attention",
            lambda q, k, v, mask=None, scale=None: (
                decoder_module.F.scaled_dot_product_attention(
                    q, k.repeat_interleave(4, 1), v.repeat_interleave(4, 1), is_causal=True, scale=scale
                )
                if mask is None
                else None
            ),
        )
        repeated = model(tokens)
    assert_close(grouped, repeated, rtol=64 * EPS, what="logits")


def test_leak_guard_names_and_restores_a_patched_global():
    """The conftest guard that fails a test leaving a process-wide setting changed: it names the setting and
    puts it back (checked here by calling it directly on a deliberate leak)."""
    from conftest import process_globals, restore_process_globals

    before = process_globals()
    real = torch.cuda.is_available
    torch.cuda.is_available = lambda: True
    torch.backends.cudnn.allow_tf32 = not before["torch.backends.cudnn.allow_tf32"]
    changed = restore_process_globals(before)
    assert changed == ["torch.cuda.is_available", "torch.backends.cudnn.allow_tf32"]
    assert torch.cuda.is_available is real and torch.cuda.is_available() is False
    assert torch.backends.cudnn.allow_tf32 == before["torch.backends.cudnn.allow_tf32"]
    assert restore_process_globals(before) == []
