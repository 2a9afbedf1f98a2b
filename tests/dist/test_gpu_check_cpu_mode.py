"""``bench/gpu_check.py`` run here in its CPU mode (tiny shapes): every check of the first GPU job runs and
passes (a dist test: the script starts a process group of its own, world size 1, and ``shardlm
export`` processes)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from conftest import ROOT, cpu_env
from tolerance import check


# ---- the one-shot GPU check, run here in its CPU mode ------------------------------------------------------
@pytest.mark.dist
def test_gpu_check_runs_in_cpu_mode(tmp_path):
    """`python bench/gpu_check.py --device cpu` (tiny shapes): every check runs and passes, one table
    is printed."""
    import json

    out = tmp_path / "gpu_check.json"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_check.py"), "--device", "cpu", "--out",
                           str(out)],
                          env=cpu_env(), capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    table = proc.stdout[proc.stdout.index("shardlm gpu_check on CPU"):]
    print(table)
    rows = json.loads(out.read_text())["rows"]
    assert [r["check"] for r in rows] == ["a. speed", "b. fp32 device vs CPU", "c. export -> transformers",
                                          "d. checkpoint + resume",
                                          "e. block-causal sdpa: packed row = each example " "alone",
                                          "e. block-causal flex: packed row = each example alone",
                                          "e. block-causal sdpa, gpt-oss sinks: packed row = each example "
                                          "alone",
                                          "e. block-causal flex, gpt-oss sinks: packed row = each example "
                                          "alone",
                                          "f. TP 2 = one process", "f'. async TP 2 (compile) = one process",
                                          "g. MoE grouped matmul (torch._grouped_mm) = loop",
                                          "h. CP 2 = one process", "i. float8 tensorwise vs bf16",
                                          "i. float8 rowwise vs bf16", "i. float8 mxfp8 vs bf16"]
    assert all(r["pass"] for r in rows) and table.count("| ok |") == 9 and table.count("| skipped |") == 6
    # float8 rows run on a GPU with float8 tensor cores; on a CPU each says why not
    assert all(r["skipped"] and "float8 is emulated" in r["result"] for r in rows[12:])
    # TP 2 ran on gloo (two launches, 3 steps each): the losses of one process; the CUDA-only rows say why not
    assert len(rows[8]["losses"]) == 3, rows[8]
    scale = max(abs(x) for x in rows[8]["losses"].values())  # relative to the loss (by step)
    check(rows[8]["max_loss_diff"], 1e-5 * scale, scale=scale, what="TP 2 loss")
    assert [r.get("skipped", False) for r in rows[8:12]] == [False, True, True, True]
    assert "needs CUDA" in rows[9]["result"] and "CUDA bf16 path" in rows[10]["result"]
    # the gpu check reports absolute logit differences without their scale (its own thresholds)
    for row, name in ((rows[4], "Mistral"), (rows[6], "gpt-oss")):  # sdpa trains on CPU, gpt-oss with its sinks
        check(row["max_logits_diff"], 1e-5, what=f"{name} packed logits (absolute)")
        check(row["grad_rel_diff"], 1e-4, what=f"{name} packed gradients, relative")
    speed = rows[0]
    assert 0 < speed["mfu"] < 1 and speed["tokens_per_s"] > 0
    check(rows[1]["max_loss_diff"], 1e-4, what="device vs CPU loss (absolute)")
    check(rows[2]["max_logits_diff"], 1e-3, what="export logits (absolute)")
