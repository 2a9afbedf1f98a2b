"""Benchmark of the costs that must not grow with the model on one rank (issue 14): initialisation and export.

Usage (a script, not a test; it launches torchrun itself, once per world size)::

    # smoke run: tiny shapes, N = 1, 2 (~30 s idle)
    python bench/bench_scale.py --quick
    # init: ~1B shape; export: ~0.3B shape; N = 1, 2, 4
    python bench/bench_scale.py
    python bench/bench_scale.py --init-model 1b --export-model 1b --worlds 1,2,4 --threads 1 --out scale.json

Memory: N = 1 of the ``1b`` shape holds 4.4 GB of parameters, plus during its export the gathered copy and
safetensors' serialised bytes (about 14 GB in all); N = 4 holds four processes of a quarter each.

For each world size N, every rank (``OMP_NUM_THREADS=--threads``):

- **init**: builds the FSDP model the trainer builds (meta device -> ``fully_shard`` per block and root ->
  ``to_empty`` -> ``init_weights``: each rank draws only its own rows) and reports the seconds this took;
- **export**: writes ``final/``-style sharded safetensors (``save_sharded_model_dir``: whole tensors, each
  rank its own file, plus the index) and reports the seconds and this rank's peak RSS during the export
  (``/proc/self/clear_refs`` resets the peak, ``VmHWM`` reads it) and the RSS before it.

The first table shows, per N, the slowest rank's init seconds (wall and CPU: with more ranks than cores, wall
time cannot fall as 1/N, CPU time can) and the busiest rank's export peak RSS, with the ratio to N = 1. The
export runs first, in a fresh process, so the RSS glibc keeps after the init phase does not count. The second
table lists every rank's figures. ``--out`` also writes the raw per-rank numbers as JSON. Shapes: ``1b`` (dim
2048, 16 layers, 16 heads, FFN 5632, vocab 32000: 1.1B parameters, 4.4 GB fp32) and ``300m`` (dim 1024, 20
layers, 16 heads, FFN 2816, vocab 32000: 0.3B, 1.3 GB fp32) and ``150m`` (dim 768, 12 layers, 12 heads, FFN
2048, vocab 32000: 0.13B, 0.54 GB fp32). Memory is the limit on a small machine: N = 1 holds the whole model
plus, during export, the copy it writes.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

MODELS = {
    "1b": dict(dim=2048, n_layers=16, n_heads=16, ffn_hidden=5632, vocab_size=32000, max_seq_len=256),
    "300m": dict(dim=1024, n_layers=20, n_heads=16, ffn_hidden=2816, vocab_size=32000, max_seq_len=256),
    "150m": dict(dim=768, n_layers=12, n_heads=12, ffn_hidden=2048, vocab_size=32000, max_seq_len=256),
    "tiny": dict(dim=128, n_layers=2, n_heads=4, ffn_hidden=256, vocab_size=512, max_seq_len=64),
}


def vm_hwm_bytes() -> int:
    """Peak resident set size since the last reset (``VmHWM`` of /proc/self/status), bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def worker(spec_path: str) -> None:
    import torch

    from shardlm.config import Config, ModelConfig
    from shardlm.convert.hf_out import save_sharded_model_dir
    from shardlm.metrics.memory import process_rss_bytes
    from shardlm.parallel import all_gather_ints, build_mesh, init_distributed
    from shardlm.parallel.dist import exit_process
    from shardlm.train.build import build_model

    spec = json.loads(Path(spec_path).read_text())
    cfg = Config()
    info = init_distributed(cfg.parallel)
    mesh = build_mesh(info)
    out: dict[str, list[int]] = {}
    cfg.model = ModelConfig(**MODELS["tiny"])
    build_model(cfg, info, mesh)  # warm-up: first-use costs (kernels, mesh groups) out of the timings
    # export first, in a fresh process: the RSS glibc keeps after the init phase's larger model would count
    for phase, model_name in (("export", spec["export_model"]), ("init", spec["init_model"])):
        cfg.model = ModelConfig(**MODELS[model_name])
        torch.distributed.barrier()
        start, cpu = time.perf_counter(), time.process_time()
        model, _ = build_model(cfg, info, mesh)
        out[f"{phase}_build_us"] = all_gather_ints(int((time.perf_counter() - start) * 1e6), info.device)
        out[f"{phase}_build_cpu_us"] = all_gather_ints(int((time.process_time() - cpu) * 1e6), info.device)
        if phase == "export":
            named = list(model.named_parameters())
            before = process_rss_bytes()
            Path("/proc/self/clear_refs").write_text("5")  # reset the peak RSS (VmHWM) to the current RSS
            torch.distributed.barrier()
            start = time.perf_counter()
            save_sharded_model_dir(named, cfg.model, Path(spec["dir"]) / "export", info.rank, info.world_size)
            seconds = time.perf_counter() - start
            out["export_us"] = all_gather_ints(int(seconds * 1e6), info.device)
            out["export_peak_rss"] = all_gather_ints(vm_hwm_bytes(), info.device)
            out["rss_before_export"] = all_gather_ints(before, info.device)
        del model
    if info.is_main:
        Path(spec["out"]).write_text(json.dumps(out))
    exit_process(0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--init-model", default="1b", choices=list(MODELS))
    parser.add_argument("--export-model", default="300m", choices=list(MODELS))
    parser.add_argument("--worlds", default="1,2,4")
    parser.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS per rank")
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: --init-model tiny --export-model tiny --worlds 1,2 (checks the "
                             "script only)")
    parser.add_argument("--out", help="also write the raw per-rank results here (JSON)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker)
        return
    if args.quick:
        args.init_model, args.export_model, args.worlds = "tiny", "tiny", "1,2"
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "PYTHONPATH": str(ROOT / "src")}
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        for n in [int(w) for w in args.worlds.split(",")]:
            spec = Path(tmp) / f"spec{n}.json"
            result = Path(tmp) / f"out{n}.json"
            spec.write_text(json.dumps({"init_model": args.init_model, "export_model": args.export_model,
                                        "dir": str(Path(tmp) / f"n{n}"), "out": str(result)}))
            subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                            f"--nproc-per-node={n}", __file__, "--worker", str(spec)], env=env, check=True)
            rows[n] = json.loads(result.read_text())
    base = rows[min(rows)]
    print(f"\ninit ({args.init_model}: meta -> sharded -> initialised), slowest rank; "
          f"export ({args.export_model}: sharded safetensors), busiest rank; OMP_NUM_THREADS={args.threads}")
    print("| N | init wall s | vs N=1 | init CPU s | vs N=1 | export s | export peak RSS MiB | vs N=1 "
          "| RSS before export MiB | export increment MiB |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for n, r in rows.items():
        init, cpu = max(r["init_build_us"]) / 1e6, max(r["init_build_cpu_us"]) / 1e6
        busiest = max(range(n), key=lambda k: r["export_peak_rss"][k])
        peak, before = r["export_peak_rss"][busiest] / 2**20, r["rss_before_export"][busiest] / 2**20
        print(f"| {n} | {init:.2f} | {init / (max(base['init_build_us']) / 1e6):.2f}x | {cpu:.2f} "
              f"| {cpu / (max(base['init_build_cpu_us']) / 1e6):.2f}x | {max(r['export_us']) / 1e6:.2f} "
              f"| {peak:.0f} | {peak / (max(base['export_peak_rss']) / 2**20):.2f}x | {before:.0f} | "
              f"{peak - before:.0f} |")
    print("\nper rank")
    print("| N | rank | init wall s | init CPU s | export s | export peak RSS MiB | RSS before export MiB |")
    print("|---|---|---|---|---|---|---|")
    for n, r in rows.items():
        for k in range(n):
            print(f"| {n} | {k} | {r['init_build_us'][k] / 1e6:.2f} | {r['init_build_cpu_us'][k] / 1e6:.2f} "
                  f"| {r['export_us'][k] / 1e6:.2f} | {r['export_peak_rss'][k] / 2**20:.0f} "
                  f"| {r['rss_before_export'][k] / 2**20:.0f} |")
    if args.out:
        Path(args.out).write_text(json.dumps({"init_model": args.init_model,
                                              "export_model": args.export_model, "threads": args.threads,
                                              "worlds": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
