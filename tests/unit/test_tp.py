"""Tensor parallel (``parallel.tp``) in one process: the mesh dims, the samples TP peers read, bad layouts and
models refused with one message each, async TP's refusal on CPU, and the planner's TP plan and communication
formula. TP across ranks is in tests/dist/test_tp_parity.py."""

from __future__ import annotations

import pytest
import torch

from conftest import ROOT
from shardlm.config import ParallelConfig, load_config
from shardlm.config.layout import check_tp
from shardlm.errors import ConfigError
from shardlm.model.config import ModelConfig
from shardlm.parallel.dist import data_parallel_rank, dp_mesh_shape, mesh_dims


# ---- the mesh and bad input: one message each, no launch ---------------------------------------------------
@pytest.mark.parametrize("replicate,shard,tp,world,per_node,dims", [
    (1, -1, 2, 4, 4, [("dp_shard", 2), ("tp", 2)]),
    (2, -1, 2, 8, 4, [("dp_replicate", 2), ("dp_shard", 2), ("tp", 2)]),
    (1, -1, 8, 64, 8, [("dp_shard", 8), ("tp", 8)]),
    (1, 1, 2, 2, 2, [("dp_shard", 1), ("tp", 2)]),
    (1, -1, 1, 4, 4, [("dp_shard", 4)]),
])
def test_mesh_dims_put_tp_innermost(replicate, shard, tp, world, per_node, dims):
    pcfg = ParallelConfig(dp_replicate=replicate, dp_shard=shard, tp=tp)
    assert mesh_dims(pcfg, world, per_node) == dims


def test_tp_peers_read_the_same_samples():
    from shardlm.parallel.dist import DistInfo

    info = [DistInfo(r, r, 8, torch.device("cpu"), "gloo") for r in range(8)]
    assert [data_parallel_rank(i, ParallelConfig(tp=2)) for i in info] == [(r // 2, 4) for r in range(8)]


@pytest.mark.parametrize("replicate,shard,tp,world,per_node,message", [
    (1, 3, 2, 4, 4,
     "parallel.dp_replicate × parallel.dp_shard × parallel.tp = 1 × 3 × 2 = 6, but the world size "
                    "is 4"),
    (1, -1, 3, 4, 4, "parallel.tp=3 must divide the world size 4"),
    (1, -1, 4, 8, 2, "parallel.tp=4 must divide the 2 ranks of a node"),
    (1, -1, 4, 12, 6, "parallel.tp=4 must divide the 6 ranks of a node"),
    (3, -1, 2, 8, 8, "parallel.dp_replicate=3 must divide the 4 data-parallel ranks (the world size 8 / "
                     "parallel.tp=2)"),
])
def test_bad_tp_mesh(replicate, shard, tp, world, per_node, message):
    with pytest.raises(ConfigError) as e:
        dp_mesh_shape(ParallelConfig(dp_replicate=replicate, dp_shard=shard, tp=tp), world, per_node)
    assert message in str(e.value)


@pytest.mark.parametrize("shape,seq_len,message", [
    (dict(n_heads=6, n_kv_heads=6, dim=48), 32, "parallel.tp=4 must divide model.n_heads = 6"),
    (dict(n_heads=8, n_kv_heads=2), 32,
     "parallel.tp=4 must divide the key/value heads (model.n_kv_heads) = 2"),
    (dict(ffn_hidden=90), 32, "parallel.tp=4 must divide the FFN width (model.ffn_hidden) = 90"),
    (dict(vocab_size=510), 32, "parallel.tp=4 must divide model.vocab_size = 510"),
    (dict(), 30, "parallel.tp=4 must divide train.seq_len (sequence parallel splits the tokens) = 30"),
])
def test_bad_tp_model(shape, seq_len, message):
    cfg = ModelConfig(**{"dim": 64, "n_heads": 8, "n_kv_heads": 4, "ffn_hidden": 128, "vocab_size": 512,
                         **shape})
    with pytest.raises(ConfigError) as e:
        check_tp(cfg, 4, seq_len)
    assert message in str(e.value)
    check_tp(cfg, 1, seq_len)  # tp = 1 checks nothing


def test_tp_refusals_in_the_config():
    cfg = ModelConfig(dim=64, n_heads=4, n_kv_heads=2, ffn_hidden=128, vocab_size=512)
    with pytest.raises(ConfigError, match="parallel.tp=2 with lora.enabled is not supported"):
        check_tp(cfg, 2, 32, lora=True)
    with pytest.raises(ConfigError, match="parallel.tp must be >= 1"):
        load_config(None, ["--parallel.tp=0"])
    with pytest.raises(ConfigError, match="parallel.tp=2 needs parallel.mode='fsdp'"):
        load_config(None, ["--parallel.tp=2", '--parallel.mode="ddp"'])


def test_async_tp_is_refused_on_cpu_before_the_process_group(monkeypatch):
    from shardlm.parallel.dist import init_distributed

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    pcfg = ParallelConfig(tp=2, async_tp=True, compile=True, device="cpu")
    with pytest.raises(ConfigError, match="parallel.async_tp needs CUDA .* this rank's device is cpu"):
        init_distributed(pcfg)
    assert not torch.distributed.is_initialized()
    with pytest.raises(ConfigError,
                       match="parallel.async_tp needs tensor parallel .* and parallel.compile = true"):
        load_config(None, ["--parallel.tp=2", "--parallel.async_tp=true"])


def test_plan_of_async_tp_on_the_cpu_is_refused_as_training_refuses_it(capsys):
    """``shardlm plan --device cpu`` of an async TP config: the same one message as training's start, exit
    2; on an H100 the same config is planned (control)."""
    from conftest import ROOT, cli_error
    from shardlm.cli.main import main as shardlm_main

    args = ["plan", str(ROOT / "configs" / "llama3-8b.toml"), "--world-size", "8", "--parallel.tp=2",
            "--parallel.compile=true", "--parallel.async_tp=true", '--parallel.activation_checkpoint="full"']
    err = cli_error(capsys, [*args, "--device", "cpu"])
    assert err == ("error: parallel.async_tp needs CUDA (TorchInductor's micro-pipelined TP runs on "
                   "symmetric GPU memory), but the planned device is cpu: set parallel.async_tp = false")
    assert shardlm_main([*args, "--device", "h100"]) == 0
    assert "peak" in capsys.readouterr().out


def test_the_planner_plans_tensor_parallel():
    """Per rank FSDP 2 x TP 2 holds the same quarter of the model state as FSDP 4 and less activation memory
    per micro-batch of the same size; the 70B config (FSDP 8 x TP 8 on 64 H100s) prints its layout and fits;
    what it does not model is refused by name."""
    from shardlm.plan import plan_memory
    from shardlm.plan.report import format_plan

    mb = ["--train.micro_batch_size=2"]
    fsdp4, tp2 = (plan_memory(load_config(None, mb + o), 4) for o in ([], ["--parallel.tp=2"]))
    # 1/4 of AdamW each
    assert tp2.breakdown["optimizer"] == pytest.approx(fsdp4.breakdown["optimizer"], rel=0.01)
    # sequence parallel, split heads and FFN
    assert tp2.breakdown["activations"] < fsdp4.breakdown["activations"]
    report = format_plan(load_config(str(ROOT / "configs" / "llama3-70b.toml")), 64, "h100", 0.05)
    print(report)
    assert "layout     mesh dp_shard 8 x tp 8: tensor parallel 8" in report
    assert "\n  fits: " in report
    with pytest.raises(ConfigError,
                       match="parallel.tp=2: the memory planner models tensor parallel .* 'selective'"):
        plan_memory(load_config(None,
                                mb + ["--parallel.tp=2", '--parallel.activation_checkpoint="selective"']), 4)


def test_tp_communication_formula():
    """The activation collectives of bench/bench_tp.py's FSDP 2 x TP 2 step, counted there: 18 all-gathers and
    18 reduce-scatters of 4 x 256 x 512 fp32 values, of which a ring moves half per rank: 36 MiB."""
    from shardlm.plan.time import tp_comm_bytes

    assert tp_comm_bytes(2, 4, 4 * 256, 512, 4) == 36 * 2**20
    assert tp_comm_bytes(1, 4, 4 * 256, 512, 4) == 0
    assert tp_comm_bytes(2, 4, 4 * 256, 512, 4, recompute=True) == 52 * 2**20  # + the blocks' 16 forward ones
