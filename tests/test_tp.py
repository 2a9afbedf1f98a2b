"""Tensor parallel (``parallel.tp``): equal to one process, per family and in training; resumes across layouts;
its export loads in transformers; bad layouts refused with one message each.

Four torchrun launches on the tiny model (fp32, gloo): every family's TP-2 logits, losses and gradients
(tests/tp_worker.py, 2 ranks); FSDP 2 x TP 2, HSDP x TP 2 and FSDP 4 with checkpoints and cross resumes
(4 ranks); TP 2, with the plain loss and in bf16 (2 ranks); one process: the reference and a resume of the
FSDP 2 x TP 2 checkpoint.
"""

from __future__ import annotations

import json
import sys

import pytest
import torch
from safetensors.torch import load_file

from conftest import ROOT, run_scenarios, scenario, torchrun
from shardlm.config import ParallelConfig, load_config
from shardlm.errors import ConfigError
from shardlm.model.config import ModelConfig
from shardlm.parallel.dist import data_parallel_rank, dp_mesh_shape, mesh_dims
from shardlm.parallel.tp import check_tp

STEPS = 4
FEW = {"train.steps": STEPS, "train.eval_interval": STEPS, "checkpoint.interval": 3, "checkpoint.keep": 0}


@pytest.fixture(scope="module")
def runs(small_data, tmp_path_factory):
    """Every training launch of this file: {name: [rank reports]} and the run root."""
    root = tmp_path_factory.mktemp("tp")
    d, out = small_data, root / "out"
    tp2 = {"parallel.tp": 2}
    reports = run_scenarios(4, [
        scenario("fsdp2_tp2", d, root, {**FEW, **tp2, "train.micro_batch_size": 4}),
        scenario("fsdp4", d, root, {**FEW, "train.micro_batch_size": 2}),
        scenario("fsdp4_to_fsdp2_tp2", d, root, {**FEW, **tp2, "train.micro_batch_size": 4,
                                                 "checkpoint.resume": f'"{root / "fsdp4/checkpoints/step-3"}"'}),
        scenario("fsdp2_tp2_to_fsdp4", d, root, {**FEW, "train.micro_batch_size": 2,
                                                 "checkpoint.resume": f'"{root / "fsdp2_tp2/checkpoints/step-3"}"'}),
        scenario("hsdp2_tp2", d, root, {**FEW, **tp2, "parallel.dp_replicate": 2, "train.micro_batch_size": 4}),
    ], out)
    reports.update(run_scenarios(2, [
        scenario("tp2", d, root, {**FEW, **tp2}),
        scenario("tp2_plain", d, root, {**FEW, **tp2, "train.loss_chunk_tokens": 0}),
        scenario("tp2_bf16", d, root, {**FEW, **tp2, "parallel.param_dtype": '"bfloat16"'}),
    ], out))
    reports.update(run_scenarios(1, [
        scenario("single", d, root, {**FEW, "parallel.mode": '"single"'}),
        scenario("fsdp2_tp2_to_single", d, root, {**FEW, "parallel.mode": '"single"',
                                                  "checkpoint.resume": f'"{root / "fsdp2_tp2/checkpoints/step-3"}"'}),
    ], out))
    return reports, root


def history(report: list[dict]) -> dict[int, dict]:
    return {rec["step"]: rec for rec in report[0]["history"]}


def step_ids(report: list[dict], tp: int) -> dict[str, list[int]]:
    """The samples of each step over the data-parallel ranks (one rank per tensor-parallel group), in rank order."""
    return {s: [i for r in report[::tp] for i in r["sample_ids"][s]] for s in report[0]["sample_ids"]}


@pytest.mark.dist
@pytest.mark.parametrize("name,tp", [("tp2", 2), ("tp2_plain", 2), ("fsdp2_tp2", 2), ("hsdp2_tp2", 2)])
def test_tensor_parallel_equals_one_process(runs, name, tp):
    """TP 2, with the plain loss (one chunk), FSDP 2 x TP 2 and HSDP (2 replicas x 1) x TP 2 against one process:
    every step's loss within 1e-5, gradient norm within 1e-6 relative, the same samples, final weights 1e-4."""
    reports, root = runs
    got, ref = history(reports[name]), history(reports["single"])
    assert sorted(got) == sorted(ref) == list(range(1, STEPS + 1))
    loss = max(abs(got[s]["loss"] - ref[s]["loss"]) for s in ref)
    norm = max(abs(got[s]["grad_norm"] - ref[s]["grad_norm"]) / ref[s]["grad_norm"] for s in ref)
    val = abs(got[STEPS]["val_loss"] - ref[STEPS]["val_loss"])
    p, q = (load_file(str(root / n / "final" / "model.safetensors")) for n in (name, "single"))
    params = max((p[k] - q[k]).abs().max().item() for k in q)
    print(f"{name} vs one process: loss {loss:.1e}, grad norm {norm:.1e} relative, val {val:.1e}, params {params:.1e}")
    assert loss <= 1e-5 and norm <= 1e-6 and val <= 1e-5 and params <= 1e-4
    assert p.keys() == q.keys()
    assert step_ids(reports[name], tp) == step_ids(reports["single"], 1)
    assert reports[name][0]["mesh"] == (["dp_replicate"] if name.startswith("hsdp") else []) + ["dp_shard", "tp"]
    placements = reports[name][0]["params"]["model.layers.0.self_attn.q_proj.weight"]["placements"]
    assert placements[-1] == "S(0)"  # split over the tp dimension by output columns


@pytest.mark.dist
def test_mixed_precision_under_tensor_parallel(runs):
    """bf16 compute (fp32 shards and reduction) at TP 2 trains like fp32 in one process: losses within 2e-3 over the
    4 steps (bf16 rounding; measured 1.7e-4; FSDP's bf16 against fp32 differs by ~3e-3 over 20 steps here)."""
    reports, _ = runs
    got, ref = history(reports["tp2_bf16"]), history(reports["single"])
    diff = max(abs(got[s]["loss"] - ref[s]["loss"]) for s in ref)
    print(f"TP 2 in bf16 vs one process in fp32: loss {diff:.1e}")
    assert diff <= 2e-3 and got[STEPS]["loss"] < got[1]["loss"]


@pytest.mark.dist
@pytest.mark.parametrize("name,writer,tp,writer_tp", [("fsdp2_tp2_to_fsdp4", "fsdp2_tp2", 1, 2),
                                                      ("fsdp2_tp2_to_single", "fsdp2_tp2", 1, 2),
                                                      ("fsdp4_to_fsdp2_tp2", "fsdp4", 2, 1)])
def test_resume_at_another_layout(runs, name, writer, tp, writer_tp):
    """A checkpoint of step 3 resumes at another TP degree / world size: step 4's loss within 1e-6 of the writer's
    own step 4, on the same samples."""
    reports, _ = runs
    got, ref = history(reports[name]), history(reports[writer])
    assert sorted(got) == [STEPS]  # resumed at step 3: only step 4 ran
    diff = abs(got[STEPS]["loss"] - ref[STEPS]["loss"])
    print(f"{name}: step {STEPS} loss {got[STEPS]['loss']:.7f} vs {ref[STEPS]['loss']:.7f} ({diff:.1e})")
    assert diff <= 1e-6
    assert step_ids(reports[name], tp)[str(STEPS - 1)] == step_ids(reports[writer], writer_tp)[str(STEPS - 1)]


@pytest.mark.dist
def test_export_of_a_tensor_parallel_run_loads_in_transformers(runs):
    """``final/`` of the FSDP 2 x TP 2 run: transformers' logits equal shardlm's on the same directory (1e-5)."""
    transformers = pytest.importorskip("transformers", reason="pip install -e '.[test]'")
    from shardlm.convert.hf_in import load_model_dir

    _, root = runs
    final = root / "fsdp2_tp2" / "final"
    tokens = torch.randint(0, 512, (2, 24), generator=torch.Generator().manual_seed(0))
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(final), dtype=torch.float32).eval()
    with torch.no_grad():
        diff = (hf(tokens).logits - load_model_dir(final)(tokens)).abs().max().item()
    print(f"export of FSDP 2 x TP 2: transformers vs shardlm logits {diff:.1e}")
    assert diff <= 1e-5


@pytest.mark.dist
def test_every_family_at_tp2_equals_one_process(tmp_path):
    """Llama (untied and tied), Qwen2 (q/k/v biases), Qwen3 (q/k norms, explicit head width), Mistral (sliding
    window; also with block-causal document masking), Gemma 3 (q/k norms, four norms per block, local/global
    layers, soft-cap, tied): logits within 1e-5; the
    vocabulary-parallel loss (chunked, one chunk) and PyTorch's ``loss_parallel`` within 1e-6 relative of the plain
    loss; gradients within 1e-5 relative. Heads are split (2 of 4 per rank) and tied weights stay one tensor."""
    out = tmp_path / "families.json"
    torchrun(2, [str(ROOT / "tests" / "tp_worker.py"), str(out)], timeout=300)
    results = json.loads(out.read_text())
    print(json.dumps(results, indent=1), file=sys.stderr)
    assert set(results) == {"llama", "llama_tied", "qwen2", "qwen3", "mistral", "gemma3", "mistral_block_causal"}
    for name, r in results.items():
        assert r["logits"] <= 1e-5, name
        assert r["logits_are_split"] == 1.0 and r["local_heads"] == 2, name
        assert max(r["chunked_rel"], r["one_chunk_rel"], r["loss_parallel_rel"]) <= 1e-6, name
        assert r["grad_rel"] <= 1e-5, name
        assert r["tied_one_tensor"] == float(name in ("llama_tied", "gemma3")), name


# ---- the mesh and bad input: one message each, no launch -----------------------------------------------------
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
    (1, 3, 2, 4, 4, "parallel.dp_replicate × parallel.dp_shard × parallel.tp = 1 × 3 × 2 = 6, but the world size "
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
    (dict(n_heads=8, n_kv_heads=2), 32, "parallel.tp=4 must divide the key/value heads (model.n_kv_heads) = 2"),
    (dict(ffn_hidden=90), 32, "parallel.tp=4 must divide the FFN width (model.ffn_hidden) = 90"),
    (dict(vocab_size=510), 32, "parallel.tp=4 must divide model.vocab_size = 510"),
    (dict(), 30, "parallel.tp=4 must divide train.seq_len (sequence parallel splits the tokens) = 30"),
])
def test_bad_tp_model(shape, seq_len, message):
    cfg = ModelConfig(**{"dim": 64, "n_heads": 8, "n_kv_heads": 4, "ffn_hidden": 128, "vocab_size": 512, **shape})
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
    with pytest.raises(ConfigError, match="parallel.async_tp needs tensor parallel .* and parallel.compile = true"):
        load_config(None, ["--parallel.tp=2", "--parallel.async_tp=true"])


def test_the_planner_plans_tensor_parallel():
    """Per rank FSDP 2 x TP 2 holds the same quarter of the model state as FSDP 4 and less activation memory per
    micro-batch of the same size; the 70B config (FSDP 8 x TP 8 on 64 H100s) prints its layout and fits; what it does not model
    is refused by name."""
    from shardlm.plan import plan_memory
    from shardlm.plan.report import format_plan

    mb = ["--train.micro_batch_size=2"]
    fsdp4, tp2 = (plan_memory(load_config(None, mb + o), 4) for o in ([], ["--parallel.tp=2"]))
    assert tp2.breakdown["optimizer"] == pytest.approx(fsdp4.breakdown["optimizer"], rel=0.01)  # 1/4 of AdamW each
    assert tp2.breakdown["activations"] < fsdp4.breakdown["activations"]  # sequence parallel, split heads and FFN
    report = format_plan(load_config(str(ROOT / "configs" / "llama3-70b.toml")), 64, "h100", 0.05)
    print(report)
    assert "layout     mesh dp_shard 8 x tp 8: tensor parallel 8" in report
    assert "\n  fits: " in report
    with pytest.raises(ConfigError, match="parallel.tp=2: the memory planner models tensor parallel .* 'selective'"):
        plan_memory(load_config(None, mb + ["--parallel.tp=2", '--parallel.activation_checkpoint="selective"']), 4)


def test_tp_communication_formula():
    """The activation collectives of bench/bench_tp.py's FSDP 2 x TP 2 step, counted there: 18 all-gathers and 18
    reduce-scatters of 4 x 256 x 512 fp32 values, of which a ring moves half per rank: 36 MiB."""
    from shardlm.plan.time import tp_comm_bytes

    assert tp_comm_bytes(2, 4, 4 * 256, 512, 4) == 36 * 2**20
    assert tp_comm_bytes(1, 4, 4 * 256, 512, 4) == 0
    assert tp_comm_bytes(2, 4, 4 * 256, 512, 4, recompute=True) == 52 * 2**20  # + the blocks' 16 forward ones


@pytest.mark.dist
def test_export_and_generate_from_a_tensor_parallel_checkpoint(runs, tmp_path, capsys):
    """``shardlm export`` of the FSDP 2 x TP 2 step-3 checkpoint (DCP, read in one process) equals the export of FSDP
    4's step-3 checkpoint (1e-4: the same training), and ``shardlm generate`` runs on it."""
    from shardlm.cli.main import main as shardlm_main

    _, root = runs
    for name in ("fsdp2_tp2", "fsdp4"):
        assert shardlm_main(["export", str(root / name / "checkpoints" / "step-3"), str(tmp_path / name)]) == 0
    p, q = (load_file(str(tmp_path / n / "model.safetensors")) for n in ("fsdp2_tp2", "fsdp4"))
    assert p.keys() == q.keys()
    diff = max((p[k] - q[k]).abs().max().item() for k in q)
    print(f"export of the FSDP 2 x TP 2 checkpoint vs FSDP 4's: {diff:.1e}")
    assert diff <= 1e-4
    capsys.readouterr()
    assert shardlm_main(["generate", "--model", str(tmp_path / "fsdp2_tp2"), "--prompt", "KING", "--temperature", "0",
                         "--max-new-tokens", "8"]) == 0
    assert capsys.readouterr().out.strip()
