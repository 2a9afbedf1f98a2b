"""Tests for shardlm.data (fast, single process)."""

from __future__ import annotations

import json
import math
import pathlib

import numpy as np
import pytest
import torch

from shardlm.data import (
    BOS,
    EOD,
    EOS,
    DataError,
    GlobalBatchSampler,
    TokenStream,
    TokenWindows,
    eval_windows,
    is_prepared,
    load_meta,
    load_tokenizer,
    prepare_corpus,
    read_documents,
    special_token_ids,
    strip_markdown,
    train_tokenizer,
)

SAMPLE_MD = """# A Midsummer Night's Dream

## ACT I

### SCENE I. Athens. The palace of THESEUS.

_Enter THESEUS, HIPPOLYTA, PHILOSTRATE, and
Attendants_

**THESEUS**
Now, fair Hippolyta, our nuptial hour
Draws on apace; four happy days bring in
Another moon: \\[Aside\\] but, O, methinks, how slow

__\\[Awaking]_
*Exit.*
"""


def _split_tokens(out: pathlib.Path, split: str) -> np.ndarray:
    stream = TokenStream(str(out), split)
    return stream.read(0, stream.num_tokens)


def _text(n_lines: int, seed: int = 0) -> str:
    rng = np.random.default_rng(seed)
    words = "the quick brown fox jumps over lazy dog and then sleeps under a tree".split()
    return "\n".join(" ".join(rng.choice(words, size=8)) for _ in range(n_lines)) + "\n"


# ----------------------------------------------------------------------------- corpus


def test_strip_markdown_sample() -> None:
    out = strip_markdown(SAMPLE_MD)
    lines = out.split("\n")
    assert lines[0] == "A Midsummer Night's Dream"
    assert lines[2] == "ACT I"
    assert lines[4] == "SCENE I. Athens. The palace of THESEUS."
    assert lines[6] == "Enter THESEUS, HIPPOLYTA, PHILOSTRATE, and"
    assert lines[7] == "Attendants"
    assert lines[9] == "THESEUS"
    assert lines[10] == "Now, fair Hippolyta, our nuptial hour"
    assert lines[12] == "Another moon: [Aside] but, O, methinks, how slow"
    assert lines[14] == "[Awaking]"
    assert lines[15] == "Exit."
    assert len(lines) == SAMPLE_MD.rstrip("\n").count("\n") + 1  # line structure kept
    assert not any(ch in out for ch in "*_#\\")
    assert all(line == line.rstrip() for line in lines)
    assert strip_markdown("snake_case stays") == "snake_case stays"


def test_read_txt_and_md(tmp_path: pathlib.Path) -> None:
    (tmp_path / "a.txt").write_text("hello  \nworld\n")
    (tmp_path / "b.md").write_text("# Title\n\n**X**  \nline\n")
    assert read_documents(str(tmp_path / "a.txt")) == ["hello  \nworld\n"]
    assert read_documents(str(tmp_path / "b.md")) == ["Title\n\nX\nline"]


def test_read_directory_sorted_recursive(tmp_path: pathlib.Path) -> None:
    (tmp_path / "sub").mkdir()
    (tmp_path / "b.txt").write_text("bee")
    (tmp_path / "a.md").write_text("# ay")
    (tmp_path / "sub" / "c.jsonl").write_text('{"text": "see1"}\n\n{"text": "see2"}\n')
    (tmp_path / "ignored.csv").write_text("x,y")
    assert read_documents(str(tmp_path)) == ["ay", "bee", "see1", "see2"]


def test_read_jsonl_and_errors(tmp_path: pathlib.Path) -> None:
    good = tmp_path / "good.jsonl"
    good.write_text('{"text": "one"}\n\n{"text": "two", "id": 3}\n')
    assert read_documents(str(good)) == ["one", "two"]

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "one"}\n{"text": "two"\n')
    with pytest.raises(DataError, match=r"bad\.jsonl:2.*invalid JSON"):
        read_documents(str(bad))

    missing_field = tmp_path / "nofield.jsonl"
    missing_field.write_text('{"text": "one"}\n{"body": "x"}\n')
    with pytest.raises(DataError, match=r"nofield\.jsonl:2.*'text'"):
        read_documents(str(missing_field))

    wrong_type = tmp_path / "wrongtype.jsonl"
    wrong_type.write_text('{"text": 5}\n')
    with pytest.raises(DataError, match=r"wrongtype\.jsonl:1.*string"):
        read_documents(str(wrong_type))


def test_read_errors(tmp_path: pathlib.Path) -> None:
    with pytest.raises(DataError, match="does not exist"):
        read_documents(str(tmp_path / "nope.txt"))
    (tmp_path / "x.csv").write_text("a,b")
    with pytest.raises(DataError, match="unsupported file extension"):
        read_documents(str(tmp_path / "x.csv"))
    (tmp_path / "blank.txt").write_text("  \n\n\t")
    with pytest.raises(DataError, match="empty corpus"):
        read_documents(str(tmp_path / "blank.txt"))
    empty_dir = tmp_path / "empty"
    empty_dir.mkdir()
    with pytest.raises(DataError, match="empty corpus"):
        read_documents(str(empty_dir))


def test_shakespeare_corpus() -> None:
    docs = read_documents("shakespeare")
    assert len(docs) == 38
    for doc in docs:
        assert "**" not in doc
        assert not any(line.startswith("#") for line in doc.splitlines())
    assert sum(len(d) for d in docs) > 3_000_000


# ----------------------------------------------------------------------------- tokenizer


def test_tokenizer_round_trip_and_specials(tmp_path: pathlib.Path) -> None:
    docs = [_text(200, seed=i) for i in range(3)]
    tok = train_tokenizer(docs, vocab_size=400)
    assert tok.get_vocab_size() <= 400
    assert [tok.token_to_id(t) for t in (BOS, EOS, EOD)] == [0, 1, 2]
    assert special_token_ids(tok) == {"bos": 0, "eos": 1, "eod": 2}
    text = "Hello, World!  The quick brown fox\n\tjumps over 123 lazy dogs; ~`{}|\n"
    enc = tok.encode(text)
    assert 0 not in enc.ids  # no automatic BOS
    assert tok.decode(enc.ids) == text
    # deterministic
    assert train_tokenizer(docs, vocab_size=400).to_str() == tok.to_str()
    # save / load
    path = tmp_path / "tok.json"
    tok.save(str(path))
    assert load_tokenizer(str(path)).encode(text).ids == enc.ids
    with pytest.raises(DataError, match="does not exist"):
        load_tokenizer(str(tmp_path / "missing.json"))
    (tmp_path / "junk.json").write_text("{not a tokenizer")
    with pytest.raises(DataError, match="not a valid tokenizer"):
        load_tokenizer(str(tmp_path / "junk.json"))
    with pytest.raises(DataError, match="too small"):
        train_tokenizer(docs, vocab_size=100)


# ----------------------------------------------------------------------------- prepare


@pytest.fixture()
def small_corpus(tmp_path: pathlib.Path) -> pathlib.Path:
    d = tmp_path / "corpus"
    d.mkdir()
    for i in range(4):
        (d / f"doc{i}.txt").write_text(_text(60, seed=i))
    return d


def test_prepare_corpus(tmp_path: pathlib.Path, small_corpus: pathlib.Path) -> None:
    out = tmp_path / "prepared"
    meta = prepare_corpus(str(small_corpus), str(out), None, vocab_size=320, val_fraction=0.1)
    assert is_prepared(str(out))
    assert load_meta(str(out)) == json.loads(json.dumps(meta))
    assert meta["dtype"] == "uint16"
    assert meta["tokenizer_vocab_size"] <= 320
    assert meta["special_ids"] == {"bos": 0, "eos": 1, "eod": 2}
    train = _split_tokens(out, "train")
    val = _split_tokens(out, "val")
    assert len(train) == meta["train_tokens"] and len(val) == meta["val_tokens"]
    shard_bytes = sum((out / s["file"]).stat().st_size for s in meta["shards"])
    assert shard_bytes == 2 * (meta["train_tokens"] + meta["val_tokens"])

    # rebuild the stream independently: BOS doc0 EOD doc1 EOD ...
    tok = load_tokenizer(str(out / "tokenizer.json"))
    stream = [0]
    for doc in read_documents(str(small_corpus)):
        stream += tok.encode(doc, add_special_tokens=False).ids + [2]
    total = len(stream)
    assert len(train) + len(val) == total
    assert len(val) == round(0.1 * total)
    assert val.tolist() == stream[-len(val):]  # validation is the tail
    assert train.tolist() == stream[: len(train)]
    assert int(train.max()) < meta["tokenizer_vocab_size"]

    _, counts = np.unique(train, return_counts=True)
    p = counts / counts.sum()
    assert meta["unigram_entropy_nats"] == pytest.approx(float(-(p * np.log(p)).sum()))
    assert 0 < meta["unigram_entropy_nats"] < math.log(meta["tokenizer_vocab_size"])

    # re-running replaces the directory atomically and leaves no temp dirs behind
    meta2 = prepare_corpus(str(small_corpus), str(out), str(out / "tokenizer.json"), 320, 0.1)
    assert meta2["train_tokens"] == meta["train_tokens"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus", "prepared"]

    # uint32 when the model vocab exceeds 65536
    big = prepare_corpus(str(small_corpus), str(tmp_path / "big"), str(out / "tokenizer.json"), 70_000, 0.1)
    assert big["dtype"] == "uint32"
    assert _split_tokens(tmp_path / "big", "train").tolist() == train.tolist()
    assert sum((tmp_path / "big" / s["file"]).stat().st_size for s in big["shards"]) == 4 * (
        big["train_tokens"] + big["val_tokens"])


def test_prepare_single_document_gets_both_splits(tmp_path: pathlib.Path) -> None:
    f = tmp_path / "one.txt"
    f.write_text(_text(30))
    meta = prepare_corpus(str(f), str(tmp_path / "out"), None, 300, 0.2)
    assert meta["train_tokens"] > 0 and meta["val_tokens"] > 0


def test_prepare_errors(tmp_path: pathlib.Path, small_corpus: pathlib.Path) -> None:
    out = tmp_path / "prepared"
    prepare_corpus(str(small_corpus), str(out), None, vocab_size=400, val_fraction=0.1)
    before = _split_tokens(out, "train").tobytes()
    n = load_meta(str(out))["tokenizer_vocab_size"]
    with pytest.raises(DataError, match=rf"{n}.*{n - 1}"):
        prepare_corpus(str(small_corpus), str(out), str(out / "tokenizer.json"), n - 1, 0.1)
    assert _split_tokens(out, "train").tobytes() == before  # failed run left out_dir intact
    for frac in (0.0, 1.0, -0.5):
        with pytest.raises(DataError, match="val_fraction"):
            prepare_corpus(str(small_corpus), str(tmp_path / "x"), None, 400, frac)
    tiny = tmp_path / "tiny.txt"
    tiny.write_text("a")
    with pytest.raises(DataError, match="empty"):
        prepare_corpus(str(tiny), str(tmp_path / "y"), str(out / "tokenizer.json"), 400, 0.01)
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()
    assert not is_prepared(str(tmp_path / "x"))
    with pytest.raises(DataError, match="meta.json"):
        load_meta(str(tmp_path / "x"))


CHAT_TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{{ eos_token }}\n{% endfor %}"
MODEL_IDS = {"bos": 0, "eos": [1, 2], "pad": 1}
"""The special ids of :func:`model_tokenizer`'s model (config.json, tokenizer_config.json): not shardlm's."""


@pytest.fixture()
def model_tokenizer(tmp_path: pathlib.Path) -> pathlib.Path:
    """A model directory's tokenizer: its tokenizer_config.json makes <|end_of_text|> (id 1) eos and pad and
    has a chat template; config.json / generation_config.json stop at [1, 2]. A tokenizer without these files
    would get shardlm's made-up ids (eos = pad = <|end_of_document|>, id 2)."""
    d = tmp_path / "model"
    d.mkdir()
    train_tokenizer([_text(200, seed=9)], 300).save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": BOS, "eos_token": EOS, "pad_token": EOS,
        "chat_template": CHAT_TEMPLATE, "model_max_length": 2048}))
    (d / "config.json").write_text(json.dumps({"model_type": "llama", "bos_token_id": 0,
                                               "eos_token_id": [1, 2]}))
    (d / "generation_config.json").write_text(json.dumps({"bos_token_id": 0, "eos_token_id": [1, 2]}))
    return d / "tokenizer.json"


def _two_sources(tmp_path: pathlib.Path, lines: int = 60) -> list:
    from shardlm.config import DataSource

    for name, seed in (("a", 1), ("b", 2)):
        (tmp_path / f"{name}.txt").write_text(_text(lines, seed=seed))
    return [DataSource(str(tmp_path / "a.txt"), 0.7, "a"), DataSource(str(tmp_path / "b.txt"), 0.3, "b")]


def test_a_mixture_records_its_model_tokenizers_special_ids_and_files_as_one_corpus_does(
        tmp_path: pathlib.Path, model_tokenizer: pathlib.Path) -> None:
    """A mixture prepared with a model directory's tokenizer: the mixture's meta.json and each source's
    record the model's special ids (eos [1, 2], pad 1), and every directory holds the tokenizer files a
    single corpus prepared with that tokenizer holds, byte for byte (its tokenizer_config.json with the chat
    template); transformers reads the model's eos, pad and template from the mixture's directory (what an
    export copies)."""
    transformers = pytest.importorskip("transformers")
    from shardlm.data.mixture import prepare_mixture
    from shardlm.data.tokenizer_files import TOKENIZER_FILES

    sources = _two_sources(tmp_path)
    single = prepare_corpus(sources[0].path, str(tmp_path / "single"), str(model_tokenizer), 512, 0.2)
    assert single["model_special_ids"] == MODEL_IDS
    mix = tmp_path / "mix"
    meta = prepare_mixture(sources, str(mix), str(model_tokenizer), 512, 0.2)
    assert meta["model_special_ids"] == load_meta(str(mix))["model_special_ids"] == MODEL_IDS
    assert meta["special_ids"] == single["special_ids"] == {"bos": 0, "eos": 1, "eod": 2}
    staged = [name for name in TOKENIZER_FILES if (tmp_path / "single" / name).is_file()]
    assert staged == ["tokenizer.json", "tokenizer_config.json"]
    for d in (mix, mix / "a", mix / "b"):
        if d != mix:
            assert load_meta(str(d))["model_special_ids"] == MODEL_IDS, d
        assert [name for name in TOKENIZER_FILES if (d / name).is_file()] == staged, d
        for name in staged:
            assert (d / name).read_bytes() == (tmp_path / "single" / name).read_bytes(), (d, name)
    # source a is the single corpus, with the same tokenizer: the same tokens
    assert load_meta(str(mix / "a"))["content_sha256"] == single["content_sha256"]
    tok = transformers.AutoTokenizer.from_pretrained(str(mix))
    assert (tok.eos_token, tok.pad_token, tok.chat_template) == (EOS, EOS, CHAT_TEMPLATE)
    assert (tok.eos_token_id, tok.pad_token_id) == (1, 1)



def test_a_model_trained_on_a_mixture_exports_its_tokenizers_model_ids(tmp_path: pathlib.Path,
                                                                       model_tokenizer: pathlib.Path) -> None:
    """The ids' consumer: a tiny model trained for 2 steps (one process) on a mixture prepared with a model
    directory's tokenizer; its final export stops at the model's eos ids [1, 2] and pads with 1
    (transformers' GenerationConfig), and its tokenizer has the model's eos token and chat template
    (AutoTokenizer); so does ``shardlm export`` of its checkpoint, and ``shardlm generate``'s reader of a
    model directory stops at [1, 2]."""
    transformers = pytest.importorskip("transformers")
    from conftest import tiny_overrides
    from shardlm.config import load_config
    from shardlm.parallel import init_distributed
    from shardlm.train.trainer import Trainer

    a, b = _two_sources(tmp_path, lines=120)
    sources = (f'[{{path = "{a.path}", weight = 0.7, name = "a"}}, '
               f'{{path = "{b.path}", weight = 0.3, name = "b"}}]')
    cfg = load_config(None, tiny_overrides(tmp_path / "mix", tmp_path / "run", {
        "data.sources": sources, "data.tokenizer": f'"{model_tokenizer}"', "data.workers": 1,
        "parallel.mode": '"single"', "train.steps": 2, "train.eval_interval": 0, "checkpoint.interval": 2}))
    started = torch.distributed.is_initialized()
    try:
        Trainer(cfg, init_distributed(cfg.parallel)).train()
    finally:
        if not started and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    from shardlm.cli.main import main as cli_main
    from shardlm.convert.hf_in import model_dir_special_ids

    exported = tmp_path / "exported"  # `shardlm export` of the checkpoint: the ids its manifest recorded
    assert cli_main(["export", str(tmp_path / "run" / "checkpoints" / "step-2"), str(exported)]) == 0
    for final in (tmp_path / "run" / "final", exported):
        gen = transformers.GenerationConfig.from_pretrained(str(final))
        assert (gen.bos_token_id, gen.eos_token_id, gen.pad_token_id) == (0, [1, 2], 1), final
        assert json.loads((final / "config.json").read_text())["eos_token_id"] == [1, 2]
        tok = transformers.AutoTokenizer.from_pretrained(str(final))
        assert (tok.eos_token, tok.eos_token_id, tok.pad_token_id) == (EOS, 1, 1)
        assert tok.chat_template == CHAT_TEMPLATE
        assert model_dir_special_ids(final)["eos"] == [1, 2]  # where `shardlm generate` stops


# ----------------------------------------------------------------------------- loader


def test_token_windows(tmp_path: pathlib.Path) -> None:
    out = tmp_path / "ds"
    out.mkdir()
    np.arange(23, dtype=np.uint16).tofile(out / "train.bin")
    np.arange(3, dtype=np.uint16).tofile(out / "val.bin")
    (out / "meta.json").write_text(
        json.dumps({"dtype": "uint16", "vocab_size": 100, "train_tokens": 23, "val_tokens": 3})
    )
    w = TokenWindows(str(out), "train", seq_len=4)
    assert len(w) == 4  # 23 // 5
    batch = w.get([3, 0])
    assert batch.dtype == torch.int64 and batch.shape == (2, 5)
    assert batch.tolist() == [[15, 16, 17, 18, 19], [0, 1, 2, 3, 4]]
    assert w.get([]).shape == (0, 5)
    with pytest.raises(IndexError):
        w.get([4])
    with pytest.raises(DataError, match=r"val split has 3 tokens.*at least.*5"):
        TokenWindows(str(out), "val", seq_len=4)


def test_sampler_world_size_independent() -> None:
    s = GlobalBatchSampler(num_windows=50, global_batch_size=8, seed=3)
    for step in range(15):  # crosses several epoch boundaries (50 % 8 != 0)
        ref = s.step_ids(step)
        assert len(ref) == 8
        for ws in (1, 2, 4):
            assert [i for r in range(ws) for i in s.rank_ids(step, r, ws)] == ref
            mbs = [mb for r in range(ws) for mb in s.micro_batches(step, r, ws, 2)]
            assert [i for mb in mbs for i in mb] == ref and all(len(mb) == 2 for mb in mbs)
    with pytest.raises(ValueError):
        s.rank_ids(0, 0, 3)
    with pytest.raises(ValueError):
        s.micro_batches(0, 0, 2, 3)


def test_sampler_epochs() -> None:
    n, g = 10, 4
    s = GlobalBatchSampler(n, g, seed=7)
    stream = [i for step in range(10) for i in s.step_ids(step)]  # 40 ids = 4 epochs
    for e in range(4):
        epoch = stream[e * n : (e + 1) * n]
        assert sorted(epoch) == list(range(n))  # every id exactly once per epoch
        gen = torch.Generator().manual_seed(7 * 1_000_003 + e)
        assert epoch == torch.randperm(n, generator=gen).tolist()
    # step 2 straddles epochs 0 and 1: positions 8..11
    assert s.step_ids(2) == s.epoch_permutation(0)[8:].tolist() + s.epoch_permutation(1)[:2].tolist()
    # a fresh sampler (e.g. after resume) gives the same ids; other seeds differ
    assert GlobalBatchSampler(n, g, seed=7).step_ids(5) == s.step_ids(5)
    assert GlobalBatchSampler(n, g, seed=8).step_ids(0) != s.step_ids(0)
    # global batch larger than the dataset
    big = GlobalBatchSampler(3, 7, seed=0).step_ids(0)
    assert len(big) == 7 and set(big) == {0, 1, 2}


@pytest.mark.parametrize(
    ("num_windows", "eval_tokens", "seq_len", "ws", "mbs"),
    [(100, 1000, 64, 4, 2), (100, 640, 64, 3, 2), (5, 10_000, 8, 4, 3), (7, 1, 8, 2, 1), (10, 90, 10, 1, 4)],
)
def test_eval_windows(num_windows: int, eval_tokens: int, seq_len: int, ws: int, mbs: int) -> None:
    k = max(1, min(num_windows, eval_tokens // seq_len))
    per_rank = [eval_windows(num_windows, eval_tokens, seq_len, r, ws, mbs) for r in range(ws)]
    expected_batches = math.ceil(math.ceil(k / ws) / mbs)
    assert all(len(b) == expected_batches for b in per_rank)
    seen = [i for r, batches in enumerate(per_rank) for mb in batches for i in mb]
    assert sorted(seen) == list(range(k))
    for r, batches in enumerate(per_rank):
        assert all(i % ws == r for mb in batches for i in mb)
        assert all(len(mb) <= mbs for mb in batches)
