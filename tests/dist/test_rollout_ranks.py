"""The rollout at 4 ranks, FSDP2-sharded, equals one process token for token; the sampler's scoring equals the
training forward bit for bit (one torchrun launch of tests/workers/rollout_worker.py, tiny fp32 model; 1 vs 2
ranks, with rewards and the training that follows, is tests/dist/test_grpo_ranks.py)."""

from __future__ import annotations

import json

import pytest

from conftest import WORKERS, torchrun


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
    assert len(set(report["lengths"])) > 5 and max(report["lengths"]) == 24  # ranks stopped decoding apart
    assert report["gathered_inside"] == [True] * 4 and report["sharded_after"] == [True] * 4
    assert report["step_equal"] == [True] * 4
