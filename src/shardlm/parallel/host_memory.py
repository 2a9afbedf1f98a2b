"""Freed host memory kept in the process for the next step on a CPU device
(``parallel.cpu_keep_freed_memory``).

A CUDA device has PyTorch's caching allocator: a freed block stays reserved for the next tensor of its size.
A CPU tensor has the C library's ``malloc``, and glibc serves every block over its mmap threshold (at most 32
MiB on 64-bit) from a mapping of its own and unmaps it on free. A training step frees and makes again the
same large blocks every step (the output projection's gradient, V x D fp32: 113 MB for SmolLM2's 49,152 x
576; a chunk of the loss's logits; an unsharded block's gradients), so each is faulted in again from the
kernel, page by page, and zero-filled: measured on SmolLM2-135M's shape (4 blocks, seq 1024, packed, 2 ranks,
fp32) about 220,000 page faults per rank per step.

``mallopt(M_MMAP_MAX, 0)`` serves every block from the heap, and ``mallopt(M_TRIM_THRESHOLD, INT_MAX)``
keeps the heap's freed top instead of returning it to the kernel, so a freed block is reused by the next
allocation that fits it. The same step, 30 steps a launch, two launches each way: most steps fault in a
handful of pages, the median step 6.75-6.79 against 7.90 s, peak RSS after 30 steps 2,019-2,103 against
1,851-1,852 MiB on the fuller rank (9-14% more; 2-3% on the other). The heap cannot return what lies below
a block still in use, and glibc's tcache keeps the few bytes ``memalign`` cuts off each 64-byte-aligned
block; they hold freed neighbours apart, so now and then a block no longer fits a hole and grows the heap
by its size. Turning the tcache off too removes that cost (1,765-1,788 MiB, 6.74-6.82 s), but only the
environment a process starts with can (``GLIBC_TUNABLES``, no ``mallopt``); a user who sets it there wins
(:func:`allocator_set_by_user`). glibc falls back to a mapping by itself where the heap cannot grow
(``man 3 mallopt``). Nothing changes in what is computed.
"""

from __future__ import annotations

import ctypes
import os
import platform

import torch

#: glibc's ``mallopt`` parameters (``<malloc.h>``)
M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4
#: the largest value ``mallopt`` takes (an ``int``)
INT_MAX = 2**31 - 1

#: whether this process keeps freed host memory (set once, by :func:`keep_freed_memory`)
_kept = False


def allocator_set_by_user() -> str | None:
    """What in the environment already configures the C allocator, or None: ``GLIBC_TUNABLES`` with a
    ``glibc.malloc`` tunable, or ``LD_PRELOAD`` naming another allocator (jemalloc, tcmalloc, mimalloc)."""
    tunables = os.environ.get("GLIBC_TUNABLES", "")
    if "glibc.malloc." in tunables:
        return f"GLIBC_TUNABLES={tunables}"
    preload = os.environ.get("LD_PRELOAD", "")
    if "malloc" in preload:
        return f"LD_PRELOAD={preload}"
    return None


def keep_freed_memory(device: torch.device, enabled: bool) -> bool:
    """Make glibc keep freed host memory in this process (see the module docstring), once per process.

    Applies only where it helps and is the C library's to set: ``device`` is the CPU, ``enabled``
    (``parallel.cpu_keep_freed_memory``), the C library is glibc, and the environment does not already
    configure the allocator (:func:`allocator_set_by_user`: the user's setting wins). Call it before the model
    is built, so that the large blocks come from the heap from the start.

    Returns whether freed memory is kept (also afterwards from :func:`freed_memory_kept`). Raises nothing:
    where ``mallopt`` refuses a value the result is False (the summary then says nothing).
    """
    global _kept
    if _kept:
        return True
    if not enabled or device.type != "cpu" or platform.libc_ver()[0] != "glibc" or allocator_set_by_user():
        return False
    mallopt = ctypes.CDLL(None).mallopt
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    # mallopt returns 1 on success; both or neither (a refused first one leaves the defaults)
    _kept = mallopt(M_MMAP_MAX, 0) == 1 and mallopt(M_TRIM_THRESHOLD, INT_MAX) == 1
    return _kept


def freed_memory_kept() -> bool:
    """Whether :func:`keep_freed_memory` took effect in this process (for the start-up summary)."""
    return _kept
