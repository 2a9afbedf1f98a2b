"""Check i of ``bench/gpu_check.py``: float8 training (``train.float8``) against bf16 on the GPU.

The speed check's config (``configs/llama3.2-1b.toml``: bf16, ``compile``, selective activation checkpointing)
runs ``steps`` steps in bf16, then the same steps from the same start on the same batches with each float8
recipe the GPU has (``tensorwise`` and ``rowwise`` from compute capability 8.9, ``mxfp8`` from 10.0): one row
per recipe with the median step time and tokens/s against bf16's (the speed-up, not judged: it depends on the
shapes and on compile), ``max_memory_allocated``, and the loss curve against bf16's, which must stay above
torchao's float8 numerics bound (20 dB SQNR: ``test/float8/test_numerics_integration.py``). A row the GPU
cannot run is skipped with the reason; on a CPU (``--device cpu``) every row is skipped: float8 there is
torchao's emulation, whose numerics and FSDP wiring ``tests/dist/test_float8_parity.py`` checks.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import torch

from shardlm.parallel.float8 import FLOAT8_MIN_CAPABILITY

#: torchao's float8 numerics bound: the loss curve's SQNR against bf16, dB
FLOAT8_SQNR_DB = 20.0
RECIPES = ("tensorwise", "rowwise", "mxfp8")


def row_name(recipe: str) -> str:
    """The row's ``check`` name for ``recipe``."""
    return f"i. float8 {recipe} vs bf16"


def check_float8(device: torch.device, steps: int, run: Callable[[list[str], Path], list[dict]],
                 work: Path) -> list[dict]:
    """(i) one row per float8 recipe (see the module docstring). ``run(overrides, run_dir)``: ``steps``
    records of the speed check's config with ``overrides`` (the first includes compilation), with
    ``max_memory_allocated`` reset after the first step and reported in the last record's
    ``max_allocated_bytes``."""
    if device.type != "cuda":
        reason = ("needs a GPU with float8 tensor cores; on a CPU float8 is emulated (numerics: "
                  "tests/dist/test_float8_parity.py)")
        return [{"check": row_name(r), "result": f"skipped: {reason}", "skipped": True, "pass": True}
                for r in RECIPES]
    have = torch.cuda.get_device_capability(device)
    usable = [r for r in RECIPES if tuple(have) >= FLOAT8_MIN_CAPABILITY[r]]
    need = {r: ".".join(map(str, FLOAT8_MIN_CAPABILITY[r])) for r in RECIPES}
    rows = {r: {"check": row_name(r), "skipped": True, "pass": True,
                "result": f"skipped: needs compute capability {need[r]}, this GPU is {have[0]}.{have[1]}"}
            for r in RECIPES if r not in usable}
    if not usable:
        return [rows[r] for r in RECIPES]
    base = run([], work / "run-bf16")
    for recipe in usable:
        rows[recipe] = compare(recipe, base, run([f"--train.float8={recipe}"], work / f"run-{recipe}"))
    return [rows[r] for r in RECIPES]


def median_step_s(records: list[dict]) -> float:
    """Median step time of the records after the first (compilation)."""
    timed = sorted(r["step_time_s"] for r in records[1:])
    return timed[len(timed) // 2]


def compare(recipe: str, base: list[dict], got: list[dict]) -> dict:
    """One row: ``got`` (float8) against ``base`` (bf16), same steps."""
    a = [r["loss"] for r in got]
    b = [r["loss"] for r in base]
    noise = math.sqrt(sum((x - y) ** 2 for x, y in zip(a, b)))
    sqnr = math.inf if noise == 0 else 20 * math.log10(math.sqrt(sum(y * y for y in b)) / noise)
    rel = max(abs(x - y) / abs(y) for x, y in zip(a, b))
    t8, t16 = median_step_s(got), median_step_s(base)
    tokens = got[-1]["tokens_per_s"] * got[-1]["step_time_s"]  # tokens per step
    row = {"check": row_name(recipe), "median_step_s": t8, "median_step_s_bf16": t16, "speedup": t16 / t8,
           "tokens_per_s": tokens / t8, "tokens_per_s_bf16": tokens / t16, "losses": a, "losses_bf16": b,
           "loss_sqnr_db": sqnr, "max_loss_rel_diff": rel,
           "max_allocated_bytes": got[-1].get("max_allocated_bytes"),
           "max_allocated_bytes_bf16": base[-1].get("max_allocated_bytes")}
    memory = ""
    if row["max_allocated_bytes"] and row["max_allocated_bytes_bf16"]:
        memory = (f"; max allocated {row['max_allocated_bytes'] / 2**30:.2f} vs "
                  f"{row['max_allocated_bytes_bf16'] / 2**30:.2f} GiB")
    row["result"] = (f"{len(a)} steps: {tokens / t8:,.0f} vs {tokens / t16:,.0f} tokens/s (x{t16 / t8:.2f}); "
                     f"loss SQNR {sqnr:.1f} dB vs bf16 (limit {FLOAT8_SQNR_DB:.0f}), max rel diff {rel:.1e}; "
                     f"loss {a[0]:.4f} -> {a[-1]:.4f}{memory}")
    row["pass"] = bool(sqnr > FLOAT8_SQNR_DB and all(math.isfinite(x) for x in a))
    return row
