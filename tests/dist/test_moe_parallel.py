"""A mixture of experts under FSDP, expert parallelism and context parallelism (alone, with FSDP, HSDP and
with EP) equals one process (3 steps, the aux loss included); a checkpoint written under EP resumes at another
layout; an EP run's export loads in transformers.

Three torchrun launches (2, 1 and 4 ranks) on a ~200k-parameter Qwen3-MoE (8 experts, top-2, 8-token
sequences, so that experts go without tokens in some micro-batches), plus one launch of the expert-parallel
layer alone with a routing that leaves an EP rank without any token, and gpt-oss's experts under EP
(tests/workers/ep_worker.py). Padded instruction samples (each padded differently, and CP's own padding on
top) under CP 2 and CP 2 x EP 2 equal one process too: the router statistics count the real tokens only.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from conftest import WORKER, prepare_chat_examples, run_scenarios, scenario, torchrun
from tolerance import EPS, assert_all_close, assert_close

#: relative: to each logged value's largest over the steps (16 fp32 roundings), to the largest parameter
LOSS_TOL, PARAM_TOL = 16 * EPS, 1e-4

MOE = {"model.family": '"qwen3_moe"', "model.n_experts": 8, "model.n_experts_per_token": 2,
       "model.head_width": 16, "model.moe_ffn_hidden": 32, "model.norm_topk_prob": "true",
       "model.router_aux_loss_coef": 0.05, "model.router_z_loss_coef": 0.001, "train.seq_len": 8,
       "train.global_batch_size": 4, "train.steps": 3, "train.warmup_steps": 1, "train.eval_interval": 0,
       "checkpoint.interval": 2, "checkpoint.keep": 0}


#: context parallel's runs: 10-token sequences, padded to 12 at CP 2 and to 16 at CP 4 (padding is routed but
#: must not enter the router statistics)
PADDED = {"train.seq_len": 10}


#: instruction data: 26-token samples (examples of 16-30 tokens, each padded or cut), padded to 28 at CP 2
INSTRUCT = {"train.seq_len": 26}


@pytest.fixture(scope="module")
def chat_data(small_data, tmp_path_factory):
    """40 short prompt/response examples prepared as instruction data with the small corpus' tokenizer."""
    return prepare_chat_examples(tmp_path_factory.mktemp("chat"), small_data, max_prompt_words=2,
                                 max_response_words=4)


def moe(extra: dict | None = None, micro: int = 4) -> dict:
    # one micro-batch per rank and step: the aux loss's statistics are those of the whole global batch
    return {**MOE, "train.micro_batch_size": micro, **(extra or {})}


@pytest.fixture(scope="module")
def results(small_data, chat_data, tmp_path_factory):
    runs = tmp_path_factory.mktemp("moe")
    out = {}
    out.update(run_scenarios(2, [
        scenario("fsdp2", small_data, runs, moe(micro=2)),
        scenario("ep2", small_data, runs, moe({"parallel.ep": 2}, micro=2)),
        # full activation checkpointing: each block's dispatch and combine run again in backward
        scenario("ep2_ac", small_data, runs,
                 moe({"parallel.ep": 2, "parallel.activation_checkpoint": '"full"'}, micro=2)),
        scenario("cp2", small_data, runs, moe({**PADDED, "parallel.cp": 2})),  # one data-parallel rank
        scenario("cp2_instruct", chat_data, runs, moe({**INSTRUCT, "parallel.cp": 2})),
    ], runs))
    step2 = runs / "ep2" / "checkpoints" / "step-2"
    out.update(run_scenarios(1, [
        scenario("single", small_data, runs,
                 moe({"parallel.mode": '"single"', "train.log_moe_layers": "true"})),
        scenario("resume_single", small_data, runs, moe({"parallel.mode": '"single"',
                                                         "checkpoint.resume": f'"{step2}"'})),
        scenario("single_padded", small_data, runs, moe({**PADDED, "parallel.mode": '"single"',
                                                         "train.log_moe_layers": "true"})),
        scenario("single_instruct", chat_data, runs, moe({**INSTRUCT, "parallel.mode": '"single"',
                                                          "train.log_moe_layers": "true"})),
    ], runs))
    out.update(run_scenarios(4, [
        scenario("ep2_fsdp2", small_data, runs,
                 moe({"parallel.ep": 2, "train.log_moe_layers": "true"}, micro=1)),
        scenario("resume_fsdp4", small_data, runs, moe({"checkpoint.resume": f'"{step2}"'}, micro=1)),
        # context parallel: FSDP 2 x CP 2 (full activation checkpointing), HSDP 2 x CP 2, CP 4 (6 of 16
        # positions padding), and with expert parallel: EP 2 (the EP groups are the CP groups) and EP 4
        # (across both CP groups)
        scenario("fsdp2_cp2", small_data, runs, moe({**PADDED, "parallel.cp": 2,
                                                     "parallel.activation_checkpoint": '"full"'}, micro=2)),
        scenario("hsdp2_cp2", small_data, runs, moe({**PADDED, "parallel.cp": 2, "parallel.dp_replicate": 2},
                                                    micro=2)),
        scenario("cp4", small_data, runs, moe({**PADDED, "parallel.cp": 4})),
        scenario("cp2_ep2", small_data, runs, moe({**PADDED, "parallel.cp": 2, "parallel.ep": 2,
                                                   "train.log_moe_layers": "true"}, micro=2)),
        scenario("cp2_ep4", small_data, runs, moe({**PADDED, "parallel.cp": 2, "parallel.ep": 4}, micro=2)),
        scenario("cp2_ep2_instruct", chat_data, runs, moe({**INSTRUCT, "parallel.cp": 2, "parallel.ep": 2,
                                                           "train.log_moe_layers": "true"}, micro=2)),
    ], runs))
    return out, runs


def losses(reports, key="loss"):
    return [r[key] for r in reports[0]["history"]]


@pytest.mark.dist
@pytest.mark.parametrize("name,reference", [
    ("fsdp2", "single"), ("ep2", "single"), ("ep2_ac", "single"), ("ep2_fsdp2", "single"),
    *[(name, "single_padded") for name in ("cp2", "fsdp2_cp2", "hsdp2_cp2", "cp4", "cp2_ep2", "cp2_ep4")],
    ("cp2_instruct", "single_instruct"), ("cp2_ep2_instruct", "single_instruct")])
def test_fsdp_expert_and_context_parallel_equal_one_process(results, name, reference):
    """Loss, aux and z-loss, gradient norm, tokens per expert and the final weights as one process's. Under CP
    each rank routes its share of every sequence; the router statistics are pooled over all ranks (data- and
    context-parallel) without CP's padding."""
    from safetensors.torch import load_file
    out, runs = results
    got, want = out[name][0]["history"], out[reference][0]["history"]
    assert len(got) == len(want) == 3
    for key in ("loss", "moe_aux_loss", "moe_z_loss", "grad_norm"):
        diff = max(abs(a[key] - b[key]) for a, b in zip(got, want))
        print(f"{name} {key}: max diff {diff:.2e}")
        assert_close([a[key] for a in got], [b[key] for b in want], rtol=LOSS_TOL, what=key)
    for key in ("tokens_per_expert_min", "tokens_per_expert_max", "tokens_per_expert_mean"):
        assert [a[key] for a in got] == [b[key] for b in want]
    if reference == "single_instruct":  # the samples' own padding is not counted either
        assert all(r["tokens_per_expert_mean"] < 4 * 26 * 2 / 8 for r in want)
    else:
        seq = 10 if reference == "single_padded" else 8  # CP's padding not counted: 12 or 16 positions routed
        assert want[0]["tokens_per_expert_mean"] == 4 * seq * 2 / 8  # tokens · k / E per (layer, expert)
    layers = [(r["tokens_per_expert_min/layer0"], r["tokens_per_expert_max/layer1"]) for r in want]
    assert all(r["tokens_per_expert_min"] == min(r["tokens_per_expert_min/layer0"],
                                                 r["tokens_per_expert_min/layer1"])
               # train.log_moe_layers: per layer, consistent with the whole
               for r in want) and len(layers) == 3
    if name in ("ep2_fsdp2", "cp2_ep2", "cp2_ep2_instruct"):
        assert [(r["tokens_per_expert_min/layer0"], r["tokens_per_expert_max/layer1"]) for r in got] == layers
    assert want[0]["moe_aux_loss"] > 0.9  # ~1 when balanced (E · Σ f·P)
    p = {k: v for f in (runs / name / "final").glob("*.safetensors") for k, v in load_file(str(f)).items()}
    q = {k: v for f in (runs / reference / "final").glob("*.safetensors")
         for k, v in load_file(str(f)).items()}
    assert p.keys() == q.keys() and any(".mlp.experts.7.down_proj.weight" in k for k in p)
    assert_all_close(p, q, rtol=PARAM_TOL, what="params")


@pytest.mark.dist
@pytest.mark.parametrize("name", ["resume_single", "resume_fsdp4"])
def test_checkpoint_at_ep2_resumes_at_another_layout(results, name):
    out, _ = results
    resumed, ep2 = out[name][0]["history"], out["ep2"][0]["history"]
    assert [r["step"] for r in resumed] == [3]
    assert_close(resumed[0]["loss"], ep2[2]["loss"], rtol=LOSS_TOL, what="loss")
    assert_close(resumed[0]["moe_aux_loss"], ep2[2]["moe_aux_loss"], rtol=LOSS_TOL, what="aux")


@pytest.mark.dist
def test_export_of_an_ep_run_loads_in_transformers_with_identical_logits(results):
    transformers = pytest.importorskip("transformers")
    from shardlm.convert.hf_in import load_model_dir
    _, runs = results
    final = runs / "ep2_fsdp2" / "final"
    hf, info = transformers.AutoModelForCausalLM.from_pretrained(final, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    tokens = torch.randint(0, 512, (2, 40), generator=torch.Generator().manual_seed(0))
    ours = load_model_dir(final)
    with torch.no_grad():
        assert_close(ours(tokens), hf.eval()(tokens).logits, rtol=64 * EPS, what="logits")


@pytest.mark.dist
def test_expert_parallel_layer_with_an_ep_rank_without_tokens_equals_one_process(tmp_path):
    proc = torchrun(4, [str(WORKER.parent / "ep_worker.py")], timeout=300)
    assert proc.stdout.count("OK") == 4 * 4, proc.stdout[-3000:]


@pytest.mark.dist
def test_shardlm_generate_reads_an_ep_runs_export_cached_equal_to_uncached(results, capsys):
    from shardlm.cli.main import main as shardlm_main
    _, runs = results
    argv = ["generate", "--model", str(runs / "ep2_fsdp2" / "final"), "--prompt", "To be, or not",
            "--temperature", "0", "--max-new-tokens", "12"]
    outputs = []
    for extra in ([], ["--no-cache"]):
        capsys.readouterr()
        assert shardlm_main(argv + extra) == 0
        outputs.append(capsys.readouterr().out)
    assert outputs[0] == outputs[1] and "To be, or not" in outputs[0], outputs
