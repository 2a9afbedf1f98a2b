"""The overlap report: its interval accounting, the collectives' names, and ``shardlm profile``'s bad input.
``shardlm profile`` on 2 CPU ranks is tests/dist/test_profile_two_ranks.py."""

from __future__ import annotations

import pytest

from conftest import ROOT
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
    assert comm_kind("shardlm::all_gather_point_to_point") == "all_gather"  # shardlm's all-gather on gloo
    assert comm_kind("c10d::_reduce_scatter_base_") == "reduce_scatter"
    assert comm_kind("c10d::alltoall_base_") == "reduce_scatter"  # shardlm's reduce-scatter on gloo
    assert comm_kind("gloo:all_to_all") == "reduce_scatter"
    assert comm_kind("ncclDevKernel_ReduceScatter_Sum_f32_RING_LL") == "reduce_scatter"
    assert comm_kind("_c10d_functional::all_reduce") == "other_comm"
    assert comm_kind("aten::broadcast_tensors") is None
    assert comm_kind("aten::mm") is None


def test_profile_bad_input(tmp_path):
    """A bad --steps value stops `shardlm profile` with one clear message and exit code 2."""
    import subprocess
    import sys

    from conftest import cpu_env

    proc = subprocess.run([sys.executable, "-m", "shardlm", "profile",
                           str(ROOT / "configs" / "shakespeare-tiny.toml"), "--steps", "0",
                           f"--run.dir={tmp_path / 'r'}"], env=cpu_env(), capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1].startswith("error: --steps must be >= 1")
