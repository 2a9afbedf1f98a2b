"""Packed training under torchrun: FSDP equals one process and resumes; a backend this device lacks stops the
run before anything. The data and helpers are tests/unit/test_packing.py's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from conftest import run_scenarios, scenario
from shardlm.config import load_config
from shardlm.data.instruct import InstructionExamples, split_batch
from shardlm.data.loader import GlobalBatchSampler
from shardlm.data.packing import PackedExamples
from shardlm.model.decoder import CausalLM
from shardlm.train.loss import token_loss_sum
from test_packing import (  # noqa: F401 (fixtures)
    ROOT,
    SEQ,
    WORDS,
    doc_data,
    packed_data,
    prepare_chat_data,
    prepare_doc_data,
    prepare_mixture_data,
    write_chat_corpus,
)
from tolerance import EPS, assert_close


@pytest.fixture(scope="module")
def mixture_data(doc_data, small_data, tmp_path_factory) -> Path:
    """:func:`prepare_mixture_data` of ``doc_data``'s documents."""
    return prepare_mixture_data(tmp_path_factory.mktemp("mix"), doc_data.parent / "docs.jsonl",
                                small_data / "tokenizer.json")


@pytest.mark.dist
def test_packed_training_fsdp_equals_one_process_and_resumes(packed_data, doc_data, mixture_data, small_data,
                                                             tmp_path):
    """Packed instruction data with block-causal attention, micro-batches of one row (gradient accumulation 4
    at 1 rank, 2 at 2, 1 at 4): the rows and each step's samples are the same at 1, 2 and 4 ranks; the first
    step's loss equals the mean over the same examples' response tokens computed one by one (1e-6) at 1 and 2
    ranks; FSDP at 2 and at 4 ranks equals one process over 4 steps (1e-6); a run resumed at step 2 continues
    bit for bit. Pre-training with block-causal attention over windows that cross documents, from one corpus
    and from a mixture of two sources: 2 ranks = 1 process over 3 steps (1e-6); the trained model's
    block-causal evaluation (``shardlm.eval --attention block_causal``) at 2 ranks = 1 process."""
    extra = {"data.format": '"instruct"', "data.pack": "true", "model.attention": '"block_causal"',
             "data.corpus": f'"{packed_data.parent / "chat.jsonl"}"', "data.val_fraction": 0.1,
             "train.seq_len": SEQ, "train.global_batch_size": 4, "train.micro_batch_size": 1,
             "train.steps": 4, "train.eval_interval": 4, "train.grad_clip": 0.0, "checkpoint.interval": 2,
             "checkpoint.keep": 0}
    runs = tmp_path / "runs"
    step2 = runs / "packed2" / "checkpoints" / "step-2"
    docs = {"model.attention": '"block_causal"', "data.corpus": f'"{doc_data.parent / "docs.jsonl"}"',
            "data.tokenizer": f'"{small_data / "tokenizer.json"}"', "data.val_fraction": 0.1,
            "train.seq_len": SEQ, "train.steps": 3, "train.eval_interval": 3, "train.micro_batch_size": 2}
    mix = {**docs, "data.corpus": '""', "data.val_fraction": 0.2, "data.sources":
           f'[{{path = "{mixture_data.parent / "a.jsonl"}", weight = 0.7, name = "a"}}, '
           f'{{path = "{mixture_data.parent / "b.jsonl"}", weight = 0.3, name = "b"}}]'}
    out = run_scenarios(1,
                        [scenario("packed1", packed_data, runs, extra),
                         scenario("doc1", doc_data, runs, docs),
                            scenario("mix1", mixture_data, runs, mix)], tmp_path / "out1")
    out.update(run_scenarios(2,
                             [scenario("doc2", doc_data, runs, docs),
                              scenario("packed2", packed_data, runs, extra),
                                 scenario("mix2", mixture_data, runs, mix),
                                 scenario("packed2_resume", packed_data, runs,
                                          {**extra, "checkpoint.resume": f'"{step2}"'})], tmp_path / "out2"))
    out.update(run_scenarios(4, [scenario("packed4", packed_data, runs, {**extra, "checkpoint.interval": 0})],
                             tmp_path / "out4"))
    cfg = load_config(None, scenario("packed1", packed_data, runs, extra)["overrides"])
    packed = PackedExamples(InstructionExamples(str(packed_data), "train", SEQ, skip_untrainable=True),
                            cfg.train.seed)
    assert all(r["rows"] == packed.rows for name in ("packed1", "packed2", "packed2_resume", "packed4")
               for r in out[name])  # the same rows at every rank and world size
    assert out["doc1"][0]["rows"] is None
    assert out["doc1"][0]["document_source"] == out["mix2"][1]["document_source"] == "recorded"
    sampler = GlobalBatchSampler(len(packed), 4, cfg.train.seed)
    for step in range(4):
        for name in ("packed1", "packed2", "packed4"):
            assert [i for r in out[name] for i in r["sample_ids"][str(step)]] == sampler.step_ids(step), name
    # step 1 at the initial weights: the examples of its rows, one by one
    model = CausalLM(cfg.model)
    model.init_weights(cfg.train.seed)
    examples = [e for i in sampler.step_ids(0) for e in packed.rows[i]]
    plain = packed.examples
    with torch.no_grad():
        alone = sum(
            token_loss_sum(model(split_batch(plain.get([e]))[0]), split_batch(plain.get([e]))[1]).double()
            for e in examples
        ).item() / plain.num_targets(examples)
    one, two = out["packed1"][0]["history"], out["packed2"][0]["history"]
    assert_close([one[0]["loss"], two[0]["loss"]], [alone, alone], rtol=16 * EPS, what="step 1 vs alone")
    assert [h["step"] for h in one] == [1, 2, 3, 4]
    four = out["packed4"][0]["history"]
    assert len(one) == len(two) == len(four)
    for other, what in ((two, "2 ranks"), (four, "4 ranks")):
        assert_close([h["loss"] for h in other], [h["loss"] for h in one], rtol=16 * EPS, what=what)
    assert_close(two[-1]["val_loss"], one[-1]["val_loss"], rtol=16 * EPS, what="val loss")
    resumed = out["packed2_resume"][0]["history"]
    assert [h["step"] for h in resumed] == [3, 4]
    assert [h["loss"] for h in resumed] == [h["loss"] for h in two[2:]]  # same world size: bit for bit
    doc1, doc2 = out["doc1"][0]["history"], out["doc2"][0]["history"]
    assert [h["step"] for h in doc1] == [1, 2, 3]
    assert_close([h["loss"] for h in doc2], [h["loss"] for h in doc1], rtol=16 * EPS, what="doc loss")
    assert_close(doc2[-1]["val_loss"], doc1[-1]["val_loss"], rtol=16 * EPS, what="doc val loss")
    # a mixture of two sources, block-causal
    mix1, mix2 = out["mix1"][0]["history"], out["mix2"][0]["history"]
    assert [h["step"] for h in mix1] == [1, 2, 3] and mix1[0]["loss"] != doc1[0]["loss"]
    assert_close([h["loss"] for h in mix2], [h["loss"] for h in mix1], rtol=16 * EPS, what="mixture loss")
    assert_close(mix2[-1]["val_loss"], mix1[-1]["val_loss"], rtol=16 * EPS, what="mixture val loss")
    # the trained model's block-causal evaluation of the prepared data: 2 ranks = 1 process
    from conftest import torchrun

    args = ["--model", str(runs / "doc1" / "final"), "--data", str(doc_data), "--attention", "block_causal",
            "--context", str(SEQ), "--batch-size", "2", "--json"]
    e1 = json.loads(torchrun(1, ["-m", "shardlm.eval", *args]).stdout.strip().splitlines()[-1])
    e2 = json.loads(torchrun(2, ["-m", "shardlm.eval", *args]).stdout.strip().splitlines()[-1])
    assert e1["tokens"] == e2["tokens"] > 0 and e2["world_size"] == 2
    assert_close(e2["mean_loss"], e1["mean_loss"], rtol=16 * EPS, what="eval mean loss")
    print(f"\npacked loss per step, 1 rank: {[h['loss'] for h in one]}; 2 ranks: {[h['loss'] for h in two]}; "
          f"one by one at step 1: {alone}; block-causal eval {e1['mean_loss']:.6f} (1 rank), "
          f"{e2['mean_loss']:.6f} (2 ranks), {e1['tokens']} tokens")


@pytest.mark.dist
def test_training_with_a_backend_this_device_lacks_stops_before_anything(tmp_path):
    """``shardlm.train`` with the flex backend on CPU (no flex backward): one error line, exit 2, before the
    data is prepared or the run directory made."""
    from conftest import torchrun

    proc = torchrun(1, ["-m", "shardlm.train", "--config", str(ROOT / "configs/shakespeare-tiny.toml"),
                        "--model.attention=block_causal", "--model.attention_backend=flex", "--train.steps=1",
                        f"--data.dir={tmp_path / 'data'}", f"--run.dir={tmp_path / 'run'}"], check=False)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert errors == ["error: model.attention_backend='flex' cannot train on CPU: PyTorch "
                      f"{torch.__version__}'s flex_attention has no backward there; use 'sdpa' (a dense "
                      "mask) or 'auto'"], proc.stderr[-2000:]
    assert "exitcode  : 2" in proc.stderr and proc.returncode != 0
    assert not (tmp_path / "data").exists() and not (tmp_path / "run").exists()
