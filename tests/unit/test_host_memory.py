"""Freed host memory kept in the process on a CPU device (``parallel.cpu_keep_freed_memory``,
shardlm/parallel/host_memory.py): a large block freed and made again is not faulted in again; the setting,
the device and the user's own allocator settings decide whether it applies."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

# a step of three large blocks (64, 32 and 64 MiB; glibc's largest mmap threshold is 32 MiB), made and
# freed ten times: the page faults of each step, and what keep_freed_memory returned
SCRIPT = """
import resource, sys, torch
from shardlm.parallel.host_memory import freed_memory_kept, keep_freed_memory
kept = keep_freed_memory(torch.device(sys.argv[1]), sys.argv[2] == "1")
assert kept == freed_memory_kept()
numel = 64 * 2**20 // 4
faults = []
for _ in range(10):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    x = torch.ones(numel); y = torch.ones(numel // 2); z = x + 1; del x, y, z
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(kept, *faults)
"""
PAGES = 160 * 2**20 // 4096  # the pages a step touches: 40,960


def run(device: str, enabled: bool, **env: str) -> tuple[bool, list[int]]:
    full = {k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES", "LD_PRELOAD")}
    out = subprocess.run([sys.executable, "-c", SCRIPT, device, "1" if enabled else "0"],
                         env={**full, "OMP_NUM_THREADS": "1", **env}, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    kept, *faults = out.stdout.split()
    return kept == "True", [int(f) for f in faults]


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's: nothing is set elsewhere")
def test_freed_blocks_are_reused_without_page_faults():
    kept, faults = run("cpu", True)
    assert kept
    # the blocks are reused: most steps after the first fault in nothing. Not every one: glibc's tcache keeps
    # the few bytes memalign cuts off a block, they pin its neighbours apart, and a block that no longer fits
    # a hole grows the heap by its size now and then (60 fresh processes here: 2-4 of the 9 later steps
    # faulted, at most 32,769 pages in one step and 65,537 in all nine)
    later = faults[1:]
    assert sum(later) < len(later) * PAGES // 2, faults
    kept, faults = run("cpu", False)  # glibc's defaults: every step maps its blocks afresh
    assert not kept
    if not huge_pages_always():  # (else a fresh mapping faults in 2 MiB pages: 512 times fewer faults)
        assert min(faults) > PAGES // 2, faults


def huge_pages_always() -> bool:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return "[always]" in f.read()
    except OSError:
        return False


def test_off_on_cuda_and_where_the_user_set_the_allocator():
    assert not run("cuda", True)[0]  # a CUDA device: PyTorch's caching allocator already keeps blocks
    assert not run("cpu", True, GLIBC_TUNABLES="glibc.malloc.mmap_threshold=4096")[0]  # the user's wins


def test_the_users_allocator_settings_are_recognised(monkeypatch):
    from shardlm.parallel.host_memory import allocator_set_by_user

    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    assert allocator_set_by_user() is None
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.rtld.optional_static_tls=2048")  # not the allocator's
    assert allocator_set_by_user() is None
    monkeypatch.setenv("LD_PRELOAD", "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2")
    assert allocator_set_by_user() == "LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libjemalloc.so.2"
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.tcache_count=0")
    assert allocator_set_by_user() == "GLIBC_TUNABLES=glibc.malloc.tcache_count=0"
