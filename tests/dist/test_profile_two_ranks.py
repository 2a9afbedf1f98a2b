"""``shardlm profile`` on 2 CPU ranks: the overlap report of a real run."""

from __future__ import annotations

import json

import pytest

from conftest import ROOT, tiny_overrides, torchrun


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
    # ranks on one host: FSDP all-gathers and reduce-scatters through shared memory (parallel/shared_memory.py),
    # not through gloo's sockets
    assert {"shardlm::all_gather_shared_memory", "shardlm::reduce_scatter_shared_memory"} <= names
    assert not names & {"c10d::_allgather_base_", "c10d::_reduce_scatter_base_", "c10d::alltoall_base_"}
    summary = json.loads((out / "summary.json").read_text())
    assert len(summary["per_rank"]) == 2
    for steps in summary["per_rank"]:
        assert len(steps) == 2
        for s in steps:
            # communication + compute + idle = step time (exposed communication, to count overlap once)
            assert s["exposed_comm_ms"] + s["compute_ms"] + s["idle_ms"] == pytest.approx(
                s["step_ms"], rel=1e-9
            )
            assert s["hidden_comm_ms"] + s["exposed_comm_ms"] == pytest.approx(s["comm_ms"], rel=1e-9)
            assert s["all_gather_ms"] > 0 and s["reduce_scatter_ms"] > 0 and s["compute_ms"] > 0
            assert 0 <= s["idle_ms"] < s["step_ms"]
    assert "hidden %" in proc.stdout and "synchronously" in proc.stdout
