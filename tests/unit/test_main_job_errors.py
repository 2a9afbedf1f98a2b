"""The main job's failures in one process: bad input with one clear error, ``exit_process`` keeping the code
and the output, and a non-finite loss that stops the run and writes nothing. The job end to end under torchrun
is tests/dist/test_main_job.py."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import cpu_env, tiny_overrides
from shardlm.cli.train import main as train_main
from shardlm.data import prepare_corpus


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
        "missing corpus": ([f"--data.corpus={tmp_path / 'nope.txt'}", f"--data.dir={fresh / 'd1'}"],
                           "nope.txt"),
        "empty corpus": ([f"--data.corpus={empty}", f"--data.dir={fresh / 'd2'}"], "empty"),
        "tokenizer too big": ([f"--data.corpus={small_corpus}", f"--data.tokenizer={tokenizer_600}",
                               f"--data.dir={fresh / 'd3'}"], "600"),
        "run dir not empty": ([f"--run.dir={busy}", "--run.overwrite=false"], "not empty"),
        "run dir is a file": ([f"--run.dir={busy / 'keep.txt'}"], "is not a directory"),
        "lr is nan": (["--train.lr=nan"], "train.lr must be a finite number"),
        "timeout not positive": (["--parallel.timeout_s=-1"], "parallel.timeout_s must be positive"),
        "data dir under a file": ([f"--data.corpus={small_corpus}",
                                   f"--data.dir={busy / 'keep.txt' / 'data'}"],
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
    assert proc.stdout == "buffered line\n" and proc.stderr.endswith("to stderr\n"), (
        proc.stdout,
        proc.stderr,
    )


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


@pytest.fixture(scope="module")
def checkpointed_run(tmp_path_factory, small_data) -> Path:
    """A tiny run of 4 steps with checkpoints step-2 and step-4 (no evaluation)."""
    run = tmp_path_factory.mktemp("checkpointed") / "run"
    assert train_main(tiny_overrides(small_data, run, {"train.steps": 4, "checkpoint.interval": 2,
                                                       "train.eval_interval": 0})) == 0
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-2", "step-4"]
    return run


def test_resume_from_a_run_directory_says_what_to_pass(checkpointed_run, small_data, tmp_path, capsys):
    """``--resume=RUN_DIR`` (a run directory, not a checkpoint): one error naming both ways to resume it,
    before any data preparation or model building, and the run untouched."""
    run = checkpointed_run
    before = sorted(str(p.relative_to(run)) for p in run.rglob("*"))
    capsys.readouterr()
    code = train_main(tiny_overrides(small_data, run, {"train.steps": 6}) + [f"--resume={run}"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("error:") == 1 and "Traceback" not in err, err
    assert err.strip() == (f"error: {run} is a run directory, not a checkpoint: to continue its run, pass "
                           f"--resume=auto --run.dir={run}; or pass one of its checkpoints, the newest is "
                           f"--resume={run / 'checkpoints' / 'step-4'}"), err
    assert sorted(str(p.relative_to(run)) for p in run.rglob("*")) == before


def test_resume_from_a_checkpoint_without_config_refuses_before_preparing_data(checkpointed_run, tmp_path,
                                                                                monkeypatch, capsys):
    """``--resume=CKPT`` alone (no ``--config``: every setting is the default, the Shakespeare corpus and a
    larger model): refused at once, naming the settings that cannot change and the way to pass the run's,
    before the default corpus is prepared or a run directory made."""
    monkeypatch.chdir(tmp_path)  # the defaults' data.dir and run.dir are relative: here
    ckpt = checkpointed_run / "checkpoints" / "step-4"
    capsys.readouterr()
    code = train_main([f"--resume={ckpt}"])
    out, err = capsys.readouterr()
    assert code == 2 and err.count("error:") == 1 and "Traceback" not in err, err
    assert err.startswith(f"error: cannot resume from {ckpt}: model.dim changed 64 -> "), err
    assert 'data.corpus changed "' in err and "--resume=auto --run.dir=RUN_DIR" in err, err
    assert "prepare:" not in out + err and list(tmp_path.iterdir()) == []  # no data, no run directory


def test_resume_auto_without_a_checkpoint_says_it_starts_from_step_0(small_data, tmp_path, capsys):
    run = tmp_path / "fresh"
    code = train_main(tiny_overrides(small_data, run, {"train.steps": 2, "train.eval_interval": 0})
                      + ["--resume=auto"])
    out = capsys.readouterr().out
    assert code == 0
    said = [line for line in out.splitlines() if line.startswith("--resume=auto")]
    assert said == [f"--resume=auto: no checkpoint found in {run / 'checkpoints'}; training starts from step "
                    "0"], out


def test_generate_with_a_run_directory_names_the_model_directory_to_pass(checkpointed_run, tmp_path, capsys):
    """``generate --model RUN_DIR`` (the run's config.json is not a model's): one error naming RUN_DIR/final,
    which then works; a run without final/ yet names its newest checkpoint to export."""
    from conftest import cli_error
    from shardlm.cli.main import main as shardlm_main

    run = checkpointed_run
    err = cli_error(capsys, ["generate", "--model", str(run), "--prompt", "To be", "--max-new-tokens", "2"])
    assert err == (f"error: {run} is a training run's directory, not a model directory: its trained model is "
                   f"{run / 'final'}: pass --model {run / 'final'}")
    assert shardlm_main(["generate", "--model", str(run / "final"), "--prompt", "To be",
                         "--max-new-tokens", "2"]) == 0
    unfinished = tmp_path / "unfinished"
    shutil.copytree(run, unfinished, ignore=shutil.ignore_patterns("final"))
    err = cli_error(capsys, ["generate", "--model", str(unfinished), "--prompt", "To be"])
    assert err == (f"error: {unfinished} is a training run's directory, not a model directory, and it has no "
                   f"final model yet: export its newest checkpoint with `shardlm export "
                   f"{unfinished / 'checkpoints' / 'step-4'} OUT` and pass --model OUT")
