"""Combinations of the parallelisms and objectives that are not built together yet: each is refused with one
message naming both settings, before any process group starts and before any data is prepared
(``config.validate``, ``config/layout.py``, ``parallel/dist.py``). Refused today: tensor parallel on a
mixture-of-experts model (context parallel, with or without expert parallel, is built:
tests/dist/test_moe_parallel.py); preference tuning with tensor or context parallel or on a mixture of
experts; tensor parallel under context parallel when a CP rank's tokens do not split evenly over the
tensor-parallel ranks. Context parallel with TP, HSDP and DDP is built (trained against one process in
tests/dist/test_cp_parity.py, and planned by ``shardlm plan``); its layouts are checked here."""

from __future__ import annotations

import pytest

from shardlm.config import ParallelConfig, load_config
from shardlm.config.layout import check_tp
from shardlm.errors import ConfigError
from shardlm.model.config import ModelConfig
from shardlm.parallel.dist import dp_mesh_shape, mesh_dims

MOE = ["--model.family=qwen3_moe", "--model.n_experts=4", "--model.n_experts_per_token=2"]


def test_context_parallel_composes_with_tensor_parallel_hsdp_and_ddp():
    """The mesh is torchtitan's (dp_replicate, dp_shard × cp, tp), tp innermost; CP groups are built beside
    it."""
    assert mesh_dims(ParallelConfig(cp=2, tp=2), 8, 8) == [("dp_shard", 4), ("tp", 2)]
    assert dp_mesh_shape(ParallelConfig(cp=2, tp=2), 8, 8) == (1, 2)  # 2 data-parallel ranks of 2 x 2
    assert mesh_dims(ParallelConfig(cp=2, dp_replicate=2), 4, 4) == [("dp_replicate", 2), ("dp_shard", 2)]
    assert mesh_dims(ParallelConfig(cp=2, mode="ddp"), 4, 4) == [("dp_shard", 4)]
    # a tensor-parallel group stays on one node; a shard group with its CP and TP peers may not straddle nodes
    with pytest.raises(ConfigError, match=r"parallel.tp=4 must divide the 2 ranks of a node"):
        dp_mesh_shape(ParallelConfig(cp=2, tp=4), 8, 2)
    with pytest.raises(ConfigError, match=r"parallel.dp_shard=3 × parallel.cp=2 × parallel.tp=2 does not "
                                          r"divide the 8 ranks of a node"):
        dp_mesh_shape(ParallelConfig(cp=2, tp=2, dp_shard=3, dp_replicate=-1), 24, 8)
    hsdp = ParallelConfig(cp=2, tp=2, dp_shard=2, dp_replicate=-1)
    assert dp_mesh_shape(hsdp, 16, 8) == (2, 2)  # HSDP x CP x TP: a shard group and its peers fill a node


def test_tp_under_cp_needs_a_cp_rank_s_tokens_to_split_evenly():
    cfg = ModelConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=4, ffn_hidden=128, vocab_size=512)
    check_tp(cfg, 4, 12)  # without CP: 12 tokens over 4 ranks
    # under CP 2: 12 tokens pad to 12, 6 per CP rank: not a multiple of tp = 4
    with pytest.raises(ConfigError, match=r"parallel.tp=4 must divide the tokens per context-parallel rank "
                                          r"\(train.seq_len=12 .*/ parallel.cp=2; sequence parallel splits "
                                          r"them\) = 6"):
        check_tp(cfg, 4, 12, cp=2)
    check_tp(cfg, 2, 12, cp=2)  # the control: 6 tokens per CP rank over 2


def test_tensor_parallel_on_a_mixture_of_experts_is_refused_context_parallel_loads():
    message = (r"parallel.tp=2 on a mixture-of-experts model \(model.n_experts=4\) is not built yet: set "
               r"parallel.tp = 1 \(expert parallelism, parallel.ep, splits the experts instead\)")
    with pytest.raises(ConfigError, match=message):
        load_config(None, [*MOE, "--parallel.tp=2"])
    with pytest.raises(ConfigError, match=r"parallel.tp=2 on a mixture-of-experts"):
        load_config(None, [*MOE, "--parallel.tp=2", "--parallel.cp=2"])  # CP does not lift TP's refusal
    load_config(None, MOE)  # the controls: the MoE model alone loads, and with CP (test_moe_parallel)
    assert load_config(None, [*MOE, "--parallel.cp=2", "--parallel.ep=2"]).parallel.cp == 2


@pytest.mark.parametrize("extra,what,fix",
                         [(["--parallel.tp=2"], "parallel.tp=2", "set parallel.tp = 1 "),
                          (["--parallel.cp=2"], "parallel.cp=2", "set parallel.cp = 1 "),
                          (["--parallel.tp=2", "--parallel.cp=2"], "parallel.tp=2 and parallel.cp=2",
                           "set parallel.tp = 1 and parallel.cp = 1 "),
                          (MOE, r"a mixture-of-experts model \(model.n_experts=4\)", "tune a dense model")])
def test_preference_tuning_with_tp_cp_or_moe_is_refused(extra, what, fix):
    """The refusal says what to change; it advised "use FSDP (parallel.mode = 'fsdp')" to users already on
    FSDP (the default), whose fix is parallel.tp = 1."""
    with pytest.raises(ConfigError,
                       match=rf"preference tuning \(data.format = 'preference'\) with {what} is not "
                                          rf"built yet: {fix}") as refused:
        load_config(None, ["--data.format=preference", *extra])
    assert "parallel.mode" not in str(refused.value)


def test_a_global_batch_that_cp_x_tp_data_parallel_ranks_cannot_split_names_both():
    from shardlm.config import Config, gradient_accumulation_steps

    cfg = Config()
    cfg.parallel.cp, cfg.parallel.tp, cfg.train.global_batch_size, cfg.train.micro_batch_size = 2, 2, 3, 1
    with pytest.raises(ConfigError, match=r"train.global_batch_size=3 must be divisible by world size × "
                                          r"train.micro_batch_size = 2 × 1 = 2 \(the data-parallel world "
                                          r"size: world size / parallel.cp=2 × parallel.tp=2\)"):
        gradient_accumulation_steps(cfg, 2)
    cfg.train.global_batch_size = 4
    assert gradient_accumulation_steps(cfg, 2) == 2


def test_the_planner_refuses_a_world_size_that_cp_x_tp_does_not_divide_naming_both():
    from shardlm.config import Config
    from shardlm.plan import plan_memory

    cfg = Config()
    cfg.train.seq_len = cfg.model.max_seq_len = 1024
    cfg.train.global_batch_size, cfg.train.micro_batch_size = 1, 1
    cfg.parallel.cp, cfg.parallel.tp = 2, 2
    with pytest.raises(ConfigError, match=r"parallel.cp=2 × parallel.tp=2 = 4 must divide the world size 6"):
        plan_memory(cfg, 6, "cpu")  # 6 is a multiple of cp and of tp, not of both
    # the control: CP x TP is planned (tests/dist/test_cp_parity.py: how)
    assert plan_memory(cfg, 4, "cpu").peak > 0


@pytest.mark.parametrize("overrides,message", [
    (["--parallel.tp=2", "--model.n_kv_heads=1"],
     r"parallel.tp=2 must divide the key/value heads \(model.n_kv_heads\) = 1: each tensor-parallel rank "),
    (["--parallel.tp=2", "--model.vocab_size=511"], r"parallel.tp=2 must divide model.vocab_size = 511"),
    (["--parallel.tp=2", "--lora.enabled=true"], r"parallel.tp=2 with lora.enabled is not supported"),
    ([*MOE, "--parallel.ep=3"], r"parallel.ep=3 must divide model.n_experts=4"),
    (["--parallel.ep=2"], r"parallel.ep=2 needs a mixture of experts"),
])
def test_a_split_the_model_cannot_take_is_refused_when_the_config_loads(overrides, message):
    """The tensor- and expert-parallel sizes are checked with the configuration (same messages as the
    model's build): before, a tp not dividing the key/value heads was refused after the data was prepared."""
    base = ["--model.dim=64", "--model.n_heads=4", "--model.n_kv_heads=2", "--model.ffn_hidden=128",
            "--model.vocab_size=512", "--train.seq_len=32"]
    load_config(None, base + ["--parallel.tp=2"])  # the control: this split loads
    with pytest.raises(ConfigError, match=message):
        load_config(None, base + overrides)


def test_an_expert_split_the_ranks_cannot_take_is_refused_before_any_data_is_prepared(tmp_path, capsys):
    """A run whose parallel.ep does not divide its ranks (what the configuration cannot know) stops before
    preparing data: no data directory is written. It was refused when the model was built, after."""
    from conftest import tiny_overrides
    from shardlm.cli.train import main as train_main

    data = tmp_path / "data"
    code = train_main(tiny_overrides(data, tmp_path / "run") + [*MOE, "--parallel.ep=2",
                                                                 "--parallel.device=cpu"])
    err = capsys.readouterr().err
    assert code == 2 and "error: parallel.ep=2 must divide the data-parallel ranks (1)" in err, err
    assert not data.exists()


def test_the_checks_that_need_the_ranks_name_the_setting():
    """What the Trainer checks against the ranks before preparing data (the model's build checked it after):
    one process's mode on two ranks, an expert-parallel degree the ranks cannot take."""
    from shardlm.config.layout import check_ranks

    single = load_config(None, ["--parallel.mode=single"])
    check_ranks(single, 1)
    with pytest.raises(ConfigError, match=r"parallel.mode='single' runs one process, but the world size is "
                                          "2"):
        check_ranks(single, 2)
    moe = load_config(None, [*MOE, "--parallel.ep=2"])
    check_ranks(moe, 4)
    with pytest.raises(ConfigError, match=r"parallel.ep=2 must divide the data-parallel ranks \(3\)"):
        check_ranks(moe, 3)
