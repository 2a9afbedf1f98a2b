"""The rollout at 2 and at 4 ranks, FSDP2-sharded, equals one process token for token; the sampler's scoring
equals the training forward bit for bit (a torchrun launch of tests/workers/rollout_worker.py per world size,
tiny fp32 model)."""

from __future__ import annotations

import json

import pytest

from conftest import WORKERS, torchrun


@pytest.mark.dist
def test_two_ranks_sample_the_one_process_completions(tmp_path):
    out = tmp_path / "rollout.json"
    torchrun(2, [str(WORKERS / "rollout_worker.py"), str(out)], timeout=300)
    report = json.loads(out.read_text())
    assert report["world"] == 2 and report["rows_per_rank"] == [12, 9]  # 4 and 3 prompts, G = 3
    assert report["keys_equal"]
    assert report["tokens_differing"] == 0 and report["completions_equal"]
    lengths = report["lengths"]
    assert len(set(lengths)) > 5 and max(lengths) == 24  # ranks stopped decoding at different steps
    assert report["gathered_inside"] == [True, True] and report["sharded_after"] == [True, True]
    # scored inside gathered (no grad) == the sharded training forward with grad, same micro-batches
    assert report["step_equal"] == [True, True]


@pytest.mark.dist
def test_four_ranks_sample_the_one_process_completions(tmp_path):
    """The same worker at 4 ranks (2, 2, 2 and 1 prompts: 6, 6, 6 and 3 rows, each rank its own generation
    batch size): every completion equals the one-process rollout token for token, each rank's scoring inside
    the gather equals its sharded training forward bit for bit."""
    out = tmp_path / "rollout4.json"
    torchrun(4, [str(WORKERS / "rollout_worker.py"), str(out)], timeout=300)
    report = json.loads(out.read_text())
    assert report["world"] == 4 and report["rows_per_rank"] == [6, 6, 6, 3]
    assert report["keys_equal"]
    assert report["tokens_differing"] == 0 and report["completions_equal"]
    assert len(set(report["lengths"])) > 5 and max(report["lengths"]) == 24
    assert report["gathered_inside"] == [True] * 4 and report["sharded_after"] == [True] * 4
    assert report["step_equal"] == [True] * 4
