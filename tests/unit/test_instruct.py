"""Instruction tuning in one process: the response-only mask, and an example without a response named by its
line."""

from __future__ import annotations

import json
from pathlib import Path

from shardlm.cli.main import main as shardlm_main
from shardlm.data.chat import ChatTemplate
from shardlm.data.instruct import read_instructions

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples" / "instruct-shakespeare.jsonl"


def test_mask_covers_exactly_the_responses(small_data):
    """shardlm's default template on its own tokenizer: each reply (with its leading space) and the
    end-of-document token that ends it are trained, nothing else (not the newline the template prints
    after it)."""
    for use_transformers in (True, False):
        chat = ChatTemplate(small_data / "tokenizer.json", use_transformers=use_transformers)
        assert chat.special_tokens["eos_token"] == "<|end_of_document|>"
        for line, messages in read_instructions(str(EXAMPLES)):
            ids, mask = chat.encode(messages, False, f"line {line}")
            trained = chat.tokenizer.decode([i for i, m in zip(ids, mask) if m], skip_special_tokens=False)
            expected = "".join(
                f" {m['content']}<|end_of_document|>" for m in messages if m["role"] == "assistant"
            )
            assert trained == expected and len(ids) == len(mask)
            assert chat.tokenizer.decode(ids, skip_special_tokens=False) == chat.render(messages)


def test_instruction_data_with_no_response_names_the_line(tmp_path, capsys, small_data):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "Hi", "response": "Hello"}) + "\n\n"
                   + json.dumps({"messages": [{"role": "user", "content": "Only a question?"}]}) + "\n")
    capsys.readouterr()
    code = shardlm_main(["prepare", "--config", str(ROOT / "configs/shakespeare-tiny.toml"),
                         "--data.format=instruct", f"--data.corpus={bad}",
                         f"--data.tokenizer={small_data / 'tokenizer.json'}", f"--data.dir={tmp_path / 'd'}"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.startswith(f"error: {bad}:3: no response") and len(err.splitlines()) == 1, err
    assert not (tmp_path / "d").exists()
