"""FSDP's shared-memory collectives against gloo's own and shardlm's socket ones, for
tests/dist/test_shared_memory.py.

Usage: ``torchrun --nproc_per_node=N tests/workers/shared_memory_worker.py OUT.json [FULL_DIR]``. Every rank
all-gathers and reduce-scatters random buffers of growing and shrinking sizes, fp32 and bf16, interleaved,
with the ranks arriving at different times, through :mod:`shardlm.parallel.shared_memory` and through the
references; rank 0 writes ``{"cases": [[name, equal]], "left": [files left in /dev/shm], "full": message,
"agreed": [[this rank's answer, the agreed one]], "map_error": message, "left_after_error": [files],
"pids": [each rank's pid]}`` (the files counted are this job's own: other jobs may run beside it).
``FULL_DIR`` (a small tmpfs) stands in for ``/dev/shm`` in a last case that must fail with one message.
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch
import torch.distributed as dist

from shardlm.errors import ConfigError
from shardlm.parallel import shared_memory
from shardlm.parallel.reduce_scatter import AllToAllReduceScatter
from shardlm.parallel.shared_memory import SharedMemoryAllGather, SharedMemoryReduceScatter, _Segments


def main() -> None:
    dist.init_process_group("gloo")
    group, rank, world = dist.group.WORLD, dist.get_rank(), dist.get_world_size()
    pids = [None] * world
    dist.all_gather_object(pids, os.getpid())

    def ours(folder: str) -> list[str]:
        """This job's segments in ``folder`` (named by the creating rank's pid): other jobs on the host,
        e.g. tests running beside this one, may hold segments of their own there."""
        return [f for f in os.listdir(folder) if f.startswith(tuple(f"shardlm-{pid}-" for pid in pids))]
    segments = _Segments()
    gather, scatter = SharedMemoryAllGather(segments), SharedMemoryReduceScatter(segments)
    reference_rs = AllToAllReduceScatter()
    gen = torch.Generator().manual_seed(1234 + rank)
    cases = []
    # sizes grow (a new segment), shrink (the same one), grow again; the reduce-scatter is the larger user
    for i, (n, dtype) in enumerate([(1000, torch.float32), (7000, torch.float32), (3000, torch.bfloat16),
                                    (20000, torch.float32), (5, torch.float32), (9000, torch.bfloat16)]):
        if rank == 1:
            time.sleep(0.05 * (i % 3))  # ranks arrive apart: a rank must not overwrite a half still read
        shard = torch.randn(n, generator=gen).to(dtype)
        out, ref = torch.empty(world * n, dtype=dtype), torch.empty(world * n, dtype=dtype)
        gather(out, out.view(world, n)[rank].copy_(shard), group)  # FSDP's input: a view of its slot
        dist.all_gather_into_tensor(ref, shard, group=group)
        cases.append([f"all-gather {n} {dtype}", torch.equal(out, ref)])
        full = torch.randn(world * n, generator=gen).to(dtype)
        for op in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):
            # FSDP's order: allocate the input (this rank's slot), copy into it, allocate the output, call
            slot = scatter.allocate((world * n,), dtype=dtype, device=torch.device("cpu"))
            slot.copy_(full)
            got = scatter.allocate((n,), dtype=dtype, device=torch.device("cpu"))
            scatter(got, slot, group, op)
            want = torch.empty(n, dtype=dtype)
            reference_rs(want, full.clone(), group, op)
            cases.append([f"reduce-scatter {op} {n} {dtype}", torch.equal(got, want)])
        # an input that is not the slot handed out is copied into the segment first
        got, want = torch.empty(n, dtype=dtype), torch.empty(n, dtype=dtype)
        scatter(got, full, group, dist.ReduceOp.SUM)
        reference_rs(want, full.clone(), group, dist.ReduceOp.SUM)
        cases.append([f"reduce-scatter of a foreign input {n} {dtype}", torch.equal(got, want)])
    dist.barrier()
    left = ours(shared_memory.SHM_DIR)
    full_message = None
    if len(sys.argv) > 2:  # a /dev/shm without room: one clear error on every rank, nothing left behind
        shared_memory.SHM_DIR = sys.argv[2]
        small = SharedMemoryAllGather(_Segments())
        try:
            small(torch.empty(world * 1_000_000), torch.zeros(1_000_000), group)
        except ConfigError as exc:
            full_message = str(exc)
        left += ours(sys.argv[2])
    agreed = None
    if len(sys.argv) > 2:  # one rank's /dev/shm has no room (another job's segments): no rank takes them
        shared_memory.SHM_DIR = sys.argv[2] if rank == 1 else "/dev/shm"
        answers = [None] * world
        dist.all_gather_object(answers, [shared_memory.shared_memory_fits(400_000, world),
                                         shared_memory.shared_memory_agreed(400_000, world)])
        agreed = answers
    # a segment that cannot be mapped (on every rank alike): the error, and its file gone from /dev/shm
    shared_memory.SHM_DIR, real_mmap = "/dev/shm", shared_memory.mmap

    class Unmappable:
        @staticmethod
        def mmap(*args, **kwargs):
            raise OSError("mapping refused (test)")

    shared_memory.mmap, map_error = Unmappable, None
    try:
        SharedMemoryAllGather(_Segments())(torch.empty(world * 10), torch.zeros(10), group)
    except OSError as exc:
        map_error = str(exc)
    finally:
        shared_memory.mmap = real_mmap
    dist.barrier()
    left_after_error = ours("/dev/shm")
    if rank == 0:
        with open(sys.argv[1], "w") as f:
            json.dump({"cases": cases, "left": left, "full": full_message, "agreed": agreed,
                       "map_error": map_error, "left_after_error": left_after_error, "pids": pids}, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
