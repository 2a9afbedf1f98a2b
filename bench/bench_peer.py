"""shardlm's trainer against torchtitan 0.2.2's on this CPU, launched alternately (A B A B) in one run
(issue 14).

Usage::

    python bench/bench_peer.py --quick                          # smoke run: 1 round of 4 steps (shardlm only
                                                                # unless TORCHTITAN_PYTHON is set)
    python bench/bench_peer.py --rounds 2 --steps 10            # needs TORCHTITAN_PYTHON for the peer rows
    TORCHTITAN_PYTHON=/tmp/ttenv/bin/python python bench/bench_peer.py

Shape: torchtitan's Llama 3 debug model (dim 256, 6 layers, 16 heads, FFN 768, vocab 2048), seq 256, local
batch 4, 2 ranks, fp32, AC off, logging every step, ``OMP_NUM_THREADS=1`` per rank. shardlm runs its own
training job (``python -m shardlm.train``, its defaults otherwise) on the Shakespeare corpus with a 2048-token
BPE, and reads ``step_time_s`` from ``metrics.jsonl``; torchtitan runs through ``bench/torchtitan_cpu.py``
(random tokens, its fused AdamW) and prints each step's time. Extra shardlm settings can be compared as
further rows with ``--shardlm-extra "NAME=--parallel.x=y --train.z=w"``; ``--torchtitan-compile`` adds
torchtitan with ``--compile.enable`` (faster than its eager run on this CPU), and a column comparing with it.
The table shows each launch's median step time over steps 3..N (the first two warm up, and take
the compilation).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHAPE = ["--model.dim=256", "--model.n_layers=6", "--model.n_heads=16", "--model.n_kv_heads=16",
         "--model.ffn_hidden=768", "--model.vocab_size=2048", "--model.max_seq_len=256",
         "--train.seq_len=256", "--train.global_batch_size=8", "--train.micro_batch_size=4",
         "--train.log_interval=1", "--train.eval_interval=0", "--checkpoint.enabled=false"]


EAGER = "torchtitan 0.2.2 (fp32, AC off)"
COMPILED = "torchtitan 0.2.2 (fp32, AC off, compiled)"


def run_shardlm(tmp: Path, steps: int, extra: list[str], tag: str) -> list[float]:
    run = tmp / f"run-{tag}"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m",
           "shardlm.train", *SHAPE, f"--train.steps={steps}", f"--run.dir={run}", "--run.overwrite=true",
           f"--data.dir={tmp / 'data'}", *extra]
    subprocess.run(cmd, env=env, check=True, capture_output=True, text=True)
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [r["step_time_s"] for r in records if "step_time_s" in r]


def run_torchtitan(python: str, tmp: Path, steps: int, compile: bool = False) -> list[float]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [python, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(ROOT / "bench" / "torchtitan_cpu.py"), "--model.name", "llama3_cpu", "--model.flavor",
           "debugmodel", "--training.local_batch_size", "4", "--training.seq_len", "256", "--training.steps",
           str(steps), "--training.mixed_precision_param", "float32", "--training.mixed_precision_reduce",
           "float32", "--optimizer.implementation", "fused", "--activation_checkpoint.mode", "none",
           "--metrics.log_freq", "1", "--lr_scheduler.warmup_steps", "2", "--job.dump_folder",
           str(tmp / "tt-out")]
    if compile:
        cmd.append("--compile.enable")  # torchtitan compiles each block and the loss
    proc = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True)
    return [
        float(m.group(1)) for m in re.finditer(r"STEP_TIME step=\d+ ([0-9.]+)", proc.stdout + proc.stderr)
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2,
                        help="A B rounds (each trainer launched this many times)")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--shardlm-extra", action="append", default=[],
                        help="NAME=OVERRIDES: another shardlm row with these overrides")
    parser.add_argument("--quick", action="store_true", help="smoke run: --rounds 1 --steps 4")
    parser.add_argument("--torchtitan-compile", action="store_true",
                        help="also time torchtitan with --compile.enable (its fastest on this CPU)")
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.steps = 1, 4
    if args.steps < 3:
        parser.error(f"--steps must be at least 3 (the first two warm up), got {args.steps}")
    titan = os.environ.get("TORCHTITAN_PYTHON")
    extras = [("shardlm defaults", [])] + [
        (e.split("=", 1)[0], e.split("=", 1)[1].split()) for e in args.shardlm_extra
    ]
    rows: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            if titan:
                times = run_torchtitan(titan, Path(tmp), args.steps)
                rows.setdefault(EAGER, []).append(statistics.median(times[2:]))
            if titan and args.torchtitan_compile:
                times = run_torchtitan(titan, Path(tmp), args.steps, compile=True)
                rows.setdefault(COMPILED, []).append(statistics.median(times[2:]))
            for name, extra in extras:
                times = run_shardlm(Path(tmp), args.steps, extra, f"{r}-{len(rows)}")
                rows.setdefault(name, []).append(statistics.median(times[2:]))
    refs = [(label, rows[key]) for label, key in (("vs torchtitan", EAGER),
                                                  ("vs torchtitan compiled", COMPILED))
            if key in rows]
    print("\n| trainer (debug shape, 2 ranks, fp32, log every step) | median step s per launch | "
          + " | ".join(label for label, _ in refs) + " |")
    print("|---|---|" + "---|" * len(refs))
    for name, values in rows.items():
        speeds = [f"{statistics.median(ref) / statistics.median(values):.2f}x" for _, ref in refs]
        print(f"| {name} | {' / '.join(f'{v:.3f}' for v in values)} | " + " | ".join(speeds) + " |")


if __name__ == "__main__":
    main()
