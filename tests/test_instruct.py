"""Instruction tuning: response-only loss, independent of how the global batch is split (1x4, 2x2, 4x1)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import run_scenarios, tiny_overrides
from shardlm.cli.main import main as shardlm_main
from shardlm.data.chat import ChatTemplate
from shardlm.data.instruct import InstructionExamples, prepare_instructions, read_instructions

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples" / "instruct-shakespeare.jsonl"


@pytest.fixture(scope="module")
def instruct_data(small_data, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("instruct") / "data"
    prepare_instructions(str(EXAMPLES), str(out), str(small_data / "tokenizer.json"), 512, 0.2)
    return out


def test_mask_covers_exactly_the_responses(small_data):
    """shardlm's default template on its own tokenizer: each reply (with its leading space) and the
    end-of-document token that ends it are trained, nothing else (not the newline the template prints after it)."""
    for use_transformers in (True, False):
        chat = ChatTemplate(small_data / "tokenizer.json", use_transformers=use_transformers)
        assert chat.special_tokens["eos_token"] == "<|end_of_document|>"
        for line, messages in read_instructions(str(EXAMPLES)):
            ids, mask = chat.encode(messages, False, f"line {line}")
            trained = chat.tokenizer.decode([i for i, m in zip(ids, mask) if m], skip_special_tokens=False)
            expected = "".join(f" {m['content']}<|end_of_document|>" for m in messages if m["role"] == "assistant")
            assert trained == expected and len(ids) == len(mask)
            assert chat.tokenizer.decode(ids, skip_special_tokens=False) == chat.render(messages)


@pytest.mark.dist
def test_batch_split_does_not_change_the_loss(instruct_data, tmp_path):
    data = InstructionExamples(str(instruct_data), "train", 96)
    responses = [int((data.get([i])[0, 1, 1:] != -100).sum()) for i in range(len(data))]
    assert len(set(responses)) > 4  # response lengths differ between samples
    extra = {"data.format": '"instruct"', "train.seq_len": 96, "model.max_seq_len": 128, "train.global_batch_size": 4,
             "train.micro_batch_size": 1, "train.steps": 3, "train.eval_interval": 3, "train.grad_clip": 0.0}
    results = {}
    for nproc in (1, 2, 4):
        name = f"instruct{nproc}x{4 // nproc}"
        overrides = tiny_overrides(instruct_data, tmp_path / name, extra)
        results[name] = run_scenarios(nproc, [{"name": name, "config": None, "overrides": overrides}],
                                      tmp_path / f"out{nproc}")[name][0]["history"]
    ref = results["instruct1x4"]
    for name, history in results.items():
        for a, b in zip(ref, history):
            assert abs(a["loss"] - b["loss"]) <= 1e-6, (name, a["step"], a["loss"], b["loss"])
        assert abs(ref[-1]["val_loss"] - history[-1]["val_loss"]) <= 1e-6, name
    print("\ninstruction loss per step: " + ", ".join(
        f"{n}: {[round(h['loss'], 7) for h in hist]}" for n, hist in results.items()))


def test_instruction_data_with_no_response_names_the_line(tmp_path, capsys, small_data):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "Hi", "response": "Hello"}) + "\n\n"
                   + json.dumps({"messages": [{"role": "user", "content": "Only a question?"}]}) + "\n")
    capsys.readouterr()
    code = shardlm_main(["prepare", "--config", str(ROOT / "configs/shakespeare-tiny.toml"), "--data.format=instruct",
                         f"--data.corpus={bad}", f"--data.tokenizer={small_data / 'tokenizer.json'}",
                         f"--data.dir={tmp_path / 'd'}"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.startswith(f"error: {bad}:3: no response") and len(err.splitlines()) == 1, err
    assert not (tmp_path / "d").exists()
