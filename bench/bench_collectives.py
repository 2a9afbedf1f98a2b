"""FSDP's two collectives on gloo, the backend's own against shardlm's (``shardlm/parallel/all_gather.py``,
``shardlm/parallel/reduce_scatter.py``, ``shardlm/parallel/shared_memory.py``): wall and CPU milliseconds per
call, and whether the results agree.

Usage (it launches torchrun itself; ``OMP_NUM_THREADS=1`` per rank)::

    python bench/bench_collectives.py                  # 2 ranks, 20.5 MB (the debug shape's 6 blocks)
    python bench/bench_collectives.py --world 4 --mb 5

Each collective runs 2 warm-up calls and ``--calls`` timed ones after a barrier; rank 0 prints the mean wall
and CPU (this process's user + system) time of one call. The all-gather's output is ``--mb`` MB of fp32, the
reduce-scatter's input the same.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time


def worker(mb: float, calls: int) -> None:
    import torch
    import torch.distributed as dist

    from shardlm.parallel.all_gather import PointToPointAllGather
    from shardlm.parallel.reduce_scatter import AllToAllReduceScatter
    from shardlm.parallel.shared_memory import SharedMemoryAllGather, SharedMemoryReduceScatter, _Segments

    dist.init_process_group("gloo")
    group, rank, world = dist.group.WORLD, dist.get_rank(), dist.get_world_size()
    n = int(mb * 1e6 / 4) // world * world
    gen = torch.Generator().manual_seed(rank)
    out, full = torch.empty(n), torch.randn(n, generator=gen)
    shard, part = out.view(world, -1)[rank], torch.empty(n // world)
    p2p, a2a = PointToPointAllGather(), AllToAllReduceScatter()
    segments = _Segments()
    shm_ag, shm_rs = SharedMemoryAllGather(segments), SharedMemoryReduceScatter(segments)
    host = torch.device("cpu")

    def shm_reduce_scatter() -> None:  # as FSDP calls it: the input is the slot allocate hands out
        slot = shm_rs.allocate(full.shape, dtype=full.dtype, device=host)
        slot.copy_(full)
        shm_rs(part, slot, group, dist.ReduceOp.SUM)

    cases = {
        "all-gather, gloo": lambda: dist.all_gather_single(out, shard),
        "all-gather, point_to_point": lambda: p2p(out, shard, group),
        "all-gather, shared_memory": lambda: shm_ag(out, shard, group),
        "reduce-scatter, gloo": lambda: dist.reduce_scatter_tensor(part, full),
        "reduce-scatter, all_to_all": lambda: a2a(part, full, group, dist.ReduceOp.SUM),
        "reduce-scatter, shared_memory": shm_reduce_scatter,
    }
    shard.copy_(torch.randn(n // world, generator=gen))
    results = {}
    for name, fn in cases.items():
        for _ in range(2):
            fn()
        results[name] = (out if name.startswith("all-gather") else part).clone()
        dist.barrier()
        wall, cpu = time.perf_counter(), time.process_time()
        for _ in range(calls):
            fn()
        wall, cpu = (time.perf_counter() - wall) / calls, (time.process_time() - cpu) / calls
        if rank == 0:
            print(f"| {name} | {n * 4 / 1e6:.1f} | {wall * 1e3:.2f} | {cpu * 1e3:.2f} |", flush=True)
    if rank == 0:
        same = all(torch.equal(results["all-gather, gloo"], results[f"all-gather, {k}"])
                   for k in ("point_to_point", "shared_memory"))
        shm = torch.equal(results["reduce-scatter, all_to_all"], results["reduce-scatter, shared_memory"])
        diff = (results["reduce-scatter, gloo"] - results["reduce-scatter, all_to_all"]).abs().max().item()
        print(f"all-gathers bit-identical: {same}; reduce-scatters all_to_all and shared_memory "
              f"bit-identical: {shm}; gloo's against all_to_all, largest difference: {diff:.1e}")
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--mb", type=float, default=20.5, help="MB gathered (and reduce-scattered)")
    parser.add_argument("--calls", type=int, default=10)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.mb, args.calls)
        return
    print(f"{args.world} ranks, gloo, mean of {args.calls} calls\n")
    print("| collective | MB | wall ms | CPU ms (rank 0) |\n|---|---|---|---|", flush=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                    f"--nproc-per-node={args.world}", __file__, "--worker", f"--mb={args.mb}",
                    f"--calls={args.calls}"], env=env, check=True)


if __name__ == "__main__":
    main()
