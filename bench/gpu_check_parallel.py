"""Checks f-h of ``bench/gpu_check.py``: what tensor, expert and context parallelism added that only a
GPU shows.

f. tensor parallel: 3 steps of the tiny model (fp32, TF32 off) at ``parallel.tp = 2`` on 2 ranks against the
   same steps in one process: losses within :data:`PARALLEL_LOSS_TOL`; on CUDA also async TP
   (``parallel.async_tp`` with ``compile``: TorchInductor's micro-pipelined collectives over symmetric memory)
   against the same reference. Each run is its own ``torchrun`` launch of ``shardlm.train``; the losses are
   read from its ``metrics.jsonl``. On a CPU (``--device cpu``) the plain TP row runs on gloo (the launches
   and the comparison themselves are checked); async TP is CUDA only.
g. the MoE experts' grouped matmul: :func:`shardlm.model.moe.grouped_linear` takes ``torch._grouped_mm`` for
   bf16 on CUDA; against a loop of ``F.linear`` per expert on the same bf16 tensors (one expert without
   tokens): outputs and the gradients of x and the stacked weights within :data:`GROUPED_MM_TOL` of the loop's
   largest magnitude (bf16 rounding: both accumulate in fp32).
h. context parallel: 3 steps at ``parallel.cp = 2`` on 2 ranks against one process (fp32, TF32 off): losses
   within :data:`PARALLEL_LOSS_TOL`. On a CPU it is skipped (``tests/dist/test_cp_parity.py`` checks it
   on gloo).

A row that needs more GPUs than the machine has is skipped with the reason (``"skipped": true``, not
a failure).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
#: fp32 with TF32 off: TP / CP change only the order of the sums (the gloo tests hold 1e-5 on a CPU)
PARALLEL_LOSS_TOL = 1e-4
#: a bf16 result's rounding (2^-7 = 7.8e-3 relative), against the largest magnitude of the loop's result
GROUPED_MM_TOL = 1e-2


def skipped(check: str, reason: str) -> dict:
    """A row not run: it passes, marked ``skipped``, with ``reason`` as its result."""
    return {"check": check, "result": f"skipped: {reason}", "pass": True, "skipped": True}


def too_few_gpus(device: torch.device, need: int) -> str | None:
    """Why a check needing ``need`` GPUs cannot run here (None when it can, or on the CPU)."""
    if device.type != "cuda":
        return None
    have = torch.cuda.device_count()
    return None if have >= need else f"needs {need} GPUs, this machine has {have}"


def launch_losses(nproc: int, overrides: list[str], device: torch.device, data: Path, run: Path,
                  timeout: float = 600) -> dict[int, float]:
    """{step: loss} of ``torchrun --nproc_per_node=nproc -m shardlm.train OVERRIDES`` on ``data``, run
    in ``run``.

    Raises:
        RuntimeError: the launch failed (with the end of its output).
    """
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", "")}
    if device.type == "cpu":
        env["OMP_NUM_THREADS"] = "1"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", "-m",
           "shardlm.train", *overrides, f'--data.dir="{data}"', f'--run.dir="{run}"', "--run.overwrite=true",
           f"--parallel.device={device.type}"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"{nproc}-rank launch failed ({proc.returncode}): "
                           f"{(proc.stdout + proc.stderr)[-1500:]}")
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return {r["step"]: r["loss"] for r in records if "loss" in r and "step" in r}


def compare(check: str, got: dict[int, float], ref: dict[int, float]) -> dict:
    """A row: the largest loss difference over the reference's steps against :data:`PARALLEL_LOSS_TOL`."""
    diff = max(abs(got[s] - ref[s]) for s in ref) if set(ref) <= set(got) and ref else float("inf")
    return {"check": check, "max_loss_diff": diff, "losses": got, "losses_one_process": ref,
            "result": f"{len(ref)} steps, max loss diff {diff:.2e} (limit {PARALLEL_LOSS_TOL:.0e})",
            "pass": diff <= PARALLEL_LOSS_TOL}


def check_tensor_parallel(device: torch.device, work: Path, data: Path, tiny: list[str]) -> list[dict]:
    """(f) TP 2 (and on CUDA async TP with compile) against one process."""
    names = ("f. TP 2 = one process", "f'. async TP 2 (compile) = one process")
    reason = too_few_gpus(device, 2)
    if reason:
        return [skipped(n, reason) for n in names]
    common = [*tiny, "--train.steps=3", "--checkpoint.enabled=false", "--parallel.tf32=false"]
    ref = launch_losses(1, common, device, data, work / "run-tp-ref")
    rows = [compare(names[0], launch_losses(2, [*common, "--parallel.tp=2"], device, data, work / "run-tp2"),
                    ref)]
    if device.type != "cuda":
        rows.append(skipped(names[1],
                            "async TP needs CUDA (symmetric memory); parallel.async_tp is refused on CPU"))
        return rows
    asynchronous = [*common, "--parallel.tp=2", "--parallel.compile=true", "--parallel.async_tp=true"]
    rows.append(compare(names[1], launch_losses(2, asynchronous, device, data, work / "run-tp2-async"), ref))
    return rows


def check_grouped_mm(device: torch.device) -> list[dict]:
    """(g) ``torch._grouped_mm`` (shardlm's CUDA bf16 path) against a loop of ``F.linear``, forward
        and backward."""
    from shardlm.model.moe import grouped_linear

    check = "g. MoE grouped matmul (torch._grouped_mm) = loop"
    if device.type != "cuda":
        return [skipped(check,
                        "torch._grouped_mm is the CUDA bf16 path; on a CPU grouped_linear runs the loop")]
    if not hasattr(torch, "_grouped_mm"):
        return [skipped(check, f"this PyTorch ({torch.__version__}) has no torch._grouped_mm")]
    major, minor = torch.cuda.get_device_capability(device)
    if major < 9:
        return [skipped(check, f"torch._grouped_mm needs sm90 or later, this GPU is sm{major}{minor}")]
    gen = torch.Generator().manual_seed(0)
    counts = torch.tensor([96, 0, 160, 64, 32, 128, 16, 16])  # expert 1 receives no token
    x = torch.randn(int(counts.sum()), 256, generator=gen).to(device, torch.bfloat16).requires_grad_()
    w = (torch.randn(len(counts), 384, 256, generator=gen) / 16).to(device, torch.bfloat16).requires_grad_()
    y = grouped_linear(x, w, counts.to(device))
    dy = torch.randn(y.shape, generator=gen).to(device, torch.bfloat16)
    dx, dw = torch.autograd.grad(y, (x, w), dy)
    x_ref, w_ref = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    y_ref = torch.cat([F.linear(g, w_ref[e]) for e, g in enumerate(x_ref.split(counts.tolist()))])
    dx_ref, dw_ref = torch.autograd.grad(y_ref, (x_ref, w_ref), dy)
    diffs = {name: ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()
             for name, a, b in (("output", y, y_ref), ("dx", dx, dx_ref), ("dweight", dw, dw_ref))}
    ok = all(d <= GROUPED_MM_TOL for d in diffs.values()) and not dw[1].any()  # no token: a zero gradient
    return [
        {
            "check": check,
            **{f"rel_diff_{k}": v for k, v in diffs.items()},
            "result": "8 experts (one without tokens), bf16: "
            + ", ".join(f"{k} {v:.1e}" for k, v in diffs.items())
            + f" of the loop's largest (limit {GROUPED_MM_TOL:.0e}); the empty expert's gradient "
            "zero",
            "pass": bool(ok),
        }
    ]


def check_context_parallel(device: torch.device, work: Path, data: Path, tiny: list[str]) -> list[dict]:
    """(h) CP 2 against one process."""
    check = "h. CP 2 = one process"
    if device.type != "cuda":
        return [skipped(check,
                        "context parallel on gloo is checked by tests/dist/test_cp_parity.py; here it needs "
                        "CUDA")]
    reason = too_few_gpus(device, 2)
    if reason:
        return [skipped(check, reason)]
    common = [*tiny, "--train.steps=3", "--checkpoint.enabled=false", "--parallel.tf32=false"]
    ref = launch_losses(1, common, device, data, work / "run-cp-ref")
    return [compare(check, launch_losses(2, [*common, "--parallel.cp=2"], device, data, work / "run-cp2"),
                    ref)]
