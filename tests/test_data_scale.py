"""Data at scale: every corpus format streamed in pieces, byte-identical at any workers and ranks,
restart after SIGKILL, one clear error per bad input, tokenizer samples, mixtures."""

from __future__ import annotations

import gzip
import hashlib
import json
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard

from conftest import ROOT, cpu_env, torchrun
from shardlm.cli.main import main as cli_main
from shardlm.config import DataSource
from shardlm.data import (
    DataError,
    TokenStream,
    is_prepared,
    load_tokenizer,
    prepare_corpus,
    read_documents,
    train_tokenizer,
)
from shardlm.data.mixture import MixtureSampler, prepare_mixture
from shardlm.data.prepare import _sample_texts, staging_dir
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
        (p := root / "c.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(jsonl_text(docs).encode()))
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


def shard_digest(out: Path) -> str:
    """SHA-256 over every token shard of a prepared directory, in stream order."""
    meta = json.loads((out / "meta.json").read_text())
    h = hashlib.sha256()
    for s in meta["shards"]:
        h.update((out / s["file"]).read_bytes())
    return h.hexdigest()


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
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))  # an empty cache: nothing is downloaded, no retries
    with pytest.raises(DataError, match=r"hf:nobody/nothing: cannot load the dataset from the local Hugging Face "
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
        line = rng.choice(["", "  ", "\t", "(", "...", "'"]) + line + rng.choice(["", " ", ".", "!\r", "  ", ":"])
        lines.append(line if rng.random() > 0.15 else rng.choice(["", " ", "***"]))
    return "\n".join(lines) + "\n"


def test_cuts_leave_byte_level_tokens_unchanged(tmp_path, monkeypatch, smol_dir):
    """A large .txt read in many pieces, 1 KB blocks and 1,200-character chunks encodes to exactly the tokens of
    the whole text in one call, for shardlm's tokenizer, the same with Llama 3's pre-tokenizer regex, SmolLM2's."""
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
    llama3.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+"
                                   r"[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
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
    code = cli_main(["prepare", "--config", str(ROOT / "configs/shakespeare-tiny.toml"), f"--data.corpus={corpus}",
                     f"--data.dir={out}", "--model.vocab_size=300", "--workers=1"])
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
    assert (tmp_path / "a" / "tokenizer.json").read_bytes() == (tmp_path / "b" / "tokenizer.json").read_bytes()
    assert a["content_sha256"] == b["content_sha256"]


# ----------------------------------------------------------------------------- identical bytes


@pytest.mark.dist
def test_workers_and_ranks_give_identical_token_files(tmp_path, corpora, tokenizer_file):
    # one directory holding a small corpus of each format: its pieces are each format's pieces, in order
    corpus = corpora["jsonl"].parent.parent
    pieces, _ = plan_pieces(str(corpus), piece_bytes=12_000)
    kinds = {(p.kind, p.compression) for p in pieces}
    assert kinds == {("jsonl", ""), ("jsonl", "gz"), ("jsonl", "zst"), ("parquet", ""), ("text", ""),
                     ("text", "zst"), ("hf", "")}
    digests = {}
    for workers in (1, 2):
        out = tmp_path / f"w{workers}"
        prepare_corpus(str(corpus), str(out), str(tokenizer_file), 400, 0.1, piece_bytes=12_000, workers=workers)
        digests[f"{workers} workers"] = [hashlib.sha256((out / s["file"]).read_bytes()).hexdigest()
                                         for s in json.loads((out / "meta.json").read_text())["shards"]]
    # a mixture with a model directory's tokenizer (eos [1, 2] in its config.json, pad 1), in the same launch
    model = tmp_path / "model"
    model.mkdir()
    (model / "tokenizer.json").write_bytes(tokenizer_file.read_bytes())
    (model / "tokenizer_config.json").write_text(json.dumps({
        "eos_token": "<|end_of_text|>", "pad_token": "<|end_of_text|>", "chat_template": "{{ x }}"}))
    (model / "config.json").write_text(json.dumps({"bos_token_id": 0, "eos_token_id": [1, 2]}))
    mixture = [{"path": str(corpora["jsonl"]), "weight": 0.7, "name": "a"},
               {"path": str(corpora["txt"]), "weight": 0.3, "name": "b"}]
    prepare_mixture([DataSource(**m) for m in mixture], str(tmp_path / "m1"), str(model / "tokenizer.json"),
                    400, 0.1, piece_bytes=12_000)
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"jobs": [
        {"corpus": str(corpus), "out": str(tmp_path / "r2"), "tokenizer": str(tokenizer_file),
         "vocab_size": 400, "piece_bytes": 12_000},
        {"sources": mixture, "out": str(tmp_path / "m2"), "tokenizer": str(model / "tokenizer.json"),
         "vocab_size": 400, "piece_bytes": 12_000}]}))
    torchrun(2, [str(ROOT / "tests" / "prepare_worker.py"), str(spec)], timeout=300)
    m1, m2 = (json.loads((tmp_path / m / "meta.json").read_text()) for m in ("m1", "m2"))
    assert m2["model_special_ids"] == m1["model_special_ids"] == {"bos": 0, "eos": [1, 2], "pad": 1}
    assert m2["content_sha256"] == m1["content_sha256"] and m2["special_ids"] == m1["special_ids"]
    for sub in ("", "a", "b"):  # 2 ranks stage the model's files and record its ids as one process does
        d1, d2 = tmp_path / "m1" / sub, tmp_path / "m2" / sub
        assert (d2 / "tokenizer_config.json").read_bytes() == (d1 / "tokenizer_config.json").read_bytes(), sub
        assert json.loads((d2 / "meta.json").read_text())["model_special_ids"] == m1["model_special_ids"], sub
    digests["2 ranks"] = [hashlib.sha256((tmp_path / "r2" / s["file"]).read_bytes()).hexdigest()
                          for s in json.loads((tmp_path / "r2" / "meta.json").read_text())["shards"]]
    assert len(digests["2 ranks"]) == len(pieces) > 20
    assert digests["1 workers"] == digests["2 workers"] == digests["2 ranks"]
    assert shard_digest(tmp_path / "w1") == shard_digest(tmp_path / "r2")
    # where documents start (block-causal attention): the same file, one start after each separator but the last
    starts = [(tmp_path / d / "document_starts.bin").read_bytes() for d in ("w1", "w2", "r2")]
    assert starts[0] == starts[1] == starts[2]
    meta = json.loads((tmp_path / "r2" / "meta.json").read_text())
    stream = np.concatenate([np.fromfile(tmp_path / "r2" / s["file"], dtype=meta["dtype"]) for s in meta["shards"]])
    recorded = np.frombuffer(starts[0], dtype="<i8")
    assert recorded.tolist() == [0] + (np.flatnonzero(stream == 2) + 1).tolist()[:-1]
    assert len(recorded) == meta["documents"] == meta["document_starts"]["count"]
    # the stream is BOS doc EOD doc EOD ...: check the first format (hf, sorted first) against the tokenizer
    tok = load_tokenizer(str(tokenizer_file))
    expected = [0]
    for doc in make_docs(200):
        expected += tok.encode(doc, add_special_tokens=False).ids + [2]
    s = TokenStream(str(tmp_path / "r2"), "train")
    assert s.read(0, len(expected)).tolist() == expected


# ----------------------------------------------------------------------------- restart


@pytest.mark.dist
def test_sigkill_part_way_then_restart_reuses_finished_pieces(tmp_path, tokenizer_file):
    corpus = write_format(tmp_path / "c", "jsonl", make_docs(3000, seed=7))
    ref = tmp_path / "ref"
    prepare_corpus(str(corpus), str(ref), str(tokenizer_file), 400, 0.1, piece_bytes=5_000)
    out = tmp_path / "out"
    # the preparation alone, without the CLI's torch import (the CLI path is tested with bad input above)
    cmd = [sys.executable, "-c", "import sys; from shardlm.data.prepare import prepare_corpus; "
           f"prepare_corpus({str(corpus)!r}, {str(out)!r}, {str(tokenizer_file)!r}, 400, 0.1, piece_bytes=5_000)"]
    proc = subprocess.Popen(cmd, env=cpu_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    tokens = staging_dir(out) / "tokens"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and len(list(tokens.glob("*.json"))) < 3 and proc.poll() is None:
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    # a piece is finished once its record (.json) is written after its .bin: a kill between the two leaves a
    # .bin that the restart encodes again
    finished = {p.name: p.stat().st_mtime_ns for p in tokens.glob("*.bin") if p.with_suffix(".json").exists()}
    n_pieces = len(plan_pieces(str(corpus), piece_bytes=5_000)[0])
    assert 3 <= len(finished) < n_pieces, (len(finished), n_pieces)
    assert not (out / "meta.json").exists() and not is_prepared(str(out))  # half-written: never complete
    again = subprocess.run(cmd, env=cpu_env(), capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr
    assert f"{len(finished)} finished before" in again.stderr
    assert shard_digest(out) == shard_digest(ref)
    assert json.loads((out / "meta.json").read_text())["content_sha256"] == \
        json.loads((ref / "meta.json").read_text())["content_sha256"]
    for name, mtime in finished.items():  # the finished pieces were kept, not encoded again
        assert (out / "tokens" / name).stat().st_mtime_ns == mtime
    assert not staging_dir(out).exists()


@pytest.mark.dist
def test_ctrl_c_part_way_is_one_line_exit_130_and_the_same_prepare_continues(tmp_path, tokenizer_file):
    """Ctrl-C (SIGINT to the process group, as a terminal sends it) while `shardlm prepare` encodes with 2
    workers: one `error:` line, no traceback (the workers printed theirs, the parent none), exit 130; the
    same command then continues from the finished pieces."""
    import os

    corpus = write_format(tmp_path / "c", "jsonl", make_docs(3000, seed=7))
    out = tmp_path / "out"
    config = tmp_path / "prep.toml"
    config.write_text(f'[model]\nvocab_size = 400\n[data]\ncorpus = "{corpus}"\ndir = "{out}"\n'
                      f'tokenizer = "{tokenizer_file}"\npiece_bytes = 5000\nworkers = 2\n')
    cmd = [sys.executable, "-m", "shardlm", "prepare", "--config", str(config)]
    proc = subprocess.Popen(cmd, env=cpu_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    tokens = staging_dir(out) / "tokens"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and len(list(tokens.glob("*.json"))) < 2 and proc.poll() is None:
        time.sleep(0.01)
    os.killpg(proc.pid, signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    assert "Traceback" not in err, err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert errors == [err.strip().splitlines()[-1]]
    assert errors[0].startswith(f"error: stopped by Ctrl-C: {out} is unchanged; the pieces encoded so far")
    assert not (out / "meta.json").exists()
    finished = len(list(tokens.glob("*.json")))
    again = subprocess.run(cmd, env=cpu_env(), capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr
    assert f"{finished} finished before" in again.stderr + again.stdout
    assert is_prepared(str(out))


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


@pytest.mark.dist
def test_training_prepares_an_unprepared_mixture_on_every_rank(tmp_path):
    """2 ranks start on unprepared data with parallel.timeout_s=2, below the preparation time: both ranks
    prepare and train. The sample ids are the sampler's (the same at any world size), a run resumed at step 6
    continues exactly, and the metrics count tokens seen per source."""
    from conftest import run_scenarios, tiny_overrides
    from shardlm.data import TokenWindows, shakespeare_dir

    extra_src = write_format(tmp_path / "src_b", "jsonl", make_docs(4000, seed=11))
    plays = shakespeare_dir() / "*" / "*.md"  # the 38 plays, 5.3 MB, through a glob
    sources = f'[{{path = "{plays}", weight = 0.7, name = "plays"}}, {{path = "{extra_src}", weight = 0.3}}]'
    data, runs = tmp_path / "data", tmp_path / "runs"
    common = {"data.sources": sources, "train.steps": 12, "train.eval_interval": 6, "checkpoint.interval": 6,
              "checkpoint.keep": 0, "data.workers": 1, "train.micro_batch_size": 4, "parallel.timeout_s": 2}

    def scenario(name, extra=None):
        return {"name": name, "config": None, "overrides": tiny_overrides(data, runs / name, {**common, **(extra or {})})}

    step6 = runs / "mix2" / "checkpoints" / "step-6"
    out = run_scenarios(2, [scenario("mix2"), scenario("mix2_resume", {"checkpoint.resume": f'"{step6}"'})],
                        tmp_path / "out")
    first = out["mix2"]
    prepare_s = [r["prepare_s"] for r in first]
    print(f"preparation took {prepare_s} s on the two ranks; parallel.timeout_s = 2")
    assert min(prepare_s) > 2  # longer than parallel.timeout_s: a collective waiting for it would have timed out
    meta = json.loads((data / "meta.json").read_text())
    assert meta["format"] == "mixture" and [s["name"] for s in meta["sources"]] == ["plays", "source1"]
    windows = [len(TokenWindows(str(data / name), "train", 32)) for name in ("plays", "source1")]
    sampler = MixtureSampler(windows, [0.7, 0.3], 8, 0)
    for step in range(12):
        merged = [i for r in range(2) for i in first[r]["sample_ids"][str(step)]]
        assert merged == sampler.step_ids(step) == sampler.rank_ids(step, 0, 1), step  # = the 1-rank ids
        if step >= 6:
            assert [i for r in range(2) for i in out["mix2_resume"][r]["sample_ids"][str(step)]] == merged
    full = {h["step"]: h for h in first[0]["history"]}
    resumed = out["mix2_resume"][0]["history"]
    assert [h["step"] for h in resumed] == list(range(7, 13))
    for h in resumed:
        assert h["loss"] == full[h["step"]]["loss"], h["step"]  # same world size: bit-exact resume
        assert h["tokens_seen/plays"] == full[h["step"]]["tokens_seen/plays"]
    last = full[12]
    drawn = sampler.drawn_before(12 * 8)
    assert [last["tokens_seen/plays"], last["tokens_seen/source1"]] == [int(drawn[0]) * 32, int(drawn[1]) * 32]
    assert drawn.tolist() == [67, 29]  # 96 samples: 9 periods of 7/3, then the 10th period's first 6 slots
    assert last["epoch/source1"] == pytest.approx(29 / windows[1])
