"""Pipeline parallel's layout checks and refusals (one message each, before any data is prepared), the
stage plan and the pruned model: no torchrun (tests/dist/test_pp_parity.py runs the pipelines)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from shardlm.config import load_config
from shardlm.config.layout import check_ranks
from shardlm.errors import ConfigError
from shardlm.model.decoder import CausalLM
from shardlm.parallel.dist import DistInfo, data_parallel_rank, mesh_dims
from shardlm.parallel.pp import apply_pp, stage_plan
from shardlm.plan.pipeline import plan_pp_memory
from shardlm.train.objectives.objective import Objective
from tolerance import assert_close

TINY = ["--model.dim=32", "--model.n_layers=4", "--model.n_heads=4", "--model.n_kv_heads=2",
        "--model.ffn_hidden=64", "--model.vocab_size=128", "--model.max_seq_len=32", "--train.seq_len=16"]


def refusal(overrides: list[str], world_size: int | None = None) -> str:
    with pytest.raises(ConfigError) as err:
        cfg = load_config(None, TINY + overrides)
        if world_size is not None:
            check_ranks(cfg, world_size)
    return str(err.value)


@pytest.mark.parametrize("overrides,world,words", [
    (["--parallel.pp=3"], None, "3 pipeline stages do not divide model.n_layers=4"),
    (["--parallel.pp=2", '--parallel.pp_schedule="interleaved_1f1b"', "--model.n_layers=6"], None,
     "4 pipeline stages do not divide model.n_layers=6"),
    (["--parallel.pp=2", "--parallel.pp_layers_per_stage=[1, 2]"], None,
     "parallel.pp_layers_per_stage=[1, 2] must give 2 stages of at least one block each, summing to "
     "model.n_layers=4"),
    (["--parallel.pp=2", "--train.global_batch_size=8", "--train.micro_batch_size=8"], 2,
     "parallel.pp_schedule='1f1b' at parallel.pp=2 needs at least 2 micro-batches per step, but the step "
     "has 1"),
    (["--parallel.pp=2", '--data.format="preference"'], None,
     "pipeline parallel (parallel.pp=2) with preference tuning (data.format = 'preference') is not built"),
    (["--parallel.pp=2", "--model.tie_embeddings=true"], None, "with tied embeddings"),
    (["--parallel.pp=2", "--lora.enabled=true"], None, "with LoRA"),
    (["--parallel.pp=2", "--parallel.cp=2"], None, "with context parallel (parallel.cp=2)"),
    (["--parallel.pp=2", '--parallel.pp_schedule="dualpipev"', "--train.global_batch_size=8",
      "--train.micro_batch_size=4"], 2,
     "parallel.pp_schedule='dualpipev' at parallel.pp=2 needs at least 4 micro-batches per step, but the "
     "step has 2"),
    (["--parallel.pp=2"], 3, "parallel.pp=2 must divide the world size 3"),
])
def test_bad_pipeline_layouts_are_refused_by_name(overrides, world, words):
    assert words in refusal(overrides, world)


def test_gpipe_takes_fewer_micro_batches_than_stages():
    """GPipe runs one micro-batch per step at PP 2 (no bound); the data-parallel rank is the one within a
    stage, and the mesh has ``pp`` outermost."""
    cfg = load_config(None, TINY + ["--parallel.pp=2", '--parallel.pp_schedule="gpipe"',
                                    "--train.global_batch_size=8", "--train.micro_batch_size=4"])
    check_ranks(cfg, 4)
    assert mesh_dims(cfg.parallel, 4, 4) == [("pp", 2), ("dp_shard", 2)]
    info = [DistInfo(r, r, 4, torch.device("cpu"), "gloo") for r in range(4)]
    assert [data_parallel_rank(i, cfg.parallel) for i in info] == [(0, 2), (1, 2), (0, 2), (1, 2)]


@pytest.mark.parametrize("schedule", ["1f1b", "zbv"])
def test_tensor_parallel_within_stages_is_accepted(schedule):
    """TP 2 x PP 2 at 4 ranks: accepted under a looped and a V schedule; the mesh is ``pp, dp_shard, tp``
    (tp innermost), the two ranks of a tensor-parallel group read the same samples; the pipeline planner
    plans it (one row per pipeline rank) and refuses by name the checkpointing it does not model under TP."""
    cfg = load_config(None, TINY + ["--parallel.pp=2", "--parallel.tp=2",
                                    f'--parallel.pp_schedule="{schedule}"', "--train.global_batch_size=8",
                                    "--train.micro_batch_size=2"])
    check_ranks(cfg, 4)
    assert mesh_dims(cfg.parallel, 4, 4) == [("pp", 2), ("dp_shard", 1), ("tp", 2)]
    info = [DistInfo(r, r, 4, torch.device("cpu"), "gloo") for r in range(4)]
    assert [data_parallel_rank(i, cfg.parallel) for i in info] == [(0, 1)] * 4
    assert [x.rank for x in plan_pp_memory(cfg, 4)] == [0, 1]
    selective = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel,
                                                                       activation_checkpoint="selective"))
    with pytest.raises(ConfigError, match="planner models tensor parallel with parallel.activation_"):
        plan_pp_memory(selective, 4)


def test_an_objective_without_a_pipeline_form_is_refused_by_name():
    """Preference tuning, RL or any objective of one's own: refused under PP, naming the objective."""
    class Rewarded(Objective):
        name = "GRPO"

        def prepare_step(self, step, micro_ids, step_ids):
            raise AssertionError

        def loss(self, model, batch, ids, inputs):
            raise AssertionError

    with pytest.raises(ConfigError, match="the GRPO objective is not built for it: set parallel.pp = 1"):
        Rewarded().pipeline_batch(torch.zeros(1, 2, dtype=torch.int64))


@pytest.mark.parametrize("schedule,pp,ids", [("1f1b", 2, [(0,), (1,)]),
                                             ("interleaved_1f1b", 2, [(0, 2), (1, 3)]),
                                             ("zbv", 2, [(0, 3), (1, 2)])])
def test_stage_plans(schedule, pp, ids):
    """Looped stages (s mod pp) and V stages (r and 2·pp - 1 - r); a stage's owner is the rank holding it."""
    plans = [stage_plan(8, pp, r, schedule) for r in range(pp)]
    assert [p.stage_ids for p in plans] == ids
    for r, p in enumerate(plans):
        assert all(p.owner(s) == r for s in p.stage_ids)
    assert [list(r) for r in plans[0].layers] == [list(range(i, i + 8 // len(plans[0].layers) ))
                                                  for i in range(0, 8, 8 // len(plans[0].layers))]


def test_stages_chained_equal_the_whole_model():
    """The parts of PP 2 (interleaved: 4 stages on 2 ranks) run one after the other give the whole model's
    logits (fp32, 8 roundings of the largest), and the parts hold the whole model's names, each once."""
    cfg = load_config(None, TINY).model
    whole = CausalLM(cfg)
    whole.init_weights(0)
    tokens = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    names = []
    parts = {}
    for rank in range(2):
        plan = stage_plan(4, 2, rank, "interleaved_1f1b")
        model = CausalLM(cfg)
        model.load_state_dict(whole.state_dict(), strict=False)
        model.init_rotary()
        for s, part in zip(plan.stage_ids, apply_pp(model, plan)):
            parts[s] = part
        names += [n for n, _ in model.named_parameters()]
    assert sorted(names) == sorted(n for n, _ in whole.named_parameters())
    h = tokens
    with torch.no_grad():
        for s in range(4):
            h = parts[s](h)
        ref = whole(tokens)
    assert_close(h, ref, rtol=8 * 2.0 ** -23, what="chained stages' logits")
