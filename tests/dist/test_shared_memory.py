"""FSDP's shared-memory collectives (shardlm/parallel/shared_memory.py) at 3 ranks: bit-identical to gloo's
all-gather and to the all-to-all reduce-scatter over growing, shrinking and interleaved calls, nothing left in
/dev/shm, and one clear error where /dev/shm has no room. Whole runs with them (the default on one host) are
compared with the other collectives in test_fsdp_options_parity.py."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from conftest import torchrun

WORKER = Path(__file__).resolve().parents[1] / "workers" / "shared_memory_worker.py"


@pytest.mark.dist
def test_shared_memory_collectives(tmp_path, tiny_fs):
    out = tmp_path / "result.json"
    torchrun(3, [str(WORKER), str(out), str(tiny_fs)], timeout=300)
    result = json.loads(out.read_text())
    assert len(result["cases"]) == 6 * 4
    assert all(equal for _, equal in result["cases"]), [name for name, equal in result["cases"] if not equal]
    # nothing left in /dev/shm by this job's ranks (segments are named by the creating rank's pid)
    ours = tuple(f"shardlm-{pid}-" for pid in result["pids"])
    assert result["left"] == [] and not [f for f in os.listdir("/dev/shm") if f.startswith(ours)]
    # 3 ranks x 4 MB in two halves do not fit a 3 MB tmpfs: the error names the place, the size and the way out
    message = result["full"]
    assert message is not None and str(tiny_fs) in message and "22.9 MiB" in message
    assert "point_to_point" in message and "all_to_all" in message and "--shm-size" in message
    # 400,000 parameters at 3 ranks need 9.6 MB: rank 1 (the 3 MB tmpfs) says no, the others yes; all agree no
    assert [local for local, _ in result["agreed"]] == [True, False, True]
    assert [agreed for _, agreed in result["agreed"]] == [False, False, False]
    # a segment no rank could map: each raises, and the first rank removed the file all the same
    assert result["map_error"] == "mapping refused (test)" and result["left_after_error"] == []
