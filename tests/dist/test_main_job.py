"""The main job end to end (torchrun, real Shakespeare, the tiny config shortened), and bad input under
torchrun."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import ROOT, cpu_env, tiny_overrides, torchrun

TINY = str(ROOT / "configs/shakespeare-tiny.toml")


@pytest.mark.dist
def test_tiny_config_beats_unigram_entropy_and_generates(tmp_path, monkeypatch):
    data, run = tmp_path / "data", tmp_path / "run"
    monkeypatch.setenv("SHARDLM_PROGRESS_INTERVAL_S", "0.2")  # output to a pipe: plain progress lines, often
    proc = torchrun(2,
                    ["-m", "shardlm.train", "--config", TINY, "--train.steps=40", "--train.eval_interval=20",
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
    assert {p.name for p in (run / "final").iterdir()} == {"config.json", "model.safetensors",
                                                           "tokenizer.json", "tokenizer_config.json",
                                                           "generation_config.json"}
    assert json.loads((run / "config.json").read_text())["train"]["steps"] == 40
    gen = subprocess.run([sys.executable, "-m", "shardlm", "generate", "--model", str(run / "final"),
                          "--prompt", "ROMEO:", "--max-new-tokens", "20"],
                         env=cpu_env(), capture_output=True, text=True, timeout=120)
    assert gen.returncode == 0, gen.stderr
    assert gen.stdout.startswith("ROMEO:") and len(gen.stdout.strip()) > len("ROMEO:") + 10


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
        time.sleep(0.3 if rank == 0 else 0.0)
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
