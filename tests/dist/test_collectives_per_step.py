"""The lean training step: beyond FSDP's own collectives, one all-reduce per step and one host read on a
logging step only (issue 14); with checkpointing on, a non-logging step also reads the stop flag (one scalar:
a signal on any rank then stops every rank after that step). Counted by tests/workers/sync_count_worker.py,
which wraps ``torch.distributed``'s collectives and ``Tensor.item`` / ``tolist`` / ``cpu``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import tiny_overrides, torchrun

pytestmark = pytest.mark.dist

FREEZE = {"train.trainable": "model.layers.1.*,norm"}  # block 1 and the final norm train; the rest is frozen
PER_RANK = {"train.log_per_rank": "true", "train.peak_flops": 1e12}


@pytest.fixture(scope="module")
def counted(tmp_path_factory, small_data) -> dict[str, list[dict]]:
    """Six steps at 2 ranks, logging every third step, no evaluation or checkpoint in between: FSDP, DDP,
    tensor parallel (TP 2, beyond its own collectives), and FSDP with frozen parameters and with LoRA adapters
    (dropout on: a seeded draw per step), the last two with per-rank lists and a peak for MFU; and FSDP with
    checkpointing on (saving at the last step only)."""
    out = tmp_path_factory.mktemp("lean")
    common = {"train.steps": 6, "train.micro_batch_size": 2, "train.log_interval": 3,
              "train.eval_interval": 0, "checkpoint.enabled": "false"}
    extra = {"fsdp": {}, "ddp": {"parallel.mode": "ddp"}, "tp": {"parallel.tp": 2},
             "frozen": {**FREEZE, **PER_RANK},
             "lora": {"lora.enabled": "true", "lora.rank": 4, "lora.alpha": 8.0, "lora.dropout": 0.1,
                      **PER_RANK},
             "checkpointing": {"checkpoint.enabled": "true", "checkpoint.interval": 0}}
    scenarios = [{"name": name, "overrides": tiny_overrides(small_data, out / name, {**common, **more})}
                 for name, more in extra.items()]
    spec = out / "spec.json"
    spec.write_text(json.dumps({"out": str(out), "scenarios": scenarios}))
    worker = str(Path(__file__).resolve().parents[1] / "workers" / "sync_count_worker.py")
    torchrun(2, [worker, str(spec)])
    return {s["name"]: [json.loads((out / s["name"] / f"rank{r}.json").read_text()) for r in range(2)]
            for s in scenarios}


@pytest.mark.parametrize("mode", ["fsdp", "ddp", "tp", "frozen", "lora", "checkpointing"])
def test_one_collective_per_step_and_host_reads_only_when_logging(counted, mode):
    for rank, report in enumerate(counted[mode]):
        steps = report["steps"]
        assert [s["logged"] for s in steps] == [False, False, True, False, False, True], (mode, rank)
        for s in steps:
            print(mode, rank, s)
            # the gradient norm's, carrying the rest
            assert s["collectives"] == ["all_reduce"], (mode, rank, s)
            # with checkpointing, the stop flag on the other steps (HostScalar.item)
            unlogged = ["item"] if mode == "checkpointing" else []
            assert s["host_reads"] == (["tolist"] if s["logged"] else unlogged), (mode, rank, s)


@pytest.mark.parametrize("mode", ["frozen", "lora"])
def test_frozen_and_lora_steps_log_mfu_and_the_trainable_shard_bytes(counted, mode):
    """With frozen parameters the logged shard bytes count gradients and AdamW state of the trainable ones
    only, predicted exactly before they exist (the first record) and measured after (later records)."""
    for rank, report in enumerate(counted[mode]):
        total = report["measured_shard_bytes"]
        assert report["trainable"] > 0 and report["frozen"] > 0, (mode, rank, report)
        assert report["expected_shard_bytes"] == total, (mode, rank)
        logged = [s for s in report["steps"] if s["logged"]]
        assert [s["shard_bytes"] for s in logged] == [total, total], (mode, rank)
        assert all(0 < s["mfu"] < 1 for s in logged), (mode, rank, logged)
