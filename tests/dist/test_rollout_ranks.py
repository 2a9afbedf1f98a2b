"""The rollout at 2 ranks, FSDP2-sharded, equals one process token for token; the sampler's scoring equals the
training forward bit for bit (one torchrun launch of tests/workers/rollout_worker.py, tiny fp32 model)."""

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
