"""Prepared data knows what it was made from: a changed corpus, text field, tokenizer or template is prepared
again (or refused) naming the change; an unchanged one is kept. Saved DatasetDict splits; "0 rows". In one
process; 2-rank training on changed data is tests/dist/test_stale_data_two_ranks.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import ROOT, cli_error
from shardlm.cli.main import main as cli_main
from shardlm.config import load_config
from shardlm.data import DataError, read_documents, train_tokenizer
from shardlm.data.build import prepare_data
from shardlm.data.tokenizer_files import write_tokenizer_files
from shardlm.errors import ConfigError

TINY = str(ROOT / "configs" / "shakespeare-tiny.toml")
WORDS = "the quick brown fox jumps over a lazy dog while seven wizards judge boxing".split()


def docs(n: int, seed: int = 0) -> list[dict]:
    return [{"text": " ".join(WORDS[(i * 7 + j + seed) % len(WORDS)] for j in range(12)),
             "body": f"row {i} {seed}"}
            for i in range(n)]


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture
def corpus(tmp_path) -> Path:
    write_jsonl(tmp_path / "corpus" / "a.jsonl", docs(400))
    write_jsonl(tmp_path / "corpus" / "b.jsonl", docs(300, seed=3))
    return tmp_path / "corpus"


@pytest.fixture
def tokenizer(tmp_path) -> Path:
    """A given tokenizer with its own tokenizer_config.json."""
    d = tmp_path / "tok"
    d.mkdir()
    train_tokenizer([r["text"] + " " + r["body"] for r in docs(400)], 300).save(str(d / "raw.json"))
    write_tokenizer_files(d / "raw.json", d)  # tokenizer.json + a synthesized tokenizer_config.json
    (d / "raw.json").unlink()
    return d / "tokenizer.json"


def token_mtimes(out: Path) -> dict[str, int]:
    return {p.name: p.stat().st_mtime_ns for p in sorted((out / "tokens").glob("*.bin"))}


def prepare(capsys, *overrides: str) -> str:
    """``shardlm prepare`` with the tiny config and ``overrides``; assert exit 0; return its stderr."""
    capsys.readouterr()
    assert cli_main(["prepare", "--config", TINY, "--model.vocab_size=300", "--workers=1", *overrides]) == 0
    return capsys.readouterr().err


def test_prepare_keeps_an_unchanged_corpus_and_prepares_a_changed_one_again(tmp_path, corpus, tokenizer,
                                                                            capsys):
    out = tmp_path / "data"
    args = [f"--data.corpus={corpus}", f"--data.dir={out}", f"--data.tokenizer={tokenizer}"]
    prepare(capsys, *args)
    meta = json.loads((out / "meta.json").read_text())
    ident = meta["identity"]
    assert [Path(i["path"]).name for i in ident["sources"][0]["inputs"]] == ["a.jsonl", "b.jsonl"]
    assert set(ident["tokenizer"]["files"]) == {"tokenizer.json", "tokenizer_config.json"}
    before = token_mtimes(out)

    err = prepare(capsys, *args)  # unchanged: not prepared again
    assert "out of date" not in err and "wrote" not in err, err
    assert f"prepare: {out} is current (the same inputs, tokenizer and settings): kept as it is" in err, err
    assert token_mtimes(out) == before
    # also not when run from another working directory through another spelling of the same path
    err = prepare(capsys, f"--data.corpus={corpus}/../corpus", f"--data.dir={out}",
                  f"--data.tokenizer={tokenizer}")
    assert "out of date" not in err and token_mtimes(out) == before, err

    a = corpus / "a.jsonl"
    raw = bytearray(a.read_bytes())
    raw[10] = ord("Q") if raw[10] != ord("Q") else ord("R")  # one byte, same size
    a.write_bytes(bytes(raw))
    err = prepare(capsys, *args)
    assert f"is out of date: data.corpus ({corpus}): {a} was modified" in err, err
    assert token_mtimes(out) != before
    after_byte = json.loads((out / "meta.json").read_text())
    assert after_byte["content_sha256"] != meta["content_sha256"]

    write_jsonl(corpus / "sub" / "c.jsonl", docs(50, seed=5))  # a file added
    err = prepare(capsys, *args)
    assert f"{corpus / 'sub' / 'c.jsonl'} added" in err, err
    assert json.loads((out / "meta.json").read_text())["documents"] == 750

    err = prepare(capsys, *args, "--data.text_field=body")
    assert 'data.text_field changed "text" -> "body"' in err, err
    assert json.loads((out / "meta.json").read_text())["identity"]["text_field"] == "body"

    config = tokenizer.parent / "tokenizer_config.json"  # only tokenizer_config.json changes
    config.write_text(json.dumps({**json.loads(config.read_text()), "model_max_length": 77}))
    err = prepare(capsys, *args, "--data.text_field=body")
    assert f"data.tokenizer: tokenizer_config.json beside {tokenizer} changed" in err, err
    assert json.loads((out / "tokenizer_config.json").read_text())["model_max_length"] == 77
    mtimes = token_mtimes(out)
    assert (
        "out of date" not in prepare(capsys, *args, "--data.text_field=body") and token_mtimes(out) == mtimes
    )

    moved = tmp_path / "moved"  # the same tokenizer files elsewhere: the same tokenizer
    moved.mkdir()
    for f in tokenizer.parent.iterdir():
        (moved / f.name).write_bytes(f.read_bytes())
    same = [f"--data.corpus={corpus}", f"--data.dir={out}", f"--data.tokenizer={moved / 'tokenizer.json'}"]
    assert (
        "out of date" not in prepare(capsys, *same, "--data.text_field=body") and token_mtimes(out) == mtimes
    )
    other = tmp_path / "other-tok.json"  # another tokenizer
    train_tokenizer([r["body"] for r in docs(400)], 270).save(str(other))
    err = prepare(capsys, f"--data.corpus={corpus}", f"--data.dir={out}", f"--data.tokenizer={other}",
                  "--data.text_field=body")
    assert f'data.tokenizer changed "{tokenizer}" -> "{other}" (a tokenizer with other files)' in err, err
    assert json.loads((out / "meta.json").read_text())["tokenizer_vocab_size"] <= 270


def test_training_prepares_its_own_directory_again_and_refuses_a_chosen_one(tmp_path, corpus, tokenizer,
                                                                           monkeypatch, capsys):
    """prepare_data as a training run calls it: the default data.dir (data/<run name>) is shardlm's and is
    prepared again; a data.dir the config names is refused, naming the change, and left as it was."""
    monkeypatch.chdir(tmp_path)
    common = [f"--data.corpus={corpus}", f"--data.tokenizer={tokenizer}", "--model.vocab_size=300",
              "--data.workers=1", "--run.name=exp"]
    prepare_data(load_config(TINY, common))
    own = tmp_path / "data" / "exp"
    before = token_mtimes(own)
    capsys.readouterr()
    prepare_data(load_config(TINY, common))
    assert token_mtimes(own) == before and "out of date" not in capsys.readouterr().err
    prepare_data(load_config(TINY, common + ["--data.val_fraction=0.2"]))
    assert "out of date: data.val_fraction changed 0.05 -> 0.2; preparing it again" in capsys.readouterr().err
    assert token_mtimes(own) != before

    chosen = [*common, f"--data.dir={own}", "--data.val_fraction=0.2"]
    prepare_data(load_config(TINY, chosen))  # the same data: used
    write_jsonl(corpus / "a.jsonl", docs(401))
    mtimes = token_mtimes(own)
    with pytest.raises(ConfigError, match=rf"data.dir {own} holds data prepared from other inputs .*"
                                          rf"{corpus / 'a.jsonl'} changed \(size \d+ -> \d+ bytes\).*shardlm "
                                          r"prepare"):
        prepare_data(load_config(TINY, chosen))
    assert token_mtimes(own) == mtimes


def test_a_preparation_without_identity_is_prepared_again_or_refused(tmp_path, corpus, tokenizer, capsys):
    out = tmp_path / "data"
    args = [f"--data.corpus={corpus}", f"--data.dir={out}", f"--data.tokenizer={tokenizer}"]
    prepare(capsys, *args)
    meta = json.loads((out / "meta.json").read_text())
    del meta["identity"]  # as an older shardlm wrote it
    (out / "meta.json").write_text(json.dumps(meta))
    cfg = load_config(TINY, [*args, "--model.vocab_size=300"])
    with pytest.raises(ConfigError,
                       match="prepared by an older shardlm that did not record what it was made from"):
        prepare_data(cfg)
    err = prepare(capsys, *args)
    assert "out of date: it was prepared by an older shardlm" in err, err
    assert "identity" in json.loads((out / "meta.json").read_text())
    prepare_data(cfg)  # now current


def test_data_made_by_another_program_is_used_with_a_note_and_never_prepared_again(tmp_path, corpus,
                                                                                   tokenizer, capsys):
    """``"identity": {"external": ...}`` in meta.json: training and ``shardlm prepare`` use it as it is, with
    a note naming what made it; the token files are not touched."""
    out = tmp_path / "data"
    args = [f"--data.corpus={corpus}", f"--data.dir={out}", f"--data.tokenizer={tokenizer}"]
    prepare(capsys, *args)
    meta = json.loads((out / "meta.json").read_text())
    meta["identity"] = {"external": "my own tokenizing script"}
    (out / "meta.json").write_text(json.dumps(meta))
    before = token_mtimes(out)
    # would differ
    prepare_data(load_config(TINY, [*args, "--model.vocab_size=300", "--data.text_field=body"]))
    assert "prepared outside shardlm (my own tokenizing script)" in capsys.readouterr().err
    err = prepare(capsys, *args, "--data.text_field=body")
    assert "prepared outside shardlm (my own tokenizing script): used as it is" in err, err
    assert (
        token_mtimes(out) == before
        and json.loads((out / "meta.json").read_text())["identity"] == meta["identity"]
    )


def test_a_trained_tokenizer_is_kept_and_its_settings_compared(tmp_path, corpus, capsys):
    out = tmp_path / "data"
    args = [f"--data.corpus={corpus}", f"--data.dir={out}"]
    prepare(capsys, *args)
    before = token_mtimes(out)
    assert "out of date" not in prepare(capsys, *args) and token_mtimes(out) == before
    err = prepare(capsys, *args, "--data.tokenizer_vocab_size=280")
    assert "data.tokenizer_vocab_size (0: model.vocab_size) changed 300 -> 280" in err, err
    # naming the trained tokenizer's own file is the same tokenizer
    copy = tmp_path / "copy"
    copy.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (copy / name).write_bytes((out / name).read_bytes())
    mtimes = token_mtimes(out)
    cfg = load_config(TINY, [*args, f"--data.tokenizer={copy / 'tokenizer.json'}", "--model.vocab_size=300"])
    prepare_data(cfg)
    assert token_mtimes(out) == mtimes


def test_a_mixture_source_that_changes_is_named(tmp_path, corpus, tokenizer, capsys):
    other = write_jsonl(tmp_path / "other.jsonl", docs(200, seed=9))
    out = tmp_path / "mix"
    sources = f'[{{path = "{corpus}", weight = 0.7, name = "main"}}, {{path = "{other}", weight = 0.3}}]'
    args = [f"--data.sources={sources}", f"--data.dir={out}", f"--data.tokenizer={tokenizer}"]
    prepare(capsys, *args)
    before = token_mtimes(out / "main")
    assert "out of date" not in prepare(capsys, *args) and token_mtimes(out / "main") == before
    write_jsonl(other, docs(201, seed=9))
    err = prepare(capsys, *args)
    assert f"out of date: data.sources 'source1' ({other}): {other} changed (size" in err, err
    sources2 = (f'[{{path = "{corpus}", weight = 0.7, name = "main"}}, {{path = "{other}", weight = 0.3, '
                'name = "x"}]')
    err = prepare(capsys, f"--data.sources={sources2}", f"--data.dir={out}", f"--data.tokenizer={tokenizer}")
    assert 'data.sources changed ["main", "source1"] -> ["main", "x"]' in err, err
    assert json.loads((out / "meta.json").read_text())["sources"][1]["name"] == "x"


def test_a_mixture_without_model_special_ids_is_prepared_again_or_refused(tmp_path, corpus, tokenizer,
                                                                          capsys):
    """A mixture prepared by a shardlm that recorded no ``model_special_ids`` (its sources had made-up ids
    and its top level no tokenizer_config.json): a training run on a chosen data.dir refuses it naming the
    cause, ``shardlm prepare`` prepares it again; nothing falls back to the data's ids."""
    other = write_jsonl(tmp_path / "other.jsonl", docs(200, seed=9))
    out = tmp_path / "mix"
    sources = f'[{{path = "{corpus}", weight = 0.7, name = "main"}}, {{path = "{other}", weight = 0.3}}]'
    args = [f"--data.sources={sources}", f"--data.dir={out}", f"--data.tokenizer={tokenizer}"]
    prepare(capsys, *args)
    fresh = json.loads((out / "meta.json").read_text())
    assert fresh["model_special_ids"] == {"bos": 0, "eos": [2], "pad": 2}  # its tokenizer_config.json's
    for meta_file in (out / "meta.json", out / "main" / "meta.json", out / "source1" / "meta.json"):
        meta = json.loads(meta_file.read_text())
        del meta["model_special_ids"]  # as an older shardlm wrote it
        meta_file.write_text(json.dumps(meta))
    (out / "tokenizer_config.json").unlink()
    cfg = load_config(TINY, [*args, "--model.vocab_size=300"])
    with pytest.raises(ConfigError, match=rf"data.dir {out} holds .*an older shardlm that did not record "
                                          r"the special ids of the tokenizer's model for a mixture .*"
                                          r"shardlm prepare"):
        prepare_data(cfg)
    err = prepare(capsys, *args)
    assert f"prepare: {out} is out of date: it was prepared by an older shardlm that did not" in err, err
    again = json.loads((out / "meta.json").read_text())
    assert again["model_special_ids"] == fresh["model_special_ids"] and again["identity"] == fresh["identity"]
    assert (out / "tokenizer_config.json").is_file()
    source = json.loads((out / "main" / "meta.json").read_text())
    assert source["model_special_ids"] == fresh["model_special_ids"]
    assert "out of date" not in prepare(capsys, *args)  # now current
    prepare_data(cfg)


TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% if m['role'] == 'assistant' %}"
            "{{ eos_token }}{% endif %}\n{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}")


def test_instruction_data_is_prepared_again_when_the_template_changes(tmp_path, tokenizer, capsys):
    examples = ROOT / "examples" / "instruct-shakespeare.jsonl"
    out = tmp_path / "inst"
    args = [f"--data.corpus={examples}", f"--data.dir={out}", f"--data.tokenizer={tokenizer}",
            '--data.format="instruct"', "--data.val_fraction=0.2", "--model.vocab_size=300"]
    prepare(capsys, *args)
    before = (out / "train.bin").stat().st_mtime_ns
    assert "out of date" not in prepare(capsys, *args) and (out / "train.bin").stat().st_mtime_ns == before
    (tokenizer.parent / "chat_template.jinja").write_text(TEMPLATE)
    err = prepare(capsys, *args)
    assert (
        f"out of date: the chat template changed (now from {tokenizer.parent / 'chat_template.jinja'})" in err
    ), err
    assert (out / "train.bin").stat().st_mtime_ns != before
    assert (out / "chat_template.jinja").is_file()
    with pytest.raises(ConfigError, match="data.val_fraction changed 0.2 -> 0.3"):
        prepare_data(load_config(TINY, args + ["--data.val_fraction=0.3"]))


# ----------------------------------------------------------------------------- saved DatasetDicts


@pytest.fixture
def dataset_dict(tmp_path) -> Path:
    datasets = pytest.importorskip("datasets")
    path = tmp_path / "dd"
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": ["train one", "train two"]}),
                          "test": datasets.Dataset.from_dict({"text": ["test one"]}),
                          "validation": datasets.Dataset.from_dict({"text": ["val one", "val two", "val 3"]})}
                         ).save_to_disk(str(path))
    return path


def test_a_split_of_a_dataset_dict_is_named_with_dir_colon_split(dataset_dict, tmp_path, tokenizer, capsys):
    assert read_documents(str(dataset_dict)) == ["train one", "train two"]
    assert read_documents(f"{dataset_dict}:validation") == ["val one", "val two", "val 3"]
    assert read_documents(f"{dataset_dict}:test") == ["test one"]
    with pytest.raises(
        DataError, match=r"dd:dev: the DatasetDict has no split 'dev' \(splits: train, test, validation\)"
    ):
        read_documents(f"{dataset_dict}:dev")
    out = tmp_path / "data"
    err = prepare(capsys, f"--data.corpus={dataset_dict}", f"--data.dir={out}",
                  f"--data.tokenizer={tokenizer}", "--data.val_fraction=0.3")
    assert (f"note: {dataset_dict} is a DatasetDict with splits train, test, validation: read 'train', not "
            f"read 'test', 'validation' (name a split as {dataset_dict}:SPLIT)") in err, err
    assert json.loads((out / "meta.json").read_text())["documents"] == 2
    err = prepare(capsys, f"--data.corpus={dataset_dict}:validation", f"--data.dir={out}",
                  f"--data.tokenizer={tokenizer}", "--data.val_fraction=0.3")
    assert (
        f'data.corpus changed "{dataset_dict}" -> "{dataset_dict}:validation"' in err and "note:" not in err
    ), err
    assert json.loads((out / "meta.json").read_text())["documents"] == 3


def test_an_empty_saved_dataset_says_0_rows(tmp_path, tokenizer, capsys):
    datasets = pytest.importorskip("datasets")
    empty = tmp_path / "empty"
    datasets.Dataset.from_dict({"text": []}).save_to_disk(str(empty))
    for tok in ("", str(tokenizer)):
        err = cli_error(capsys,
                        ["prepare", "--config", TINY, f"--data.corpus={empty}",
                         f"--data.dir={tmp_path / 'd'}",
                                 f"--data.tokenizer={tok}", "--model.vocab_size=300", "--workers=1"])
        assert err == f"error: empty corpus: {empty} has 0 rows", err
    assert not (tmp_path / "d").exists()
    dd = tmp_path / "dd"
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": []})}).save_to_disk(str(dd))
    with pytest.raises(DataError, match=r"empty corpus: .*dd:train has 0 rows"):
        read_documents(f"{dd}:train")
    mixed = tmp_path / "mixed"  # an empty dataset beside other data is no error: it adds nothing
    datasets.Dataset.from_dict({"text": []}).save_to_disk(str(mixed / "empty"))
    write_jsonl(mixed / "b.jsonl", [{"text": "one"}, {"text": "two"}])
    assert read_documents(str(mixed)) == ["one", "two"]


def test_a_resume_compares_the_tokens_not_when_the_inputs_were_touched():
    """Identical data prepared again (a touched corpus) keeps a run resumable: the checkpoint's meta.json
    record is compared without its identity (modification times); other tokens are still refused."""
    from shardlm.checkpoint.resume_config import data_problems

    stored = {"content_sha256": "aa", "train_tokens": 5,
              "identity": {"sources": [{"inputs": [{"mtime_ns": 1}]}]}}
    again = {**stored, "identity": {"sources": [{"inputs": [{"mtime_ns": 2}]}]}}
    assert data_problems({"data": stored}, again, None) == []
    other = {**again, "content_sha256": "bb"}
    assert data_problems({"data": stored}, other, None) == [
        'the prepared data differs from the checkpoint\'s (meta.json: content_sha256 "aa" -> "bb")']
    # an older mixture prepared again records its tokenizer's model ids: the same tokens, still resumable
    ids = {"bos": 0, "eos": [1, 2], "pad": 1}
    assert data_problems({"data": stored}, {**again, "model_special_ids": ids}, None) == []
    with_ids = {**stored, "model_special_ids": ids}
    assert data_problems({"data": with_ids}, {**again, "model_special_ids": {}}, None) == [
        'the prepared data differs from the checkpoint\'s (meta.json: model_special_ids '
        '{"bos": 0, "eos": [1, 2], "pad": 1} -> {})']
