"""``shardlm tune`` under torchrun: the fitting candidates measured in one launch (tensor and context parallel
among them), a killed rank keeping the measurements, a crashed worker's output shown."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import cpu_env, describing
from shardlm.cli.main import main as shardlm_main
from shardlm.config import load_config
from shardlm.plan import tune
from shardlm.plan.devices import GIB
from shardlm.plan.tune import Planner, config_candidate
from test_tune import TINY, as_candidate, table_rows


def tiny_toml(data: Path) -> str:
    """:data:`TINY` on the prepared ``data``, with the data settings it was made with (conftest's
    ``describing``), so that a run on it is not refused as made from other data."""
    settings = "".join(f"{k.removeprefix('data.')} = {v}\n" for k, v in describing(data).items())
    return TINY.format(data=data).replace(f'dir = "{data}"\n', f'dir = "{data}"\n{settings}', 1)


@pytest.mark.dist
def test_tune_measures_the_fitting_candidates_in_one_launch(tmp_path, small_data, capsys, monkeypatch):
    """A memory budget between the config's own settings and activation checkpointing: the config's row does
    not fit and is not measured, several others are, in one torchrun launch; the pick is the fastest measured
    row and its TOML, layered on the config, loads as those settings, which fit the budget."""
    config = tmp_path / "tiny.toml"
    config.write_text(tiny_toml(small_data))
    cfg = load_config(str(config))
    own = config_candidate(cfg, 2)
    probe = Planner(cfg, 2, "cpu", 0)
    budget = (probe.bytes(own) + probe.bytes(own.with_value("ac", "full"))) / 2
    launches = []
    popen = subprocess.Popen

    def counting_popen(cmd, *args, **kwargs):
        launches.append(cmd)
        return popen(cmd, *args, **kwargs)

    monkeypatch.setattr(tune.subprocess, "Popen", counting_popen)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    out = tmp_path / "tuned.toml"
    capsys.readouterr()
    code = shardlm_main(["tune", str(config), "--world-size", "2", "--out", str(out), "--warmup", "1",
                         "--steps", "2", "--memory-per-rank", f"{budget / GIB:.9f}", "--headroom", "0"])
    captured = capsys.readouterr()
    print(captured.out)
    assert code == 0, captured.err
    assert (
        len(launches) == 1 and "torch.distributed.run" in launches[0] and "--nproc_per_node=2" in launches[0]
    )
    rows = table_rows(captured.out)
    measured = [r for r in rows if r["step s"] != "-"]
    assert len(measured) >= 4 and all(r["fits"] == "yes" for r in measured)
    assert {r["compile"] for r in measured} == {"false", "true"}  # compiled blocks measured too (gcc is here)
    assert {r["blocks/group"] for r in measured} == {"1", "2"}  # and both blocks in one FSDP group
    tensor_parallel = [r for r in measured if r["tp"] == "2"]  # and tensor parallel over both ranks: the same
    # 8 rows
    assert tensor_parallel and all(r["micro-batch x accum"].endswith(" x 2") for r in tensor_parallel)
    assert all(r["AC"] in ("none", "full") for r in tensor_parallel) and {r["ep"] for r in rows} == {"1"}
    # and context parallel over both ranks (each sequence split in two): one data-parallel rank, which takes
    # all 8 sequences (micro-batch x accumulation); never with tp 2 (cp x tp = 4 ranks)
    split = [r for r in measured if r["cp"] == "2"]
    assert split and all(r["tp"] == "1" for r in split)
    assert all(int(m) * int(k) == 8 for m, k in (r["micro-batch x accum"].split(" x ") for r in split))
    assert {r["cp"] for r in rows} == {"1", "2"}
    progress = re.findall(r"^tune: reshard=.*$", captured.err, re.M)  # one line per measurement
    assert any(" cp=2 tp=1 " in line for line in progress)
    assert len([line for line in progress if not line.endswith("(confirming)")]) == len(measured)
    assert len([line for line in progress if line.endswith("(confirming)")]) == 2  # the 2 fastest, once more
    assert len([r for r in measured if "confirmed" in r["note"]]) == 2
    config_row = next(r for r in rows if "config" in r["note"])
    assert config_row["fits"] == "no" and config_row["step s"] == "-"  # the config's own settings do not fit
    assert float(config_row["predicted MiB/rank"].replace(",", "")) * 2**20 > budget
    picked = [r for r in rows if "picked" in r["note"]]
    finalists = [r for r in measured if "confirmed" in r["note"]]  # the pick is the faster of the two
    assert len(picked) == 1 and picked[0] in finalists
    assert float(picked[0]["step s"]) == min(float(r["step s"]) for r in finalists)
    for r in measured:  # tokens/s = global batch x seq / step time (the table rounds the step to 1 ms)
        step, tokens_s = float(r["step s"]), float(r["tokens/s"].replace(",", ""))
        assert 8 * 32 / (step + 0.0005) - 1 <= tokens_s <= 8 * 32 / max(step - 0.0005, 1e-9) + 1, r
    # the written overrides layer on the config (and the printed dotted form says the same)
    tuned = load_config([str(config), str(out)])
    chosen = config_candidate(tuned, 2)
    assert chosen == as_candidate(picked[0])
    assert Planner(tuned, 2, "cpu", budget).fits(chosen)
    assert set(re.findall(r"^\[(\w+)\]", out.read_text(), re.M)) == {"parallel", "train"}
    assert re.search(r"^cp = (\d+)$", out.read_text(), re.M).group(1) == picked[0]["cp"]
    line = next(line for line in captured.out.splitlines() if line.startswith("dotted overrides: "))
    assert config_candidate(load_config(str(config), line.split(": ", 1)[1].split()), 2) == chosen
    assert tuned.model == cfg.model and tuned.train.global_batch_size == 8 and tuned.run.name == "tiny"


def tune_workers() -> dict[int, int]:
    """{rank: PID} of the running ``shardlm.cli.tune_worker`` ranks (not torchrun itself)."""
    pids = {}
    for proc in Path("/proc").iterdir():
        try:
            cmd = (proc / "cmdline").read_bytes().split(b"\0")
            env = (proc / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"shardlm.cli.tune_worker" in cmd and b"torch.distributed.run" not in cmd:
            rank = next(int(v[5:]) for v in env if v.startswith(b"RANK="))
            pids[rank] = int(proc.name)
    return pids


@pytest.mark.dist
def test_a_killed_rank_keeps_the_measurements(tmp_path, small_data):
    """A rank killed (SIGKILL) after two measurements: one error line naming the failed launch, the rows
    measured before it printed as a table, non-zero exit, no traceback, nothing written."""
    config = tmp_path / "tiny.toml"
    config.write_text(tiny_toml(small_data))
    out = tmp_path / "tuned.toml"
    cmd = [sys.executable, "-m", "shardlm", "tune", str(config), "--world-size", "2", "--out", str(out),
           "--warmup", "1", "--steps", "2", "--parallel.timeout_s=60"]
    proc = subprocess.Popen(cmd, env=cpu_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    progress = []
    for line in proc.stderr:
        if line.startswith("tune: "):
            progress.append(line)
            if len(progress) == 2:
                workers = tune_workers()
                assert sorted(workers) == [0, 1]
                os.kill(workers[1], signal.SIGKILL)
                break
    stdout, rest = proc.communicate(timeout=240)
    err = "".join(progress) + rest
    assert proc.returncode == 2, err
    assert "Traceback" not in err
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert errors == ["error: the measuring launch failed (rank 1 ended with exit code -9 (SIGKILL)); 2 "
                     "candidates were measured before the failure"], err
    assert "measured before the launch failed (nothing was written)" in stdout
    measured = [r for r in table_rows(stdout) if r["step s"] != "-"]
    assert len(measured) == 2  # the two announced before the kill (a third cannot finish without rank 1)
    announced = {float(re.search(r": ([0-9.]+) s/step", line).group(1)) for line in progress}
    assert announced <= {float(r["step s"]) for r in measured}
    assert not out.exists()


@pytest.mark.dist
def test_a_crashed_worker_shows_its_output(tmp_path):
    """A worker that crashes (here: a malformed candidate in the spec) ends the launch with torchrun's root
    cause and the end of the output, where the worker's traceback says what happened."""
    spec = {"config": None, "overrides": [], "rows": [{"cand": {"no_such_field": 1}}], "base": {},
            "warmup": 1, "steps": 1, "repeats": 1, "confirm": 0, "search": "full", "device": "cpu",
            "budget": 1e12}
    with pytest.raises(tune.TuneError) as info:
        tune.launch(spec, 2, tmp_path)
    message = str(info.value)
    # both ranks crash alike: torchrun names whichever it saw fail first
    assert re.match(r"the measuring launch failed \(rank [01] ended with exit code 1\); 0 candidates were "
                    r"measured before the failure; the end of the workers' output:\n", message), message
    assert "unexpected keyword argument 'no_such_field'" in message
    assert info.value.rows == []
