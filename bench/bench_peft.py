"""Per-rank memory and step time of full fine-tuning, LoRA, LoRA on a bf16 base and QLoRA of SmolLM2-135M.

Usage (a script, not a test; it launches torchrun itself)::

    python bench/bench_peft.py --model models/smollm2-135m            # 2 ranks, 4 steps (1 warm-up), seq 64
    python bench/bench_peft.py --model DIR --world 2 --steps 6 --seq 128

``DIR`` is SmolLM2-135M-Instruct imported from its GGUF (``shardlm import --gguf ...``, see the README). Every
run is ``configs/smollm2-135m-lora.toml`` (instruction data, global batch 4, micro-batch 2) with the overrides
of its row; no checkpoint, no evaluation. Per rank: parameter, gradient and AdamW state bytes after the first
step (``Trainer.local_shard_bytes``: local shard bytes, NF4 counted by its codes and scales), the frozen
base's share of the parameter bytes, and the median step time of the steps after the warm-up one. fp32 compute
(``parallel.param_dtype``) throughout: on this CPU bf16 GEMMs are slower than fp32 ones.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RUNS = {
    "full fine-tuning": {"lora.enabled": "false"},
    "LoRA r=8 (fp32 base)": {},
    "LoRA r=8 (bf16 base)": {"lora.base_dtype": "bfloat16"},
    "QLoRA r=8 (NF4 base)": {"lora.base_dtype": "nf4"},
}


def worker(spec_path: str) -> None:
    """One torchrun launch: each run in turn; rank 0 writes the results next to the spec."""
    import torch

    from shardlm.config import load_config
    from shardlm.metrics import local_bytes
    from shardlm.parallel import all_gather_ints, exit_process, init_distributed
    from shardlm.train.build import unwrap
    from shardlm.train.trainer import Trainer

    spec = json.loads(Path(spec_path).read_text())
    results = []
    for name, overrides in spec["runs"].items():
        cfg = load_config(str(ROOT / "configs" / "smollm2-135m-lora.toml"), overrides)
        trainer = Trainer(cfg, init_distributed(cfg.parallel))
        frozen = sum(local_bytes(p) for p in unwrap(trainer.model).parameters() if not p.requires_grad)
        times = [trainer.train_step()["step_time_s"] for _ in range(cfg.train.steps)]
        shard = trainer.local_shard_bytes
        device = trainer.info.device
        row = {"run": name, "frozen": all_gather_ints(frozen, device),
               **{k: all_gather_ints(shard[k], device) for k in ("params", "grads", "optimizer", "total")},
               "step_s": statistics.median(times[1:]) if len(times) > 1 else times[0]}
        results.append(row)
        del trainer
        torch.distributed.barrier()
    if torch.distributed.get_rank() == 0:
        Path(spec["out"]).write_text(json.dumps(results))
    exit_process(0)


def mib(values: list[int]) -> str:
    return " / ".join(f"{v / 2**20:.1f}" for v in values)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="models/smollm2-135m", help="SmolLM2-135M model directory")
    parser.add_argument("--world", type=int, default=2, help="ranks (torchrun --nproc_per_node)")
    parser.add_argument("--steps", type=int, default=4, help="steps per run, the first one untimed")
    parser.add_argument("--seq", type=int, default=64, help="train.seq_len")
    parser.add_argument("--runs", default=",".join(RUNS), help="comma-separated row names (default: all)")
    args = parser.parse_args()
    chosen = [r.strip() for r in args.runs.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        common = [f'--model.init_from="{Path(args.model).resolve()}"', f"--train.steps={args.steps}",
                  f"--train.seq_len={args.seq}", "--train.eval_interval=0", "--checkpoint.enabled=false",
                  f'--data.corpus="{ROOT / "examples" / "instruct-shakespeare.jsonl"}"',
                  f'--data.dir="{Path(tmp) / "data"}"', f'--run.dir="{Path(tmp) / "run"}"',
                  "--run.overwrite=true"]
        runs = {name: common + [f"--{k}={v}" for k, v in RUNS[name].items()] for name in chosen}
        spec = Path(tmp) / "spec.json"
        spec.write_text(json.dumps({"runs": runs, "out": str(Path(tmp) / "out.json")}))
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")}
        subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                        f"--nproc_per_node={args.world}", __file__, "--worker", str(spec)], env=env,
                       check=True)
        results = json.loads((Path(tmp) / "out.json").read_text())
    print(f"SmolLM2-135M at {args.world} ranks, seq {args.seq}, global batch 4; MiB per rank (rank 0 / rank "
          "1 ...)")
    print("| run | parameters (of which frozen base) | gradients | AdamW state | total | step time (s) |")
    print("|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['run']} | {mib(r['params'])} ({mib(r['frozen'])}) | {mib(r['grads'])} | "
              f"{mib(r['optimizer'])} | {mib(r['total'])} | {r['step_s']:.2f} |")


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--worker":
        worker(sys.argv[2])
    else:
        main()
