"""The pipeline planner (shardlm/plan/pipeline.py): micro-batches in flight against PyTorch's own schedules,
the bubble, what a stage holds, and ``shardlm plan`` with ``parallel.pp`` > 1. The prediction against a
measured peak: tests/dist/test_planner_measured_peak.py (``test_pipeline_prediction_per_rank``)."""

from __future__ import annotations

import pytest
import torch.distributed.pipelining.schedules as S
from torch.distributed.pipelining.schedules import _ComputationType as C

from conftest import ROOT
from shardlm.config import ConfigError, load_config
from shardlm.plan.param_groups import meta_model
from shardlm.plan.pipeline import bubble_fraction, in_flight, plan_pp_memory, stage_dp
from tolerance import EPS, assert_close

CLASSES = {"interleaved_1f1b": S.ScheduleInterleaved1F1B, "zbv": S.ScheduleZBVZeroBubble,
           "dualpipev": S.ScheduleDualPipeV}
TINY = ["--model.dim=32", "--model.n_layers=8", "--model.n_heads=4", "--model.n_kv_heads=2",
        "--model.ffn_hidden=64", "--model.vocab_size=128", "--model.max_seq_len=32", "--train.seq_len=16",
        "--model.tie_embeddings=false", "--train.global_batch_size=16", "--train.micro_batch_size=2"]


def torch_in_flight(schedule: str, pp: int, m: int) -> list[int]:
    """The most forwards without their backward on each rank, counted on PyTorch's own action lists (its
    private ``_calculate_single_rank_operations``, on an object given only the fields that reads)."""
    cls = CLASSES[schedule]
    o = cls.__new__(cls)
    o.pp_group_size, o.num_stages, o._n_microbatches, o.n_local_stages = pp, 2 * pp, m, 2
    o.number_of_rounds = max(1, m // pp)
    o.microbatches_per_round = m // o.number_of_rounds
    style = "loop" if schedule == "interleaved_1f1b" else "v"
    o.stage_index_to_group_rank = S.generate_stage_to_rank_mapping(pp, 2 * pp, style=style)
    out, last = [], 0
    for rank in range(pp):
        alive, most, alive_last = 0, 0, 0
        for a in o._calculate_single_rank_operations(rank):
            if a is None:
                continue
            kind = a.computation_type
            step = (kind == C.FORWARD) - (kind in (C.FULL_BACKWARD, C.BACKWARD_INPUT))
            alive += step
            most = max(most, alive)
            if a.stage_index == 2 * pp - 1:
                alive_last += step
                last = max(last, alive_last)
        out.append(most)
    return out, last


@pytest.mark.parametrize("schedule", list(CLASSES))
@pytest.mark.parametrize("pp,m", [(2, 4), (2, 8), (4, 8), (4, 16), (8, 16)])
def test_in_flight_matches_pytorchs_schedules(schedule, pp, m):
    """The closed forms equal the counts of torch 2.13's action lists (e.g. interleaved at pp 4: 11, 9, 7, 5;
    zbv 8 on every rank; dualpipev 8, 8, 8, 9), and the last stage holds one micro-batch at a time (what
    plan_pp_memory assumes for a rank holding it beside another stage)."""
    per_rank, last = torch_in_flight(schedule, pp, m)
    assert [in_flight(schedule, pp, m, r) for r in range(pp)] == per_rank
    assert last == 1


def test_in_flight_and_bubble_of_the_single_stage_schedules():
    """GPipe keeps every micro-batch, 1F1B pp - rank; the bubble (pp - 1) / (m + pp - 1), interleaved
    (pp - 1) / (2m + pp - 1)."""
    assert [in_flight("gpipe", 4, 8, r) for r in range(4)] == [8] * 4
    assert [in_flight("1f1b", 4, 8, r) for r in range(4)] == [4, 3, 2, 1]
    assert [in_flight("1f1b", 4, 2, r) for r in range(4)] == [2, 2, 2, 1]
    assert_close(bubble_fraction("1f1b", 4, 8), 3 / 11, rtol=EPS)
    assert_close(bubble_fraction("gpipe", 8, 32), 7 / 39, rtol=EPS)
    assert_close(bubble_fraction("interleaved_1f1b", 4, 8), 3 / 19, rtol=EPS)
    assert_close(bubble_fraction("zbv", 4, 8), 3 / 19, rtol=EPS)


def test_each_rank_holds_its_stages_and_the_schedule_moves_the_activations():
    """PP 4 of 8 blocks: the ranks' parameters sum to the model's, the first holds the embedding's share, the
    last the output's; GPipe's activations are m / in-flight times 1F1B's on the first rank, equal on the
    last; under FSDP 2 x PP 2 the optimizer state is halved by the sharding."""
    cfg = load_config(None, [*TINY, "--parallel.pp=4", '--parallel.pp_schedule="1f1b"'])
    one = plan_pp_memory(cfg, 4)
    gpipe = plan_pp_memory(load_config(None, [*TINY, "--parallel.pp=4", '--parallel.pp_schedule="gpipe"']), 4)
    whole = sum(p.numel() for p in meta_model(cfg).parameters())
    assert sum(x.params for x in one) == whole
    assert [x.layers for x in one] == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert one[0].params == one[1].params + 128 * 32 and one[3].params == one[1].params + 128 * 32 + 32
    assert [x.in_flight for x in one] == [4, 3, 2, 1] and [x.in_flight for x in gpipe] == [8] * 4
    assert gpipe[0].breakdown["activations"] == 2 * one[0].breakdown["activations"]
    assert gpipe[3].breakdown["activations"] == 8 * one[3].breakdown["activations"]
    half = plan_pp_memory(load_config(None, [*TINY, "--parallel.pp=2"]), 4)  # FSDP 2 x PP 2
    full = plan_pp_memory(load_config(None, [*TINY, "--parallel.pp=2"]), 2)  # PP 2
    # halved but for FSDP's dim-0 padding of odd rows and AdamW's step per tensor
    # (measured: 38 bytes of 165,030)
    assert_close(half[1].breakdown["optimizer"], full[1].breakdown["optimizer"] / 2, rtol=1e-3,
                 what="optimizer halved by FSDP 2")


def test_shardlm_plan_prints_each_pipeline_rank(capsys):
    """``shardlm plan`` with ``parallel.pp`` = 8 for Llama 3 70B at 64 ranks: the mesh, the bubble, one row
    per pipeline rank, the verdict on the busiest."""
    from shardlm.cli.main import main as shardlm_main

    assert shardlm_main(["plan", str(ROOT / "configs" / "llama3-70b.toml"), "--world-size", "64",
                         "--parallel.tp=1", "--parallel.pp=8", '--parallel.reduce_dtype="bfloat16"',
                         "--parallel.reshard_after_forward=false", "--train.global_batch_size=256"]) == 0
    out = capsys.readouterr().out
    assert "mesh pp 8 x dp_shard 8: schedule 1f1b, 8 stages, 32 micro-batches" in out
    assert "bubble     17.9% of the step idle" in out
    rows = [r for r in (line.split() for line in out.splitlines()) if len(r) == 12]
    assert [r[0] for r in rows] == [str(i) for i in range(8)]
    assert [r[4] for r in rows] == ["8", "7", "6", "5", "4", "3", "2", "1"]
    # 65.1 GiB before a checkpointed block's recomputed activations were counted in its backward (+2.9 GiB)
    assert out.splitlines()[-1].startswith("  fits: 68.0 GiB on pipeline rank 0")


def test_shardlm_plan_refuses_a_pipeline_training_refuses(capsys):
    """A layout training refuses is refused by the plan with training's message (stages that do not divide
    the blocks), exit status 2."""
    from shardlm.cli.main import main as shardlm_main

    assert shardlm_main(["plan", str(ROOT / "configs" / "llama3-8b.toml"), "--world-size", "16",
                         "--parallel.pp=3", "--parallel.tp=1", "--model.tie_embeddings=false"]) == 2
    assert "3 pipeline stages do not divide model.n_layers=32" in capsys.readouterr().err
    assert shardlm_main(["plan", str(ROOT / "configs" / "llama3-8b.toml"), "--world-size", "16",
                         "--parallel.pp=2", "--parallel.tp=1", "--model.tie_embeddings=false",
                         "--parallel.dp_replicate=2"]) == 2
    err = capsys.readouterr().err
    assert "parallel.dp_replicate=2 with parallel.pp=2: the pipeline planner models" in err


def test_tensor_parallel_within_the_stages():
    """TP 2 x PP 2 of the tiny model at 4 ranks (one data-parallel rank per stage, full checkpointing, fp32),
    each value derived here by hand from the shapes: dim 32, 4 heads of 8 (2 key/value heads), FFN 64,
    vocabulary 128, 8 micro-batches of 2 x 16 tokens per step (B = 32, B / tp = 16 tokens between blocks)."""
    cfg = load_config(None, [*TINY, "--parallel.pp=2", "--parallel.tp=2",
                             '--parallel.activation_checkpoint="full"'])
    first, last = plan_pp_memory(cfg, 4)
    # a block's TP piece: q 1024, k 512, v 512, o 1024, gate/up/down 2048 each, split by 2; 2 norms whole
    block = (1024 + 512 + 512 + 1024 + 3 * 2048) // 2 + 2 * 32
    head = 128 * 32 // 2 + 32  # output projection by vocabulary rows, the final norm whole
    # AdamW: 2 fp32 moments, a step per tensor (9 per block)
    assert last.breakdown["optimizer"] == 8 * (4 * block + head) + 4 * (4 * 9 + 2)
    assert first.breakdown["optimizer"] == 8 * (4 * block + 128 * 32 // 2) + 4 * (4 * 9 + 1)
    hidden = 4 * 16 * 32  # one micro-batch's sequence shard, fp32
    assert first.sent_bytes == last.sent_bytes == 8 * hidden  # 8 micro-batches over the one boundary
    assert last.breakdown["buffers"] == 2 * 4 * 32 * 8 + 8 * hidden  # RoPE tables, a receive buffer each
    # 1F1B: 2 in flight on the first rank (4 blocks' inputs and the stage output kept), 1 on the last (4
    # inputs, the final norm's fp32 normalised x, rsqrt and input, the loss's hidden gradient (every token)
    # and fp32 accumulator of the local 64 vocabulary rows)
    assert first.breakdown["activations"] == 2 * (4 * hidden + hidden)
    loss_kept = 4 * 32 * 32 + 4 * 64 * 32
    assert last.breakdown["activations"] == 4 * hidden + (hidden + 4 * 16 + hidden) + loss_kept
    # a block's backward: SwiGLU gradients on the local FFN width, the gathered output gradient and input
    # partial gradient, beside its recomputed activations (two sequence-parallel norms, attention on 2 query
    # heads and 1 key/value head, residuals on 16 tokens, SwiGLU on 32 of 64) less the kept input
    norms = 2 * (4 * 16 * 32 + 4 * 16 + 4 * 32 * 32)
    attention = 2 * 4 * 32 * 2 * 8 + 2 * 4 * 32 * 1 * 8 + 4 * 2 * 2 * 16
    recomputed = norms + attention + 2 * hidden + 4 * 4 * 32 * 32
    assert last.breakdown["temporaries"] == 2 * 4 * 32 * 32 + 2 * 4 * 32 * 32 + recomputed - hidden
    assert stage_dp(512, 8, 8) == 8
    with pytest.raises(ConfigError, match="parallel.pp=8 x parallel.tp=8 = 64 must divide the world size 96"):
        stage_dp(96, 8, 8)


def test_shardlm_plan_405b_with_tensor_parallel_in_the_stages(capsys):
    """Issue 44's layout: Llama 3.1 405B on 512 H100s, TP 8 within a node, PP 8 (interleaved, 16 stages of 7
    or 8 blocks), FSDP over the other 8, bf16 parameters, full checkpointing: it fits and is compute-bound."""
    from shardlm.cli.main import main as shardlm_main

    assert shardlm_main(["plan", str(ROOT / "configs" / "llama3-70b.toml"), "--world-size", "512", "--device",
                         "h100", "--model-preset", "llama3.1-405b", "--parallel.tp=8", "--parallel.pp=8",
                         '--parallel.pp_schedule="interleaved_1f1b"',
                         "--parallel.pp_layers_per_stage=[7,8,8,8,8,8,8,8,8,8,8,8,8,8,8,7]",
                         "--parallel.reshard_after_forward=false"]) == 0
    out = capsys.readouterr().out
    assert "mesh pp 8 x dp_shard 8 x tp 8: schedule interleaved_1f1b, 16 stages, 8 micro-batches" in out
    assert "; compute-bound: compute outlasts communication" in out
    rows = [r for r in (line.split() for line in out.splitlines()) if len(r) == 13 and r[0].isdigit()]
    assert [r[0] for r in rows] == [str(i) for i in range(8)]
    assert out.splitlines()[-1].startswith("  fits: 51.7 GiB on pipeline rank 4 (steady state")
