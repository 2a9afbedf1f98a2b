"""Context parallelism (shardlm/parallel/cp.py): the load-balanced split, its masks, and attention across it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from conftest import torchrun
from shardlm.errors import ConfigError
from shardlm.parallel.cp import ContextParallel, chunk_indices, gathered_indices, padded_length

WORKER = Path(__file__).resolve().parent / "cp_worker.py"


def test_split_is_head_and_tail_chunks_covering_the_padded_sequence():
    assert padded_length(13, 2) == 16 and padded_length(16, 2) == 16 and padded_length(17, 4) == 24
    assert chunk_indices(13, 2, 0).tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert chunk_indices(13, 2, 1).tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    assert sorted(gathered_indices(17, 4).tolist()) == list(range(24))
    # causal work (keys each query sees) is the same on every rank
    work = [sum(i + 1 for i in chunk_indices(64, 4, r).tolist()) for r in range(4)]
    assert len(set(work)) == 1


def test_one_rank_split_is_the_identity_and_masks_are_the_reference():
    from shardlm.model.attention import dense_mask
    cp = ContextParallel(None)
    x = torch.arange(2 * 7).view(2, 7)
    assert torch.equal(cp.shard(x), x)
    docs = torch.tensor([[0, 0, 1, 1, 1, 2, 2], [0, 1, 1, 1, 1, 1, 1]])
    assert torch.equal(cp.masks(7, docs, {3}, "cpu")[3], dense_mask(docs, 3))
    assert torch.equal(cp.rope_positions(2, 7, docs, "cpu"), torch.tensor([[0, 1, 0, 1, 2, 0, 1], [0, 0, 1, 2, 3, 4, 5]]))


def test_padding_past_the_rotary_tables_is_refused():
    cp = ContextParallel(None)
    cp.size = 4
    cp.check_sequence(24, 24)
    with pytest.raises(ConfigError, match=r"train.seq_len=25 split over parallel.cp=4 pads to 32 .* at most 24"):
        cp.check_sequence(25, 30)


@pytest.mark.dist
def test_cp2_attention_equals_one_rank_forward_and_grads(tmp_path):
    out = tmp_path / "cp.json"
    torchrun(2, [str(WORKER), str(out)], timeout=240)
    results = json.loads(out.read_text())
    assert set(results) == {"causal_odd", "block_causal_odd", "sliding_window", "sliding_block_causal_odd"}
    for name, r in results.items():
        for key in ("out", "dq", "dk", "dv"):
            assert r[key] <= 1e-6, (name, key, r[key])
    assert results["causal_odd"]["padding_total"] == 3 and results["sliding_block_causal_odd"]["padding_total"] == 1
    for name in ("block_causal_odd", "sliding_window", "sliding_block_causal_odd"):
        assert results[name]["vs_causal"] > 0.1, name  # documents and windows change the result
