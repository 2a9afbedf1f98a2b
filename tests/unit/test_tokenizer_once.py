"""The tokenizer opened once per instruction preparation (``shardlm.data.tokenizer_files.open_tokenizer``) and
handed to each step: ``tokenizer.json`` is parsed once by shardlm (and once by transformers for its own chat
rendering), where each step used to read it again (7 parses for a tokenizer without
``tokenizer_config.json``). Preference and pre-training preparation likewise (pre-training: once per rank; it
was 5 parses for a given tokenizer, 3 for a trained one, 5 per source of a mixture)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import tokenizers

from shardlm.config import DataSource
from shardlm.data.instruct import prepare_instructions
from shardlm.data.mixture import prepare_mixture
from shardlm.data.preference import prepare_preferences
from shardlm.data.prepare import prepare_corpus
from shardlm.data.tokenizer import load_tokenizer, special_token_ids, train_tokenizer
from shardlm.data.tokenizer_files import model_special_ids, open_tokenizer

transformers = pytest.importorskip("transformers", reason="pip install -e '.[test]'")


def test_instruction_preparation_parses_the_tokenizer_once(tmp_path, monkeypatch):
    train_tokenizer(["hello world, this is a test of the tokenizer " * 50], 300).save(
        str(tmp_path / "tokenizer.json")
    )
    lines = [{"messages": [{"role": "user", "content": f"hi {i}"},
                           {"role": "assistant", "content": f"hello {i}"}]}
             for i in range(4)]
    (tmp_path / "chat.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    parsed = []
    from_file = tokenizers.Tokenizer.from_file
    monkeypatch.setattr(tokenizers.Tokenizer, "from_file",
                        lambda path, *a, **k: parsed.append(path) or from_file(path, *a, **k))
    meta = prepare_instructions(str(tmp_path / "chat.jsonl"), str(tmp_path / "out"),
                                str(tmp_path / "tokenizer.json"), 512, 0.25, identity={"test": True})
    assert parsed == [str(tmp_path / "tokenizer.json")] * 2, parsed  # shardlm's one, transformers' own
    assert meta["train_examples"] == 3 and meta["val_examples"] == 1
    opened = open_tokenizer(tmp_path / "tokenizer.json")  # the same answers as reading the files again
    assert (
        meta["model_special_ids"]
        == model_special_ids(opened)
        == model_special_ids(tmp_path / "tokenizer.json")
    )
    assert (tmp_path / "out" / "tokenizer_config.json").is_file()


def test_preference_preparation_parses_the_tokenizer_once(tmp_path, monkeypatch):
    """As instruction data: shardlm's one parse and transformers' own for its chat rendering (it was 5)."""
    tokenizer = tmp_path / "tokenizer.json"
    train_tokenizer(["hello world, this is a test of the tokenizer " * 50], 300).save(str(tokenizer))
    rows = [{"prompt": f"hi {i}", "chosen": f"hello {i}", "rejected": f"go away {i}"} for i in range(4)]
    (tmp_path / "pairs.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    parsed = count_parses(monkeypatch)
    meta = prepare_preferences(str(tmp_path / "pairs.jsonl"), str(tmp_path / "out"), str(tokenizer), 512,
                               0.25, identity={"test": True})
    assert parsed == [str(tokenizer)] * 2, parsed  # shardlm's one, transformers' own
    assert meta["train_pairs"] == 3 and meta["val_pairs"] == 1
    assert meta["model_special_ids"] == model_special_ids(tokenizer) == {"bos": 0, "eos": [2], "pad": 2}
    written = json.loads((tmp_path / "out" / "tokenizer_config.json").read_text())
    assert written["eos_token"] == "<|end_of_document|>" and "chat_template" in written


def count_parses(monkeypatch) -> list[str]:
    """The paths ``tokenizers.Tokenizer.from_file`` parses from now on, in order (filled in as it runs)."""
    parsed: list[str] = []
    from_file = tokenizers.Tokenizer.from_file
    monkeypatch.setattr(tokenizers.Tokenizer, "from_file",
                        lambda path, *a, **k: parsed.append(path) or from_file(path, *a, **k))
    return parsed


def test_pre_training_preparation_parses_the_tokenizer_once(tmp_path, monkeypatch):
    """A given tokenizer is parsed once (its special ids, config files and encoding all from that object); a
    trained one not at all (the object in memory, whose saved file encodes the same ids); a mixture's once
    for all its sources."""
    words = "the of and to in is that it was for on are as with his they at be this from".split()
    docs = [" ".join(words[(i * 7 + j) % len(words)] for j in range(40 + i)) for i in range(30)]
    corpus = tmp_path / "docs.jsonl"
    corpus.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    given = tmp_path / "tok" / "tokenizer.json"
    given.parent.mkdir()
    train_tokenizer(docs[:10], 300).save(str(given))
    parsed = count_parses(monkeypatch)
    quiet = {"log": lambda _m: None}
    given_meta = prepare_corpus(str(corpus), str(tmp_path / "given"), str(given), 512, 0.2, **quiet)
    assert parsed == [str(given)], parsed
    assert given_meta["model_special_ids"] == model_special_ids(given) == {"bos": 0, "eos": [2], "pad": 2}
    staged_config = json.loads((tmp_path / "given" / "tokenizer_config.json").read_text())
    assert staged_config["eos_token"] == "<|end_of_document|>"
    parsed.clear()
    meta = prepare_corpus(str(corpus), str(tmp_path / "trained"), None, 400, 0.2, **quiet)
    assert parsed == [], parsed  # the trained object itself, not its file read back
    saved = load_tokenizer(str(tmp_path / "trained" / "tokenizer.json"))
    assert meta["model_special_ids"] == model_special_ids(tmp_path / "trained" / "tokenizer.json")
    special = special_token_ids(saved)
    stream = np.fromfile(tmp_path / "trained" / meta["shards"][0]["file"], dtype=np.uint16).tolist()
    first = saved.encode(docs[0]).ids  # BOS doc0 EOD doc1 ...: the saved file encodes what was written
    assert stream[:len(first) + 2] == [special["bos"], *first, special["eod"]] and len(first) > 20
    parsed.clear()
    sources = [DataSource(str(corpus), 0.5, "a"), DataSource(str(corpus), 0.5, "b")]
    mixture = prepare_mixture(sources, str(tmp_path / "mixture"), str(given), 512, 0.2)
    assert parsed == [str(given)], parsed  # read where it lies (its model's files), once for all its sources
    assert mixture["model_special_ids"] == given_meta["model_special_ids"]
    # both sources are the corpus, encoded with the given tokenizer: the same content as its own preparation
    assert mixture["content_sha256"] == 2 * given_meta["content_sha256"][:16]


def test_a_restart_reads_the_tokenizer_an_earlier_run_trained_once(tmp_path, monkeypatch):
    """Killed after staging its trained tokenizer, a preparation run again reads that staged file once and
    writes the data a clean run writes."""
    import shardlm.data.prepare as prepare

    corpus = tmp_path / "docs.jsonl"
    corpus.write_text("".join(json.dumps({"text": f"document {i} " + "words in a row " * (i + 5)}) + "\n"
                              for i in range(20)))
    clean = prepare_corpus(str(corpus), str(tmp_path / "clean"), None, 400, 0.2, log=lambda _m: None)

    def killed(*_a, **_k):
        raise KeyboardInterrupt

    with monkeypatch.context() as m:
        m.setattr(prepare, "encode_pieces", killed)
        with pytest.raises(KeyboardInterrupt):
            prepare_corpus(str(corpus), str(tmp_path / "out"), None, 400, 0.2, log=lambda _m: None)
    staged = prepare.staging_dir(tmp_path / "out") / "tokenizer.json"
    assert staged.is_file() and not (tmp_path / "out").exists()
    parsed = count_parses(monkeypatch)
    again = prepare_corpus(str(corpus), str(tmp_path / "out"), None, 400, 0.2, log=lambda _m: None)
    assert parsed == [str(staged)], parsed
    assert again["content_sha256"] == clean["content_sha256"]
    assert again["model_special_ids"] == clean["model_special_ids"]
