"""The main job end to end (torchrun, real Shakespeare, the tiny config shortened), and bad input."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from conftest import ROOT, cpu_env, tiny_overrides, torchrun
from shardlm.cli.train import main as train_main
from shardlm.data import prepare_corpus

TINY = str(ROOT / "configs/shakespeare-tiny.toml")


@pytest.mark.dist
def test_tiny_config_beats_unigram_entropy_and_generates(tmp_path, monkeypatch):
    data, run = tmp_path / "data", tmp_path / "run"
    monkeypatch.setenv("SHARDLM_PROGRESS_INTERVAL_S", "0.2")  # output to a pipe: plain progress lines, often
    proc = torchrun(2, ["-m", "shardlm.train", "--config", TINY, "--train.steps=40", "--train.eval_interval=20",
                        "--train.eval_tokens=8192", f"--data.dir={data}", f"--run.dir={run}"], timeout=400)
    assert "world size 2" in proc.stdout and "backend gloo" in proc.stdout
    lines = (proc.stdout + proc.stderr).splitlines()
    progress = [ln for ln in lines if ln.startswith("train ") and " step" in ln and "loss=" in ln]
    print(f"{len(progress)} progress lines, the longest output line {max(map(len, lines))} characters")
    assert len(progress) >= 3 and progress[-1].startswith("train 40/40 step (100%)")
    assert max(map(len, lines)) <= 300 and "\r" not in proc.stderr  # no redrawn bar joined into one line
    meta = json.loads((data / "meta.json").read_text())
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    final = records[-1]
    print(f"val_loss {final['val_loss']:.3f} vs unigram entropy {meta['unigram_entropy_nats']:.3f}; "
          f"{final['tokens_per_s']:.0f} tokens/s; shard bytes {final['shard_bytes']}")
    assert final["step"] == 40
    assert final["val_loss"] < meta["unigram_entropy_nats"]
    for key in ("loss", "lr", "grad_norm", "tokens_per_s", "tokens_per_s_per_rank", "shard_bytes"):
        assert key in final, key
    assert final["world_size"] == 2 and set(final["shard_bytes"]) == {"min", "max", "mean", "max_rank"}
    hf = json.loads((run / "final" / "config.json").read_text())
    assert hf["model_type"] == "llama" and hf["tie_word_embeddings"] is True
    assert {p.name for p in (run / "final").iterdir()} == {"config.json", "model.safetensors", "tokenizer.json",
                                                           "tokenizer_config.json", "generation_config.json"}
    assert json.loads((run / "config.json").read_text())["train"]["steps"] == 40
    gen = subprocess.run([sys.executable, "-m", "shardlm", "generate", "--model", str(run / "final"),
                          "--prompt", "ROMEO:", "--max-new-tokens", "20"],
                         env=cpu_env(), capture_output=True, text=True, timeout=120)
    assert gen.returncode == 0, gen.stderr
    assert gen.stdout.startswith("ROMEO:") and len(gen.stdout.strip()) > len("ROMEO:") + 10


@pytest.fixture
def tokenizer_600(tmp_path, small_corpus):
    out = tmp_path / "tok600"
    prepare_corpus(str(small_corpus), str(out), None, 600, 0.1)
    return out / "tokenizer.json"


def bad_cases(tmp_path, small_data, small_corpus, tokenizer_600):
    empty = tmp_path / "empty.txt"
    empty.write_text("  \n\n")
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "keep.txt").write_text("precious")
    fresh = tmp_path / "fresh"
    return {
        "unknown key": (["--train.bogus=1"], "unknown config key 'train.bogus'"),
        "wrong type": (["--train.steps=ten"], "train.steps: expected an integer"),
        "batch not divisible": (["--train.global_batch_size=7", "--train.micro_batch_size=2"],
                                "global_batch_size=7 must be divisible"),
        "seq too long": (["--train.seq_len=128"], "exceeds the model's maximum"),
        "missing corpus": ([f"--data.corpus={tmp_path / 'nope.txt'}", f"--data.dir={fresh / 'd1'}"], "nope.txt"),
        "empty corpus": ([f"--data.corpus={empty}", f"--data.dir={fresh / 'd2'}"], "empty"),
        "tokenizer too big": ([f"--data.corpus={small_corpus}", f"--data.tokenizer={tokenizer_600}",
                               f"--data.dir={fresh / 'd3'}"], "600"),
        "run dir not empty": ([f"--run.dir={busy}", "--run.overwrite=false"], "not empty"),
        "run dir is a file": ([f"--run.dir={busy / 'keep.txt'}"], "is not a directory"),
        "lr is nan": (["--train.lr=nan"], "train.lr must be a finite number"),
        "timeout not positive": (["--parallel.timeout_s=-1"], "parallel.timeout_s must be positive"),
        "data dir under a file": ([f"--data.corpus={small_corpus}", f"--data.dir={busy / 'keep.txt' / 'data'}"],
                                  f"cannot create {busy / 'keep.txt' / 'data'}: a parent is a file"),
    }


@pytest.mark.parametrize("case", ["unknown key", "wrong type", "batch not divisible", "seq too long",
                                  "missing corpus", "empty corpus", "tokenizer too big", "run dir not empty",
                                  "run dir is a file", "lr is nan", "timeout not positive",
                                  "data dir under a file"])
def test_bad_input_one_clear_error(case, tmp_path, small_data, small_corpus, tokenizer_600, capsys):
    overrides, needle = bad_cases(tmp_path, small_data, small_corpus, tokenizer_600)[case]
    base = tiny_overrides(small_data, tmp_path / "run")
    code = train_main(base + overrides)
    err = capsys.readouterr().err
    assert code == 2
    assert err.count("error:") == 1 and needle in err, err
    assert "Traceback" not in err
    if case == "run dir not empty":
        assert (tmp_path / "busy" / "keep.txt").read_text() == "precious"
    if case in ("missing corpus", "empty corpus", "tokenizer too big"):
        assert not (tmp_path / "fresh").exists() or not any((tmp_path / "fresh").rglob("*.bin"))


def test_bad_input_with_run_overwrite_keeps_the_previous_run(tmp_path, small_data, small_corpus,
                                                               tokenizer_600, capsys):
    """run.overwrite=true with data that cannot be trained on: the error, and the previous run's files kept
    (the directory was cleared before the data and the model were checked: a typo cost the previous run)."""
    run = tmp_path / "run"
    (run / "final").mkdir(parents=True)
    previous = {"metrics.jsonl": '{"step": 1}\n', "config.json": "{}", "final/model.safetensors": "weights"}
    for name, text in previous.items():
        (run / name).write_text(text)
    overrides = [f"--data.corpus={small_corpus}", f"--data.tokenizer={tokenizer_600}",
                 f"--data.dir={tmp_path / 'fresh'}"]
    assert train_main(tiny_overrides(small_data, run) + overrides) == 2
    assert "600" in capsys.readouterr().err
    assert {name: (run / name).read_text() for name in previous} == previous


@pytest.mark.dist
def test_bad_input_under_torchrun_exits_without_hang(tmp_path, small_data):
    args = ["-m", "shardlm.train", *tiny_overrides(small_data, tmp_path / "run"),
            "--train.global_batch_size=6", "--train.micro_batch_size=2", "--parallel.timeout_s=60"]
    proc = torchrun(2, args, timeout=120, check=False)
    assert proc.returncode != 0
    assert proc.stderr.count("error: train.global_batch_size=6 must be divisible") == 1


ERROR_SCRIPT = """
import os, sys, time
from shardlm.cli.errors import run_cli
from shardlm.config import ConfigError
rank, case = int(os.environ["RANK"]), sys.argv[1]
def fail():
    if case == "rank 0 late":  # every rank raises the same error; rank 1 exits first
        time.sleep(1.0 if rank == 0 else 0.0)
        raise ConfigError("same error on every rank")
    if rank == 1:  # only rank 1 fails; rank 0 would go on (here: waits to be stopped)
        raise ConfigError("error of rank 1 alone")
    time.sleep(60)
sys.exit(run_cli(fail))
"""


@pytest.mark.parametrize("case,message", [("rank 0 late", "same error on every rank"),
                                          ("rank 1 alone", "error of rank 1 alone")])
@pytest.mark.dist
def test_an_error_is_printed_once_whichever_rank_raises_it_first(tmp_path, case, message):
    """An error raised on every rank prints once even when rank 0 is the last to raise it (torchrun stops the
    others as soon as one rank exits), and an error raised on rank 1 alone is printed, not lost."""
    script = tmp_path / "fail.py"
    script.write_text(ERROR_SCRIPT)
    proc = torchrun(2, [str(script), case], timeout=60, check=False)
    assert proc.returncode != 0
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert errors == [f"error: {message}"], proc.stderr[-3000:]


@pytest.mark.parametrize("start_group", [True, False])
def test_exit_process_keeps_the_code_and_the_output(start_group):
    """``exit_process`` (which skips the interpreter's teardown once a process group was started) still
    exits with the given code, with buffered output written and the process group destroyed first."""
    script = ("import sys\nfrom shardlm.config import ParallelConfig\n"
              "from shardlm.parallel import exit_process, init_distributed\n"
              f"if {start_group}: init_distributed(ParallelConfig())\n"
              "print('buffered line'); print('to stderr', file=sys.stderr)\n"
              "exit_process(5)\n")
    proc = subprocess.run([sys.executable, "-c", script], env=cpu_env(), capture_output=True, text=True,
                          timeout=60, stdin=subprocess.DEVNULL)
    assert proc.returncode == 5, proc.stderr
    assert proc.stdout == "buffered line\n" and proc.stderr.endswith("to stderr\n"), (proc.stdout, proc.stderr)


def test_non_finite_loss_stops_and_writes_nothing(tmp_path, small_data, capsys):
    run = tmp_path / "run"
    # an absurd learning rate blows the weights up within a few steps: the loss becomes inf/NaN
    code = train_main(tiny_overrides(small_data, run, {"train.lr": 1e30, "train.min_lr": 1e30,
                                                       "train.warmup_steps": 0, "train.grad_clip": 0.0}))
    err = capsys.readouterr().err
    assert code == 3
    assert err.count("error:") == 1 and "is not finite" in err, err
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert len(records) < 20
    assert all(math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]) for r in records)
    assert not (run / "final").exists()
