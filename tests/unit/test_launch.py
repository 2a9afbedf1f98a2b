"""Ctrl-C and the ``shardlm train`` launcher in one process (issue 34 items 1-3): resume from the run
directory alone, the signal rules, the resume command, and what the launcher passes to the ranks and returns.
The 2-rank launches stopped by Ctrl-C are in tests/dist/test_launch_signals.py."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
import torch

from shardlm.checkpoint.dcp import Checkpointer
from shardlm.checkpoint.resume_config import config_changes
from shardlm.checkpoint.run import LAUNCH_ENV, resume_command, write_run_config
from shardlm.cli import launch
from shardlm.cli.main import main as shardlm_main
from shardlm.cli.train import parse_args, train_config
from shardlm.config import load_config
from shardlm.errors import ConfigError
from shardlm.parallel.dist import DistInfo


# ---- one process --------------------------------------------------------------------------------
def test_resume_auto_with_the_run_dir_alone_restores_its_config(tmp_path, monkeypatch):
    started = load_config("configs/shakespeare-tiny.toml",
                          ["--train.lr=1e-3", "--train.steps=7", "--model.dim=96",
                                                            "--parallel.reshard_after_forward=false",
                                                            f"--run.dir={tmp_path}", "--checkpoint.keep=2"])
    write_run_config(tmp_path, "20260101-000000-00000000", started.to_dict())
    paths, overrides = parse_args(["--resume=auto", f"--run.dir={tmp_path}"])
    restored = train_config(paths, overrides)
    assert restored.checkpoint.resume == "auto"
    restored.checkpoint.resume = ""
    assert restored == started
    # a flag given with it is a change on top of the recorded config (the resume rules then apply)
    changed = train_config(*parse_args(["--resume=auto", f"--run.dir={tmp_path}", "--train.steps=9"]))
    assert changed.train.steps == 9 and changed.train.lr == 1e-3 and changed.model.dim == 96
    assert [c.key for c in config_changes(started.to_dict(), changed.to_dict())] == ["train.steps"]
    # the old spelling is the same setting
    assert train_config(None, ["--checkpoint.resume=auto", f"--run.dir={tmp_path}"]).model.dim == 96
    with pytest.raises(ConfigError, match=f"{tmp_path / 'missing'}/config.json, which cannot be read"):
        train_config(*parse_args(["--resume=auto", f"--run.dir={tmp_path / 'missing'}"]))
    # no run there yet, other flags given: they alone, as before (auto then starts fresh)
    assert train_config(None, ["--checkpoint.resume=auto", f"--run.dir={tmp_path / 'new'}", "--model.dim=32"]
                        ).model.dim == 32
    # with a config file, the file decides as before
    assert train_config(["configs/shakespeare-tiny.toml"], ["--checkpoint.resume=auto"]).model.dim != 96
    # a run in its default directory runs/<name>: naming that directory is no change
    default = load_config(None, ["--run.name=tiny"])
    (tmp_path / "runs" / "tiny").mkdir(parents=True)
    write_run_config(tmp_path / "runs" / "tiny", "20260101-000000-00000001", default.to_dict())
    monkeypatch.chdir(tmp_path)
    again = train_config(None, ["--checkpoint.resume=auto", "--run.dir=runs/tiny"])
    assert again.run.dir == "" and [c.key for c in config_changes(default.to_dict(), again.to_dict())] == []


def test_other_prepared_data_is_refused_by_content():
    """The prepared data is compared by content at resume: another tokenizer.json (its SHA-256) or another
    meta.json record is named; the same is no problem."""
    from shardlm.checkpoint.resume_config import data_problems

    manifest = {"files": {"tokenizer.json": {"sha256": "a" * 64}}, "data": {"content_sha256": "ab"}}
    assert data_problems(manifest, {"content_sha256": "ab"}, "a" * 64) == []
    (problem,) = data_problems(manifest, {"content_sha256": "ab"}, "b" * 64)
    assert problem.startswith("the tokenizer differs (tokenizer.json SHA-256 aaaaaaaaaaaa... in the "
                              "checkpoint, bbbbbbbbbbbb... in the data directory)"), problem
    (problem,) = data_problems(manifest, {"content_sha256": "cd"}, "a" * 64)
    assert problem == ("the prepared data differs from the checkpoint's (meta.json: content_sha256 "
                       '"ab" -> "cd")')


def test_the_resume_setting_is_not_a_change():
    old = load_config(None, []).to_dict()
    new = load_config(None, ["--checkpoint.resume=auto"]).to_dict()
    assert config_changes(old, new) == []


def checkpointer(tmp_path: Path) -> Checkpointer:
    cfg = load_config(None, [f"--run.dir={tmp_path}"])
    return Checkpointer(cfg, DistInfo(0, 0, 1, torch.device("cpu"), "gloo"), tmp_path)


def test_first_ctrl_c_is_recorded_and_the_next_signal_stops_at_once(tmp_path, capfd):
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)}
    c = checkpointer(tmp_path)
    c.install_signal_handlers()
    try:
        assert not c.signal_received()
        os.kill(os.getpid(), signal.SIGINT)  # handled in the main thread before the next line runs
        assert c.signal_received()
        assert all(signal.getsignal(s) == signal.SIG_DFL for s in before)  # a second one: the default action
        assert "Ctrl-C: finishing this step, then saving a checkpoint" in capfd.readouterr().err
    finally:
        c.close()
    assert {s: signal.getsignal(s) for s in before} == before


def test_ctrl_c_saves_after_the_step_it_came_in_not_at_the_next_logging_step(tmp_path, small_data,
                                                                           monkeypatch, capfd):
    """A Ctrl-C during step 3 of a run that logs every 10 steps: the run saves ``step-3`` and stops after
    step 3, as its line says (the flag was read only on logging steps: it went on to step 10)."""
    from conftest import tiny_overrides
    from shardlm.cli.train import main as train_main
    from shardlm.errors import STOPPED_EXIT_CODE
    from shardlm.train.trainer import Trainer

    original = Trainer.train_step

    def step(self, log: bool = True):
        if self.step == 2:  # step 3 starts: Ctrl-C while it computes
            os.kill(os.getpid(), signal.SIGINT)
        return original(self, log)

    monkeypatch.setattr(Trainer, "train_step", step)
    run = tmp_path / "run"
    code = train_main(tiny_overrides(small_data, run, {"train.log_interval": 10, "train.eval_interval": 0,
                                                       "checkpoint.interval": 0}))
    out, err = capfd.readouterr()
    assert code == STOPPED_EXIT_CODE, err[-2000:]
    assert "Ctrl-C: finishing this step, then saving a checkpoint" in err
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-3"]
    assert f"stopped after step 3 on a signal; checkpoint {run / 'checkpoints' / 'step-3'}." in out


def test_after_sigterm_only_ctrl_c_stops_at_once(tmp_path):
    c = checkpointer(tmp_path)
    c.install_signal_handlers()
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        assert c.signal_received()
        assert signal.getsignal(signal.SIGINT) == signal.SIG_DFL
        # Slurm and torchrun both sending it: still saves
        assert signal.getsignal(signal.SIGTERM) == c._on_signal
    finally:
        c.close()


def test_resume_command_names_the_launcher(monkeypatch, tmp_path):
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.delenv(LAUNCH_ENV, raising=False)
    assert resume_command(Path("runs/a b")) == "python -m shardlm.train --resume=auto '--run.dir=runs/a b'"
    monkeypatch.setenv(LAUNCH_ENV, "shardlm train --nproc-per-node=2")
    assert resume_command(tmp_path) == f"shardlm train --nproc-per-node=2 --resume=auto --run.dir={tmp_path}"


def test_launcher_passes_everything_else_to_the_ranks(monkeypatch):
    seen = {}
    monkeypatch.setattr(launch, "cmd_train", lambda args, rest: seen.update(args=args, rest=rest) or 0)
    argv = ["train", "--nproc-per-node", "2", "--config", "a.toml", "--train.lr=1e-3", "--resume=auto",
            "--nnodes=1"]
    assert shardlm_main(argv) == 0
    assert seen["rest"] == ["--config", "a.toml", "--train.lr=1e-3", "--resume=auto"]
    args = seen["args"]
    assert launch.launch_options(args) == ["--nproc-per-node=2"]
    assert launch.torchrun_argv(args, ["--config", "a.toml"])[-5:] == ["--standalone", "-m", "shardlm.train",
                                                                       "--config", "a.toml"]


def test_launcher_outcome_keeps_the_ranks_exit_code():
    # rank 0 printed its error; torchrun then killed rank 1
    assert launch.outcome({0: 2, 1: -15}) == (2, None)
    assert launch.outcome({1: 5, 0: -15}) == (5, None)
    code, line = launch.outcome({1: 1, 0: -15})
    assert code == 1 and line == "error: rank 1 failed with exit code 1 (its traceback is above)"
    code, line = launch.outcome({0: -9, 1: -9})
    assert code == 137 and line.startswith("error: rank 0 was killed by SIGKILL")
    assert launch.outcome({0: -15, 1: 1})[1] == ("error: rank 1 failed with exit code 1 (its traceback is "
                                                 "above)")
    assert launch.outcome({0: -15})[1] == "error: rank 0 was killed by SIGTERM (exit code -15)"
    early = launch.Forwarder()
    early.received = [signal.SIGINT]
    assert launch.outcome({0: -2, 1: -2}, early) == (130,
                                                     "error: stopped by Ctrl-C before training began (no "
                                                          "checkpoint written)")
    twice = launch.Forwarder()
    twice.received = [signal.SIGINT, signal.SIGINT]
    assert launch.outcome({0: -2, 1: -2}, twice)[0] == 130
    # the first Ctrl-C reached no rank (forwarded while torchrun spawned them): the second was the ranks'
    # first, they saved and printed the resume command, which stays the last line
    assert launch.outcome({0: 5, 1: 5}, twice) == (5, None)


def test_ctrl_c_while_the_command_still_imports_torch_is_one_line(capsys, monkeypatch):
    """Ctrl-C before ``shardlm train --nproc-per-node 2`` starts its ranks, while the command itself still
    imports torch (``run_cli``'s import of ``shardlm.parallel.dist``): one line and exit 130, no traceback."""
    import builtins

    from shardlm.cli.errors import run_cli

    real_import = builtins.__import__

    def interrupted_import(name, *args, **kwargs):
        if name == "shardlm.parallel.dist":
            raise KeyboardInterrupt
        return real_import(name, *args, **kwargs)

    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    monkeypatch.setattr(builtins, "__import__", interrupted_import)
    ran = []
    assert run_cli(lambda: ran.append(1)) == 130
    monkeypatch.setattr(builtins, "__import__", real_import)
    assert not ran and capsys.readouterr().err == "error: stopped by Ctrl-C\n"


def test_ctrl_c_while_the_ranks_prepare_data_or_build_the_model_is_one_line():
    """A Ctrl-C that reaches a rank inside ``run_cli`` (after its imports, before the training loop's handler:
    data preparation, the model's build) ends that rank with 130 and no line (under torchrun the launcher
    says it): the launcher then prints its one line, whatever the other ranks' codes."""
    early = launch.Forwarder()
    early.received = [signal.SIGINT]
    line = "error: stopped by Ctrl-C before training began (no checkpoint written)"
    for codes in ({0: 130, 1: 130}, {0: 130, 1: -2}, {0: -2, 1: 130}, {0: 130, 1: -15}):
        assert launch.outcome(codes, early) == (130, line), codes
    assert launch.outcome({0: 5, 1: 5}, early) == (5, None)  # saved: the ranks printed the resume command
    assert launch.outcome({0: 130, 1: 130}) == (130, None)  # no Ctrl-C forwarded: the ranks' own


INTERRUPTED_IN_A_CALLBACK = """
import builtins, os, runpy, signal, sys, time, weakref
real_import = builtins.__import__

class Garbage:
    pass

def interrupted_import(name, *args, **kwargs):
    if name == "shardlm.cli.train" and not getattr(builtins, "_done", False):
        builtins._done = True
        # the Ctrl-C arrives while the import machinery runs a weakref callback (its module locks' cb):
        # Python prints 'Exception ignored in' and the import goes on
        ref = weakref.ref(Garbage(), lambda r: (os.kill(os.getpid(), signal.SIGINT), time.sleep(0.2)))
    return real_import(name, *args, **kwargs)

builtins.__import__ = interrupted_import
sys.argv = ["shardlm.train", "--config", "missing.toml"]
runpy.run_module("shardlm.train", run_name="__main__", alter_sys=True)
"""


def test_a_ctrl_c_while_a_rank_imports_ends_it_even_inside_a_callback(tmp_path):
    """``python -m shardlm.train`` taking a Ctrl-C while it still imports, at a moment when Python runs a
    weakref callback (the import machinery's, e.g.): the rank ends by SIGINT without a line, as an uncaught
    Ctrl-C does, instead of printing 'Exception ignored' and going on to train."""
    import subprocess
    import sys

    src = str(Path(launch.__file__).parents[2])
    proc = subprocess.run([sys.executable, "-c", INTERRUPTED_IN_A_CALLBACK], capture_output=True, text=True,
                          timeout=120, cwd=tmp_path, env={**os.environ, "PYTHONPATH": src})
    assert proc.returncode == -signal.SIGINT, proc.stdout + proc.stderr
    assert proc.stdout + proc.stderr == ""
