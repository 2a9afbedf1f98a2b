"""The tokenizer opened once per instruction preparation (``shardlm.data.tokenizer_files.open_tokenizer``) and
handed to each step: ``tokenizer.json`` is parsed once by shardlm (and once by transformers for its own chat
rendering), where each step used to read it again (7 parses for a tokenizer without ``tokenizer_config.json``)."""

from __future__ import annotations

import json

import pytest
import tokenizers

from shardlm.data.instruct import prepare_instructions
from shardlm.data.tokenizer import train_tokenizer
from shardlm.data.tokenizer_files import model_special_ids, open_tokenizer

transformers = pytest.importorskip("transformers", reason="pip install -e '.[test]'")


def test_instruction_preparation_parses_the_tokenizer_once(tmp_path, monkeypatch):
    train_tokenizer(["hello world, this is a test of the tokenizer " * 50], 300).save(str(tmp_path / "tokenizer.json"))
    lines = [{"messages": [{"role": "user", "content": f"hi {i}"}, {"role": "assistant", "content": f"hello {i}"}]}
             for i in range(4)]
    (tmp_path / "chat.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    parsed = []
    from_file = tokenizers.Tokenizer.from_file
    monkeypatch.setattr(tokenizers.Tokenizer, "from_file", lambda path, *a, **k: parsed.append(path) or from_file(path, *a, **k))
    meta = prepare_instructions(str(tmp_path / "chat.jsonl"), str(tmp_path / "out"), str(tmp_path / "tokenizer.json"),
                                512, 0.25, identity={"test": True})
    assert parsed == [str(tmp_path / "tokenizer.json")] * 2, parsed  # shardlm's one, transformers' own
    assert meta["train_examples"] == 3 and meta["val_examples"] == 1
    opened = open_tokenizer(tmp_path / "tokenizer.json")  # the same answers as reading the files again
    assert meta["model_special_ids"] == model_special_ids(opened) == model_special_ids(tmp_path / "tokenizer.json")
    assert (tmp_path / "out" / "tokenizer_config.json").is_file()
