"""Ctrl-C that saves, and the ``shardlm train`` launcher, at 2 ranks (issue 34 items 1-3).

One module fixture runs six 2-rank launches of the tiny model: ``shardlm train --nproc-per-node 2`` stopped by
SIGINT and resumed by the command it printed; the same under plain ``torchrun -m shardlm.train``; one stopped
by Ctrl-C pressed again and again; and an uninterrupted plain torchrun run as the reference.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import cpu_env, describing, require_dist_marker, tiny_overrides
from shardlm.checkpoint.run import LAUNCH_ENV
from shardlm.cli.train import main as train_main
from shardlm.errors import STOPPED_EXIT_CODE
from shardlm.metrics.report import attempt_seconds, load_run

STEPS = 150
#: the tiny run, started with many overrides (more than five: model shape, data, schedule, run directory...)
EXTRA = {"train.steps": STEPS, "train.micro_batch_size": 4, "checkpoint.interval": 0,
         "train.eval_interval": 50}
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m",
            "shardlm.train"]
SHARDLM = [sys.executable, "-m", "shardlm", "train", "--nproc-per-node", "2"]


def env() -> dict[str, str]:
    """The tests' child environment, with this Python's ``bin`` first on PATH (``shardlm`` and
    ``torchrun`` there)."""
    e = cpu_env()
    e["PATH"] = str(Path(sys.executable).parent) + os.pathsep + e.get("PATH", "")
    e.pop(LAUNCH_ENV, None)
    return e


def metrics_steps(run: Path) -> list[int]:
    path = run / "metrics.jsonl"
    return [json.loads(line)["step"] for line in path.read_text().splitlines()] if path.is_file() else []


def losses(run: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())}


def interrupted(cmd: list[str], run: Path, log: Path, after_step: int = 3, repeat: bool = False
                ) -> tuple[int, list[str]]:
    """Start ``cmd``; once ``run``'s metrics reach ``after_step``, send the launcher one SIGINT (what Ctrl-C
    sends to the terminal's foreground process), or with ``repeat`` one every 5 ms until it ends (Ctrl-C
    pressed again while the ranks finish their step and save); return (exit code, output lines)."""
    require_dist_marker()
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, env=env(), stdout=out, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 240
        while (not metrics_steps(run) or metrics_steps(run)[-1] < after_step) and proc.poll() is None:
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.02)
        proc.send_signal(signal.SIGINT)
        while repeat and proc.poll() is None:
            time.sleep(0.005)
            proc.send_signal(signal.SIGINT)
        code = proc.wait(timeout=240)
    return code, log.read_text().splitlines()


def run_alone(command: str, log: Path) -> subprocess.CompletedProcess:
    """Run a printed command line exactly as printed (split as a shell would)."""
    require_dist_marker()
    proc = subprocess.run(shlex.split(command), env=env(), capture_output=True, text=True, timeout=300)
    log.write_text(proc.stdout + proc.stderr)
    return proc


@pytest.fixture(scope="module")
def runs(small_data, tmp_path_factory):
    """{name: (exit code, output lines)} of the five launches, and the run root."""
    root = tmp_path_factory.mktemp("launch")
    out = {}
    out["launcher"] = interrupted([*SHARDLM, *tiny_overrides(small_data, root / "launcher", EXTRA)],
                                  root / "launcher", root / "launcher.log")
    out["launcher_resume"] = run_alone(out["launcher"][1][-1].strip(), root / "launcher_resume.log")
    out["torchrun"] = interrupted([*TORCHRUN, *tiny_overrides(small_data, root / "torchrun", EXTRA)],
                                  root / "torchrun", root / "torchrun.log")
    printed = [line for line in out["torchrun"][1] if "--resume=auto" in line]
    out["torchrun_resume"] = run_alone(printed[-1].strip() if printed else "false",
                                       root / "torchrun_resume.log")
    out["twice"] = interrupted([*SHARDLM, *tiny_overrides(small_data, root / "twice", EXTRA)], root / "twice",
                               root / "twice.log", repeat=True)
    ref = [*TORCHRUN, *tiny_overrides(small_data, root / "ref", EXTRA)]
    require_dist_marker()
    out["ref"] = subprocess.run(ref, env=env(), capture_output=True, text=True, timeout=300)
    return out, root


def assert_stopped_and_resumed_exactly(root: Path, name: str, code: int, lines: list[str], resumed) -> None:
    assert code != 0, lines[-20:]
    ckpts = sorted((p.name for p in (root / name / "checkpoints").iterdir()),
                   key=lambda n: int(n.split("-")[1]))
    assert len(ckpts) == 2 and ckpts[-1] == f"step-{STEPS}", ckpts  # the stop's checkpoint, then the end's
    stopped_at = int(ckpts[0].split("-")[1])
    assert 3 <= stopped_at < STEPS
    said = [line for line in lines if line.startswith("stopped after step")]
    assert said == [f"stopped after step {stopped_at} on a signal; checkpoint "
                    f"{root / name / 'checkpoints' / ckpts[0]}. Resume with:"], lines[-10:]
    assert resumed.returncode == 0, (resumed.stdout + resumed.stderr)[-3000:]
    assert f"at step {stopped_at}" in resumed.stdout
    # nothing listed as changed, resume included
    assert "setting" not in resumed.stdout.split("resumed run")[0]
    want, got = losses(root / "ref"), losses(root / name)
    assert sorted(got) == list(range(1, STEPS + 1)) and got == want  # every step once, bit-equal
    p, q = load_file(str(root / name / "final" / "model.safetensors")), load_file(str(root / "ref" / "final" /
                                                                                   "model.safetensors"))
    assert p.keys() == q.keys() and all(torch.equal(p[k], q[k]) for k in q)


@pytest.mark.dist
def test_ctrl_c_under_the_launcher_saves_prints_the_resume_command_last_and_exits_5(runs):
    out, root = runs
    assert out["ref"].returncode == 0, out["ref"].stderr[-3000:]  # torchrun -m shardlm.train keeps working
    code, lines = out["launcher"]
    assert code == STOPPED_EXIT_CODE, lines[-20:]
    assert lines[-1] == f"  shardlm train --nproc-per-node=2 --resume=auto --run.dir={root / 'launcher'}"
    assert any(line.startswith("Ctrl-C: finishing this step") for line in lines)
    assert not any("Traceback" in line or "ChildFailedError" in line for line in lines)
    assert_stopped_and_resumed_exactly(root, "launcher", code, lines, out["launcher_resume"])


@pytest.mark.dist
def test_ctrl_c_to_plain_torchrun_saves_and_its_resume_command_alone_resumes_bit_exact(runs):
    out, root = runs
    code, lines = out["torchrun"]
    printed = [line.strip() for line in lines if "--resume=auto" in line]
    assert printed == [f"torchrun --standalone --nproc_per_node=2 -m shardlm.train --resume=auto "
                       f"--run.dir={root / 'torchrun'}"]
    assert_stopped_and_resumed_exactly(root, "torchrun", code, lines, out["torchrun_resume"])


@pytest.mark.dist
def test_ctrl_c_twice_stops_at_once_without_saving(runs):
    out, root = runs
    code, lines = out["twice"]
    assert code == 130, lines[-20:]
    assert lines[-1].startswith("error: stopped at once (Ctrl-C twice)"), lines[-10:]
    assert not any(line.startswith("stopped after step") for line in lines)
    ckpts = root / "twice" / "checkpoints"
    assert not ckpts.exists() or not [p for p in ckpts.iterdir() if p.name.startswith("step-")]
    assert metrics_steps(root / "twice")  # it was training when stopped


@pytest.mark.dist
def test_launcher_bad_override_ends_with_the_one_line_error(small_data, tmp_path):
    require_dist_marker()
    cmd = [*SHARDLM, *tiny_overrides(small_data, tmp_path / "bad", {"train.bogus": 1})]
    proc = subprocess.run(cmd, env=env(), capture_output=True, text=True, timeout=300)
    lines = (proc.stdout + proc.stderr).strip().splitlines()
    assert proc.returncode == 2
    assert lines[-1].startswith("error: unknown config key 'train.bogus'"), lines[-10:]
    assert not any("Traceback" in line or "torch/distributed/elastic" in line for line in lines), lines


def ranks_of(launcher: int) -> list[int]:
    """The pids of ``python -m shardlm.train`` processes whose parent is ``launcher`` (the ranks that
    torchrun, run inside the launcher, started)."""
    pids = []
    for entry in Path("/proc").iterdir():
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
            parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        if parent == launcher and b"shardlm.train" in argv:
            pids.append(int(entry.name))
    return pids


@pytest.mark.dist
def test_ctrl_c_while_the_ranks_import_torch_is_one_line_and_exit_130(small_data, tmp_path):
    """Ctrl-C 0.1 s after both ranks started (each is still importing torch, which takes seconds here):
    the launcher's one line, exit 130, no rank's KeyboardInterrupt traceback (the package no longer imports
    the trainer before ``shardlm.train.__main__``, which takes the interrupt), nothing written."""
    require_dist_marker()
    run = tmp_path / "early"
    proc = subprocess.Popen([*SHARDLM, *tiny_overrides(small_data, run, EXTRA)], env=env(),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 120
    while len(ranks_of(proc.pid)) < 2 and proc.poll() is None:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    time.sleep(0.1)
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=120)
    lines = out.strip().splitlines()
    assert proc.returncode == 130, lines[-20:]
    assert lines == ["error: stopped by Ctrl-C before training began (no checkpoint written)"], lines[-30:]
    assert not (run / "checkpoints").exists()


@pytest.mark.dist
def test_console_words_progress_lines_and_the_report_of_a_resumed_run(runs, small_data, tmp_path, capsys):
    out, root = runs
    lines = (
        out["launcher"][1]
        + out["launcher_resume"].stdout.splitlines()
        + out["launcher_resume"].stderr.splitlines()
    )
    assert any(line.startswith("  parallel   fsdp, world size 2,") and line.endswith(", mesh dp_shard 2")
               for line in lines), lines[:12]
    progress = [line.split(" step ")[0] for line in lines if line.startswith("train ")]
    assert progress and len(progress) == len(set(progress)), progress  # one line per step count
    attempts = attempt_seconds(load_run(root / "launcher"))  # the interrupted start, then the resume
    assert len(attempts) == 2 and all(a > 0 for a in attempts)
    # fine-tuning from the reference's final model: the step-0 validation loss is printed, not only logged
    # on the data's own tokenizer (not init_from's)
    assert train_main(tiny_overrides(small_data, tmp_path / "ft", {
        "model.init_from": f'"{root / "ref" / "final"}"', "train.steps": 1, "train.eval_interval": 1,
        **describing(small_data, tokenizer_file=True)})) == 0
    logged = json.loads((tmp_path / "ft" / "metrics.jsonl").read_text().splitlines()[0])
    assert logged["step"] == 0
    assert f"step 0 (the pretrained model): val loss {logged['val_loss']:.4f}" in capsys.readouterr().out


def ended(pid: int) -> bool:
    """Whether process ``pid`` has ended (gone, or a zombie that its new parent has not reaped yet)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


@pytest.mark.dist
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl(PR_SET_PDEATHSIG) is Linux's")
def test_killing_torchrun_stops_its_ranks_after_a_checkpoint(small_data, tmp_path):
    """torchrun killed outright (SIGKILL, as the out-of-memory killer or a scheduler does) after step 3: its
    ranks are not left training on their own. Linux sends each SIGTERM (shardlm/parallel/launcher_exit.py),
    so they finish the step, save it and end within a minute; nothing is written after that step."""
    require_dist_marker()
    run, log = tmp_path / "orphans", tmp_path / "orphans.log"
    with log.open("w") as out:
        proc = subprocess.Popen([*TORCHRUN, *tiny_overrides(small_data, run, EXTRA)], env=env(), stdout=out,
                                stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 240
        while (not metrics_steps(run) or metrics_steps(run)[-1] < 3) and proc.poll() is None:
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.02)
        ranks = ranks_of(proc.pid)
        assert len(ranks) == 2, log.read_text()[-3000:]
        proc.kill()
        proc.wait(timeout=30)
        deadline = time.monotonic() + 60
        while not all(ended(pid) for pid in ranks):
            assert time.monotonic() < deadline, f"ranks {ranks} still running a minute after the kill"
            time.sleep(0.1)
    lines = log.read_text().splitlines()
    saved = [p.name for p in (run / "checkpoints").iterdir() if p.name.startswith("step-")]
    assert len(saved) == 1, (saved, lines[-20:])
    stopped_at = int(saved[0].split("-")[1])
    assert 3 <= stopped_at < STEPS and metrics_steps(run)[-1] == stopped_at
    assert any(line.startswith(f"stopped after step {stopped_at} on a signal") for line in lines), lines[-10:]
    assert not (run / "final").exists()
