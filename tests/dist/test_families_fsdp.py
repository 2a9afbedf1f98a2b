"""Every model family under FSDP: 2 ranks equal one process over 3 steps and the final export loads;
activation checkpointing, CPU offload and the bf16 kernel per family. The families' models are
tests/unit/test_families.py's."""

from __future__ import annotations

import pytest
import torch

from conftest import run_scenarios, scenario
from shardlm.convert.hf_in import load_model_dir
from test_families import (
    FAMILY_CASES,
    IDS,
    family_dirs,  # noqa: F401 (fixtures)
    hf_configs,
    hf_model,
)
from tolerance import EPS, assert_close


@pytest.fixture(scope="module")
def parity(family_dirs, small_data, tmp_path_factory):  # noqa: F811 (the imported fixture)
    """3 steps of each family from its imported weights, at 1 process and FSDP 2 ranks (two
    torchrun launches)."""
    runs = tmp_path_factory.mktemp("family_parity")
    extra = {"train.steps": 3, "train.warmup_steps": 1, "train.eval_interval": 3, "train.eval_tokens": 512,
             "train.seq_len": 32, "checkpoint.interval": 0}
    out = {}
    for world, mode in ((1, '"single"'), (2, '"fsdp"')):
        scenarios = [scenario(f"{name}_{world}", small_data, runs,
                              {**extra, "parallel.mode": mode, "model.init_from": f'"{family_dirs[name]}"',
                               "train.micro_batch_size": 8 // world})
                     for name in FAMILY_CASES]
        if world == 2:
            # per family, the other techniques: AC + CPU offload (exact), bf16 through the CPU kernel
            scenarios += [
                scenario("gemma3_ac_offload", small_data, runs, {
                    **extra, "model.init_from": f'"{family_dirs["gemma3"]}"', "train.micro_batch_size": 4,
                    "parallel.activation_checkpoint": '"selective"', "parallel.cpu_offload": "true"}),
                scenario("qwen2_bf16", small_data, runs, {
                    **extra, "model.init_from": f'"{family_dirs["qwen2_untied"]}"',
                    "train.micro_batch_size": 4, "parallel.param_dtype": '"bfloat16"',
                    "parallel.cpu_bf16_matmul": '"fp32"'}),
            ]
            # pipeline parallel, 2 stages of one block, 2 micro-batches of 4 (families whose embedding is
            # not tied to the output projection: the others are refused by name, tests/unit/test_pp_config.py)
            scenarios += [scenario(f"{name}_pp2", small_data, runs, {
                **extra, "model.init_from": f'"{family_dirs[name]}"', "train.micro_batch_size": 4,
                "parallel.pp": 2}) for name in PP_CASES]
        out.update(run_scenarios(world, scenarios, runs))
    return out, runs


def untied(name: str) -> bool:
    return not getattr(hf_configs()[name], "tie_word_embeddings", False)


PP_CASES = [name for name in FAMILY_CASES if untied(name)]


def assert_export_loads(final) -> None:
    """The exported directory loads in transformers with every weight matched, and its logits equal shardlm's
    model read from it within 64 fp32 roundings."""
    hf, info = hf_model(final)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    ours = load_model_dir(final).eval()
    with torch.no_grad():
        assert_close(ours(IDS), hf(IDS).logits, rtol=64 * EPS, what="export vs transformers")


@pytest.mark.dist
@pytest.mark.parametrize("name", FAMILY_CASES)
def test_fsdp_two_ranks_equal_one_process_and_final_loads(parity, name):
    out, runs = parity
    one, two = ([h for h in out[f"{name}_{world}"][0]["history"] if "loss" in h] for world in (1, 2))
    assert len(one) == len(two) == 3
    diff = max(abs(a["loss"] - b["loss"]) for a, b in zip(one, two))
    print(f"\n{name}: FSDP 2 ranks vs one process, max loss diff over 3 steps {diff:.2e} "
          f"(losses {[round(h['loss'], 4) for h in one]})")
    assert_close([b["loss"] for b in two], [a["loss"] for a in one], rtol=16 * EPS, what="loss")
    assert_export_loads(runs / f"{name}_2" / "final")


@pytest.mark.dist
def test_checkpointing_offload_and_bf16_kernel_per_family(parity):
    """Gemma 3 with selective activation checkpointing and CPU offload equals the plain run exactly; Qwen2
    (biased q/k/v, which keep nn.Linear's path) trains in bf16 with the fp32-multiply CPU kernel on the
    other layers."""
    out, _ = parity
    losses = {n: [h["loss"] for h in out[n][0]["history"] if "loss" in h] for n in
              ("gemma3_2", "gemma3_ac_offload", "qwen2_untied_2", "qwen2_bf16")}
    print(f"\n{losses}")
    assert losses["gemma3_ac_offload"] == losses["gemma3_2"]
    # bf16 training against fp32 over 3 steps: within 4 bf16 roundings (2**-8 each) of the largest loss
    assert_close(losses["qwen2_bf16"], losses["qwen2_untied_2"], rtol=4 * 2 ** -8, what="bf16 loss")


@pytest.mark.dist
@pytest.mark.parametrize("name", PP_CASES)
def test_pipeline_two_stages_equal_one_process_and_final_loads(parity, name):
    """PP 2 (1f1b, one block a stage) of each family with an untied output projection: the losses of one
    process over 3 steps, and the export (gathered from both stages) loads in transformers with its logits."""
    out, runs = parity
    one, pp = ([h for h in out[run][0]["history"] if "loss" in h] for run in (f"{name}_1", f"{name}_pp2"))
    assert len(one) == len(pp) == 3
    print(f"\n{name}: PP 2 vs one process, losses {[h['loss'] for h in pp]} vs {[h['loss'] for h in one]}")
    assert_close([b["loss"] for b in pp], [a["loss"] for a in one], rtol=16 * EPS, what="loss")
    assert_export_loads(runs / f"{name}_pp2" / "final")
