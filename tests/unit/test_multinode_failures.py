"""Beyond one machine, in one process: the mesh shape and its bad input, the node split, and how failures are
told apart and named (silent ranks, own failures, a lost store, the heartbeat watch). The launches across
"nodes" are in tests/dist/test_multinode.py."""

from __future__ import annotations

import gc
import socket
import subprocess
import sys
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from conftest import cpu_env, tiny_overrides
from shardlm.config import ConfigError, ParallelConfig
from shardlm.parallel.dist import dp_mesh_shape
from shardlm.parallel.faults import (
    FaultMonitor,
    NodeLost,
    RankHost,
    heartbeat_interval,
    is_communication_failure,
    rank_ranges,
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---- bad input: one clear error before any collective --------------------------------------
@pytest.mark.parametrize("replicate,shard,world,per_node,expected", [
    (1, -1, 8, 8, (1, 8)), (2, -1, 8, 4, (2, 4)), (4, 2, 8, 4, (4, 2)), (4, 4, 16, 8, (4, 4)),
    (2, 8, 16, 4, (2, 8)), (1, -1, 3, 2, (1, 3)), (2, 1, 2, 1, (2, 1)), (-1, 8, 32, 8, (4, 8)),
    (-1, 2, 2, 1, (1, 2)),
])
def test_mesh_shape(replicate, shard, world, per_node, expected):
    assert dp_mesh_shape(ParallelConfig(dp_replicate=replicate, dp_shard=shard), world, per_node) == expected


@pytest.mark.parametrize("replicate,shard,world,per_node,mode,message", [
    (3, -1, 4, 4, "fsdp", "parallel.dp_replicate=3 must divide the world size 4"),
    (2, 3, 4, 4, "fsdp", "2 × 3 = 6, but the world size is 4"),
    (1, 2, 4, 4, "fsdp", "1 × 2 = 2, but the world size is 4"),
    (3, 2, 6, 3, "fsdp", "parallel.dp_shard=2 does not divide the 3 ranks of a node"),
    (2, 2, 4, 4, "ddp", "needs parallel.mode='fsdp'"),
    (-1, 3, 4, 4, "fsdp", "parallel.dp_shard=3 must divide the world size 4"),
    (-1, -1, 4, 4, "fsdp", "cannot both be -1"),
])
def test_bad_mesh_shape(replicate, shard, world, per_node, mode, message):
    with pytest.raises(ConfigError, match="parallel.dp_") as e:
        dp_mesh_shape(ParallelConfig(mode=mode, dp_replicate=replicate, dp_shard=shard), world, per_node)
    assert message in str(e.value)


def test_node_split_stops_before_the_rendezvous(small_data, tmp_path):
    """Rank 0 of node 0 of 2 nodes × 3 ranks, asked for 3 replicas of 2-rank shard groups (group 1 would
    hold ranks 2 and 3, on two nodes); its peers never come, so a check after the process group's
    rendezvous would wait for them (and time out here): the error comes first."""
    env = {**cpu_env(), "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "6", "LOCAL_WORLD_SIZE": "3",
           "GROUP_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    run = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "shardlm.train",
                           *tiny_overrides(small_data, run, {"parallel.dp_replicate": 3})], env=env,
                          capture_output=True, text=True, timeout=90)
    assert proc.returncode == 2, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, proc.stderr[-3000:]
    assert "parallel.dp_shard=2 does not divide the 3 ranks of a node" in errors[0]
    assert "Traceback" not in proc.stderr
    assert not run.exists()  # nothing written


# ---- the lost-node diagnosis, in one process (four "ranks" sharing a real TCPStore) -----------
HOSTS = [RankHost(0, 0, 0, "host-a", 10), RankHost(1, 1, 0, "host-a", 11), RankHost(2, 0, 1, "host-b", 12),
         RankHost(3, 1, 1, "host-b", 13)]
GLOO_RESET = RuntimeError("[gloo/transport/tcp/pair.cc:537] Read error [10.0.0.2]:4000: Connection reset by "
                          "peer")


@pytest.fixture
def store():
    master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                           timeout=timedelta(seconds=5))
    yield master
    del master


def monitors(store, ranks: list[int], interval: float = 0.5) -> dict[int, FaultMonitor]:
    """Fault monitors for these ranks; a live rank must beat within 3 intervals, so the interval is long
    enough (1.5 s of watch) that a busy CI machine never starves a live rank's heartbeat thread that long."""
    def connect():
        return dist.TCPStore("127.0.0.1", store.port, is_master=False, wait_for_workers=False,
                             timeout=timedelta(seconds=5))

    return {r: FaultMonitor(HOSTS, r, interval, connect, "token", f"127.0.0.1:{store.port}") for r in ranks}


def test_silent_ranks_are_named_with_node_and_host(store):
    mons = monitors(store, [0, 1, 2, 3])
    try:
        mons[2].close()
        mons[3].close()  # node 1 stops beating
        assert mons[0].find_lost() == ([2, 3], {})
        with pytest.raises(NodeLost) as e:
            with mons[0].watch():
                raise GLOO_RESET
        assert str(e.value).startswith("lost node 1 (host host-b): ranks 2-3: no heartbeat for 1.5 s after a "
                                       "collective failed with RuntimeError: [gloo/")
        assert [h.rank for h in e.value.lost] == [2, 3] and e.value.__cause__ is GLOO_RESET
        assert e.value.report_here  # rank 0 is the lowest survivor of node 0: it prints
        assert not mons[1].diagnose(GLOO_RESET).report_here  # rank 1 stays quiet
    finally:
        for m in mons.values():
            m.close()


def test_own_failures_are_not_losses(store):
    mons = monitors(store, [0, 1, 2, 3])
    try:
        with pytest.raises(ValueError, match="boom"):  # not a communication failure: unchanged
            with mons[3].watch():
                raise ValueError("boom")
        mons[3].close()  # rank 3 exits after its own error; rank 2 dies silently
        mons[2].close()
        lost = mons[0].diagnose(GLOO_RESET)
        assert [h.rank for h in lost.lost] == [2]
        assert "lost rank 2 of node 1 (host host-b):" in str(lost)  # rank 3 of that node still lives
        assert "ranks that failed on their own: rank 3: ValueError: boom" in str(lost)
        with pytest.raises(RuntimeError) as e:  # every other rank still beats: the original error
            with mons[0].watch():
                mons[2], mons[3] = monitors(store, [2, 3]).values()
                raise GLOO_RESET
        assert e.value is GLOO_RESET
    finally:
        for m in mons.values():
            m.close()


def test_lost_store_names_the_first_node():
    master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                           timeout=timedelta(seconds=5))
    mons = monitors(master, [0, 2])
    store_port = master.port
    del master  # the store's server stops, as when node 0 dies
    gc.collect()
    try:
        lost = mons[2].diagnose(GLOO_RESET)  # node 1 cannot reach node 0's store: node 0 is gone
        assert str(lost).startswith(f"lost the node hosting the c10d store 127.0.0.1:{store_port}: node 0 "
                                    "(host host-a): ranks 0-1")
        assert mons[0].diagnose(GLOO_RESET) is None  # node 0 itself: no remote loss to report
    finally:
        for m in mons.values():
            m.close()


def test_heartbeat_watch_ends_the_job_without_a_failed_collective(store):
    """While the loop runs (inside watch()), a rank whose heartbeat stops is noticed by the heartbeat threads
    themselves, no collective involved: every survivor ends with code 4, one per node prints the message."""
    mons = monitors(store, [0, 1, 2, 3], interval=0.2)
    exits: dict[int, int] = {}
    for r, m in mons.items():
        m.timeout_s = 3.0
        m.exit_process = lambda code, r=r: exits.setdefault(r, code)
    try:
        with mons[0].watch(), mons[1].watch(), mons[3].watch():
            mons[2]._stop.set()  # rank 2 freezes: no more beats, and no "stopped" mark
            start = time.monotonic()
            while len(exits) < 3 and time.monotonic() - start < 20:
                time.sleep(0.05)
            took = time.monotonic() - start
        print(f"frozen rank noticed and every survivor ended {took:.1f} s after the freeze (timeout 3 s)")
        assert exits == {0: 4, 1: 4, 3: 4} and took <= 3.0 + 3.0 + 2.0  # non-printing ranks wait 3 s first
        for r in (0, 3):  # the lowest survivor of each node prints; rank 1 (node 0, after rank 0) does not
            assert mons[r].reported.startswith("lost rank 2 of node 1 (host host-b): no heartbeat for "), r
            assert "heartbeat watch, before any collective timed out" in mons[r].reported
        assert mons[1].reported is None
    finally:
        for m in mons.values():
            m.close()


def test_heartbeat_watch_leaves_finished_and_unwatched_ranks_alone(store):
    """A rank that left the loop (close() marks it stopped) is not lost; outside watch() nothing
    is watched."""
    mons = monitors(store, [0, 1], interval=0.2)
    exits: list[int] = []
    for m in mons.values():
        m.timeout_s = 1.5
        m.exit_process = exits.append
    try:
        mons[1]._stop.set()  # silent, but rank 0 is not inside watch(): nobody reports
        time.sleep(2.5)
        assert exits == []
        mons[1].close()  # now it says it finished
        with mons[0].watch():
            time.sleep(2.5)
        assert exits == [] and mons[0].reported is None
    finally:
        for m in mons.values():
            m.close()


@pytest.mark.parametrize("error,expected", [
    (GLOO_RESET, True), (RuntimeError("[gloo] Timed out waiting 60000ms for recv operation"), True),
    (dist.DistBackendError("NCCL watchdog"), True), (RuntimeError("CUDA out of memory"), False),
    (ValueError("connection"), False), (ConfigError("bad"), False),
])
def test_is_communication_failure(error, expected):
    assert is_communication_failure(error) is expected
    assert rank_ranges([9, 0, 1, 2, 5, 7, 8]) == "0-2, 5, 7-9" and rank_ranges([3]) == "3"
    assert heartbeat_interval(600) == 2.0 and heartbeat_interval(30) == 1.0 and heartbeat_interval(1) == 0.2
