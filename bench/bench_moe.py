"""Benchmark of a small mixture of experts under FSDP only and under expert parallelism (``parallel.ep``).

Usage (a script, not a test; it launches torchrun itself, once per world size)::

    # N = 2 and 4: FSDP, EP 2, EP 4 (~2 min on 2 idle cores)
    python bench/bench_moe.py
    python bench/bench_moe.py --worlds 2 --steps 2      # quickest look
    python bench/bench_moe.py --out bench/moe.json

Model: a Qwen3-MoE of dim 128, 4 layers of 8 experts (top 2, expert width 256), vocab 2048; sequences of 128
random (seeded) tokens, micro-batch 4 per rank, fp32. Per configuration: ``--warmup`` steps, then ``--steps``
timed steps (the median is shown, the slowest rank's). Per rank and step: the bytes FSDP all-gathers (every
``all_gather_single`` output, counted by wrapping it), the bytes the expert all-to-alls send (tokens and their
gradients), parameter + gradient + AdamW shard bytes, the largest single all-gather (the unsharded group that
memory must hold at once) and peak RSS (a poor measure on CPU: glibc keeps freed memory).

With EP each rank all-gathers only its ep rank's experts (n_experts / ep of them), so the bytes all-gathered
fall by (1 - 1/ep) of the experts' share of the parameters; the tokens travel by all-to-all instead.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

MODEL = dict(family="qwen3_moe", dim=128, n_layers=4, n_heads=4, n_kv_heads=2, head_width=32, ffn_hidden=256,
             moe_ffn_hidden=256, n_experts=8, n_experts_per_token=2, vocab_size=2048, max_seq_len=128)
SEQ_LEN, MICRO = 128, 4


def worker(spec_path: str) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from shardlm.config import Config, ParallelConfig
    from shardlm.metrics import shard_bytes
    from shardlm.model.config import ModelConfig
    from shardlm.parallel import all_gather_ints, build_mesh, init_distributed
    from shardlm.parallel.dist import exit_process
    from shardlm.train.build import build_model
    from shardlm.train.moe_loss import moe_loss_term
    from shardlm.train.optim import build_optimizer

    spec = json.loads(Path(spec_path).read_text())
    info = init_distributed(ParallelConfig())
    mesh = build_mesh(info)
    counted = {"gather": 0, "largest": 0, "a2a": 0, "on": False}
    all_gather_single, all_to_all = dist.all_gather_single, torch.distributed._functional_collectives
    a2a_autograd = all_to_all.all_to_all_single_autograd

    def counting_gather(output, input, *args, **kwargs):  # noqa: A002 - torch's own argument names
        if counted["on"]:
            nbytes = output.numel() * output.element_size()
            counted["gather"] += nbytes
            counted["largest"] = max(counted["largest"], nbytes)
        return all_gather_single(output, input, *args, **kwargs)

    def counting_a2a(x, out_splits, in_splits, group, *args, **kwargs):
        if counted["on"]:  # forward tokens now, their gradients (same bytes) in backward
            counted["a2a"] += 2 * x.numel() * x.element_size()
        return a2a_autograd(x, out_splits, in_splits, group, *args, **kwargs)

    dist.all_gather_single = counting_gather
    all_to_all.all_to_all_single_autograd = counting_a2a
    results = []
    for run in spec["runs"]:
        cfg = Config()
        cfg.model = ModelConfig(**MODEL)
        cfg.train.seq_len, cfg.train.micro_batch_size = SEQ_LEN, MICRO
        cfg.train.global_batch_size = MICRO * info.world_size
        cfg.parallel.ep = run["ep"]
        model, _ = build_model(cfg, info, mesh)
        optimizer = build_optimizer(model, cfg.train, info.device)
        gen = torch.Generator().manual_seed(1000 + info.rank)
        times, gathered, a2a, largest, shards = [], [], [], 0, 0
        counted["largest"] = 0
        for step in range(spec["warmup"] + spec["steps"]):
            counted.update(gather=0, a2a=0, on=True)
            start = time.perf_counter()
            tokens = torch.randint(0, cfg.model.vocab_size, (MICRO, SEQ_LEN + 1), generator=gen)
            logits = model(tokens[:, :-1])
            loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
            term = moe_loss_term(model, cfg.model.router_aux_loss_coef)
            ((loss + term.term) * info.world_size).backward()
            optimizer.step()
            if step == 0:
                shards = shard_bytes(model, optimizer)["total"]
            optimizer.zero_grad(set_to_none=True)
            counted["on"] = False
            if step >= spec["warmup"]:
                times.append(time.perf_counter() - start)
                gathered.append(counted["gather"])
                a2a.append(counted["a2a"])
            largest = max(largest, counted["largest"])
        step_all = all_gather_ints(int(statistics.median(times) * 1e6), info.device)
        results.append(dict(
            run, world_size=info.world_size, step_s=max(step_all) / 1e6,
            gathered_bytes=all_gather_ints(int(statistics.median(gathered)), info.device),
            a2a_bytes=all_gather_ints(int(statistics.median(a2a)), info.device),
            largest_gather_bytes=all_gather_ints(largest, info.device),
            shard_bytes=all_gather_ints(shards, info.device),
            rss_bytes=all_gather_ints(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, info.device),
        ))
        del model, optimizer
    if info.is_main:
        Path(spec["out"]).write_text(json.dumps(results))
    exit_process(0)


def mib(values: list[int]) -> str:
    return f"{max(values) / 2**20:.2f}"


def print_table(rows: list[dict]) -> None:
    head = ["N", "layout", "step s", "all-gathered MiB/step", "all-to-all MiB/step", "largest gather MiB",
            "shard MiB", "peak RSS MiB"]
    lines = [[str(r["world_size"]),
              "FSDP only" if r["ep"] == 1 else f"EP {r['ep']} x FSDP {r['world_size'] // r['ep']}",
              f"{r['step_s']:.3f}", mib(r["gathered_bytes"]), mib(r["a2a_bytes"]),
              mib(r["largest_gather_bytes"]), mib(r["shard_bytes"]), mib(r["rss_bytes"])] for r in rows]
    widths = [max(len(h), *(len(line[i]) for line in lines)) for i, h in enumerate(head)]
    print("| " + " | ".join(h.ljust(w) for h, w in zip(head, widths)) + " |")
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for line in lines:
        print("| " + " | ".join(c.ljust(w) for c, w in zip(line, widths)) + " |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--worlds", default="2,4")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    rows = []
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")}
    for n in (int(w) for w in args.worlds.split(",")):
        runs = [{"ep": ep} for ep in (1, 2, 4, 8) if ep <= n and n % ep == 0 and MODEL["n_experts"] % ep == 0]
        with tempfile.TemporaryDirectory() as tmp:
            spec, out = Path(tmp) / "spec.json", Path(tmp) / "out.json"
            spec.write_text(json.dumps({"runs": runs, "steps": args.steps, "warmup": args.warmup,
                                        "out": str(out)}))
            subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                            f"--nproc_per_node={n}", __file__, "--worker", str(spec)], env=env, check=True)
            rows += json.loads(out.read_text())
    print_table(rows)
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--worker":
        worker(sys.argv[2])
    else:
        main()
