"""The lean training step: beyond FSDP's own collectives, one all-reduce per step and one host read on a logging
step only (issue 14). Counted by tests/sync_count_worker.py, which wraps ``torch.distributed``'s collectives and
``Tensor.item`` / ``tolist`` / ``cpu``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import tiny_overrides, torchrun

pytestmark = pytest.mark.dist


@pytest.fixture(scope="module")
def counted(tmp_path_factory, small_data) -> dict[str, list[dict]]:
    """Six steps of FSDP and of DDP at 2 ranks, logging every third step, no evaluation or checkpoint in between."""
    out = tmp_path_factory.mktemp("lean")
    common = {"train.steps": 6, "train.micro_batch_size": 2, "train.log_interval": 3, "train.eval_interval": 0,
              "checkpoint.enabled": "false"}
    scenarios = [{"name": mode, "overrides": tiny_overrides(small_data, out / mode, {**common, "parallel.mode": mode})}
                 for mode in ("fsdp", "ddp")]
    spec = out / "spec.json"
    spec.write_text(json.dumps({"out": str(out), "scenarios": scenarios}))
    worker = str(Path(__file__).resolve().parent / "sync_count_worker.py")
    torchrun(2, [worker, str(spec)])
    return {s["name"]: [json.loads((out / s["name"] / f"rank{r}.json").read_text()) for r in range(2)]
            for s in scenarios}


@pytest.mark.parametrize("mode", ["fsdp", "ddp"])
def test_one_collective_per_step_and_host_reads_only_when_logging(counted, mode):
    for rank, report in enumerate(counted[mode]):
        steps = report["steps"]
        assert [s["logged"] for s in steps] == [False, False, True, False, False, True], (mode, rank)
        for s in steps:
            print(mode, rank, s)
            assert s["collectives"] == ["all_reduce"], (mode, rank, s)  # the gradient norm's, carrying the rest
            assert s["host_reads"] == (["tolist"] if s["logged"] else []), (mode, rank, s)
