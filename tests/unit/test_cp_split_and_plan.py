"""Context parallelism (shardlm/parallel/cp.py) in one process: the load-balanced split, its masks, the
refusals, and the planner's share of the sequence per rank. Attention and training across CP ranks are in
tests/dist/test_cp_parity.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from shardlm.errors import ConfigError
from shardlm.parallel.cp import ContextParallel, chunk_indices, gathered_indices, padded_length


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
    assert cp.masks(7, None, {0, 7}, "cpu") == {0: None, 7: None}  # causal by position: no mask needed
    assert torch.equal(cp.rope_positions(2, 7, docs, "cpu"), torch.tensor([[0, 1, 0, 1, 2, 0, 1], [0, 0, 1, 2, 3, 4, 5]]))


def test_a_sequence_shorter_than_cp_is_refused_and_padding_may_pass_the_tables():
    cp = ContextParallel(None)
    cp.size = 4
    cp.check_sequence(4)
    with pytest.raises(ConfigError, match=r"train.seq_len=3 is shorter than parallel.cp=4: .* at least 4 tokens"):
        cp.check_sequence(3)
    # a 63-token sequence of a 64-position model pads to 64 at cp 4 and to 72 at cp 6: padding takes position 0
    cp.size = 6
    assert cp.shard(torch.arange(63).view(1, 63)).shape == (1, 12)
    cp.rank = 0
    assert cp.rope_positions(1, 63, None, "cpu").max().item() < 64


def test_cp_not_dividing_the_world_size_is_one_clear_error():
    from shardlm.config import Config, ParallelConfig, validate
    from shardlm.parallel.dist import dp_mesh_shape

    with pytest.raises(ConfigError, match=r"parallel.cp=3 must divide the world size 4 \(each sequence is split"):
        dp_mesh_shape(ParallelConfig(cp=3), 4, 4)
    assert dp_mesh_shape(ParallelConfig(cp=2), 4, 4) == (1, 2)  # 2 data-parallel ranks of 2 CP ranks each
    cfg = Config()
    cfg.parallel.cp, cfg.parallel.mode = 2, "single"
    with pytest.raises(ConfigError, match="parallel.cp must be >= 1 .* and 1 in parallel.mode='single', got 2"):
        validate(cfg)


def test_planner_counts_a_rank_s_share_of_the_sequence():
    from shardlm.config import Config
    from shardlm.plan import plan_memory

    cfg = Config()
    cfg.train.seq_len = cfg.model.max_seq_len = 1024
    cfg.train.global_batch_size, cfg.train.micro_batch_size = 2, 1
    fsdp = plan_memory(cfg, 2, "cpu")
    cfg.parallel.cp, cfg.train.global_batch_size = 2, 1
    cp = plan_memory(cfg, 2, "cpu")
    # same parameters and state per rank; activations of 512 tokens per rank plus attention over all 1024
    assert cp.breakdown["params"] == fsdp.breakdown["params"] and cp.breakdown["optimizer"] == fsdp.breakdown["optimizer"]
    assert 0.5 * fsdp.breakdown["activations"] < cp.breakdown["activations"] < 0.8 * fsdp.breakdown["activations"]


def test_plan_llama3_8b_at_128k_tokens_on_8_h100s_with_cp8(capsys):
    from shardlm.cli.main import main as shardlm_main

    config = str(Path(__file__).resolve().parents[2] / "configs" / "llama3-8b.toml")
    args = ["plan", config, "--world-size", "8", "--device", "h100", "--train.seq_len=131072",
            "--model.max_seq_len=131072", "--train.global_batch_size=1", "--train.micro_batch_size=1",
            "--parallel.activation_checkpoint=full"]
    capsys.readouterr()
    assert shardlm_main([*args, "--parallel.cp=8"]) == 0
    out = capsys.readouterr().out
    assert "context parallel 8: each sequence split over 8 ranks, 16,384 tokens per rank" in out and "  fits:" in out
    cp8 = float(out.split("activations (saved for backward)")[1].split()[0])
    assert shardlm_main([*args, "--train.global_batch_size=8"]) == 0  # no CP: a 128k sequence on every rank
    out = capsys.readouterr().out
    assert "does not fit" in out
    assert float(out.split("activations (saved for backward)")[1].split()[0]) > 5 * cp8  # 55.6 against 9.3 GiB
