"""Context parallelism across ranks: CP 2 attention equals one-rank attention (forward and gradients), CP
training equals one process, and a CP 2 checkpoint resumes at CP 1 x FSDP 2 exactly (tests/workers/cp_worker.py
and the dist worker)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from conftest import torchrun

WORKER = Path(__file__).resolve().parents[1] / "workers" / "cp_worker.py"


@pytest.mark.dist
def test_cp2_attention_equals_one_rank_forward_and_grads(tmp_path):
    out = tmp_path / "cp.json"
    torchrun(2, [str(WORKER), str(out)], timeout=240)
    results = json.loads(out.read_text())
    assert set(results) == {"causal_odd", "block_causal_odd", "sliding_window", "sliding_block_causal_odd"}
    for name, r in results.items():
        for key in ("out", "dq", "dk", "dv"):
            assert r[key] <= 1e-6, (name, key, r[key])
    assert not results["causal_odd"]["dense_mask"]  # plain causal: SDPA's causal kernel, no T x T mask
    assert all(results[n]["dense_mask"] for n in ("block_causal_odd", "sliding_window", "sliding_block_causal_odd"))
    assert results["causal_odd"]["padding_total"] == 3 and results["sliding_block_causal_odd"]["padding_total"] == 1
    for name in ("block_causal_odd", "sliding_window", "sliding_block_causal_odd"):
        assert results[name]["vs_causal"] > 0.1, name  # documents and windows change the result


# ---- training: CP 2 and FSDP 2 x CP 2 equal one process; a CP 2 checkpoint resumes at CP 1 ---------------------
STEPS = {"train.steps": 3, "train.seq_len": 30, "train.eval_interval": 3, "train.eval_tokens": 960,
         "train.warmup_steps": 1, "checkpoint.interval": 1, "checkpoint.keep": 0}
#: Mistral's sliding window (8 of the 30 tokens): CP's masked path in training
WINDOW = {**STEPS, "model.family": '"mistral"', "model.sliding_window": 8}
#: block-causal attention over windows that cross document boundaries (document ids sharded with the tokens)
DOCS = {**STEPS, "model.attention": '"block_causal"', "train.eval_interval": 0}


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
    out = run_scenarios(2, [
        scenario("cp2", small_data, runs, {**STEPS, "parallel.cp": 2}),
        scenario("cp2_window", small_data, runs, {**WINDOW, "parallel.cp": 2}),
        scenario("cp2_docs", docs, runs, {**DOCS, "parallel.cp": 2}),
        # the CP 2 run's step-2 checkpoint, resumed with FSDP 2 and no CP: step 3 as the CP 2 run made it
        scenario("resumed_fsdp2", small_data, runs, {**STEPS, "train.micro_batch_size": 4,
                                                     "checkpoint.resume": f'"{runs / "cp2" / "checkpoints/step-2"}"'}),
    ], runs)
    # FSDP 2 x CP 2, with full activation checkpointing (the all-gather of K and V runs again in the recompute)
    out.update(run_scenarios(4, [scenario("fsdp2_cp2", small_data, runs, {
        **STEPS, "parallel.cp": 2, "train.micro_batch_size": 4, "parallel.activation_checkpoint": '"full"'})], runs))
    return runs, out


def logged(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.dist
@pytest.mark.parametrize("name,reference", [("cp2", "one"), ("fsdp2_cp2", "one"), ("cp2_window", "one_window"),
                                            ("cp2_docs", "one_docs")])
def test_cp_training_equals_one_process(cp_runs, name, reference):
    from safetensors.torch import load_file
    runs, out = cp_runs
    ref, hist = logged(runs / reference), out[name][0]["history"]
    assert [r["step"] for r in hist] == [r["step"] for r in ref if "loss" in r] == [1, 2, 3]
    ref_loss = [r["loss"] for r in ref if "loss" in r]
    loss_diff = max(abs(a["loss"] - b) for a, b in zip(hist, ref_loss))
    print(f"\n{name} vs {reference}: max loss diff {loss_diff:.2e} over {len(hist)} steps")
    assert loss_diff <= 1e-6, (hist, ref_loss)
    ref_val = [r["val_loss"] for r in ref if "val_loss" in r]
    assert len(ref_val) == (0 if name == "cp2_docs" else 1)
    assert all(abs(hist[-1]["val_loss"] - v) <= 1e-6 for v in ref_val)
    assert hist[0]["loss"] != hist[-1]["loss"]  # it trained
    p, q = (load_file(str(runs / n / "final" / "model.safetensors")) for n in (name, reference))
    assert p.keys() == q.keys() and max((p[k] - q[k]).abs().max().item() for k in p) <= 1e-4  # as test_fsdp_parity


@pytest.mark.dist
def test_cp2_checkpoint_resumes_at_cp1_fsdp2_exactly(cp_runs):
    from safetensors.torch import load_file
    runs, out = cp_runs
    resumed, cp2 = out["resumed_fsdp2"][0]["history"], out["cp2"][0]["history"]
    assert [r["step"] for r in resumed] == [3]
    assert abs(resumed[0]["loss"] - cp2[-1]["loss"]) <= 1e-6
    p, q = (load_file(str(runs / n / "final" / "model.safetensors")) for n in ("resumed_fsdp2", "cp2"))
    assert max((p[k] - q[k]).abs().max().item() for k in p) <= 1e-4
