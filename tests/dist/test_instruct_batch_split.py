"""Instruction tuning: the response-only loss is independent of how the global batch is split (1x4, 2x2,
4x1), at 1, 2 and 4 ranks, with the plain sample order and grouped by length (``data.group_by_length_steps``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import run_scenarios, tiny_overrides
from shardlm.data.instruct import InstructionExamples, prepare_instructions
from test_instruct import EXAMPLES
from tolerance import EPS, assert_close


@pytest.fixture(scope="module")
def instruct_data(small_data, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("instruct") / "data"
    prepare_instructions(str(EXAMPLES), str(out), str(small_data / "tokenizer.json"), 512, 0.2)
    return out


@pytest.mark.dist
def test_batch_split_does_not_change_the_loss(instruct_data, tmp_path):
    data = InstructionExamples(str(instruct_data), "train", 96)
    responses = [int((data.get([i])[0, 1, 1:] != -100).sum()) for i in range(len(data))]
    assert len(set(responses)) > 4  # response lengths differ between samples
    extra = {"data.format": '"instruct"', "train.seq_len": 96, "model.max_seq_len": 128,
             "train.global_batch_size": 4, "train.micro_batch_size": 1, "train.steps": 3,
             "train.eval_interval": 3, "train.grad_clip": 0.0}
    results = {}
    for nproc in (1, 2, 4):  # one launch each: the plain order and the length-grouped one
        names = {f"instruct{nproc}x{4 // nproc}": extra,
                 f"grouped{nproc}x{4 // nproc}": {**extra, "data.group_by_length_steps": 3}}
        out = run_scenarios(nproc, [{"name": n, "config": None, "overrides": tiny_overrides(
            instruct_data, tmp_path / n, e)} for n, e in names.items()], tmp_path / f"out{nproc}")
        results.update({n: out[n][0]["history"] for n in names})
    for name, history in results.items():
        ref = results["grouped1x4" if name.startswith("grouped") else "instruct1x4"]
        assert len(history) == len(ref)
        assert_close([b["loss"] for b in history], [a["loss"] for a in ref], rtol=16 * EPS,
                     what=f"{name} loss")
        assert_close(history[-1]["val_loss"], ref[-1]["val_loss"], rtol=16 * EPS, what=f"{name} val loss")
    print("\ninstruction loss per step: " + ", ".join(
        f"{n}: {[round(h['loss'], 7) for h in hist]}" for n, hist in results.items()))
