"""Benchmark of shardlm's parallel modes and FSDP knobs: step time, tokens/s, MFU, memory per rank.

Usage (a script, not a test; it launches torchrun itself, once per world size)::

    # default: debug shape, N = 1, 2, 4, all options (~3 min, 2 idle cores)
    python bench/bench_fsdp.py
    python bench/bench_fsdp.py --models debug,20m --worlds 1,2,4 --steps 5 --warmup 2 --options all --compile
    python bench/bench_fsdp.py --worlds 2 --options none --steps 1   # quickest look (~1 min)
    python bench/bench_fsdp.py --out bench/results.json --threads 1

Models: ``debug`` is torchtitan's Llama 3 debug shape (dim 256, 6 layers, 16 heads, FFN hidden 768,
vocab 2048, seq 256, micro-batch 4 per rank); ``20m`` is a ~22M-parameter Llama (dim 512, 4 layers,
8 heads, FFN hidden 1536, vocab 8192, seq 256). Tokens are random (seeded): speed and memory do not
depend on them. Each configuration runs ``--warmup`` steps, then ``--steps`` timed steps; the table
shows the median step time.

Scaling: ``weak`` holds the per-rank batch fixed (micro-batch 4 per rank, global batch 4·N);
``strong`` holds the global batch fixed (8 sequences: N=1 two micro-batches of 4, N=2 one of 4,
N=4 one of 2). Modes ``single`` (world size 1 only), ``ddp`` and ``fsdp`` run under both; the FSDP
options run at world size 2 (reshard N=2 at 4) under weak scaling, except the gradient-sync policy,
which runs next to the default at two micro-batches per rank (``accum2``, G = 8·N).

MFU = tokens/s per rank × (6·N + 12·L·H·Q·T) ÷ peak (PaLM, appendix B; N without the input
embedding), where the peak is the matrix-multiply rate each rank measures in the same launch, in the
same dtype, with all ranks running at once (``shardlm.metrics.flops``). Memory per rank: parameter,
gradient and AdamW shard bytes after a step; bytes autograd saves for backward in one micro-batch
(``SavedActivationCounter``); peak allocated bytes on CUDA (``-`` on CPU, where the allocator keeps
no statistics).

Issue 14's rows live in two scripts of their own: ``bench/bench_scale.py`` (init time per rank of a ~1B shape
and sharded export time and peak RSS per rank, at N = 1, 2, 4) and ``bench/bench_peer.py`` (this trainer
against torchtitan's, launched alternately); each has ``--quick``.
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
    "debug": dict(dim=256, n_layers=6, n_heads=16, ffn_hidden=768, vocab_size=2048, max_seq_len=256),
    "20m": dict(dim=512, n_layers=4, n_heads=8, ffn_hidden=1536, vocab_size=8192, max_seq_len=256),
}
SEQ_LEN, MICRO, STRONG_GLOBAL = 256, 4, 8
#: FSDP options benchmarked at world size 2 (name -> [parallel] overrides)
OPTIONS = {
    "bf16": {"param_dtype": "bfloat16"},
    "bf16 native matmul": {"param_dtype": "bfloat16", "cpu_bf16_matmul": "native"},
    "bf16+bf16-reduce": {"param_dtype": "bfloat16", "reduce_dtype": "bfloat16"},
    "no-reshard": {"reshard_after_forward": False},
    "prefetch f2/b2": {"forward_prefetch": 2, "backward_prefetch": 2},
    "async all-gather": {"async_all_gather": True},
    "cpu offload": {"cpu_offload": True},
    "AC full": {"activation_checkpoint": "full"},
    "AC every 2": {"activation_checkpoint": "every_n", "activation_checkpoint_n": 2},
    "AC selective": {"activation_checkpoint": "selective"},
    "grad sync every": {"grad_sync": "every_micro_batch"},
}


def plan(models: list[str], worlds: list[int], options: list[str], compile_: bool) -> dict[int, list[dict]]:
    """The configurations to run, grouped by world size (one torchrun launch each)."""
    runs: dict[int, list[dict]] = {}
    for w in worlds:
        out = runs.setdefault(w, [])
        for model in models:
            for scaling in ("weak", "strong"):
                for mode in (["single", "fsdp"] if w == 1 else ["ddp", "fsdp"]):
                    out.append(dict(model=model, scaling=scaling, mode=mode, option="-",
                                    parallel={"mode": mode}))
            if w == 2 and model == models[0]:
                for name in options:
                    if name == "grad sync every":
                        # needs accumulation: compare with the default at 2 micro-batches
                        out.append(dict(model=model, scaling="accum2", mode="fsdp", option="-", parallel={}))
                    scaling = "accum2" if name == "grad sync every" else "weak"
                    out.append(dict(model=model, scaling=scaling, mode="fsdp", option=name,
                                    parallel=OPTIONS[name]))
                if compile_:
                    out.append(dict(model=model, scaling="weak", mode="fsdp", option="compile",
                                    parallel={"compile": True}))
            if w == 4 and model == models[0] and options:
                out.append(dict(model=model, scaling="weak", mode="fsdp", option="reshard N=2",
                                parallel={"reshard_after_forward": 2}))
    return runs


# ---- worker (one torchrun launch) -------------------------------------------------------------
def worker(spec_path: str) -> None:
    import torch
    import torch.nn.functional as F

    from shardlm.config import Config, ModelConfig, ParallelConfig
    from shardlm.metrics import (
        device_memory,
        measure_matmul_flops,
        mfu,
        model_flops_per_token,
        shard_bytes,
    )
    from shardlm.model.cpu_matmul import use_fp32_matmul
    from shardlm.parallel import all_gather_ints, build_mesh, init_distributed, set_gradient_sync
    from shardlm.parallel.dist import exit_process
    from shardlm.parallel.options import DTYPES
    from shardlm.parallel.saved_activations import SavedActivationCounter
    from shardlm.train.build import build_model
    from shardlm.train.optim import build_optimizer

    spec = json.loads(Path(spec_path).read_text())
    info = init_distributed(
        ParallelConfig(cpu_offload=any(r["parallel"].get("cpu_offload") for r in spec["runs"]))
    )
    mesh = build_mesh(info)
    n = info.world_size
    peaks: dict[str, float] = {}
    results = []
    for run in spec["runs"]:
        cfg = Config()
        cfg.model = ModelConfig(**MODELS[run["model"]])
        micro = STRONG_GLOBAL // n if run["scaling"] == "strong" and n >= 4 else MICRO
        cfg.train.seq_len, cfg.train.micro_batch_size = SEQ_LEN, micro
        cfg.train.global_batch_size = {"weak": MICRO * n, "accum2": 2 * MICRO * n}.get(
            run["scaling"], STRONG_GLOBAL
        )
        accum = cfg.train.global_batch_size // (n * micro)
        for key, value in run["parallel"].items():
            setattr(cfg.parallel, key, value)
        # peak measured next to each configuration: same load, same dtype,
        dtype_name = cfg.parallel.param_dtype
        fp32_multiply = use_fp32_matmul(cfg.parallel.cpu_bf16_matmul, info.device, dtype_name)  # same kernel
        peaks[dtype_name] = measure_matmul_flops(info.device, DTYPES[dtype_name], fp32_multiply=fp32_multiply)
        model, _ = build_model(cfg, info, mesh if cfg.parallel.mode != "single" else None)
        optimizer = build_optimizer(model, cfg.train, info.device)
        gen = torch.Generator().manual_seed(1000 + info.rank)
        times, saved, shards = [], 0, 0
        if info.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(info.device)
        for step in range(spec["warmup"] + spec["steps"]):
            start = time.perf_counter()
            for i in range(accum):
                tokens = torch.randint(0, cfg.model.vocab_size, (micro, SEQ_LEN + 1), generator=gen).to(
                    info.device
                )
                set_gradient_sync(model, last_micro_batch=(i == accum - 1), policy=cfg.parallel.grad_sync)
                counter = SavedActivationCounter() if step == 0 and i == 0 else None
                if counter is not None:
                    counter.__enter__()
                logits = model(tokens[:, :-1])
                loss = F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten()) / accum
                if counter is not None:
                    counter.__exit__(None, None, None)
                    saved = counter.bytes
                loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            if step == 0:
                shards = shard_bytes(model, optimizer)["total"]
            optimizer.zero_grad(set_to_none=True)
            if info.device.type == "cuda":
                torch.cuda.synchronize(info.device)
            if step >= spec["warmup"]:
                times.append(time.perf_counter() - start)
        step_s = statistics.median(times)
        tokens_per_s = cfg.train.global_batch_size * SEQ_LEN / step_s
        fpt = model_flops_per_token(cfg.model, SEQ_LEN)
        peak_alloc = device_memory(info.device).get("max_allocated_bytes", -1)
        step_all = all_gather_ints(int(step_s * 1e6), info.device)
        results.append(dict(
            run, world_size=n, global_batch=cfg.train.global_batch_size, micro_batch=micro, accum=accum,
            step_s=max(step_all) / 1e6,
            tokens_per_s=cfg.train.global_batch_size * SEQ_LEN * 1e6 / max(step_all),
            mfu=mfu(tokens_per_s / n, fpt, peaks[dtype_name]), peak_flops_per_rank=peaks[dtype_name],
            flops_per_token=fpt, shard_bytes=all_gather_ints(shards, info.device),
            saved_activation_bytes=all_gather_ints(saved, info.device),
            peak_allocated_bytes=all_gather_ints(peak_alloc, info.device),
        ))
        del model, optimizer
    if info.is_main:
        Path(spec["out"]).write_text(json.dumps(results))
    exit_process(0)  # destroys the process group; skips a teardown that can abort (see there)


# ---- launcher -----------------------------------------------------------------------------------
def mib(values: list[int]) -> str:
    return "-" if max(values) < 0 else f"{max(values) / 2**20:.1f}"


def print_table(rows: list[dict]) -> None:
    head = ["model", "scaling", "N", "mode", "option", "G", "mb×acc", "step s", "tokens/s", "MFU %",
            "shard MiB", "saved act MiB", "peak alloc MiB"]
    lines = [[r["model"], r["scaling"], str(r["world_size"]), r["mode"], r["option"], str(r["global_batch"]),
              f"{r['micro_batch']}×{r['accum']}", f"{r['step_s']:.3f}", f"{r['tokens_per_s']:.0f}",
              f"{100 * r['mfu']:.1f}", mib(r["shard_bytes"]), mib(r["saved_activation_bytes"]),
              mib(r["peak_allocated_bytes"])] for r in rows]
    widths = [max(len(h), *(len(line[i]) for line in lines)) for i, h in enumerate(head)]
    fmt = lambda cells: "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths)) + " |"  # noqa: E731
    print(fmt(head))
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for line in lines:
        print(fmt(line))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="debug", help="comma list of: " + ", ".join(MODELS))
    parser.add_argument("--worlds", default="1,2,4", help="world sizes (one torchrun launch each)")
    parser.add_argument("--steps", type=int, default=3,
                        help="timed steps per configuration (median reported)")
    parser.add_argument("--warmup", type=int, default=1,
                        help="untimed steps first (saved activations measured here)")
    parser.add_argument("--options", default="all",
                        help="FSDP options at N=2: 'all', 'none' or a comma list of: " + ", ".join(OPTIONS))
    parser.add_argument("--compile", action="store_true",
                        help="also benchmark parallel.compile (slow cold start)")
    parser.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS per rank")
    parser.add_argument("--out", default="bench/results.json", help="where the JSON rows are written")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args.worker)
    models = args.models.split(",")
    unknown = [m for m in models if m not in MODELS]
    options = (
        list(OPTIONS) if args.options == "all" else [] if args.options == "none" else args.options.split(",")
    )
    unknown += [o for o in options if o not in OPTIONS]
    if unknown or args.steps < 1 or args.warmup < 1:
        parser.error(f"unknown model/option {unknown}" if unknown else "--steps and --warmup must be >= 1")
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), PYTHONPATH=str(ROOT / "src"))
    rows: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        for world, runs in plan(
            models, [int(w) for w in args.worlds.split(",")], options, args.compile
        ).items():
            spec, out = Path(tmp) / f"spec{world}.json", Path(tmp) / f"out{world}.json"
            spec.write_text(json.dumps(dict(runs=runs, steps=args.steps, warmup=args.warmup, out=str(out))))
            print(f"world size {world}: {len(runs)} configurations ...", file=sys.stderr, flush=True)
            subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                            f"--nproc_per_node={world}", __file__, "--worker", str(spec)], env=env,
                           check=True)
            rows += json.loads(out.read_text())
    print_table(rows)
    meta = dict(threads_per_rank=args.threads, steps=args.steps, warmup=args.warmup, seq_len=SEQ_LEN,
                cpu_count=os.cpu_count(), torch=__import__("torch").__version__)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(dict(meta=meta, rows=rows), indent=1) + "\n")
    print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
