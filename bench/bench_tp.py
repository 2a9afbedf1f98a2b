"""Benchmark of tensor parallel against FSDP alone at 4 ranks: step time, memory per rank, bytes moved
per step.

Usage (a script, not a test; it launches torchrun itself, once for both layouts)::

    # 20m shape, FSDP 4 vs FSDP 2 x TP 2, 3 timed steps (~2 min idle)
    python bench/bench_tp.py
    python bench/bench_tp.py --steps 5 --warmup 2 --out bench/tp_results.json

The ``20m`` shape of bench/bench_fsdp.py (dim 512, 4 layers, 8 heads, FFN 1536, vocab 8192, seq 256), fp32,
the same global batch of 8 sequences either way (FSDP 4: 2 per rank; FSDP 2 x TP 2: 4 per data-parallel rank,
its two tensor-parallel ranks reading the same 4), the chunked loss (256 tokens a chunk; vocabulary-parallel
under TP). Tokens are random (seeded). Each layout runs ``--warmup`` steps, then ``--steps`` timed ones
(median shown).

Memory per rank: parameter + gradient + AdamW shard bytes after a step, and the bytes autograd saves for
backward in one micro-batch (``SavedActivationCounter``); on CPU the allocator keeps no peak statistics, so
their sum stands for the peak. Bytes per step per rank: every collective issued during a step is counted by
wrapping ``torch.distributed``'s functions (FSDP's all-gathers and reduce-scatters / all-to-alls, the gradient
norm's all-reduce, the vocabulary-parallel loss's all-reduces) and
``torch.distributed._functional_collectives``' (DTensor's redistributions: tensor parallel's all-gathers and
reduce-scatters): each counts the bytes of its larger buffer (an all-gather's output, a reduce-scatter's or
all-reduce's input), by kind.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

SHAPE = dict(dim=512, n_layers=4, n_heads=8, ffn_hidden=1536, vocab_size=8192, max_seq_len=256)
SEQ_LEN, GLOBAL = 256, 8
LAYOUTS = {"FSDP 4": {"tp": 1}, "FSDP 2 x TP 2": {"tp": 2}}
#: wrapped collectives: name -> which argument holds the larger buffer (0: the first tensor argument,
#: "out": output)
DIST = {"all_gather_single": 0, "all_gather_into_tensor": 0, "reduce_scatter_single": 1,
        "reduce_scatter_tensor": 1, "all_reduce": 0, "all_to_all_single": 1, "broadcast": 0}
FUNCOL = {"all_gather_single": "out", "all_gather_tensor": "out", "reduce_scatter_single": 0,
          "reduce_scatter_tensor": 0, "all_reduce": 0, "all_to_all_single": 0}


def count_bytes(counts: dict[str, int]) -> None:
    """Wrap the collectives of :data:`DIST` and :data:`FUNCOL` to add their buffer bytes to ``counts[kind]``
    while ``counts["on"]`` is set."""
    import torch
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol

    def nbytes(x) -> int:  # noqa: ANN001 - a tensor, a DTensor's local tensor, or a list of tensors
        if isinstance(x, (list, tuple)):
            return sum(nbytes(t) for t in x)
        return x.numel() * x.element_size() if isinstance(x, torch.Tensor) else 0

    def wrap(owner, name: str, where, prefix: str) -> None:  # noqa: ANN001
        original = getattr(owner, name)

        @functools.wraps(original)
        def counted(*args, **kwargs):
            out = original(*args, **kwargs)
            if counts.get("on"):
                buf = out if where == "out" else args[where] if len(args) > where else None
                counts[f"{prefix}{name}"] += nbytes(buf)
            return out

        setattr(owner, name, counted)

    for name, where in DIST.items():  # (torch 2.13 names FSDP2's all-gather / reduce-scatter ``*_single``)
        if hasattr(dist, name):
            wrap(dist, name, where, "")
    for name, where in FUNCOL.items():
        if hasattr(funcol, name):
            wrap(funcol, name, where, "dtensor ")


def worker(spec_path: str) -> None:
    import torch

    from shardlm.config import Config, ModelConfig
    from shardlm.metrics import shard_bytes
    from shardlm.parallel import build_mesh, init_distributed
    from shardlm.parallel.dist import data_parallel_rank, exit_process
    from shardlm.parallel.saved_activations import SavedActivationCounter
    from shardlm.train.build import build_model
    from shardlm.train.loss import model_loss_sum
    from shardlm.train.optim import build_optimizer, clip_grad_norm_

    spec = json.loads(Path(spec_path).read_text())
    counts: dict[str, int] = defaultdict(int)
    count_bytes(counts)
    results = []
    info = None
    for name, parallel in LAYOUTS.items():
        cfg = Config()
        cfg.model = ModelConfig(**SHAPE)
        cfg.parallel.tp = parallel["tp"]
        info = info or init_distributed(cfg.parallel)
        dp_rank, dp_size = data_parallel_rank(info, cfg.parallel)
        micro = GLOBAL // dp_size
        cfg.train.seq_len, cfg.train.micro_batch_size, cfg.train.global_batch_size = SEQ_LEN, micro, GLOBAL
        mesh = build_mesh(info, cfg.parallel)
        model, _ = build_model(cfg, info, mesh)
        optimizer = build_optimizer(model, cfg.train, info.device)
        gen = torch.Generator().manual_seed(1000 + dp_rank)  # tensor-parallel peers: the same tokens
        times, saved, step_bytes = [], 0, {}
        for step in range(spec["warmup"] + spec["steps"]):
            tokens = torch.randint(0, SHAPE["vocab_size"], (micro, SEQ_LEN + 1), generator=gen)
            timed = step >= spec["warmup"]
            counts.clear()
            # bytes of the first timed step (every step is alike)
            counts["on"] = timed and step == spec["warmup"]
            torch.distributed.barrier()
            start = time.perf_counter()
            with SavedActivationCounter() as counter:
                loss = model_loss_sum(model, tokens[:, :-1], tokens[:, 1:], 256)
            (loss * (dp_size / (GLOBAL * SEQ_LEN))).backward()
            clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            if step == 0:
                shards = shard_bytes(model, optimizer)["total"]
            optimizer.zero_grad(set_to_none=True)
            if counts.pop("on", False):
                step_bytes = dict(counts)
            torch.distributed.barrier()
            if timed:
                times.append(time.perf_counter() - start)
            saved = counter.bytes
        results.append({"layout": name, "step_s": statistics.median(times), "shard_bytes": shards,
                        "saved_bytes": saved, "bytes_per_step": step_bytes, "rank": info.rank})
        del model, optimizer
    if info.rank == 0:
        Path(spec["out"]).write_text(json.dumps(results))
    torch.distributed.barrier()
    exit_process(0)


def mib(n: float) -> str:
    return f"{n / 2**20:.1f} MiB"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--out", default="", help="also write the results as JSON here")
    p.add_argument("--worker", default="", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args.worker)
        return
    with tempfile.TemporaryDirectory() as tmp:
        spec, out = Path(tmp) / "spec.json", Path(tmp) / "out.json"
        spec.write_text(json.dumps({"steps": args.steps, "warmup": args.warmup, "out": str(out)}))
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")}
        subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=4",
                        __file__, "--worker", str(spec)], env=env, check=True)
        results = json.loads(out.read_text())
    print("| layout (4 ranks, 20m, fp32) | step time | params+grads+AdamW per rank | saved activations per "
          "rank | bytes per step per rank (by collective) |")
    print("|---|---|---|---|---|")
    for r in results:
        total = sum(r["bytes_per_step"].values())
        kinds = ", ".join(f"{k} {mib(v)}" for k, v in sorted(r["bytes_per_step"].items()))
        print(f"| {r['layout']} | {r['step_s']:.2f} s | {mib(r['shard_bytes'])} | {mib(r['saved_bytes'])} "
              f"| {mib(total)} ({kinds}) |")
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
