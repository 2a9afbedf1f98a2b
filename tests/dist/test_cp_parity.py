"""Context parallelism across ranks: CP 2 attention equals one-rank attention (forward and gradients), CP
training equals one process, and a CP 2 checkpoint resumes at CP 1 x FSDP 2 exactly
(tests/workers/cp_worker.py and the dist worker)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from conftest import torchrun
from tolerance import EPS, assert_all_close, assert_close, check

WORKER = Path(__file__).resolve().parents[1] / "workers" / "cp_worker.py"


@pytest.mark.dist
def test_cp2_attention_equals_one_rank_forward_and_grads(tmp_path):
    out = tmp_path / "cp.json"
    torchrun(4, [str(WORKER), str(out)], timeout=240)  # CP 2 (two groups of 2 ranks) and CP 4
    results = json.loads(out.read_text())
    sinks = {"sinks_causal_odd", "sinks_sliding_block_causal_odd"}  # gpt-oss: joined once to the normaliser
    cases = {"causal_odd", "block_causal_odd", "sliding_window", "sliding_block_causal_odd"} | sinks
    assert set(results) == cases | {f"{c}/fallback" for c in cases} | {f"{c}@cp4" for c in cases}
    for name, r in results.items():
        for key in ("out", "dq", "dk", "dv"):  # relative to the one-rank reference's largest value
            check(r[key], 32 * EPS * r[f"{key}_scale"], scale=r[f"{key}_scale"], what=f"{name} {key}")
        # the sinks' gradient (relative to its magnitude); they change the output (the case bites)
        assert r["dsinks"] <= 1e-5 and (r["vs_no_sinks"] > 0.1) == name.startswith("sinks"), (name, r)
    for name in cases:  # blockwise: nothing of T_pad rows saved for the backward; the fallback keeps K/V
        blockwise, fallback, cp4 = results[name], results[f"{name}/fallback"], results[f"{name}@cp4"]
        assert blockwise["cp"] == fallback["cp"] == 2 and cp4["cp"] == 4
        assert (
            blockwise["saved_rows"] == blockwise["t_pad"] // 2 and cp4["saved_rows"] == cp4["t_pad"] // 4
        ), name
        assert fallback["saved_rows"] == fallback["t_pad"], name
        assert blockwise["saved_bytes"] < fallback["saved_bytes"], name
    assert not results["causal_odd"]["dense_mask"]  # plain causal: SDPA's causal kernel, no T x T mask
    assert all(results[n]["dense_mask"] for n in ("block_causal_odd", "sliding_window",
                                                  "sliding_block_causal_odd"))
    for suffix in ("", "/fallback", "@cp4"):
        assert results[f"causal_odd{suffix}"]["padding_total"] == 3
        assert results[f"sliding_block_causal_odd{suffix}"]["padding_total"] == 1
    for name in ("block_causal_odd", "sliding_window", "sliding_block_causal_odd"):
        assert results[name]["vs_causal"] > 0.1, name  # documents and windows change the result


# ---- training: CP 2, FSDP / HSDP / DDP / TP x CP 2 equal one process; CP checkpoints resume at CP 1 -------
STEPS = {"train.steps": 3, "train.seq_len": 30, "train.eval_interval": 3, "train.eval_tokens": 960,
         "train.warmup_steps": 1, "checkpoint.interval": 1, "checkpoint.keep": 0}
#: Mistral's sliding window (8 of the 30 tokens): CP's masked path in training
WINDOW = {**STEPS, "model.family": '"mistral"', "model.sliding_window": 8}
#: block-causal attention over windows that cross document boundaries (document ids sharded with the tokens)
DOCS = {**STEPS, "model.attention": '"block_causal"', "train.eval_interval": 0}
#: gpt-oss (attention sinks, experts, YaRN): sliding layers alternating with full ones
GPT_OSS = {"model.family": '"gpt_oss"', "model.n_experts": 4, "model.n_experts_per_token": 2,
           "model.sliding_window_pattern": 2, "model.rope_yarn_factor": 4.0,
           "model.rope_original_max_seq_len": 16}
#: its window shorter than the 30 tokens, on block-causal documents (the sinks under CP's block masks)
GPT_OSS_WINDOW = {**DOCS, **GPT_OSS, "model.sliding_window": 8}
#: its window longer than the sequence (CP's causal blocks, no mask)
GPT_OSS_LONG_WINDOW = {**STEPS, **GPT_OSS, "model.sliding_window": 48, "model.attention": '"causal"'}


def short_documents(corpus: Path, out: Path, tokenizer: Path) -> Path:
    """80 documents of 5-40 words cut from ``corpus``, prepared as a text stream with ``tokenizer``."""
    from shardlm.data import prepare_corpus

    out.mkdir(parents=True)
    words = corpus.read_text().split()[:20000]
    gen = torch.Generator().manual_seed(5)
    with (out / "docs.jsonl").open("w") as f:
        for _ in range(80):
            n = int(torch.randint(5, 40, (), generator=gen))
            start = int(torch.randint(0, len(words) - n, (), generator=gen))
            f.write(json.dumps({"text": " ".join(words[start:start + n])}) + "\n")
    prepare_corpus(str(out / "docs.jsonl"), str(out / "data"), str(tokenizer), 512, 0.1)
    return out / "data"


@pytest.fixture(scope="module")
def cp_runs(small_data, small_corpus, tmp_path_factory):
    from conftest import run_scenarios, scenario, tiny_overrides
    from shardlm.cli.train import main as train_main

    runs = tmp_path_factory.mktemp("cp")
    assert train_main(tiny_overrides(small_data, runs / "one", STEPS)) == 0  # one process, in this one
    assert train_main(tiny_overrides(small_data, runs / "one_window", WINDOW)) == 0
    docs = short_documents(small_corpus, runs / "docs", small_data / "tokenizer.json")
    assert train_main(tiny_overrides(docs, runs / "one_docs", DOCS)) == 0
    assert train_main(tiny_overrides(docs, runs / "one_gpt_oss_window", GPT_OSS_WINDOW)) == 0
    assert train_main(tiny_overrides(small_data, runs / "one_gpt_oss_long_window", GPT_OSS_LONG_WINDOW)) == 0
    # 4 ranks: FSDP 2 x CP 2 with full activation checkpointing (the all-gather of K and V runs again in the
    # recompute); CP 2 composed with TP 2 (one data-parallel rank; also with a sliding window and block-causal
    # documents: CP's masks on the local heads), with HSDP (2 replicas of a 1-rank shard group) and with DDP 2
    out = run_scenarios(4, [
        scenario("fsdp2_cp2", small_data, runs, {**STEPS, "parallel.cp": 2, "train.micro_batch_size": 4,
                                                  "parallel.activation_checkpoint": '"full"'}),
        scenario("tp2_cp2", small_data, runs, {**STEPS, "parallel.cp": 2, "parallel.tp": 2}),
        scenario("tp2_cp2_window", small_data, runs, {**WINDOW, "parallel.cp": 2, "parallel.tp": 2}),
        scenario("tp2_cp2_docs", docs, runs, {**DOCS, "parallel.cp": 2, "parallel.tp": 2}),
        scenario("hsdp2_cp2", small_data, runs, {**STEPS, "parallel.cp": 2, "parallel.dp_replicate": 2,
                                                  "train.micro_batch_size": 4}),
        scenario("ddp2_cp2", small_data, runs, {**STEPS, "parallel.cp": 2, "parallel.mode": '"ddp"',
                                                 "train.micro_batch_size": 4}),
    ], runs)
    resume = {**STEPS, "train.micro_batch_size": 4}  # FSDP 2, no CP: step 3 from a step-2 checkpoint
    out.update(run_scenarios(2, [
        scenario("cp2", small_data, runs, {**STEPS, "parallel.cp": 2}),
        scenario("cp2_window", small_data, runs, {**WINDOW, "parallel.cp": 2}),
        scenario("cp2_docs", docs, runs, {**DOCS, "parallel.cp": 2}),
        scenario("cp2_gpt_oss_window", docs, runs, {**GPT_OSS_WINDOW, "parallel.cp": 2}),
        scenario("cp2_gpt_oss_long_window", small_data, runs, {**GPT_OSS_LONG_WINDOW, "parallel.cp": 2}),
        scenario("resumed_fsdp2", small_data, runs, {
            **resume, "checkpoint.resume": f'"{runs / "cp2/checkpoints/step-2"}"'}),
        scenario("tp2_cp2_to_fsdp2", small_data, runs, {
            **resume, "checkpoint.resume": f'"{runs / "tp2_cp2/checkpoints/step-2"}"'}),
    ], runs))
    # one process (in this one) resumes the TP 2 x CP 2 checkpoint
    assert train_main(tiny_overrides(small_data, runs / "tp2_cp2_to_one", {
        **STEPS, "checkpoint.resume": f'"{runs / "tp2_cp2/checkpoints/step-2"}"'})) == 0
    return runs, out


def logged(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.dist
@pytest.mark.parametrize("name,reference", [
    ("cp2", "one"), ("fsdp2_cp2", "one"), ("cp2_window", "one_window"), ("cp2_docs", "one_docs"),
    ("tp2_cp2", "one"), ("hsdp2_cp2", "one"), ("ddp2_cp2", "one"), ("tp2_cp2_window", "one_window"),
    ("tp2_cp2_docs", "one_docs"), ("cp2_gpt_oss_window", "one_gpt_oss_window"),
    ("cp2_gpt_oss_long_window", "one_gpt_oss_long_window")])
def test_cp_training_equals_one_process(cp_runs, name, reference):
    from safetensors.torch import load_file
    runs, out = cp_runs
    ref, hist = logged(runs / reference), out[name][0]["history"]
    assert [r["step"] for r in hist] == [r["step"] for r in ref if "loss" in r] == [1, 2, 3]
    ref_loss = [r["loss"] for r in ref if "loss" in r]
    loss_diff = max(abs(a["loss"] - b) for a, b in zip(hist, ref_loss))
    print(f"\n{name} vs {reference}: max loss diff {loss_diff:.2e} over {len(hist)} steps")
    assert_close([a["loss"] for a in hist], ref_loss, rtol=16 * EPS, what="loss")
    ref_val = [r["val_loss"] for r in ref if "val_loss" in r]
    # DOCS evaluates nothing
    assert len(ref_val) == (0 if reference in ("one_docs", "one_gpt_oss_window") else 1)
    assert_close([hist[-1]["val_loss"] for _ in ref_val], ref_val, rtol=16 * EPS, what="val loss")
    assert hist[0]["loss"] != hist[-1]["loss"]  # it trained
    p, q = (load_file(str(runs / n / "final" / "model.safetensors")) for n in (name, reference))
    # as test_fsdp_parity
    assert_all_close(p, q, rtol=1e-4, what="params")
    if "gpt_oss" in name:
        # the first step's gradient (sinks included) before AdamW's sign-like first updates amplify fp32
        # rounding in the parameters (measured: 1e-8 of the norm; parameters after 3 steps differ by up to
        # 3e-5, sinks 1e-7)
        norms = [r["grad_norm"] for r in ref if "loss" in r]
        assert_close(hist[0]["grad_norm"], norms[0], rtol=1e-6, what="step-1 gradient norm")
        assert any(k.endswith("self_attn.sinks") for k in p)


@pytest.mark.dist
@pytest.mark.parametrize("resumed,source", [("resumed_fsdp2", "cp2"), ("tp2_cp2_to_fsdp2", "tp2_cp2"),
                                            ("tp2_cp2_to_one", "tp2_cp2")])
def test_cp_checkpoint_resumes_at_cp1_exactly(cp_runs, resumed, source):
    """A step-2 checkpoint of CP 2 (and of TP 2 x CP 2) resumed without CP (FSDP 2, one process): step 3 as
    the CP run made it."""
    from safetensors.torch import load_file
    runs, out = cp_runs
    hist = (out[resumed][0]["history"] if resumed in out
            else [r for r in logged(runs / resumed) if "loss" in r])
    ref = out[source][0]["history"]
    assert [r["step"] for r in hist] == [3]
    assert_close(hist[0]["loss"], ref[-1]["loss"], rtol=16 * EPS, what="step-3 loss")
    p, q = (load_file(str(runs / n / "final" / "model.safetensors")) for n in (resumed, source))
    assert_all_close(p, q, rtol=1e-4, what="params")


@pytest.mark.dist
def test_cp_groups_and_meshes_composed_with_tp_hsdp_and_ddp(cp_runs):
    """torchtitan's order (dp_replicate, dp_shard, cp, tp), tp innermost: a CP group holds the ranks of one
    data-parallel and tensor-parallel coordinate (tp apart under TP, consecutive otherwise); FSDP shards over
    dp_shard × cp (HSDP: replicated across the replicate dimension); the ranks of a CP group read the same
    samples."""
    _, out = cp_runs
    expected = {"tp2_cp2": ([[0, 2], [1, 3], [0, 2], [1, 3]], ["dp_shard", "tp"]),
                "hsdp2_cp2": ([[0, 1], [0, 1], [2, 3], [2, 3]], ["dp_replicate", "dp_shard"]),
                "ddp2_cp2": ([[0, 1], [0, 1], [2, 3], [2, 3]], ["dp_shard"]),
                "fsdp2_cp2": ([[0, 1], [0, 1], [2, 3], [2, 3]], ["dp_shard"])}
    for name, (groups, mesh) in expected.items():
        reports = out[name]
        assert [r["cp_ranks"] for r in reports] == groups, name
        assert reports[0]["mesh"] == mesh, name
        for group in groups:  # one data-parallel rank per CP group: the same samples on its ranks
            assert reports[group[0]]["sample_ids"] == reports[group[1]]["sample_ids"], name
    assert out["hsdp2_cp2"][0]["sample_ids"] != out["hsdp2_cp2"][2]["sample_ids"]
    q_proj = "model.layers.0.self_attn.q_proj.weight"
    placements = {name: out[name][0]["params"][q_proj]["placements"] for name in expected}
    assert placements["hsdp2_cp2"] == ["R", "S(0)"]  # replicated across replicas, sharded over dp_shard × cp
    assert placements["fsdp2_cp2"] == ["S(0)"] and placements["ddp2_cp2"] == []
    assert placements["tp2_cp2"] == ["_S(0, 2)", "S(0)"]  # FSDP's rows (dp_shard × cp) of TP's column split
