"""When ``auto`` takes FSDP's shared-memory collectives (shardlm/parallel/shared_memory.py): every rank on
one host and room in /dev/shm for 2 x ranks x the model in fp32; where an explicit setting is refused."""

from __future__ import annotations

import pytest

from shardlm.errors import ConfigError
from shardlm.parallel import shared_memory
from shardlm.parallel.all_gather import resolve_all_gather
from shardlm.parallel.reduce_scatter import resolve_reduce_scatter
from shardlm.parallel.shared_memory import (
    check_shared_memory,
    shared_memory_fits,
    shared_memory_usable,
    single_host,
)


def test_one_host_is_read_from_torchrun_variables(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert single_host()
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")  # two nodes of 4
    assert not single_host() and not shared_memory_usable(0)
    monkeypatch.delenv("LOCAL_WORLD_SIZE")  # not set: one node
    assert single_host()


def test_room_in_dev_shm_decides(monkeypatch, tiny_fs):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setattr(shared_memory, "SHM_DIR", str(tiny_fs))  # 3 MB
    assert shared_memory_usable(2_000_000) and not shared_memory_usable(4_000_000)
    # 2 ranks x 4 bytes x P x 2 halves: 200,000 parameters need 3.2 MB
    assert shared_memory_fits(150_000, 2) and not shared_memory_fits(200_000, 2)
    assert not shared_memory_fits(10, 1)  # one rank: no collectives to speed up
    monkeypatch.setattr(shared_memory, "SHM_DIR", str(tiny_fs / "missing"))
    assert not shared_memory_usable(0)


def test_auto_resolves_per_device_and_room():
    assert resolve_all_gather("auto", "cpu", True) == "shared_memory"
    assert resolve_all_gather("auto", "cpu", False) == "point_to_point"
    assert resolve_all_gather("auto", "cuda", True) == "native"
    assert resolve_reduce_scatter("auto", "cpu", True) == "shared_memory"
    assert resolve_reduce_scatter("auto", "cpu", False) == "all_to_all"
    assert resolve_reduce_scatter("auto", "cuda", True) == "native"
    assert resolve_reduce_scatter("all_to_all", "cpu", True) == "all_to_all"  # a user's setting wins


def test_explicit_shared_memory_is_refused_where_it_cannot_work(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    check_shared_memory("shared_memory", "all_to_all", "cpu")  # one host, CPU: taken
    check_shared_memory("auto", "auto", "cuda")  # auto never takes them on a GPU
    with pytest.raises(ConfigError, match="for CPU ranks.*cuda"):
        check_shared_memory("native", "shared_memory", "cuda")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")  # two hosts: the other host's ranks cannot open the file
    check_shared_memory("point_to_point", "auto", "cpu")
    with pytest.raises(ConfigError, match="one host.*LOCAL_WORLD_SIZE = 4 of WORLD_SIZE = 8"):
        check_shared_memory("shared_memory", "shared_memory", "cpu")


def test_every_build_all_reduces_the_choice(monkeypatch):
    """Every call is one MIN all-reduce, whatever was asked before: a pipeline stage counts its own
    parameters, so an answer cached by its arguments let one rank all-reduce while the others did not (the
    4-rank pipeline launch hung so); the answer is the MIN over ranks, and the summary reads it back."""
    calls = []

    def all_reduce(flag, op):
        calls.append(op)
        flag.zero_()  # another rank has no room

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setattr(shared_memory, "_CHOSEN", [False])  # this process's answer, restored afterwards
    monkeypatch.setattr(shared_memory.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(shared_memory.dist, "all_reduce", all_reduce)
    for _ in range(3):
        assert not shared_memory.shared_memory_agreed(1000, 2)
    assert calls == [shared_memory.dist.ReduceOp.MIN] * 3
    assert shared_memory.shared_memory_chosen() is False
    monkeypatch.setattr(shared_memory.dist, "all_reduce", lambda flag, op: calls.append(op))  # all have room
    assert shared_memory.shared_memory_agreed(1000, 2) and shared_memory.shared_memory_chosen()
    assert len(calls) == 4
