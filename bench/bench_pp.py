"""Benchmark of pipeline parallel against FSDP alone at 4 ranks: step time and memory per rank, per schedule.

Usage (a script, not a test; it launches torchrun itself, once for every layout)::

    python bench/bench_pp.py                       # 3 timed steps after 1 warm-up (~4 min on 2 cores)
    python bench/bench_pp.py --steps 5 --out bench/pp_results.json

A deeper tiny model (dim 128, 8 blocks, 4 heads, FFN 384, vocabulary 512, 64 tokens a sequence), fp32, the
same global batch of 16 sequences in every layout, 2 sequences a micro-batch, on three Shakespeare plays
(prepared once into a temporary directory). Layouts: FSDP 4; PP 4 under ``gpipe`` and ``1f1b`` (two blocks a
stage), ``zbv`` and ``dualpipev`` (8 stages of one block, two per rank in a V); PP 2 × FSDP 2 under ``1f1b``
and ``interleaved_1f1b`` (4 stages of two blocks).

Per rank: the median step time (host seconds, the step synchronised by its record) and the bytes of its
parameter, gradient and AdamW shards after a step (``Trainer.local_shard_bytes``): a pipeline rank holds only
its stages' parameters; the peak of one more step (``shardlm.metrics.peak.measure_train_step_peak``: live
storages at its start plus the allocator's events during it, activations in flight included) beside the
planner's prediction for that rank (``shardlm plan``'s: :func:`shardlm.plan.pipeline.plan_pp_memory` per
pipeline rank, :func:`shardlm.plan.plan_memory` for FSDP 4).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "tests"))

SHAPE = {"model.dim": 128, "model.n_layers": 8, "model.n_heads": 4, "model.n_kv_heads": 2,
         "model.ffn_hidden": 384, "model.vocab_size": 512, "model.max_seq_len": 64, "train.seq_len": 64,
         "train.global_batch_size": 16, "train.micro_batch_size": 2}
LAYOUTS = {
    "FSDP 4": {},
    "PP 4 gpipe": {"parallel.pp": 4, "parallel.pp_schedule": '"gpipe"'},
    "PP 4 1f1b": {"parallel.pp": 4, "parallel.pp_schedule": '"1f1b"'},
    "PP 4 zbv": {"parallel.pp": 4, "parallel.pp_schedule": '"zbv"'},
    "PP 4 dualpipev": {"parallel.pp": 4, "parallel.pp_schedule": '"dualpipev"'},
    "PP 2 x FSDP 2 1f1b": {"parallel.pp": 2, "parallel.pp_schedule": '"1f1b"'},
    "PP 2 x FSDP 2 interleaved": {"parallel.pp": 2, "parallel.pp_schedule": '"interleaved_1f1b"'},
}


def worker(spec_path: str) -> None:
    """One torchrun rank: every layout of the spec, ``warmup`` + ``steps`` steps each; a JSON per rank."""
    import torch

    from shardlm.config import load_config
    from shardlm.metrics.peak import measure_train_step_peak
    from shardlm.parallel import exit_process, init_distributed
    from shardlm.train.trainer import Trainer

    spec = json.loads(Path(spec_path).read_text())
    results = {}
    for name, overrides in spec["layouts"].items():
        cfg = load_config(None, overrides)
        trainer = Trainer(cfg, init_distributed(cfg.parallel))
        times = []
        for i in range(spec["warmup"] + spec["steps"]):
            start = time.perf_counter()
            trainer.train_step(log=True)
            if i >= spec["warmup"]:
                times.append(time.perf_counter() - start)
        peak = measure_train_step_peak(trainer)["peak"]
        results[name] = {"step_s": statistics.median(times), "shard_bytes": trainer.local_shard_bytes,
                         "peak": peak}
        torch.distributed.barrier()
    rank = torch.distributed.get_rank()
    Path(spec["out"], f"rank{rank}.json").write_text(json.dumps(results))
    exit_process(0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    args = parser.parse_args()
    from conftest import cpu_env, tiny_overrides
    from shardlm.config import load_config
    from shardlm.data import prepare_corpus, read_documents
    from shardlm.plan import plan_memory
    from shardlm.plan.pipeline import plan_pp_memory

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        (tmp / "plays.txt").write_text("\n\n".join(read_documents("shakespeare")[:3]))
        prepare_corpus(str(tmp / "plays.txt"), str(tmp / "data"), None, 512, 0.1)
        layouts = {name: tiny_overrides(tmp / "data", tmp / "runs" / str(i),
                                        {**SHAPE, **extra, "checkpoint.enabled": "false"})
                   for i, (name, extra) in enumerate(LAYOUTS.items())}
        spec = tmp / "spec.json"
        spec.write_text(json.dumps({"layouts": layouts, "steps": args.steps, "warmup": args.warmup,
                                    "out": str(tmp)}))
        subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=4",
                        __file__, "--worker", str(spec)], env=cpu_env(), check=True)
        ranks = [json.loads((tmp / f"rank{r}.json").read_text()) for r in range(4)]
        predicted = {}
        for name, overrides in layouts.items():
            cfg = load_config(None, overrides)
            if cfg.parallel.pp > 1:  # pp is the outermost mesh dimension: rank r on pipeline rank r // dp
                stages = plan_pp_memory(cfg, 4)
                predicted[name] = [stages[r // (4 // cfg.parallel.pp)].peak for r in range(4)]
            else:
                predicted[name] = [plan_memory(cfg, 4).peak] * 4
    table = {name: [{**r[name], "predicted": predicted[name][i]} for i, r in enumerate(ranks)]
             for name in LAYOUTS}
    print(f"{'layout':28} {'step s (max over ranks)':>24}  shard MiB per rank (params + grads + AdamW); "
          "peak MiB per rank, measured / predicted")
    for name, per_rank in table.items():
        step = max(r["step_s"] for r in per_rank)
        mib = ", ".join(f"{r['shard_bytes']['total'] / 2**20:.2f}" for r in per_rank)
        peaks = ", ".join(f"{r['peak'] / 2**20:.2f} / {r['predicted'] / 2**20:.2f}" for r in per_rank)
        print(f"{name:28} {step:24.3f}  {mib}; {peaks}")
    if args.out:
        args.out.write_text(json.dumps(table, indent=1))


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--worker":
        worker(sys.argv[2])
    else:
        main()
