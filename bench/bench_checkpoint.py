"""Benchmark of checkpoint saves: how long a synchronous save blocks training, against ``checkpoint.async``.

Usage (a script, not a test; it launches torchrun itself)::

    python bench/bench_checkpoint.py                          # 350m shape, 2 ranks, 2 repeats (~5 min, idle)
    python bench/bench_checkpoint.py --model 100m --repeats 1   # quickest look (~1 min)
    python bench/bench_checkpoint.py --dir /scratch/ckpt --world 2 --threads 1

Each rank builds the model sharded (FSDP2, fp32, AdamW state created by one step), then per repeat:

- sync: ``Checkpointer.save`` with ``checkpoint.async = false``: the seconds the call takes (write with
  fsync, SHA-256 computed while writing, manifest, rename), the slowest rank;
- async: the seconds the same call takes with ``checkpoint.async = true`` (staging: a host copy of the
  rank's state; the slowest rank) = the time the training loop is blocked; training steps then run until
  the background write has completed on every rank (an all-reduce per step agrees on that), and the table
  shows the write's own seconds (save start to manifest and rename, in the background) and the step time
  during it against an idle step.

Shapes: ``350m`` (dim 1024, 24 layers, 16 heads, FFN 2816, vocab 32000: 372M parameters, checkpoint ~4.5 GB)
and ``100m`` (dim 768, 12 layers, 12 heads, FFN 2048, vocab 32000: 134M, ~1.6 GB). Training steps use 32-token
sequences, one per rank (only to show that training runs while the write goes on). Checkpoints go to a
temporary directory under ``--dir`` (default: the system's), ``keep = 1``, removed at the end. Memory: about
20 bytes per parameter over all ranks (shards, gradients, AdamW moments, the staged copy).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

MODELS = {
    "350m": dict(dim=1024, n_layers=24, n_heads=16, ffn_hidden=2816, vocab_size=32000, max_seq_len=64),
    "100m": dict(dim=768, n_layers=12, n_heads=12, ffn_hidden=2048, vocab_size=32000, max_seq_len=64),
}
SEQ_LEN = 32


# ---- worker (one torchrun launch) -------------------------------------------------------------
def worker(spec_path: str) -> None:
    import torch
    import torch.nn.functional as F

    from shardlm.checkpoint.dcp import Checkpointer, local_bytes, training_state
    from shardlm.config import Config, ModelConfig
    from shardlm.model.decoder import num_params
    from shardlm.parallel import all_gather_ints, all_reduce_sum, build_mesh, init_distributed
    from shardlm.parallel.dist import exit_process
    from shardlm.train.build import build_model, unwrap
    from shardlm.train.optim import build_optimizer, build_scheduler

    spec = json.loads(Path(spec_path).read_text())
    cfg = Config()
    cfg.model = ModelConfig(**MODELS[spec["model"]])
    cfg.train.seq_len, cfg.train.micro_batch_size = SEQ_LEN, 1
    cfg.checkpoint.keep = 1
    info = init_distributed(cfg.parallel)
    cfg.train.global_batch_size = info.world_size
    model, _ = build_model(cfg, info, build_mesh(info, cfg.parallel))
    optimizer = build_optimizer(model, cfg.train, info.device)
    scheduler = build_scheduler(optimizer, cfg.train)
    gen = torch.Generator().manual_seed(1000 + info.rank)

    def train_step() -> float:
        start = time.perf_counter()
        tokens = torch.randint(0, cfg.model.vocab_size, (1, SEQ_LEN + 1), generator=gen)
        logits = model(tokens[:, :-1])
        F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
        return time.perf_counter() - start

    def slowest(seconds: float) -> float:
        return max(all_gather_ints(int(seconds * 1e6), info.device)) / 1e6

    train_step()  # AdamW's moments exist from here on
    idle = [train_step() for _ in range(2)]
    ckpt = Checkpointer(cfg, info, Path(spec["dir"]))
    ckpt.load(model, optimizer, scheduler)  # a fresh start: sets the run id
    state_bytes = local_bytes(training_state(model, optimizer, scheduler, 0))
    rows = []
    for r in range(spec["repeats"]):
        cfg.checkpoint.async_ = False
        start = time.perf_counter()
        ckpt.save(model, optimizer, scheduler, 1000 + 2 * r)
        sync_s = slowest(time.perf_counter() - start)
        cfg.checkpoint.async_ = True
        start = time.perf_counter()
        ckpt.save(model, optimizer, scheduler, 1001 + 2 * r)
        blocked_s = slowest(time.perf_counter() - start)
        during = []
        while True:  # train on until every rank's background write has completed
            flight = ckpt._in_flight
            done = torch.tensor([float(flight is None or flight.outcome is not None)])
            if all_reduce_sum(done).item() == info.world_size:
                break
            during.append(train_step())
        ckpt.wait()
        rows.append(dict(sync_s=sync_s, blocked_s=blocked_s, write_s=slowest(ckpt.last_save["seconds"]),
                         steps_during=len(during),
                         step_during_s=slowest(statistics.median(during)) if during else 0.0,
                         bytes=ckpt.last_save["bytes"]))
    if info.is_main:
        Path(spec["out"]).write_text(json.dumps(dict(
            rows=rows, params=num_params(unwrap(model)), world_size=info.world_size,
            state_bytes_per_rank=state_bytes, idle_step_s=max(idle))))
    exit_process(0)  # destroys the process group; skips a teardown that can abort (see there)


def print_table(model: str, result: dict) -> None:
    head = ["model", "params", "N", "ckpt GB", "state MB/rank", "sync save s", "async blocked s",
            "blocked/sync", "async write s", "steps during write", "step s idle", "step s during write"]
    lines = [[model, f"{result['params'] / 1e6:.0f}M", str(result["world_size"]), f"{r['bytes'] / 1e9:.2f}",
              f"{result['state_bytes_per_rank'] / 1e6:.0f}", f"{r['sync_s']:.2f}", f"{r['blocked_s']:.2f}",
              f"{100 * r['blocked_s'] / r['sync_s']:.1f}%", f"{r['write_s']:.2f}", str(r["steps_during"]),
              f"{result['idle_step_s']:.2f}", f"{r['step_during_s']:.2f}"] for r in result["rows"]]
    widths = [max(len(h), *(len(line[i]) for line in lines)) for i, h in enumerate(head)]
    fmt = lambda cells: "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths)) + " |"  # noqa: E731
    print(fmt(head))
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for line in lines:
        print(fmt(line))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="350m", choices=list(MODELS))
    parser.add_argument("--world", type=int, default=2, help="ranks (one torchrun launch)")
    parser.add_argument("--repeats", type=int, default=2, help="sync + async save pairs (one table row each)")
    parser.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS per rank")
    parser.add_argument("--dir", default=None,
                        help="where the checkpoints are written (a temporary directory inside)")
    parser.add_argument("--out", default="bench/results-checkpoint.json",
                        help="where the JSON result is written")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args.worker)
    if args.repeats < 1 or args.world < 1:
        parser.error("--repeats and --world must be >= 1")
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), PYTHONPATH=str(ROOT / "src"))
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        spec, out = Path(tmp) / "spec.json", Path(tmp) / "out.json"
        spec.write_text(json.dumps(dict(model=args.model, repeats=args.repeats, dir=str(Path(tmp) / "run"),
                                        out=str(out))))
        print(f"{args.model} at {args.world} ranks: {args.repeats} sync + async save pairs ...",
              file=sys.stderr, flush=True)
        subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                        f"--nproc_per_node={args.world}", __file__, "--worker", str(spec)], env=env,
                       check=True)
        result = json.loads(out.read_text())
    print_table(args.model, result)
    result["meta"] = dict(model=args.model, threads_per_rank=args.threads, seq_len=SEQ_LEN,
                          cpu_count=os.cpu_count(), torch=__import__("torch").__version__)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
