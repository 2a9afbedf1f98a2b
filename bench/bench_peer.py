"""shardlm's trainer against torchtitan 0.3.0's and 0.2.2's on this CPU, launched alternately (A B A B) in one
run (issues 14 and 43).

Usage::

    python bench/bench_peer.py --quick                          # smoke run: 1 round of 4 steps
    TORCHTITAN03_PYTHON=/work/tt-venv/bin/python python bench/bench_peer.py --rounds 3 --steps 20 \
        --torchtitan-compile
    TORCHTITAN_PYTHON=/tmp/ttenv/bin/python python bench/bench_peer.py     # the 0.2.2 peer

The peers are optional: each runs only when its interpreter is named (``TORCHTITAN03_PYTHON`` for
torchtitan 0.3.0, ``TORCHTITAN_PYTHON`` for 0.2.2) and imports that version; otherwise the script says
how to install it (:data:`INSTALL`) and times shardlm alone. Neither is a dependency of shardlm.

Shape: torchtitan's Llama 3 debug model (dim 256, 6 layers, 16 heads, FFN 768, vocab 2048), seq 256, local
batch 4, 2 ranks, fp32, AC off, logging every step, ``OMP_NUM_THREADS=1`` per rank. shardlm runs its own
training job (``python -m shardlm.train``, its defaults otherwise: the settings left ``auto`` as the planner
picks them) on the Shakespeare corpus with a 2048-token BPE, and reads ``step_time_s`` from
``metrics.jsonl``; torchtitan 0.3.0 runs its ``llama3_debugmodel_ce_loss`` config (plain cross-entropy)
through ``bench/torchtitan03_cpu.py`` (causal SDPA, FSDP2 through its ``partial_dtensor`` backend, random
tokens), 0.2.2 through ``bench/torchtitan_cpu.py``; both print each step's time. Extra shardlm settings
can be compared as further rows with ``--shardlm-extra "NAME=--parallel.x=y --train.z=w"``;
``--torchtitan-compile`` adds each torchtitan with ``--compile.enable`` and a column comparing with it.
The first table shows each launch's median step time over steps 3..N (the first two warm up, and take the
compilation), and the load average before and after (numbers from a loaded machine are not final); the second
each trainer's fastest step over all its launches (noise only adds time, so on a shared machine whose
launches differ by 20-30 % this is the steadier comparison of what each trainer can do).
"""

from __future__ import annotations

import argparse
import json
import math
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


#: the peers: name -> (environment variable naming its interpreter, harness, version)
PEERS = {"torchtitan 0.3.0": ("TORCHTITAN03_PYTHON", "torchtitan03_cpu.py", "0.3.0"),
         "torchtitan 0.2.2": ("TORCHTITAN_PYTHON", "torchtitan_cpu.py", "0.2.2")}
#: how to install a peer beside this machine's torch (a venv that sees the shared one's packages)
INSTALL = """{name} not found ({var} unset or not a Python with torchtitan {version}); to compare with it:
    python -m venv /work/tt-venv{tag}
    echo {site} > /work/tt-venv{tag}/lib/python3.11/site-packages/shared.pth
    /work/tt-venv{tag}/bin/pip install torchtitan=={version} torch=={torch}
    {var}=/work/tt-venv{tag}/bin/python python bench/bench_peer.py ..."""


def run_shardlm(tmp: Path, steps: int, extra: list[str], tag: str) -> list[float]:
    run = tmp / f"run-{tag}"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m",
           "shardlm.train", *SHAPE, f"--train.steps={steps}", f"--run.dir={run}", "--run.overwrite=true",
           f"--data.dir={tmp / 'data'}", *extra]
    subprocess.run(cmd, env=env, check=True, capture_output=True, text=True)
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [r["step_time_s"] for r in records if "step_time_s" in r]


def peer_python(name: str) -> str | None:
    """The interpreter of peer ``name`` (:data:`PEERS`) when its variable names one that imports the
    peer's version, else None (with the install recipe on stderr)."""
    var, _, version = PEERS[name]
    python = os.environ.get(var)
    if python:
        query = "import importlib.metadata as m; print(m.version('torchtitan'))"
        probe = subprocess.run([python, "-c", query], capture_output=True, text=True)
        if probe.returncode == 0 and probe.stdout.strip() == version:
            return python
    import torch

    site = next(p for p in sys.path if p.endswith("site-packages"))
    print(INSTALL.format(name=name, var=var, version=version, tag="" if version == "0.3.0" else "-022",
                         site=site, torch=torch.__version__.split("+")[0]), file=sys.stderr)
    return None


def run_torchtitan(name: str, python: str, tmp: Path, steps: int, compile: bool = False) -> list[float]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    harness = str(ROOT / "bench" / PEERS[name][1])
    launch = [python, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", harness]
    common = ["--training.local_batch_size", "4", "--training.seq_len", "256", "--training.steps", str(steps),
              "--training.mixed_precision_param", "float32", "--training.mixed_precision_reduce", "float32",
              "--lr_scheduler.warmup_steps", "2", "--metrics.log_freq", "1"]
    if PEERS[name][2] == "0.3.0":  # its llama3 debug config, AC off (a tyro subcommand: last)
        cmd = [*launch, *common, "--dump_folder", str(tmp / "tt03-out"),
               *(["--compile.enable"] if compile else []), "activation-checkpoint:none"]
    else:
        cmd = [*launch, "--model.name", "llama3_cpu", "--model.flavor", "debugmodel", *common,
               "--optimizer.implementation", "fused", "--activation_checkpoint.mode", "none",
               "--job.dump_folder", str(tmp / "tt-out"), *(["--compile.enable"] if compile else [])]
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
    peers = {name: python for name in PEERS if (python := peer_python(name))}
    extras = [("shardlm defaults", [])] + [
        (e.split("=", 1)[0], e.split("=", 1)[1].split()) for e in args.shardlm_extra
    ]
    rows: dict[str, list[float]] = {}  # each launch's median step
    fastest: dict[str, float] = {}  # the fastest step of all launches
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for peer, python in peers.items():
                for compiled in (False, True) if args.torchtitan_compile else (False,):
                    times = run_torchtitan(peer, python, Path(tmp), args.steps, compile=compiled)
                    key = f"{peer} (fp32, AC off{', compiled' if compiled else ''})"
                    rows.setdefault(key, []).append(statistics.median(times[2:]))
                    fastest[key] = min(fastest.get(key, math.inf), *times[2:])
            for name, extra in extras:
                times = run_shardlm(Path(tmp), args.steps, extra, f"{r}-{len(rows)}")
                rows.setdefault(name, []).append(statistics.median(times[2:]))
                fastest[name] = min(fastest.get(name, math.inf), *times[2:])
    refs = [(f"vs {key.split(' (')[0]}{' compiled' if 'compiled' in key else ''}", key)
            for key in rows if key.startswith("torchtitan")]
    load = " -> ".join(", ".join(f"{a:.1f}" for a in avg) for avg in (load_before, os.getloadavg()))
    print(f"\nload average (1, 5, 15 min) {load} on {os.cpu_count()} CPUs; {args.rounds} round(s) of "
          f"{args.steps} steps")
    print("\n| trainer (debug shape, 2 ranks, fp32, log every step) | median step s per launch | "
          + " | ".join(label for label, _ in refs) + " |")
    print("|---|---|" + "---|" * len(refs))
    for name, values in rows.items():
        speeds = [f"{statistics.median(rows[ref]) / statistics.median(values):.2f}x" for _, ref in refs]
        print(f"| {name} | {' / '.join(f'{v:.3f}' for v in values)} | " + " | ".join(speeds) + " |")
    # the machine's noise only adds time: the fastest step of each trainer is a steadier comparison of what
    # each can do than medians of launches that differ by 20-30 % on a shared machine
    print("\n| trainer | fastest step s (all launches) | " + " | ".join(label for label, _ in refs) + " |")
    print("|---|---|" + "---|" * len(refs))
    for name, best in fastest.items():
        speeds = [f"{fastest[ref] / best:.2f}x" for _, ref in refs]
        print(f"| {name} | {best:.3f} | " + " | ".join(speeds) + " |")


if __name__ == "__main__":
    main()
