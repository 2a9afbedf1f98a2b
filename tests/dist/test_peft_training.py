"""Parameter-efficient fine-tuning under torchrun: frozen parameters, LoRA (fp32 / bf16 base), QLoRA (NF4
base), adapter-only checkpoints and their exports.

The tiny model trains at 2 ranks (FSDP) and in one process in two torchrun launches of several scenarios each
(tests/workers/peft_worker.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import tiny_overrides, torchrun
from test_peft import measured
from tolerance import EPS, assert_all_close, assert_close

WORKER = Path(__file__).resolve().parents[1] / "workers" / "peft_worker.py"
STEPS = 5
# block 1 and the final norm; embedding and block 0 frozen
FREEZE = {"train.trainable": "model.layers.1.*,norm"}
LORA = {"lora.enabled": "true", "lora.rank": 4, "lora.alpha": 8.0}
QLORA = {**LORA, "lora.base_dtype": "nf4", "train.steps": 10, "checkpoint.interval": 5}


def run_launch(nproc: int, scenarios: list[dict], out: Path) -> dict[str, list[dict]]:
    out.mkdir(parents=True, exist_ok=True)
    spec = out / f"spec-{nproc}.json"
    spec.write_text(json.dumps({"out": str(out), "scenarios": scenarios}))
    torchrun(nproc, [str(WORKER), str(spec)], timeout=900)
    return {s["name"]: [json.loads((out / s["name"] / f"rank{r}.json").read_text()) for r in range(nproc)]
            for s in scenarios}


def sc(name: str, data: Path, runs: Path, extra: dict, **hooks) -> dict:
    base = {"train.steps": STEPS, "train.micro_batch_size": 4, "train.eval_interval": 0,
            "checkpoint.interval": 3, "checkpoint.keep": 0}
    return {"name": name, "overrides": tiny_overrides(data, runs / name, {**base, **extra}), **hooks}


@pytest.fixture(scope="module")
def peft_runs(tmp_path_factory, small_data) -> tuple[dict, dict, Path]:
    out = tmp_path_factory.mktemp("peft")
    runs = out / "runs"
    ckpt = runs / "lora" / "checkpoints" / "step-3"
    two = run_launch(2, [
        sc("freeze", small_data, runs, FREEZE),
        sc("unfreeze", small_data, runs, {**FREEZE, "checkpoint.keep": 2}, unfreeze_after=2,
           save_steps=[1, 3, 4, 5]),
        sc("lora", small_data, runs, LORA),
        sc("lora_bf16", small_data, runs, {**LORA, "lora.base_dtype": "bfloat16"}),
        sc("qlora", small_data, runs, QLORA),
        sc("qlora_resumed", small_data, runs,
           {**QLORA, "checkpoint.resume": f'"{runs / "qlora" / "checkpoints" / "step-5"}"'}),
        sc("lora_ac_offload", small_data, runs, {**LORA, "parallel.activation_checkpoint": "full",
                                                 "parallel.cpu_offload": "true",
                                                 "checkpoint.enabled": "false"}),
        sc("lora_resumed", small_data, runs, {**LORA, "checkpoint.resume": f'"{ckpt}"'}),
        sc("other_base", small_data, runs, {**LORA, "train.seed": 1, "checkpoint.resume": f'"{ckpt}"'},
           expect_error=True),
    ], out / "two")
    single = {"parallel.mode": "single"}
    one = run_launch(1, [
        sc("freeze", small_data, runs / "one", {**FREEZE, **single}),
        sc("lora", small_data, runs / "one", {**LORA, **single}),
        sc("lora_bf16", small_data, runs / "one", {**LORA, **single, "lora.base_dtype": "bfloat16"}),
        sc("qlora", small_data, runs / "one", {**QLORA, **single}),
        sc("lora_resumed_1rank", small_data, runs / "one", {**LORA, "checkpoint.resume": f'"{ckpt}"'}),
        {"name": "unfreeze_resumed",  # --resume=auto in the run that switched to all-trainable at step 2
         "overrides": tiny_overrides(small_data, runs / "unfreeze", {
             **single, "train.steps": STEPS + 1, "train.eval_interval": 0, "checkpoint.keep": 2,
             "checkpoint.resume": "auto"})},
    ], out / "one")
    return two, one, runs


def losses(report: list[dict]) -> list[float]:
    return [r["loss"] for r in report[0]["history"] if "loss" in r]


@pytest.mark.dist
def test_frozen_parameters_stay_bit_identical_and_trainable_ones_equal_one_process(peft_runs):
    two, one, runs = peft_runs
    for rank in two["freeze"]:
        assert rank["frozen_unchanged"] and all(rank["frozen_unchanged"].values())
        assert set(rank["frozen_unchanged"]) == {"model.embed_tokens.weight", "lm_head.weight",
                                                 *(f"model.layers.0.{n}" for n in (
                                                     "input_layernorm.weight", "self_attn.q_proj.weight",
                                                     "self_attn.k_proj.weight", "self_attn.v_proj.weight",
                                                     "self_attn.o_proj.weight",
                                                     "post_attention_layernorm.weight",
                                                     "mlp.gate_proj.weight", "mlp.up_proj.weight",
                                                     "mlp.down_proj.weight"))}
        # no optimizer state for a frozen parameter
        assert all(n.startswith(("model.layers.1.", "model.norm.")) for n in rank["optimizer_state_names"])
        assert len(rank["optimizer_state_names"]) == 10
        assert "trainable  " in rank["summary"]
    a, b = losses(two["freeze"]), losses(one["freeze"])
    measured("freeze 2 ranks vs 1 process, max loss diff", max(abs(x - y) for x, y in zip(a, b)))
    assert len(a) == STEPS
    assert_close(a, b, rtol=16 * EPS, what="freeze loss")
    assert a[-1] < a[0]
    ta, tb = (
        load_file(runs / "freeze" / "trainable.safetensors"),
        load_file(runs / "one" / "freeze" / "trainable.safetensors"),
    )
    assert sorted(ta) == sorted(tb) and len(ta) == 10
    measured("freeze trainable params max diff", max((ta[k] - tb[k]).abs().max().item() for k in ta))
    assert_all_close(ta, tb, rtol=1e-4, what="trainable params")  # relative to the largest (a norm's, ~1)


@pytest.mark.dist
def test_frozen_first_then_unfrozen(peft_runs):
    two, _, _ = peft_runs
    for rank in two["unfreeze"]:
        assert len(rank["history"]) == STEPS and all(
            torch.isfinite(torch.tensor(r["loss"])) for r in rank["history"]
        )
        # every parameter: embedding, blocks, norm, head
        assert rank["after_unfreeze_trainable"] == 1 + 2 * 9 + 1 + 1
        assert "model.embed_tokens.weight" in rank["optimizer_state_names"]
        assert not all(rank["frozen_unchanged"].values())  # the formerly frozen ones moved after unfreezing
    # the first two steps are the frozen run's
    assert losses(two["unfreeze"])[:2] == losses(two["freeze"])[:2]


@pytest.mark.dist
def test_checkpoint_after_set_trainable_is_the_runs_own(peft_runs, small_data):
    """A checkpoint saved after ``set_trainable`` (the unfreeze scenario saves after steps 1, 3, 4 and 5,
    switching after step 2) carries the run id, the data identity and the special ids of the first;
    ``--resume=auto`` (one rank, one more step) picks the newest, step 5, and its save of step 6 is the same
    run's; retention (``checkpoint.keep = 2``) pruned the older saves of the run, the one before the
    switch included."""
    from shardlm.checkpoint.manifest import read_manifest
    from shardlm.data import load_meta

    two, one, runs = peft_runs
    root = runs / "unfreeze" / "checkpoints"
    kept = sorted(p.name for p in root.iterdir())
    assert kept == ["step-5", "step-6"], kept  # steps 1 (before the switch), 3 and 4 pruned as this run's
    run_id = two["unfreeze"][0]["run_id"]
    meta = load_meta(str(small_data))
    for name in kept:
        manifest = read_manifest(root / name)
        assert manifest["run_id"] == run_id and run_id
        assert manifest["data"] == meta  # the data identity, as the first checkpointer records it
        assert manifest["special_ids"] == meta["model_special_ids"]
        assert manifest["base"] is None  # every parameter trainable after the switch
        assert manifest["config"]["train"]["trainable"] == ""
    assert read_manifest(root / "step-5")["save_seq"] < read_manifest(root / "step-6")["save_seq"]
    resumed = one["unfreeze_resumed"][0]
    assert resumed["last_load"]["path"] == str(root / "step-5") and resumed["run_id"] == run_id
    assert [r["step"] for r in resumed["history"] if "loss" in r] == [STEPS + 1]


@pytest.mark.dist
@pytest.mark.parametrize("name", ["qlora", "freeze"])
def test_partial_checkpoint_exports_equal_final(peft_runs, tmp_path, name):
    """``shardlm export`` of the last checkpoint of a QLoRA run (NF4 base rebuilt from the seed, quantised as
    training did) and of a partly frozen run gives the run's ``final/`` bit for bit; the QLoRA merge records
    that it went into the dequantised NF4 base."""
    from shardlm.cli.main import main as shardlm_main

    _, _, runs = peft_runs
    step = QLORA["train.steps"] if name == "qlora" else STEPS
    out = tmp_path / "out"
    assert shardlm_main(["export", str(runs / name / "checkpoints" / f"step-{step}"), str(out)]) == 0
    got, want = load_file(out / "model.safetensors"), load_file(runs / name / "final" / "model.safetensors")
    assert sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in got)
    if name == "qlora":
        record = json.loads((out / "lora_merge.json").read_text())
        assert record == json.loads((runs / name / "final" / "lora_merge.json").read_text())
        assert (
            record["base_dtype"] == "nf4"
            and record["merged_into"] == "training_base"
            and not record["approximate"]
        )
        assert "dequantised NF4" in record["description"]
        peft_out = tmp_path / "adapter"
        assert shardlm_main(["export", str(runs / name / "checkpoints" / f"step-{step}"), str(peft_out),
                             "--format", "peft"]) == 0
        a, b = load_file(peft_out / "adapter_model.safetensors"), load_file(
            runs / name / "final-adapter" / "adapter_model.safetensors")
        assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)
    else:
        assert not (out / "lora_merge.json").exists()


@pytest.mark.dist
def test_lora_two_ranks_equal_one_process(peft_runs):
    two, one, runs = peft_runs
    for name in ("lora", "lora_bf16"):
        a, b = losses(two[name]), losses(one[name])
        measured(f"{name} 2 ranks vs 1 process, max loss diff over {STEPS} steps",
                 max(abs(x - y) for x, y in zip(a, b)))
        assert len(a) == STEPS
        assert_close(a, b, rtol=16 * EPS, what=f"{name} loss")
        for rank in two[name]:
            assert all(rank["frozen_unchanged"].values())
            assert all(".lora_" in n for n in rank["optimizer_state_names"])
            assert len(rank["optimizer_state_names"]) == 2 * 7 * 2  # 2 layers x 7 targets x (A, B)
        ta = load_file(runs / name / "trainable.safetensors")
        tb = load_file(runs / "one" / name / "trainable.safetensors")
        measured(f"{name} adapters max diff", max((ta[k] - tb[k]).abs().max().item() for k in ta))
        # relative to the largest adapter value (an A's, ~1/sqrt(64)): the same 1e-4 at that scale
        assert_all_close(ta, tb, rtol=1e-3, what=f"{name} adapters")
        # the adapters trained: every B left zero (its initial value). (Not "the last loss is below the
        # first": over 5 warm-up steps on a random base, each step a new batch, the change is within batch
        # noise: +0.02 here.)
        assert all(v.abs().max() > 0 for k, v in ta.items() if ".lora_B." in k) and len(ta) == 2 * 7 * 2
    # a bf16 base stores half the fp32 base's bytes
    fp32, bf16 = two["lora"][0]["frozen_bytes"], two["lora_bf16"][0]["frozen_bytes"]
    assert bf16 < fp32


@pytest.mark.dist
def test_lora_resume_is_bit_exact_and_works_at_one_rank(peft_runs):
    two, one, runs = peft_runs
    full, resumed = losses(two["lora"]), losses(two["lora_resumed"])
    assert resumed == full[3:]  # steps 4 and 5, bit for bit
    ckpt = runs / "lora" / "checkpoints" / "step-3"
    manifest = json.loads((ckpt / "manifest.json").read_text())
    assert manifest["base"]["seed"] == 0 and manifest["base"]["lora"]["rank"] == 4
    meta_names = (ckpt / ".metadata").read_bytes()
    assert b"lora_A" in meta_names and b"q_proj.weight" not in meta_names.replace(b"q_proj.lora", b"")
    one_rank = losses(one["lora_resumed_1rank"])
    measured("lora resumed 2 -> 1 rank, max loss diff", max(abs(x - y) for x, y in zip(one_rank, full[3:])))
    assert_close(one_rank, full[3:], rtol=16 * EPS, what="resumed at 1 rank")
    # another base (train.seed): refused from the checkpoint's recorded settings before any data is prepared
    error = two["other_base"][0]["error"]
    assert "cannot resume from" in error and "train.seed changed" in error, error


@pytest.mark.dist
def test_qlora_tiny_equals_one_process_and_stores_a_quarter_of_bf16(peft_runs):
    """The NF4 codes are quantised from whole tensors, so 2 ranks equal one process here too."""
    two, one, _ = peft_runs
    a, b = losses(two["qlora"]), losses(one["qlora"])
    measured("qlora tiny 2 ranks vs 1 process, max loss diff", max(abs(x - y) for x, y in zip(a, b)))
    rank0 = two["qlora"][0]
    measured("qlora tiny whole frozen base bytes / bf16 bytes",
             rank0["frozen_bytes"] / rank0["frozen_bf16_bytes"])
    assert len(a) == 10 and a[-1] < a[0], a  # a random base: LoRA moves the loss only a little
    assert_close(a, b, rtol=16 * EPS, what="qlora loss")
    for rank in two["qlora"]:
        assert all(rank["frozen_unchanged"].values())
        # everything frozen (embedding, output projection, linears, norms) against the same values in bf16
        assert rank["frozen_bytes"] <= 0.3 * rank["frozen_bf16_bytes"], rank["frozen_bytes"]
        assert {"model.embed_tokens.weight", "lm_head.weight"} <= set(rank["nf4_names"])
    assert losses(two["qlora_resumed"]) == a[5:]  # resumed from the adapter checkpoint of step 5, bit for bit


@pytest.mark.dist
def test_lora_with_activation_checkpointing_and_cpu_offload(peft_runs):
    two, _, _ = peft_runs
    a, b = losses(two["lora_ac_offload"]), losses(two["lora"])
    measured("lora AC + CPU offload vs plain, max loss diff", max(abs(x - y) for x, y in zip(a, b)))
    assert_close(a, b, rtol=16 * EPS, what="AC + offload loss")


@pytest.mark.dist
def test_qlora_on_smollm2_trains_at_two_ranks(smol_dir, small_corpus, tmp_path):
    """QLoRA of the real SmolLM2-135M (NF4 base, r = 8 on every projection) at 2 ranks: the held-out loss
    falls over 10 steps, and each rank stores the whole frozen base (the NF4 token embedding, tied to the
    output projection, the NF4 linear layers and the fp32 norms) in at most 0.3x its bf16 bytes."""
    pytest.importorskip("torchao", reason="pip install -e '.[test]'")
    overrides = {
        "model.init_from": f'"{smol_dir}"', "data.corpus": f'"{small_corpus}"',
        "data.dir": f'"{tmp_path / "data"}"', "data.val_fraction": 0.05, "lora.enabled": "true",
        "lora.base_dtype": "nf4", "lora.alpha": 16.0, "train.seq_len": 32, "train.global_batch_size": 4,
        "train.micro_batch_size": 2, "train.steps": 10, "train.lr": 2e-3, "train.min_lr": 2e-4,
        "train.warmup_steps": 0, "train.weight_decay": 0.0, "train.eval_interval": 10,
        "train.eval_tokens": 512, "checkpoint.enabled": "false", "run.dir": f'"{tmp_path / "run"}"'}
    report = run_launch(2, [{"name": "smol", "overrides": [f"--{k}={v}" for k, v in overrides.items()]}],
                        tmp_path)
    ranks = report["smol"]
    history = ranks[0]["history"]
    vals = [r["val_loss"] for r in history if "val_loss" in r]
    assert len(vals) == 2 and vals[1] < vals[0] - 0.05, vals  # pretrained (step 0) -> step 10
    train = [r["loss"] for r in history if "loss" in r]
    assert len(train) == 10 and sum(train[-3:]) < sum(train[:3])
    for rank in ranks:
        assert rank["frozen_bytes"] <= 0.3 * rank["frozen_bf16_bytes"], (rank["frozen_bytes"],
                                                                         rank["frozen_bf16_bytes"])
        assert "model.embed_tokens.weight" in rank["nf4_names"] and rank["tied"]
        assert all(rank["frozen_unchanged"].values())
    measured("smollm2 qlora",
             json.dumps({"val": vals, "train": train, "frozen_bytes": [r["frozen_bytes"] for r in ranks],
                      "frozen_bf16_bytes": [r["frozen_bf16_bytes"] for r in ranks],
                      "ratio": [r["frozen_bytes"] / r["frozen_bf16_bytes"] for r in ranks],
                      "lora_base_bytes": [r["lora_base_bytes"] for r in ranks]}))
