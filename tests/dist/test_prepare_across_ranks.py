"""Data preparation across ranks: byte-identical token files at any workers and ranks, a restart after
SIGKILL reuses the finished pieces, and training prepares an unprepared mixture on every rank
(tests/workers/prepare_worker.py)."""

from __future__ import annotations

import hashlib
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from conftest import ROOT, cpu_env, torchrun
from shardlm.config import DataSource
from shardlm.data import (
    TokenStream,
    is_prepared,
    load_tokenizer,
    prepare_corpus,
)
from shardlm.data.mixture import MixtureSampler, prepare_mixture
from shardlm.data.prepare import staging_dir
from shardlm.data.readers import plan_pieces
from test_data_scale import FORMATS, WORDS, corpora, jsonl_text, make_docs, tokenizer_file, write_format  # noqa: F401 (fixtures)


def shard_digest(out: Path) -> str:
    """SHA-256 over every token shard of a prepared directory, in stream order."""
    meta = json.loads((out / "meta.json").read_text())
    h = hashlib.sha256()
    for s in meta["shards"]:
        h.update((out / s["file"]).read_bytes())
    return h.hexdigest()


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
        prepare_corpus(str(corpus), str(out), str(tokenizer_file), 400, 0.1, piece_bytes=12_000,
                       workers=workers)
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
    torchrun(2, [str(ROOT / "tests" / "workers" / "prepare_worker.py"), str(spec)], timeout=300)
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
    # where documents start (block-causal attention): the same file, one start after each separator but
    # the last
    starts = [(tmp_path / d / "document_starts.bin").read_bytes() for d in ("w1", "w2", "r2")]
    assert starts[0] == starts[1] == starts[2]
    meta = json.loads((tmp_path / "r2" / "meta.json").read_text())
    stream = np.concatenate(
        [np.fromfile(tmp_path / "r2" / s["file"], dtype=meta["dtype"]) for s in meta["shards"]]
    )
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
    # 12,000 documents: on 2 idle cores the second piece is done at about 2.7 s of 6.8 (3,000 finished at 4.0 s:
    # a fast machine's prepare once ended before the Ctrl-C)
    corpus = write_format(tmp_path / "c", "jsonl", make_docs(12000, seed=7))
    ref = tmp_path / "ref"
    prepare_corpus(str(corpus), str(ref), str(tokenizer_file), 400, 0.1, piece_bytes=5_000)
    out = tmp_path / "out"
    # the preparation alone, without the CLI's torch import (the CLI path is tested with bad input above)
    cmd = [sys.executable, "-c", "import sys; from shardlm.data.prepare import prepare_corpus; "
           f"prepare_corpus({str(corpus)!r}, {str(out)!r}, {str(tokenizer_file)!r}, 400, 0.1, "
           "piece_bytes=5_000)"]
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

    # 12,000 documents: on 2 idle cores the second piece is done at about 2.7 s of 6.8 (3,000 finished at 4.0 s:
    # a fast machine's prepare once ended before the Ctrl-C)
    corpus = write_format(tmp_path / "c", "jsonl", make_docs(12000, seed=7))
    out = tmp_path / "out"
    config = tmp_path / "prep.toml"
    config.write_text(f'[model]\nvocab_size = 400\n[data]\ncorpus = "{corpus}"\ndir = "{out}"\n'
                      f'tokenizer = "{tokenizer_file}"\npiece_bytes = 5000\nworkers = 2\n')
    cmd = [sys.executable, "-m", "shardlm", "prepare", "--config", str(config)]
    def as_a_terminal_starts_it() -> None:  # Ctrl-C acts in the child whatever this process inherited
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})

    # in the whole suite an earlier test leaves this process ignoring SIGINT, which a child inherits: it then
    # finished (exit 0) instead of stopping (reproduced: this test under a parent with SIGINT ignored)
    proc = subprocess.Popen(cmd, env=cpu_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, preexec_fn=as_a_terminal_starts_it)
    tokens = staging_dir(out) / "tokens"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and len(list(tokens.glob("*.json"))) < 2 and proc.poll() is None:
        time.sleep(0.01)
    assert proc.poll() is None, "the prepare ended before the test could press Ctrl-C: give it more data"
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
        return {"name": name, "config": None,
                "overrides": tiny_overrides(data, runs / name, {**common, **(extra or {})})}

    step6 = runs / "mix2" / "checkpoints" / "step-6"
    out = run_scenarios(2, [scenario("mix2"), scenario("mix2_resume", {"checkpoint.resume": f'"{step6}"'})],
                        tmp_path / "out")
    first = out["mix2"]
    prepare_s = [r["prepare_s"] for r in first]
    print(f"preparation took {prepare_s} s on the two ranks; parallel.timeout_s = 2")
    # longer than parallel.timeout_s: a collective waiting for it would have timed out
    assert min(prepare_s) > 2
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
    assert [last["tokens_seen/plays"], last["tokens_seen/source1"]] == [int(drawn[0]) * 32,
                                                                        int(drawn[1]) * 32]
    assert drawn.tolist() == [67, 29]  # 96 samples: 9 periods of 7/3, then the 10th period's first 6 slots
    assert last["epoch/source1"] == pytest.approx(29 / windows[1])
