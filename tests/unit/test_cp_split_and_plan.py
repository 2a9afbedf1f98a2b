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
    assert torch.equal(cp.dense_mask(cp.masks(7, docs, {3}, "cpu")[3], 7, "cpu"), dense_mask(docs, 3))
    assert cp.masks(7, None, {0, 7}, "cpu") == {0: None, 7: None}  # causal by position: no mask needed
    assert torch.equal(cp.rope_positions(2, 7, docs, "cpu"),
                       torch.tensor([[0, 1, 0, 1, 2, 0, 1], [0, 0, 1, 2, 3, 4, 5]]))


@pytest.mark.parametrize("window,with_docs", [(0, False), (0, True), (5, False), (3, True)])
def test_blockwise_blocks_cover_exactly_the_keys_each_query_sees(window, with_docs):
    """Each rank's blocks (diagonal first, masks one block at a time, hidden blocks skipped) put together
    are its rows of the one-rank reference mask over the padded sequence, at cp 2 and 3."""
    from shardlm.model.attention import dense_mask
    from shardlm.parallel.cp_attention import blocks, global_chunk, ring_steps

    t = 23
    docs = torch.tensor([[0] * 9 + [1] * 3 + [2] * 11, [0] * 10 + [1] * 13]) if with_docs else None
    for size in (2, 3):
        cp = ContextParallel(None)
        cp.size = size
        t_pad, c = padded_length(t, size), padded_length(t, size) // (2 * size)
        spec = cp.masks(t, docs, {window}, "cpu")[window]
        assert (spec is None) == (window == 0 and not with_docs)
        # without documents padding attends causally like any token (no real query sees it: it comes last)
        padded = spec.documents if with_docs else torch.zeros(2, t_pad, dtype=torch.int64)
        reference = dense_mask(padded, window)[:, 0]
        skipped = 0
        for rank in range(size):
            cp.rank = rank
            built = torch.zeros(2, 2 * c, t_pad, dtype=torch.bool)
            steps = ring_steps(size, rank, c, spec, torch.device("cpu"))
            # ring step s holds CP rank (rank - s) % size's two chunks; the same blocks as all at once
            assert all(blk.key // 2 == (rank - s) % size for s, step in enumerate(steps) for blk in step)
            seen = [blk for step in steps for blk in step]
            assert sorted((b.query, b.key) for b in seen) == sorted(
                (b.query, b.key) for b in blocks(size, rank, c, spec, torch.device("cpu")))
            for blk in seen:
                k0, rows = global_chunk(blk.key, size) * c, slice(blk.query * c, (blk.query + 1) * c)
                part = torch.ones(c, c, dtype=torch.bool)
                part = part.tril() if blk.causal else part
                built[:, rows, k0:k0 + c] = part if blk.mask is None else blk.mask[:, 0]
            firsts = {b.query: b for b in reversed(seen)}  # each query chunk's first block: its diagonal
            assert [global_chunk(firsts[q].key, size) for q in (0, 1)] == [rank, 2 * size - 1 - rank]
            assert torch.equal(built, reference[:, cp.local_indices(t_pad)]), (size, rank)
            skipped += sum(1 for q_chunk in (rank, 2 * size - 1 - rank) for p in range(2 * size)
                           if global_chunk(p, size) <= q_chunk) - len(seen)
        assert (skipped > 0) == (window > 0 or with_docs)  # windows and documents leave blocks out


def test_a_sequence_shorter_than_cp_is_refused_and_padding_may_pass_the_tables():
    cp = ContextParallel(None)
    cp.size = 4
    cp.check_sequence(4)
    with pytest.raises(ConfigError,
                       match=r"train.seq_len=3 is shorter than parallel.cp=4: .* at least 4 tokens"):
        cp.check_sequence(3)
    # a 63-token sequence of a 64-position model pads to 64 at cp 4 and to 72 at cp 6: padding takes
    # position 0
    cp.size = 6
    assert cp.shard(torch.arange(63).view(1, 63)).shape == (1, 12)
    cp.rank = 0
    assert cp.rope_positions(1, 63, None, "cpu").max().item() < 64


def test_cp_not_dividing_the_world_size_is_one_clear_error():
    from shardlm.config import Config, ParallelConfig, validate
    from shardlm.parallel.dist import dp_mesh_shape

    with pytest.raises(ConfigError,
                       match=r"parallel.cp=3 must divide the world size 4 \(each sequence is split"):
        dp_mesh_shape(ParallelConfig(cp=3), 4, 4)
    assert dp_mesh_shape(ParallelConfig(cp=2), 4, 4) == (1, 2)  # 2 data-parallel ranks of 2 CP ranks each
    # the mesh under CP covers world / cp ranks: the message names both (it said "the world size 1" at 2)
    with pytest.raises(ConfigError, match=r"parallel.tp=2 must divide the world size 2 / parallel.cp=2 = 1"):
        dp_mesh_shape(ParallelConfig(cp=2, tp=2), 2, 2)
    with pytest.raises(ConfigError, match=r"= 1 × 3 = 3, but the world size is 4 / parallel.cp=2 = 2: the"):
        dp_mesh_shape(ParallelConfig(cp=2, dp_shard=3), 4, 4)
    cfg = Config()
    cfg.parallel.cp, cfg.parallel.mode = 2, "single"
    with pytest.raises(ConfigError,
                       match="parallel.cp must be >= 1 .* and 1 in parallel.mode='single', got 2"):
        validate(cfg)


def test_planner_counts_a_rank_s_share_of_the_sequence():
    from shardlm.config import Config
    from shardlm.plan import plan_memory

    cfg = Config()
    cfg.train.seq_len = cfg.model.max_seq_len = 1024
    cfg.model.attention = "causal"  # the causal path (unprepared text data under "auto" plans block-causal)
    cfg.train.global_batch_size, cfg.train.micro_batch_size = 2, 1
    fsdp = plan_memory(cfg, 2, "cpu")
    cfg.parallel.cp, cfg.train.global_batch_size = 2, 1
    cp = plan_memory(cfg, 2, "cpu")
    # same parameters and state per rank; blockwise attention (the CPU's): activations of 512 tokens per rank
    assert (
        cp.breakdown["params"] == fsdp.breakdown["params"]
        and cp.breakdown["optimizer"] == fsdp.breakdown["optimizer"]
    )
    assert 0.5 < cp.breakdown["activations"] / fsdp.breakdown["activations"] < 0.51
    # the fallback (a GPU: no log-sum-exp kernel wired) keeps attention over all 1024 tokens on CP rank 0
    gpu_cp = plan_memory(cfg, 2, "h100")
    cfg.parallel.cp, cfg.train.global_batch_size = 1, 2
    gpu_fsdp = plan_memory(cfg, 2, "h100")
    assert 0.55 < gpu_cp.breakdown["activations"] / gpu_fsdp.breakdown["activations"] < 0.8
    assert ContextParallel(None, "cpu").kernels is not None and ContextParallel(None, "cuda").kernels is None
    assert "blockwise" in ContextParallel(None, "cpu").attention_path
    assert "fallback" in ContextParallel(None, "cuda").attention_path


def test_a_cp_rank_s_moe_layers_count_only_its_real_tokens():
    """shard_batch gives each rank its slice of the real-token mask, CP's padding False: 10 tokens padded to
    12 at CP 2, rank 0 holds global positions 0-2 and 9-11 (10 and 11 padding), rank 1 positions 3-8; with the
    data's own padding (row 1 real up to position 4) its slice too. No padding at all: no mask."""
    from shardlm.model.moe import MoE
    inputs = torch.arange(20).view(2, 10)
    data_real = torch.arange(10).expand(2, 10) < torch.tensor([[10], [5]])
    for rank, want, want_data in (
        (0, [[True] * 4 + [False] * 2] * 2, [[True] * 4 + [False] * 2, [True] * 3 + [False] * 3]),
        (1, [[True] * 6] * 2, [[True] * 6, [True] * 2 + [False] * 4]),
    ):
        cp = ContextParallel(None)
        cp.size, cp.rank = 2, rank
        x, _, extra = cp.shard_batch(inputs, inputs, None)
        assert x.shape == (2, 6) and extra["real_tokens"].tolist() == want
        _, _, extra_data = cp.shard_batch(inputs, inputs, None, data_real)
        assert extra_data["real_tokens"].tolist() == want_data
        layer = MoE(8, 4, 8, 2)
        layer(torch.randn(2, 6, 8), extra["real_tokens"])
        assert layer.stats.tokens == (8 if rank == 0 else 12)
    cp = ContextParallel(None)
    cp.size, cp.rank = 2, 0
    assert "real_tokens" not in cp.shard_batch(inputs[:, :8], inputs[:, :8], None)[2]


@pytest.mark.parametrize("ep", [1, 2])
def test_planner_counts_a_rank_s_share_of_a_mixture_of_experts_sequence(ep):
    """A MoE model (with and without expert parallel) under CP 2: the router, sorted token copies and
    all-to-all buffers of plan/moe.py are counted at the rank's 512 of 1024 tokens, as the rest of its
    activations."""
    from shardlm.config import load_config
    from shardlm.plan import plan_memory

    moe = ["--model.family=qwen3_moe", "--model.n_experts=8", "--model.n_experts_per_token=2",
           "--model.moe_ffn_hidden=256", "--train.seq_len=1024", "--model.max_seq_len=1024",
           "--model.attention=causal", "--train.micro_batch_size=1", f"--parallel.ep={ep}"]
    fsdp = plan_memory(load_config(None, [*moe, "--train.global_batch_size=2"]), 2, "cpu")
    cp = plan_memory(load_config(None, [*moe, "--train.global_batch_size=1", "--parallel.cp=2"]), 2, "cpu")
    for part in ("params", "optimizer"):
        assert cp.breakdown[part] == fsdp.breakdown[part]
    assert 0.5 < cp.breakdown["activations"] / fsdp.breakdown["activations"] < 0.51


def test_plan_llama3_8b_at_128k_tokens_on_8_h100s_with_cp8(capsys):
    from shardlm.cli.main import main as shardlm_main

    config = str(Path(__file__).resolve().parents[2] / "configs" / "llama3-8b.toml")
    args = ["plan", config, "--world-size", "8", "--device", "h100", "--train.seq_len=131072",
            "--model.max_seq_len=131072", "--train.global_batch_size=1", "--train.micro_batch_size=1",
            "--parallel.activation_checkpoint=full", "--model.attention=causal"]  # CP's causal path (no mask)
    capsys.readouterr()
    assert shardlm_main([*args, "--parallel.cp=8"]) == 0
    out = capsys.readouterr().out
    assert (
        "context parallel 8: each sequence split over 8 ranks, 16,384 tokens per rank" in out
        and "  fits:" in out
    )
    cp8 = float(out.split("activations (saved for backward)")[1].split()[0])
    assert shardlm_main([*args, "--train.global_batch_size=8"]) == 0  # no CP: a 128k sequence on every rank
    out = capsys.readouterr().out
    assert "does not fit" in out
    # 55.6 against 9.3 GiB
    assert float(out.split("activations (saved for backward)")[1].split()[0]) > 5 * cp8


LLAMA3_8B_128K = ["--train.seq_len=131072", "--model.max_seq_len=131072", "--train.micro_batch_size=1",
                  "--parallel.activation_checkpoint=full", "--model.attention=causal"]  # CP's causal path


@pytest.mark.parametrize("cp,tp", [(8, 1), (4, 2), (2, 4)])
def test_plan_of_cp_x_tp_is_tp_s_at_a_cp_rank_s_tokens_plus_one_block_of_cp_attention_on_its_heads(cp, tp):
    """Under full checkpointing every block keeps only its input, so CP adds to what the same TP layout
    holds at a CP rank's 131072 / cp tokens only the forward's rotary gathers and, in the one block
    recomputed at the peak, the fallback's attention rows (a GPU: on CP rank 0 q and output up to T_pad, the
    gathered K/V) on that rank's n_heads / tp and kv / tp heads. At tp = 1 this is plain CP's rule."""
    from shardlm.config import load_config
    from shardlm.plan import activations as act
    from shardlm.plan import plan_memory
    from shardlm.plan.context_parallel import cp_block_extra_saved, cp_forward_saved

    config = str(Path(__file__).resolve().parents[2] / "configs" / "llama3-8b.toml")
    split = load_config(config, [*LLAMA3_8B_128K, f"--parallel.cp={cp}", f"--parallel.tp={tp}",
                                 "--train.global_batch_size=1"])
    local = load_config(config, [*LLAMA3_8B_128K, f"--parallel.tp={tp}", f"--train.seq_len={131072 // cp}",
                                 f"--train.global_batch_size={8 // tp}"])
    with_cp, without = plan_memory(split, 8, "h100"), plan_memory(local, 8, "h100")
    assert with_cp.phase == without.phase == "micro-batch 1/1 backward block 31"
    # a model of the local heads, built as its own config (not by the planner's tp_local_heads)
    heads = load_config(config, [f"--model.n_heads={32 // tp}", f"--model.n_kv_heads={8 // tp}",
                                 "--model.head_width=128"])
    s = act.shape_of(heads.model, 1, 131072 // cp, 2)
    assert (s.h, s.kv, s.hd) == (32 // tp, 8 // tp, 128)
    extra = cp_block_extra_saved(s, 131072, False, False) + cp_forward_saved(s, 131072, 0, False, False)
    assert extra > 0.25 * 2**30 // tp  # the fallback's rows up to T_pad: not a negligible term
    assert with_cp.breakdown["activations"] - without.breakdown["activations"] == extra
    assert with_cp.breakdown["params"] == without.breakdown["params"]
    assert with_cp.breakdown["optimizer"] == without.breakdown["optimizer"]


def test_plan_llama3_8b_at_128k_on_8_h100s_with_cp4_x_tp2_is_near_cp8_and_fits(capsys):
    from shardlm.cli.main import main as shardlm_main

    config = str(Path(__file__).resolve().parents[2] / "configs" / "llama3-8b.toml")
    args = ["plan", config, "--world-size", "8", "--device", "h100", *LLAMA3_8B_128K,
            "--train.global_batch_size=1"]
    capsys.readouterr()
    planned = {}
    for layout in (["--parallel.cp=8"], ["--parallel.cp=4", "--parallel.tp=2"]):
        assert shardlm_main([*args, *layout]) == 0
        out = capsys.readouterr().out
        assert "  fits:" in out, out
        planned[len(layout)] = float(out.split("activations (saved for backward)")[1].split()[0])
    assert ("context parallel 4: each sequence split over 4 ranks, 32,768 tokens per rank (16,384 between "
            "the blocks: sequence parallel over tp 2)") in out
    assert "mesh dp_shard 4 x tp 2: tensor parallel 2" in out
    # both hold 16,384 tokens per rank between the blocks (the 32 checkpointed inputs: 4 GiB each way); in
    # the recomputed block CP 4 x TP 2 has twice the tokens on half the heads and FFN width (the same bytes)
    # but all-gathers its norms' outputs over 32,768 tokens, while the fallback's rows up to T_pad (CP rank
    # 0's q and output, the gathered K/V) are on half the heads: 8.30 against 9.29 GiB (was 75.6: CP's
    # attention charged to all 32 checkpointed blocks, on all the heads)
    assert 0.8 < planned[2] / planned[1] < 1.0, planned
