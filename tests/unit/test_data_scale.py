"""Data at scale, in one process: every corpus format streamed in pieces, line-cut pieces of a large .txt,
one clear error per bad input, tokenizer samples, mixture draws. Preparation across workers and ranks is in
tests/dist/test_prepare_across_ranks.py."""

from __future__ import annotations

import gzip
import json
import random
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard

from conftest import ROOT
from shardlm.cli.main import main as cli_main
from shardlm.data import (
    DataError,
    is_prepared,
    load_tokenizer,
    prepare_corpus,
    read_documents,
    train_tokenizer,
)
from shardlm.data.mixture import MixtureSampler
from shardlm.data.prepare import _sample_texts
from shardlm.data.readers import plan_pieces, read_piece

WORDS = "the quick brown fox jumps over a lazy dog while seven wizards judge boxing é ü 漢字 — ok".split()


def make_docs(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return ["\n".join(" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 12)))
                      for _ in range(rng.randint(1, 25))) for _ in range(n)]


def jsonl_text(docs: list[str]) -> str:
    return "".join(json.dumps({"id": i, "text": d}) + "\n" for i, d in enumerate(docs))


def write_format(root: Path, fmt: str, docs: list[str]) -> Path:
    """A small corpus of ``docs`` in format ``fmt`` under ``root``; returns its path."""
    root.mkdir(parents=True, exist_ok=True)
    if fmt == "jsonl":
        (p := root / "c.jsonl").write_text(jsonl_text(docs))
    elif fmt == "jsonl.gz":
        with gzip.open(p := root / "c.jsonl.gz", "wt") as f:
            f.write(jsonl_text(docs))
    elif fmt == "jsonl.zst":
        (p := root / "c.jsonl.zst").write_bytes(
            zstandard.ZstdCompressor().compress(jsonl_text(docs).encode())
        )
    elif fmt == "parquet":
        pq.write_table(pa.table({"id": list(range(len(docs))), "text": docs}), p := root / "c.parquet",
                       row_group_size=40)
    elif fmt == "txt":
        (p := root / "c.txt").write_text("\n\n".join(docs))
    elif fmt == "txt.zst":
        (p := root / "c.txt.zst").write_bytes(zstandard.ZstdCompressor().compress("\n\n".join(docs).encode()))
    elif fmt == "hf":
        import datasets

        datasets.Dataset.from_dict({"text": docs}).save_to_disk(str(p := root / "ds"))
    else:  # pragma: no cover
        raise ValueError(fmt)
    return p


FORMATS = ["jsonl", "jsonl.gz", "jsonl.zst", "parquet", "txt", "txt.zst", "hf"]


@pytest.fixture(scope="module")
def corpora(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("formats")
    docs = make_docs(200)
    return {fmt: write_format(root / fmt.replace(".", "_"), fmt, docs) for fmt in FORMATS}


@pytest.fixture(scope="module")
def tokenizer_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    train_tokenizer(make_docs(300, seed=1), 400).save(str(path))
    return path


# ----------------------------------------------------------------------------- readers


def test_every_format_reads_the_same_documents(corpora):
    docs = make_docs(200)
    for fmt in ("jsonl", "jsonl.gz", "jsonl.zst", "parquet", "hf"):
        assert read_documents(str(corpora[fmt])) == docs, fmt
        pieces, _ = plan_pieces(str(corpora[fmt]), piece_bytes=4000)
        assert [c.text for p in pieces for c in read_piece(p)] == docs, fmt
    for fmt in ("txt", "txt.zst"):
        assert read_documents(str(corpora[fmt])) == ["\n\n".join(docs)], fmt
    assert len(plan_pieces(str(corpora["parquet"]), piece_bytes=1)[0]) == 5  # one piece per row group
    assert len(plan_pieces(str(corpora["hf"]), piece_bytes=4000)[0]) > 3


def test_hf_dataset_by_name_is_offline(tmp_path, monkeypatch):
    # an empty cache: nothing is downloaded, no retries
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    with pytest.raises(DataError,
                       match=r"hf:nobody/nothing: cannot load the dataset from the local Hugging Face "
                                        r"cache \(offline\)"):
        plan_pieces("hf:nobody/nothing")


def test_large_txt_is_read_in_line_cut_pieces(tmp_path):
    text = "\n".join(f"line {i} " + "x" * (i % 50) for i in range(3000)) + "\n"
    (tmp_path / "big.txt").write_text(text)
    pieces, _ = plan_pieces(str(tmp_path / "big.txt"), piece_bytes=10_000)
    assert len(pieces) > 10
    raw = text.encode()
    assert all(raw[p.start - 1:p.start] == b"\n" for p in pieces[1:])  # every cut at a line start
    chunks = [c for p in pieces for c in read_piece(p, chunk_chars=3000)]
    assert max(len(c.text) for c in chunks) <= 3000
    assert "".join(c.text for c in chunks) == text
    assert [c.ends_document for c in chunks] == [False] * (len(chunks) - 1) + [True]


def _awkward_text(n_lines: int, seed: int = 0) -> str:
    """Lines a cut could break: blank and indented lines, trailing spaces, CRLF, punctuation, non-ASCII."""
    rng = random.Random(seed)
    lines = []
    for _ in range(n_lines):
        line = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 9)))
        line = rng.choice(["", "  ", "\t", "(", "...", "'"]) + line + rng.choice(["", " ", ".", "!\r", "  ",
                                                                                  ":"])
        lines.append(line if rng.random() > 0.15 else rng.choice(["", " ", "***"]))
    return "\n".join(lines) + "\n"


def test_cuts_leave_byte_level_tokens_unchanged(tmp_path, monkeypatch, smol_dir):
    """A large .txt read in many pieces, 1 KB blocks and 1,200-character chunks encodes to exactly the tokens
    of the whole text in one call, for shardlm's tokenizer, the same with Llama 3's pre-tokenizer
    regex, SmolLM2's."""
    from tokenizers import Regex, pre_tokenizers

    from shardlm.data import pieces as data_pieces

    text = _awkward_text(6000)
    (tmp_path / "big.txt").write_text(text, newline="")
    monkeypatch.setattr(data_pieces, "READ_BLOCK", 1000)
    pieces, _ = plan_pieces(str(tmp_path / "big.txt"), piece_bytes=10_000)
    chunks = [c.text for p in pieces for c in read_piece(p, chunk_chars=1200)]
    assert len(pieces) > 10 and len(chunks) > 100
    assert "".join(chunks) == text
    chunks_of = [(text, chunks)]
    ours = train_tokenizer([text], 600)
    llama3 = train_tokenizer([text], 600)
    llama3.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(
                Regex(
                    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| "
                    r"?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
                ),
                behavior="isolated",
            ),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    smol = load_tokenizer(str(smol_dir / "tokenizer.json"))
    # and documents without a usable newline: CRLF line ends, one long line (cut before a space)
    crlf = text.replace("\r", "").replace("\n", "\r\n")
    one_line = text.replace("\r", "").replace("\n", " ")
    for doc in (crlf, one_line):
        (tmp_path / "doc.txt").write_text(doc, newline="")
        pieces, _ = plan_pieces(str(tmp_path / "doc.txt"))
        parts = [c.text for p in pieces for c in read_piece(p, chunk_chars=1200)]
        assert len(parts) > 100 and "".join(parts) == doc
        chunks_of.append((doc, parts))
    for tok in (ours, llama3, smol):
        for doc, parts in chunks_of:
            pieces_ids = [i for e in tok.encode_batch(parts, add_special_tokens=False) for i in e.ids]
            assert pieces_ids == tok.encode(doc, add_special_tokens=False).ids


def test_a_line_longer_than_the_read_limit_is_cut_between_characters(tmp_path, monkeypatch):
    """A line longer than 4 read blocks: cut anywhere but inside a UTF-8 character or a CRLF; and such a line
    does not stop the piece cuts of the rest of the file."""
    from shardlm.data import pieces as data_pieces

    monkeypatch.setattr(data_pieces, "READ_BLOCK", 1000)
    text = "ab漢é" * 3001 + "\r\nend\n"  # one 33 KB line of 1-, 2- and 3-byte characters
    (tmp_path / "long.txt").write_text(text, newline="")
    pieces, _ = plan_pieces(str(tmp_path / "long.txt"))
    chunks = [c.text for p in pieces for c in read_piece(p, chunk_chars=700)]
    assert "".join(chunks) == text and max(map(len, chunks)) <= 700
    assert not any(c.endswith("\r") for c in chunks)
    lines = "".join(f"line {i} of the file\n" for i in range(2000))
    (tmp_path / "mixed.txt").write_text(lines + "x" * 5000 + "\n" + lines)
    pieces, _ = plan_pieces(str(tmp_path / "mixed.txt"), piece_bytes=3000)
    assert len(pieces) > 25 and max(p.size for p in pieces) < 7000  # ~89 KB in pieces of ~3 KB


def test_directory_and_glob_list_what_is_not_read(tmp_path, corpora):
    d = tmp_path / "mixed"
    write_format(d / "a", "jsonl", ["one", "two"])
    write_format(d / "b", "parquet", ["three"])
    (d / "notes.csv").write_text("x,y")
    (d / "b" / "image.png").write_bytes(b"\x89PNG")
    pieces, skipped = plan_pieces(str(d))
    assert [Path(p.path).suffix for p in pieces] == [".jsonl", ".parquet"]
    assert skipped == ["b/image.png", "notes.csv"]
    assert read_documents(str(d / "**" / "*.parquet")) == ["three"]
    meta = prepare_corpus(str(d), str(tmp_path / "out"), None, 300, 0.3)
    assert meta["skipped_files"] == {"count": 2, "first": ["b/image.png", "notes.csv"]}
    assert meta["documents"] == 3


# ----------------------------------------------------------------------------- bad input


def _bad_inputs(tmp: Path) -> dict[str, tuple[Path, str]]:
    cases = {}
    good = jsonl_text(["alpha beta", "gamma"]).encode()
    (p := tmp / "corrupt.jsonl.gz").write_bytes(gzip.compress(good)[:12] + b"\x00garbage" * 20)
    cases["corrupt gz"] = (p, "corrupt.jsonl.gz: cannot read (gz stream is corrupt or truncated")
    z = zstandard.ZstdCompressor().compress(jsonl_text(make_docs(50)).encode())
    (p := tmp / "truncated.jsonl.zst").write_bytes(z[: len(z) // 2])
    cases["truncated zst"] = (p, "truncated.jsonl.zst: cannot read (zst stream is corrupt or truncated")
    pq.write_table(pa.table({"body": ["x", "y"]}), p := tmp / "nocol.parquet")
    cases["parquet without text"] = (p, "nocol.parquet: no column 'text' (columns: body)")
    (p := tmp / "badline.jsonl").write_text('{"text": "a"}\n\n{"text": "b"\n')
    cases["jsonl not json"] = (p, "badline.jsonl:3: invalid JSON")
    (p := tmp / "nofield.jsonl").write_text('{"text": "a"}\n{"body": "b"}\n')
    cases["jsonl lacks field"] = (p, "nofield.jsonl:2: missing field 'text'")
    (p := tmp / "latin1.txt").write_bytes("first line\nsecond line\ncaf\xe9\n".encode("latin-1"))
    cases["txt not utf-8"] = (p, "latin1.txt:3: not valid UTF-8")
    (p := tmp / "latin1.jsonl").write_bytes(b'{"text": "ok"}\n{"text": "caf\xe9"}\n')
    cases["jsonl not utf-8"] = (p, "latin1.jsonl:2: not valid UTF-8")
    (p := tmp / "blank.txt").write_text("  \n\n\t\n")
    cases["empty corpus"] = (p, "empty")
    (p := tmp / "nothing").mkdir()
    (p / "a.csv").write_text("x")
    cases["directory with nothing readable"] = (p, "nothing readable (1 files, e.g. a.csv")
    return cases


BAD = ["corrupt gz", "truncated zst", "parquet without text", "jsonl not json", "jsonl lacks field",
       "txt not utf-8", "jsonl not utf-8", "empty corpus", "directory with nothing readable"]


@pytest.mark.parametrize("case", BAD)
def test_bad_input_one_clear_error(case, tmp_path, capsys):
    corpus, needle = _bad_inputs(tmp_path)[case]
    out = tmp_path / "data"
    code = cli_main(["prepare", "--config", str(ROOT / "configs/shakespeare-tiny.toml"),
                     f"--data.corpus={corpus}", f"--data.dir={out}", "--model.vocab_size=300", "--workers=1"])
    err = capsys.readouterr().err
    assert code == 2
    assert err.count("error:") == 1 and needle in err, err
    assert "Traceback" not in err
    assert not (out / "meta.json").exists() and not is_prepared(str(out))


def test_bad_input_in_a_worker_process(tmp_path, tokenizer_file):
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "a.jsonl").write_text(jsonl_text(make_docs(100)))
    (tmp_path / "c" / "b.jsonl").write_text(jsonl_text(make_docs(100)) + '{"text": 3}\n')
    with pytest.raises(DataError, match=r"b\.jsonl:101: field 'text' must be a string"):
        prepare_corpus(str(tmp_path / "c"), str(tmp_path / "out"), str(tokenizer_file), 400, 0.1, workers=2)
    assert not (tmp_path / "out").exists()


# ----------------------------------------------------------------------------- tokenizer sample


def test_tokenizer_sample_is_bounded_and_seeded(tmp_path):
    corpus = write_format(tmp_path, "jsonl", make_docs(2000, seed=3))
    pieces, _ = plan_pieces(str(corpus), piece_bytes=20_000)
    sample = list(_sample_texts(pieces, "text", 50_000, seed=5))
    assert sum(len(t.encode()) for t in sample) <= 50_000 + max(p.size for p in pieces)
    assert sample == list(_sample_texts(pieces, "text", 50_000, seed=5))
    assert sample != list(_sample_texts(pieces, "text", 50_000, seed=6))
    a = prepare_corpus(str(corpus), str(tmp_path / "a"), None, 400, 0.1, seed=5, piece_bytes=20_000,
                       tokenizer_sample_bytes=50_000)
    b = prepare_corpus(str(corpus), str(tmp_path / "b"), None, 400, 0.1, seed=5, piece_bytes=20_000,
                       tokenizer_sample_bytes=50_000)
    assert (tmp_path / "a" / "tokenizer.json").read_bytes() == (
        tmp_path / "b" / "tokenizer.json"
    ).read_bytes()
    assert a["content_sha256"] == b["content_sha256"]


# ----------------------------------------------------------------------------- mixtures


def test_mixture_draws_follow_the_weights_at_any_world_size():
    s = MixtureSampler([1000, 300], [0.7, 0.3], global_batch_size=8, seed=3)
    ids = [i for step in range(500) for i in s.step_ids(step)]
    share = np.mean(np.asarray(s.source_of(ids)) == 0)
    assert abs(share - 0.7) <= 0.01
    assert s.drawn_before(4000).tolist() == [2800, 1200]
    for step in (0, 7, 499):
        for ws in (1, 2, 4):
            assert [i for r in range(ws) for i in s.rank_ids(step, r, ws)] == s.step_ids(step)
    # each source runs through its own epochs: source 1 (300 windows) has seen every window 4 times
    src1 = [i - 1000 for i in ids if i >= 1000]
    assert sorted(src1[:1200]) == sorted(list(range(300)) * 4)
    assert s.source_epochs(500) == [2.8, 4.0]
    # a fresh sampler (a resumed run) continues exactly
    assert MixtureSampler([1000, 300], [0.7, 0.3], 8, 3).step_ids(321) == s.step_ids(321)
    assert MixtureSampler([1000, 300], [0.7, 0.3], 8, 4).step_ids(0) != s.step_ids(0)
