"""FSDP's two collectives on gloo, the backend's own against shardlm's (``shardlm/parallel/all_gather.py``,
``shardlm/parallel/reduce_scatter.py``): wall and CPU milliseconds per call, and whether the results agree.

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

    dist.init_process_group("gloo")
    group, rank, world = dist.group.WORLD, dist.get_rank(), dist.get_world_size()
    n = int(mb * 1e6 / 4) // world * world
    gen = torch.Generator().manual_seed(rank)
    out, full = torch.empty(n), torch.randn(n, generator=gen)
    shard, part = out.view(world, -1)[rank], torch.empty(n // world)
    p2p, a2a = PointToPointAllGather(), AllToAllReduceScatter()
    cases = {
        "all-gather, gloo": lambda: dist.all_gather_single(out, shard),
        "all-gather, point_to_point": lambda: p2p(out, shard, group),
        "reduce-scatter, gloo": lambda: dist.reduce_scatter_tensor(part, full),
        "reduce-scatter, all_to_all": lambda: a2a(part, full, group, dist.ReduceOp.SUM),
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
        same = torch.equal(results["all-gather, gloo"], results["all-gather, point_to_point"])
        diff = (results["reduce-scatter, gloo"] - results["reduce-scatter, all_to_all"]).abs().max().item()
        print(f"all-gathers bit-identical: {same}; reduce-scatters' largest difference: {diff:.1e}")
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
