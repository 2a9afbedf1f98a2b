"""Benchmark of context parallelism on long sequences: peak memory per rank and step time, CP 2 against
FSDP 2.

Usage (a script, not a test; it launches torchrun itself, once)::

    # 8k and 16k tokens, 2 ranks, 3 timed steps (~4 min idle)
    python bench/bench_long_context.py
    python bench/bench_long_context.py --seq 8192 --steps 1  # quickest look
    python bench/bench_long_context.py --out bench/long_context.json
    python bench/bench_long_context.py --seq 8192 --world 4 --steps 1  # CP 4 against FSDP 4 (~3 min idle)
    python bench/bench_long_context.py --seq 4096 --world 4 --tp 2 --steps 1  # TP 2 x CP 2 against FSDP 4
    python bench/bench_long_context.py --seq 4096 --world 4 --tp 2 --ac full --steps 1  # both checkpointed

Model: a small Llama (dim 256, 4 layers, 4 query / 2 key-value heads, FFN 768, vocab 512: 3.4M parameters),
fp32, no activation checkpointing (``--ac`` sets another mode for every configuration), the chunked loss (the
default). Data: seeded random token ids in the prepared-data layout (speed and memory do not depend on them).
Each rank trains one sequence per step:

- ``fsdp2``: FSDP over 2 ranks, each rank a sequence of its own (global batch 2, ``parallel.cp = 1``);
- ``cp2``: FSDP over the same 2 ranks with ``parallel.cp = 2``: both ranks share one sequence (global batch
  1), each holding half of its tokens (a head and a tail chunk) and attending over all of them.

With ``--world N``: ``fsdpN`` (global batch N) against ``cpN`` (``parallel.cp = N``, global batch 1). With
``--tp T`` as well: ``fsdpN`` against ``cpMxtpT`` (``parallel.cp = M = N / T``, ``parallel.tp = T``, global
batch 1): each CP rank holds ``T_pad / M`` tokens with the ``n_heads / T`` heads of its TP rank, sequence
parallel splits those tokens over the TP group between the blocks.

Per configuration: 2 warm-up steps (AdamW state exists), then ``--steps`` timed steps (the median host time)
and one step measured by :func:`shardlm.metrics.peak.measure_train_step_peak` (the allocator's events under
the profiler: never RSS), the largest rank's peak. Beside it the planner's prediction
(``shardlm.plan.plan_memory``) for the same config, computed without running anything. The activation share is
the peak above the memory live before the step's first forward (``above start``: parameters, gradients and
AdamW state are in that start), CP's over FSDP's. The machine's 2 cores are shared by both ranks (and, here,
by other users): step times are noisy; memory figures are not.
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
sys.path.insert(0, str(ROOT / "bench"))

MODEL = {"model.dim": 256, "model.n_layers": 4, "model.n_heads": 4, "model.n_kv_heads": 2,
         "model.ffn_hidden": 768, "model.vocab_size": 512,
         "model.attention": '"causal"'}  # one random document per sequence: causal (not the default "auto")


def overrides(seq: int, cp: int, world: int, data: Path, run: Path, tp: int = 1,
              ac: str = "none") -> list[str]:
    """The command-line overrides of one configuration at ``world`` ranks (see the module docstring): one
    sequence per CP group (of TP groups) per step."""
    values = {**MODEL, "model.max_seq_len": seq, "train.seq_len": seq, "parallel.cp": cp, "parallel.tp": tp,
              "parallel.activation_checkpoint": ac,
              "train.global_batch_size": world // (cp * tp), "train.micro_batch_size": 1, "train.steps": 100,
              "train.warmup_steps": 1, "train.eval_interval": 0, "train.log_interval": 1,
              "checkpoint.interval": 0, "data.dir": f'"{data}"', "run.dir": f'"{run}"',
              "run.overwrite": "true", "parallel.device": "cpu"}
    return [f"--{k}={v}" for k, v in values.items()]


# ---- worker (one torchrun launch) -------------------------------------------------------------
def worker(spec_path: str) -> None:
    import torch

    from shardlm.config import load_config
    from shardlm.metrics.peak import measure_train_step_peak
    from shardlm.parallel import all_gather_ints, exit_process, init_distributed
    from shardlm.plan import plan_memory
    from shardlm.train.trainer import Trainer

    spec = json.loads(Path(spec_path).read_text())
    results = []
    for case in spec["cases"]:
        cfg = load_config(None, case["overrides"])
        info = init_distributed(cfg.parallel)
        trainer = Trainer(cfg, info)
        for _ in range(2):
            trainer.train_step(log=False)
        seconds = []
        for _ in range(spec["steps"]):
            start = time.perf_counter()
            trainer.train_step(log=True)  # the read synchronises the step
            seconds.append(time.perf_counter() - start)
        peak = measure_train_step_peak(trainer)
        peaks = all_gather_ints(peak["peak"], info.device)
        starts = all_gather_ints(peak["start"], info.device)
        if info.is_main:
            print(f"bench: {case['name']}: step {statistics.median(seconds):.2f} s, peaks {peaks}",
                  flush=True)
            plan = plan_memory(cfg, info.world_size, "cpu")
            results.append({"name": case["name"], "seq": cfg.train.seq_len, "cp": cfg.parallel.cp,
                            "tp": cfg.parallel.tp,
                            "step_s": statistics.median(seconds), "peaks": peaks, "starts": starts,
                            "predicted": plan.peak, "breakdown": plan.breakdown})
        del trainer
        torch.distributed.barrier()
    if torch.distributed.get_rank() == 0:
        Path(spec["out"]).write_text(json.dumps(results, indent=2))
    exit_process(0)


# ---- driver -------------------------------------------------------------------------------------
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, nargs="+", default=[8192, 16384], help="sequence lengths (tokens)")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per configuration")
    parser.add_argument("--world", type=int, default=2, help="ranks (CP uses all of them)")
    parser.add_argument("--tp", type=int, default=1,
                        help="tensor-parallel degree of the CP case (CP = world / tp)")
    parser.add_argument("--ac", default="none", help="parallel.activation_checkpoint of every configuration")
    parser.add_argument("--threads", type=int, default=1, help="OMP threads per rank")
    parser.add_argument("--out", default="", help="write the results as JSON here too")
    args = parser.parse_args()
    from gpu_check import write_random_data

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        data = write_random_data(work / "data", MODEL["model.vocab_size"], 4 * max(args.seq) * 16)
        cp = args.world // args.tp
        split = f"cp{cp}xtp{args.tp}" if args.tp > 1 else f"cp{cp}"
        cases = [{"name": f"{name} {seq}",
                  "overrides": overrides(seq, c, args.world, data, work / f"run-{seq}-{c}", t, args.ac)}
                 for seq in args.seq for name, c, t in ((f"fsdp{args.world}", 1, 1), (split, cp, args.tp))]
        spec, out = work / "spec.json", work / "results.json"
        spec.write_text(json.dumps({"cases": cases, "steps": args.steps, "out": str(out)}))
        env = {**os.environ, "OMP_NUM_THREADS": str(args.threads),
               "PYTHONPATH": str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", "")}
        subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                        f"--nproc_per_node={args.world}", __file__, "--worker", str(spec)], env=env,
                       check=True)
        results = json.loads(out.read_text())
    mib = 1 << 20
    print(f"{'config':<12} {'tokens':>7} {'step s':>7} {'peak/rank MiB':>14} {'above start':>12} "
          f"{'planned MiB':>12} {'plan/meas.':>10}")
    for r in results:
        peak = max(r["peaks"])
        above = max(p - s for p, s in zip(r["peaks"], r["starts"]))
        print(f"{r['name'].split()[0]:<12} {r['seq']:>7} {r['step_s']:>7.2f} {peak / mib:>14.1f} "
              f"{above / mib:>12.1f} {r['predicted'] / mib:>12.1f} {r['predicted'] / peak:>10.3f}")
    # the activation share: what a step adds above the memory live before its first forward (parameters, their
    # gradients' storage and AdamW state are in that start), CP's against FSDP's at the same sequence length
    above = {(r["seq"], r["cp"] > 1): max(p - s for p, s in zip(r["peaks"], r["starts"])) for r in results}
    planned = {(r["seq"], r["cp"] > 1): r["breakdown"]["activations"] for r in results}
    for seq in args.seq:
        if (seq, False) in above and (seq, True) in above:
            measured, plan = above[seq, True] / above[seq, False], planned[seq, True] / planned[seq, False]
            print(f"{split} / fsdp{args.world} at {seq} tokens: above start {measured:.3f}, planned "
                  f"activations {plan:.3f}")
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--worker":
        worker(sys.argv[2])
    else:
        main()
