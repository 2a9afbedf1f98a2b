"""The overlap report: its interval accounting, and `shardlm profile` on 2 CPU ranks."""

from __future__ import annotations

import json

import pytest

from conftest import ROOT, tiny_overrides, torchrun
from shardlm.metrics.overlap import account, comm_kind, intersect, length, union


def test_interval_accounting_by_hand():
    # step 0..100 µs; compute 0-40 and 60-90; all-gather 30-50 (10 hidden, 10 exposed);
    # reduce-scatter 85-95 (5 hidden, 5 exposed); idle: 50-60 and 95-100
    acc = account((0.0, 100.0), {"compute": [(0, 40), (60, 90)], "all_gather": [(30, 50)],
                                 "reduce_scatter": [(85, 95)], "other_comm": []})
    assert acc.step_ms == pytest.approx(0.100)
    assert acc.compute_ms == pytest.approx(0.070)
    assert acc.comm_ms == pytest.approx(0.030)
    assert acc.hidden_comm_ms == pytest.approx(0.015)
    assert acc.exposed_comm_ms == pytest.approx(0.015)
    assert acc.idle_ms == pytest.approx(0.015)
    assert acc.exposed_comm_ms + acc.compute_ms + acc.idle_ms == pytest.approx(acc.step_ms)
    assert union([(5, 7), (0, 2), (1, 3)]) == [(0, 3), (5, 7)]
    assert length(intersect([(0, 10)], [(2, 3), (9, 12)])) == 2


def test_collective_names():
    assert comm_kind("c10d::_allgather_base_") == "all_gather"
    assert comm_kind("gloo:all_gather") == "all_gather"
    assert comm_kind("c10d::_reduce_scatter_base_") == "reduce_scatter"
    assert comm_kind("c10d::alltoall_base_") == "reduce_scatter"  # shardlm's reduce-scatter on gloo
    assert comm_kind("gloo:all_to_all") == "reduce_scatter"
    assert comm_kind("ncclDevKernel_ReduceScatter_Sum_f32_RING_LL") == "reduce_scatter"
    assert comm_kind("_c10d_functional::all_reduce") == "other_comm"
    assert comm_kind("aten::broadcast_tensors") is None
    assert comm_kind("aten::mm") is None


@pytest.mark.dist
def test_profile_two_ranks(small_data, tmp_path):
    run = tmp_path / "prof"
    args = ["-m", "shardlm", "profile", str(ROOT / "configs" / "shakespeare-tiny.toml"), "--steps", "2",
            *tiny_overrides(small_data, run, {"train.micro_batch_size": 2})]
    proc = torchrun(2, args, timeout=300)
    out = run / "profile"
    assert (out / "trace_rank0.json").stat().st_size > 0 and (out / "trace_rank1.json").stat().st_size > 0
    assert (out / "timeline.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    trace = json.loads((out / "trace_rank1.json").read_text())
    names = {e.get("name", "") for e in trace["traceEvents"]}
    assert any("allgather" in n for n in names)
    # on gloo FSDP reduce-scatters through shardlm's all-to-all (parallel/reduce_scatter.py), not gloo's own
    assert "c10d::alltoall_base_" in names and "c10d::_reduce_scatter_base_" not in names
    summary = json.loads((out / "summary.json").read_text())
    assert len(summary["per_rank"]) == 2
    for steps in summary["per_rank"]:
        assert len(steps) == 2
        for s in steps:
            # communication + compute + idle = step time (exposed communication, to count overlap once)
            assert s["exposed_comm_ms"] + s["compute_ms"] + s["idle_ms"] == pytest.approx(s["step_ms"], rel=1e-9)
            assert s["hidden_comm_ms"] + s["exposed_comm_ms"] == pytest.approx(s["comm_ms"], rel=1e-9)
            assert s["all_gather_ms"] > 0 and s["reduce_scatter_ms"] > 0 and s["compute_ms"] > 0
            assert 0 <= s["idle_ms"] < s["step_ms"]
    assert "hidden %" in proc.stdout and "synchronously" in proc.stdout


def test_profile_bad_input(tmp_path):
    """A bad --steps value stops `shardlm profile` with one clear message and exit code 2."""
    import subprocess
    import sys

    from conftest import cpu_env

    proc = subprocess.run([sys.executable, "-m", "shardlm", "profile", str(ROOT / "configs" / "shakespeare-tiny.toml"),
                           "--steps", "0", f"--run.dir={tmp_path / 'r'}"], env=cpu_env(), capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1].startswith("error: --steps must be >= 1")
