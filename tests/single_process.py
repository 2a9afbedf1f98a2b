"""A pytest plugin (loaded by tests/conftest.py) for the single-process tests of tests/unit: none launches
torchrun or a worker script, none joins a process group of more than one rank, and none leaves a process group
behind (:func:`single_process`).

A test here may still run shardlm's trainer in this process, as ``shardlm train`` without torchrun does: it
opens a process group of one rank on an in-process store (``HashStore``, world size 1: no other process, no
port) and closes it before it returns.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch.distributed

UNIT = Path(__file__).resolve().parent / "unit"
#: words of a command line that starts ranks or runs a worker script
LAUNCHERS = ("torch.distributed.run", "torchrun", "_worker.py")

#: set while a test of this folder runs: the audit hook below refuses launches only then
_guarding: list[bool] = [False]


def launch_in(argv: object) -> str | None:
    """The launcher word of :data:`LAUNCHERS` in a ``subprocess.Popen`` argument list (or string), or None."""
    words = [argv] if isinstance(argv, (str, bytes, os.PathLike)) else list(argv or [])
    text = " ".join(os.fsdecode(w) if isinstance(w, (bytes, os.PathLike)) else str(w) for w in words)
    return next((w for w in LAUNCHERS if w in text), None)


def refuse_launches(event: str, args: tuple) -> None:
    """Audit hook: a ``subprocess.Popen`` of torchrun or a worker while a unit test runs raises RuntimeError,
    which stops the launch before any process starts."""
    if event == "subprocess.Popen" and _guarding[0] and (word := launch_in(args[1])):
        raise RuntimeError(f"a test in tests/unit launches {word!r}: launches belong in tests/dist (mark it "
                           "dist)")


sys.addaudithook(refuse_launches)  # an audit hook cannot be removed; it does nothing outside a unit test


#: the unit tests that opened a one-rank in-process group (listed in the run's summary)
one_rank_groups: list[str] = []


def one_rank_only(init_process_group, nodeid: str = ""):
    """``init_process_group`` wrapped to refuse a world size above 1 (a group that other processes
    would join)."""

    def init(*args, **kwargs):
        world = kwargs.get("world_size", args[3] if len(args) > 3 else -1)
        if world == -1:
            world = int(os.environ.get("WORLD_SIZE", "1"))
        if world != 1:
            raise RuntimeError(f"a test in tests/unit starts a process group of {world} ranks: that is a "
                               "dist test")
        if nodeid and nodeid not in one_rank_groups:
            one_rank_groups.append(nodeid)
        return init_process_group(*args, **kwargs)

    return init


def pytest_terminal_summary(terminalreporter) -> None:
    """Say how many single-process tests ran shardlm's one-rank in-process group (``shardlm train`` without
    torchrun does the same)."""
    if one_rank_groups:
        terminalreporter.write_line(f"tests/unit: {len(one_rank_groups)} tests opened a one-rank in-process "
                                    "process group (world size 1, closed again)")


@pytest.fixture(autouse=True)
def single_process(request):
    """For a test in tests/unit: refuse torchrun and worker launches and groups of several ranks during the
    test; fail it when it leaves a process group initialized (destroyed here, so that the next test
    starts clean)."""
    if Path(str(request.node.path)).resolve().parent != UNIT:
        yield
        return
    assert not torch.distributed.is_initialized(), "a process group was left by an earlier test or fixture"
    original = torch.distributed.init_process_group
    torch.distributed.init_process_group = one_rank_only(original, request.node.nodeid)
    _guarding[0] = True
    try:
        yield
    finally:
        _guarding[0] = False
        torch.distributed.init_process_group = original
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
        pytest.fail(f"{request.node.nodeid} left a process group initialized (destroyed now)")
