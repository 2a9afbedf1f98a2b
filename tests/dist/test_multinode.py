"""Beyond one machine: HSDP, two torchrun launchers as two nodes, a lost node, bad mesh input.

Ranks are processes on this machine; a "node" is one torchrun launcher. Launches: 1 rank (the
one-process reference), 4 ranks (FSDP, HSDP 2x2, HSDP 2x2 with accumulation), 2 ranks in one
launcher, 2 launchers of 1 rank each (FSDP and HSDP 2x1 across the two "nodes"), 2 launchers of
which the second is killed, and the bad-input runs (which stop before any collective).
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file
from test_multinode_failures import free_port

import conftest
from conftest import WORKER, cpu_env, require_dist_marker, run_scenarios, tiny_overrides, torchrun
from shardlm.checkpoint.manifest import list_checkpoints
from shardlm.parallel.faults import (
    heartbeat_timeout,
)
from tolerance import assert_all_close, assert_close

#: relative to the largest loss of the reference run (~6) and to the largest parameter (a norm's, ~1)
LOSS_TOL, PARAM_TOL = 1e-5, 1e-4
STEPS = {"train.steps": 8, "train.eval_interval": 4}


def scenario(name: str, data: Path, runs: Path, extra: dict | None = None) -> dict:
    return conftest.scenario(name, data, runs, {**STEPS, **(extra or {})})


def node_launcher(node_rank: int, port: int, nproc: int = 1) -> list[str]:
    """torchrun for node ``node_rank`` of two, static rendezvous on loopback (node 0 hosts the store)."""
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", f"--node-rank={node_rank}",
            "--master-addr=127.0.0.1", f"--master-port={port}", f"--nproc_per_node={nproc}"]


def start_nodes(args: list[str], logs: Path, nproc: int = 1) -> list[subprocess.Popen]:
    """Start two launchers (each in its own process group, output to ``logs/node<i>.{out,err}``)."""
    require_dist_marker()
    port = free_port()
    logs.mkdir(parents=True, exist_ok=True)
    procs = []
    for node in (0, 1):
        with open(logs / f"node{node}.out", "w") as out, open(logs / f"node{node}.err", "w") as err:
            procs.append(subprocess.Popen(node_launcher(node, port, nproc) + args, env=cpu_env(), stdout=out,
                                          stderr=err, start_new_session=True))
    return procs


def stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            kill_node(p)


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (torchrun starts its workers in sessions of their own)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        try:
            kids = [int(c) for t in os.listdir(f"/proc/{p}/task")
                    for c in Path(f"/proc/{p}/task/{t}/children").read_text().split()]
        except OSError:
            continue
        out += kids
        todo += kids
    return out


def kill_node(proc: subprocess.Popen) -> None:
    """SIGKILL a launcher and all its workers at once, as when the machine dies."""
    pids = [proc.pid, *descendants(proc.pid)]
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait()


def logs_of(logs: Path) -> str:
    return "\n".join(f"--- {f.name}\n{f.read_text()[-4000:]}" for f in sorted(logs.glob("node*.*")))


# ---- HSDP on one launcher, FSDP, one process, two launchers -------------------------------------
@pytest.fixture(scope="module")
def results(small_data, tmp_path_factory):
    runs = tmp_path_factory.mktemp("multinode")
    gn = {"train.steps": 1, "train.eval_interval": 0, "train.grad_clip": 0.1}  # grad-norm scenarios: one step
    out = run_scenarios(1, [scenario("single", small_data, runs, {"parallel.mode": '"single"'}),
                            scenario("gn_single", small_data, runs, {**gn, "parallel.mode": '"single"'})],
                        runs)
    out.update(run_scenarios(4, [
        scenario("fsdp4", small_data, runs, {"train.micro_batch_size": 2}),
        scenario("hsdp2x2", small_data, runs, {"train.micro_batch_size": 2, "parallel.dp_replicate": 2}),
        scenario("hsdp2x2_accum", small_data, runs,
                 {"train.micro_batch_size": 1, "parallel.dp_replicate": 2, "parallel.dp_shard": 2}),
        # HSDP's own gradient-sync policy: reduce-scatter every micro-batch, all-reduce across replicas on
        # the last
        scenario("hsdp2x2_rs_every", small_data, runs,
                 {"train.micro_batch_size": 1, "parallel.dp_replicate": 2,
                  "parallel.grad_sync": '"reduce_scatter_every_all_reduce_last"'}),
        scenario("gn_fsdp4", small_data, runs, {**gn, "train.micro_batch_size": 2}),
        scenario("gn_hsdp2x2", small_data, runs,
                 {**gn, "train.micro_batch_size": 2, "parallel.dp_replicate": 2}),
    ], runs))
    out.update(run_scenarios(2, [
        scenario("fsdp2", small_data, runs, {"train.micro_batch_size": 4}),
        scenario("gn_fsdp2", small_data, runs, {**gn, "train.micro_batch_size": 4}),
        scenario("gn_ddp2", small_data, runs, {**gn, "train.micro_batch_size": 4, "parallel.mode": '"ddp"'}),
    ], runs))
    two_nodes = [
        scenario("nodes_fsdp2", small_data, runs, {"train.micro_batch_size": 4}),
        scenario(
            "nodes_hsdp2x1", small_data, runs, {"train.micro_batch_size": 4, "parallel.dp_replicate": 2}
        ),
    ]
    spec = runs / "spec-nodes.json"
    spec.write_text(json.dumps({"out": str(runs), "scenarios": two_nodes}))
    procs = start_nodes([str(WORKER), str(spec)], runs / "nodes-logs")
    try:
        codes = [p.wait(timeout=400) for p in procs]
    finally:
        stop(procs)
    assert codes == [0, 0], logs_of(runs / "nodes-logs")
    for s in two_nodes:
        out[s["name"]] = [json.loads((runs / s["name"] / f"rank{r}.json").read_text()) for r in range(2)]
    return out, runs


def max_diffs(out: dict, runs: Path, name: str, ref: str) -> tuple[float, float, float]:
    """Max differences of loss, val loss and final params of run ``name`` against ``ref``, each asserted
    within its tolerance (relative: tests/tolerance.py)."""
    hist, ref_hist = out[name][0]["history"], out[ref][0]["history"]
    assert len(hist) == len(ref_hist) == STEPS["train.steps"]
    loss = assert_close([a["loss"] for a in hist], [b["loss"] for b in ref_hist], rtol=LOSS_TOL, what="loss")
    val = assert_close(*([r["val_loss"] for r in h if "val_loss" in r] for h in (hist, ref_hist)),
                       rtol=LOSS_TOL, what="val loss")
    p = load_file(str(runs / name / "final" / "model.safetensors"))
    q = load_file(str(runs / ref / "final" / "model.safetensors"))
    return loss, val, assert_all_close(p, q, rtol=PARAM_TOL, what="params")


@pytest.mark.parametrize("name,ref", [
    ("hsdp2x2", "single"), ("hsdp2x2", "fsdp4"), ("hsdp2x2_accum", "single"), ("hsdp2x2_rs_every", "single"),
    # FSDP 4 against one process is tested once, in test_fsdp_parity.py
    ("nodes_fsdp2", "fsdp2"), ("nodes_hsdp2x1", "fsdp2"), ("nodes_fsdp2", "single"),
])
@pytest.mark.dist
def test_losses_and_params_match(results, name, ref):
    out, runs = results
    loss, val, param = max_diffs(out, runs, name, ref)
    print(f"{name} vs {ref}: max loss diff {loss:.2e}, val {val:.2e}, params {param:.2e}")
    hist = out[name][0]["history"]
    assert hist[-1]["loss"] < hist[0]["loss"] - 0.3  # it trained: the comparison is not vacuous


@pytest.mark.dist
def test_grad_norm_does_not_depend_on_the_sharding(results):
    """Step 1's gradient norm (with clipping active) agrees within 1e-7 relative under one process, FSDP 2,
    FSDP 4, HSDP 2x2 and DDP: squares summed in fp64 on each rank, then all-reduced (train/optim.py)."""
    out, _ = results
    norms = {name: out[name][0]["history"][0]["grad_norm"]
             for name in ("gn_single", "gn_fsdp2", "gn_fsdp4", "gn_hsdp2x2", "gn_ddp2")}
    ref = norms["gn_single"]
    print("step-1 grad_norm: " + ", ".join(f"{k} {v!r}" for k, v in norms.items()))
    assert ref > 0.1  # above train.grad_clip: clipping is active
    for name, value in norms.items():
        assert_close(value, ref, rtol=1e-7, what=name)


@pytest.mark.dist
def test_hsdp_mesh_and_placements(results):
    out = results[0]
    assert out["fsdp4"][0]["mesh"] == ["dp_shard"] and out["nodes_fsdp2"][0]["mesh"] == ["dp_shard"]
    for name, shard in (("hsdp2x2", 2), ("nodes_hsdp2x1", 1)):
        reports = out[name]
        assert all(r["mesh"] == ["dp_replicate", "dp_shard"] for r in reports)
        for pname, p in reports[0]["params"].items():
            assert all(r["params"][pname]["placements"] == ["R", "S(0)"] for r in reports), pname
            rows = [r["params"][pname]["local_rows"] for r in reports]
            # rank = replica * S + shard index: replicas hold the same rows, the shard group splits them
            assert sum(rows[:shard]) == p["full_rows"], (name, pname, rows)
            assert rows == rows[:shard] * (len(reports) // shard), (name, pname, rows)
    for r in out["fsdp4"]:
        assert all(p["placements"] == ["S(0)"] for p in r["params"].values())
    # per-rank model state is 1/S of the whole: HSDP 2x2 holds twice FSDP-4's bytes per rank
    assert out["hsdp2x2"][0]["shard_bytes"]["params"] == pytest.approx(
        2 * out["fsdp4"][0]["shard_bytes"]["params"], rel=0.05
    )


@pytest.mark.dist
@pytest.mark.parametrize("name", ["hsdp2x2", "hsdp2x2_accum", "hsdp2x2_rs_every", "nodes_hsdp2x1"])
def test_replicas_start_and_stay_identical(results, name):
    reports = results[0][name]
    shard = 2 if name.startswith("hsdp2x2") else 1
    for rank in range(shard):  # rank `rank` of replica 0 and rank `rank + S` of replica 1 hold the same shard
        a, b = reports[rank], reports[rank + shard]
        assert a["init_digest"] == b["init_digest"]  # bitwise-identical initial local shards
        assert a["final_digest"] == b["final_digest"]  # and still identical after training
        assert a["init_digest"] != a["final_digest"]  # training changed them
        for report in (a, b):
            # and each equals the whole model's initialisation, chunked over the shard group
            assert all(p["init_max_abs_diff"] == 0.0 for p in report["params"].values())
    if shard > 1:  # the digests tell shards apart: the comparison above is not vacuous
        assert reports[0]["init_digest"] != reports[1]["init_digest"]


@pytest.mark.parametrize("name,world", [("hsdp2x2", 4), ("hsdp2x2_accum", 4), ("hsdp2x2_rs_every", 4),
                                        ("nodes_fsdp2", 2),
                                        ("nodes_hsdp2x1", 2)])
@pytest.mark.dist
def test_sample_ids_follow_the_global_rank(results, name, world):
    out = results[0]
    one = out["single"][0]["sample_ids"]
    for step, ids in one.items():
        assert [i for r in range(world) for i in out[name][r]["sample_ids"][step]] == ids, (name, step)


@pytest.mark.dist
def test_bad_mesh_under_torchrun(small_data, tmp_path):
    run = tmp_path / "run"
    proc = torchrun(2, ["-m", "shardlm.train", *tiny_overrides(small_data, run, {"parallel.dp_replicate": 2,
                                                                                "parallel.dp_shard": 2})],
                    timeout=120, check=False)
    assert proc.returncode != 0
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert errors == ["error: parallel.dp_replicate × parallel.dp_shard = 2 × 2 = 4, but the world size is "
                      "2: the mesh must cover every rank exactly once"], proc.stderr[-3000:]
    assert not run.exists()


# ---- a lost node -----------------------------------------------------------------------------
def wait_for_steps(
    metrics: Path, n: int, procs: list[subprocess.Popen], logs: Path, limit_s: float = 240
) -> None:
    """Block until rank 0 logged ``n`` steps (fail if a launcher exits first)."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        if metrics.exists() and len(metrics.read_text().splitlines()) >= n:
            return
        if any(p.poll() is not None for p in procs):
            raise AssertionError("a launcher exited before training got going:\n" + logs_of(logs))
        time.sleep(0.5)
    raise AssertionError(f"no {n} steps within {limit_s} s:\n" + logs_of(logs))


def freeze_node(proc: subprocess.Popen) -> list[int]:
    """SIGSTOP a launcher and its workers: the machine is silent, its connections stay open."""
    pids = [proc.pid, *descendants(proc.pid)]
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    return pids


def wait_for_checkpoint(ckpts: Path, procs: list[subprocess.Popen], logs: Path, limit_s: float = 240) -> None:
    """Block until a complete checkpoint exists (fail if a launcher exits first)."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        if list_checkpoints(ckpts):
            return
        if any(p.poll() is not None for p in procs):
            raise AssertionError("a launcher exited before the first checkpoint:\n" + logs_of(logs))
        time.sleep(0.2)
    raise AssertionError(f"no checkpoint within {limit_s} s:\n" + logs_of(logs))


def read_losses(metrics: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in map(json.loads, metrics.read_text().splitlines())}


RESUME_STEPS = 40


@pytest.mark.parametrize("fault,timeout_s,limit_s,cause", [
    # the second node dies (it does not host the store): connections close, the survivor stops at once, well
    # within the collective timeout; then both nodes are relaunched and resume from the last checkpoint (gloo
    # says "reset" or "closed" by peer, depending on whether the dead side's socket closed before a write)
    ("kill", 30, 30, ("Connection reset by peer", "Connection closed by peer")),
    # the second node goes silent (no connection closes): gloo's timeout fires after parallel.timeout_s,
    # then three heartbeats tell the dead from the blocked; without the timeout the survivor would hang
    ("freeze", 10, 60, ("Timed out",)),
])
@pytest.mark.dist
def test_lost_node_is_named(small_data, tmp_path, fault, timeout_s, limit_s, cause):
    run, logs = tmp_path / "run", tmp_path / "logs"
    # HSDP 2x1: one replica per node, the layout of real clusters
    job = {"train.eval_interval": 0, "train.micro_batch_size": 4, "parallel.timeout_s": timeout_s,
           "parallel.dp_replicate": 2, "checkpoint.interval": 4,
           "train.steps": RESUME_STEPS if fault == "kill" else 100000}
    args = ["-m", "shardlm.train", *tiny_overrides(small_data, run, job)]
    procs = start_nodes(args, logs)
    try:
        if fault == "kill":
            wait_for_checkpoint(run / "checkpoints", procs, logs)
        wait_for_steps(run / "metrics.jsonl", 3, procs, logs)
        start = time.monotonic()
        if fault == "kill":
            kill_node(procs[1])
        else:
            freeze_node(procs[1])
        try:
            code = procs[0].wait(timeout=limit_s)
        except subprocess.TimeoutExpired:
            raise AssertionError(
                f"the survivor still runs {limit_s} s after the fault:\n" + logs_of(logs)
            ) from None
        print(f"{fault}: the survivor's launcher exited {time.monotonic() - start:.1f} s after the fault "
              f"(parallel.timeout_s={timeout_s})")
    finally:
        stop(procs)
    err = (logs / "node0.err").read_text()
    errors = re.findall(r"error: lost[^\r\n]*", err)  # the progress bar may share its line
    print(errors)
    assert code != 0
    assert len(errors) == 1, logs_of(logs)
    assert f"lost node 1 (host {socket.gethostname()}): rank 1:" in errors[0]
    assert "no heartbeat" in errors[0] and "collective failed" in errors[0]
    assert any(c in errors[0] for c in cause), errors[0]
    assert "exitcode  : 4" in err  # the survivor's worker stopped with NODE_LOST_EXIT_CODE
    assert not (run / "final").exists()
    if fault == "kill":
        check_relaunch_resumes(small_data, run, tmp_path / "logs-relaunch", job)


def rank_pid(launcher: subprocess.Popen, rank: int) -> int:
    """The pid of the worker of ``rank`` under a torchrun launcher (from its RANK environment variable)."""
    for pid in descendants(launcher.pid):
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"RANK={rank}".encode() in env and any(e.startswith(b"LOCAL_RANK=") for e in env):
            return pid
    raise AssertionError(f"no worker of rank {rank} under {launcher.pid}")


@pytest.mark.dist
def test_frozen_rank_is_reported_within_the_heartbeat_timeout(small_data, tmp_path):
    """SIGSTOP one rank's process (silent, its connections open) with parallel.timeout_s = 600: the survivor's
    heartbeat watch reports the lost rank and its host within heartbeat_timeout(600) = 30 s, not after 600 s,
    and exits non-zero (code 4)."""
    run, logs = tmp_path / "run", tmp_path / "logs"
    logs.mkdir()
    args = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m",
            "shardlm.train",
            *tiny_overrides(small_data, run, {"train.eval_interval": 0, "train.steps": 100000,
                                                               "parallel.timeout_s": 600,
                                              "checkpoint.enabled": "false",
                                                               "train.micro_batch_size": 4})]
    with open(logs / "node0.out", "w") as out, open(logs / "node0.err", "w") as err:
        proc = subprocess.Popen(args, env=cpu_env(), stdout=out, stderr=err, start_new_session=True)
    frozen = None
    try:
        wait_for_steps(run / "metrics.jsonl", 3, [proc], logs)
        frozen = rank_pid(proc, 1)
        os.kill(frozen, signal.SIGSTOP)
        start, reported = time.monotonic(), None
        while time.monotonic() - start < 120 and reported is None:
            found = re.findall(r"error: lost[^\r\n]*", (logs / "node0.err").read_text())
            reported = time.monotonic() - start if found else None
            time.sleep(0.2)
        assert reported is not None, "no report within 120 s:\n" + logs_of(logs)
        # torchrun's own stop of a stopped process would wait for its grace period
        os.kill(frozen, signal.SIGKILL)
        code = proc.wait(timeout=120)
    finally:
        if frozen is not None:
            try:
                os.kill(frozen, signal.SIGKILL)
            except ProcessLookupError:
                pass
        stop([proc])
    err = (logs / "node0.err").read_text()
    errors = re.findall(r"error: lost[^\r\n]*", err)
    print(f"SIGSTOP of rank 1, parallel.timeout_s=600: reported after {reported:.1f} s "
          f"(heartbeat timeout {heartbeat_timeout(600):.0f} s); launcher exit code {code}\n{errors}")
    assert len(errors) == 1, logs_of(logs)
    assert errors[0].startswith(f"error: lost rank 1 of node 0 (host {socket.gethostname()}): no heartbeat "
                                "for ")
    assert "heartbeat watch" in errors[0]
    assert reported <= heartbeat_timeout(600) + 5  # + the polling of this test and a loaded machine's slack
    assert code != 0 and "exitcode  : 4" in err  # the survivor stopped with NODE_LOST_EXIT_CODE


def check_relaunch_resumes(small_data: Path, run: Path, logs: Path, job: dict) -> None:
    """Relaunch both nodes with ``--checkpoint.resume=auto``, as plain FSDP this time: the run continues
    from the newest complete checkpoint (written under HSDP) to the end, and repeats the steps logged
    between that checkpoint and the kill with the same losses."""
    step, path = list_checkpoints(run / "checkpoints")[-1]
    before = read_losses(run / "metrics.jsonl")
    assert max(before) < RESUME_STEPS  # the kill came before the end
    args = ["-m", "shardlm.train", *tiny_overrides(small_data, run, {**job, "parallel.dp_replicate": 1,
                                                                      "checkpoint.resume": '"auto"'})]
    procs = start_nodes(args, logs)
    try:
        codes = [p.wait(timeout=300) for p in procs]
    finally:
        stop(procs)
    assert codes == [0, 0], logs_of(logs)
    out = (logs / "node0.out").read_text()
    assert "resumed run " in out and f" from {path} at step {step}" in out, out[-3000:]
    after = read_losses(run / "metrics.jsonl")
    assert sorted(after) == list(range(1, RESUME_STEPS + 1))  # every step logged once
    repeated = [s for s in before if s > step]
    diff = max((abs(after[s] - before[s]) for s in repeated), default=0.0)
    print(f"relaunch resumed at step {step} (killed after step {max(before)}); "
          f"{len(repeated)} repeated steps, max loss diff {diff:.2e} (HSDP 2x1 before, FSDP 2 after)")
    assert all(after[s] == before[s] for s in before if s <= step)  # the history up to the checkpoint is kept
    assert_close([after[s] for s in repeated], [before[s] for s in repeated], rtol=LOSS_TOL, what="loss")
    assert (run / "final" / "model.safetensors").is_file()
