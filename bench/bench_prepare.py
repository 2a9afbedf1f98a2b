"""Benchmark of ``shardlm prepare``: wall time, MB/s and peak memory of the whole process tree, per format.

Usage (a script, not a test)::

    python bench/bench_prepare.py                               # sizes 200, 1000, 2000 MB (hours on 2 cores)
    python bench/bench_prepare.py --sizes 5 --formats jsonl --runs w1,w2   # quickest look
    # the README table (idle 2 cores: ~7 min, then ~45 min for the 2 GB runs):
    python bench/bench_prepare.py --sizes 200 --formats jsonl,jsonl.zst,parquet,txt --runs w1,w2 \\
        --no-shakespeare --ref-mb 20
    python bench/bench_prepare.py --sizes 2000 --formats txt,parquet,jsonl.zst,jsonl --runs w2 \\
        --no-shakespeare --ref-mb 1

Corpora are generated locally under ``--workdir`` (default ``/tmp/shardlm-bench-prepare``, never
committed): documents of about 4 KB, each 40-80 lines drawn with a seeded generator from the
embedded Shakespeare plays (real English, so the tokenizer's word cache behaves as on real text),
written as ``.jsonl``, ``.jsonl.zst``, Parquet (row groups of 10,000 rows) and one large ``.txt``
(the documents joined by blank lines; one document for shardlm, read in line-cut pieces), plus the
plays themselves (``shakespeare``, 5.3 MB). Every run uses the same given ``tokenizer.json`` (an
8,192-token byte-level BPE trained on the plays), so the numbers measure reading and encoding.

Runs: ``w1`` = one process, 1 worker; ``w2`` = one process, 2 workers; ``r2`` = ``torchrun
--nproc_per_node=2 -m shardlm.data`` with 1 worker per rank. The smallest size runs ``--runs``; the
larger sizes run ``--big-runs`` (the memory comparison). Peak RSS is the largest sum of the resident
set sizes of the launched process and all its descendants, sampled every 50 ms (file pages a
process maps count too). MB/s is megabytes of text (UTF-8, uncompressed) per second, of the whole
wall time (with Python, torch and worker start-up) and of the encoding phase alone (rank 0's "encoded
... in S s": from the first piece to the written ``meta.json``), which the reference compares with.

Reference: bare HF ``tokenizers`` ``encode_batch_fast`` on the first ``--ref-mb`` of the same
documents, in a fresh Python that imports only ``tokenizers``, with its own thread pool over all cores
the process may use (the most the library itself does), batches of 1,000 documents; the median of 3
measurements taken just before each row, so that each row is compared with the machine's speed of
that moment (this is a shared VM: its speed drifts by about 10 % over minutes).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from shardlm.data import read_documents, shakespeare_dir, train_tokenizer  # noqa: E402

FORMATS = ("jsonl", "jsonl.zst", "parquet", "txt")


def env() -> dict[str, str]:
    e = dict(os.environ)
    e["OMP_NUM_THREADS"] = "1"
    e["PYTHONPATH"] = str(ROOT / "src") + os.pathsep + e.get("PYTHONPATH", "")
    return e


def documents(target_bytes: int, seed: int = 0):
    """Yield documents of about 4 KB of Shakespeare lines until ``target_bytes`` of text."""
    lines = [ln for doc in read_documents("shakespeare") for ln in doc.split("\n") if ln.strip()]
    rng = random.Random(seed)
    made = 0
    while made < target_bytes:
        doc = "\n".join(rng.choice(lines) for _ in range(rng.randint(40, 80)))
        made += len(doc.encode("utf-8"))
        yield doc


def make_corpus(fmt: str, size_mb: int, workdir: Path) -> tuple[Path, int]:
    """Write (or reuse) the ``fmt`` corpus of ``size_mb`` MB of text; return (path, text bytes)."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    import zstandard

    d = workdir / f"{size_mb}mb"
    d.mkdir(parents=True, exist_ok=True)
    path = d / {"jsonl": "c.jsonl", "jsonl.zst": "c.jsonl.zst", "parquet": "c.parquet", "txt": "c.txt"}[fmt]
    info = path.with_name(path.name + ".bytes")
    if path.exists() and info.exists():
        return path, int(info.read_text())
    target = size_mb * 1_000_000
    text_bytes = 0
    tmp = path.with_name(path.name + ".tmp")
    if fmt == "parquet":
        schema = pa.schema([("text", pa.string())])
        with pq.ParquetWriter(tmp, schema) as w:
            batch = []
            for doc in documents(target):
                batch.append(doc)
                text_bytes += len(doc.encode())
                if len(batch) == 10_000:
                    w.write_table(pa.table({"text": batch}, schema=schema))
                    batch = []
            if batch:
                w.write_table(pa.table({"text": batch}, schema=schema))
    else:
        raw = open(tmp, "wb")
        out = zstandard.ZstdCompressor(level=3).stream_writer(raw) if fmt == "jsonl.zst" else raw
        first = True
        for doc in documents(target):
            text_bytes += len(doc.encode())
            if fmt == "txt":
                out.write((("" if first else "\n\n") + doc).encode())
            else:
                out.write((json.dumps({"text": doc}) + "\n").encode())
            first = False
        out.close()
    tmp.rename(path)
    info.write_text(str(text_bytes))
    return path, text_bytes


def tree_rss(proc: psutil.Process) -> int:
    total = 0
    for p in [proc, *proc.children(recursive=True)]:
        try:
            total += p.memory_info().rss
        except psutil.Error:
            pass
    return total


def run_prepare(corpus: str, run: str, workdir: Path, tokenizer: Path, tag: str) -> dict:
    out = workdir / "out" / tag
    cfg = workdir / f"{tag}.toml"
    cfg.write_text(f'[model]\nvocab_size = 8192\n[data]\ncorpus = "{corpus}"\ndir = "{out}"\n'
                   f'tokenizer = "{tokenizer}"\nval_fraction = 0.01\n')
    subprocess.run(["rm", "-rf", str(out), str(out.parent / f".{out.name}.partial")], check=True)
    if run == "r2":
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m",
               "shardlm.data", "--config", str(cfg), "--workers", "1"]
    else:
        cmd = [sys.executable, "-m", "shardlm.data", "--config", str(cfg), "--workers", run[1:]]
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    ps = psutil.Process(proc.pid)
    peak = 0
    while proc.poll() is None:
        peak = max(peak, tree_rss(ps))
        time.sleep(0.05)
    wall = time.perf_counter() - start
    stdout, stderr = proc.communicate()
    if proc.returncode != 0:
        raise SystemExit(f"{tag} failed:\n{stderr[-3000:]}")
    meta = json.loads((out / "meta.json").read_text())
    subprocess.run(["rm", "-rf", str(out)], check=True)
    # the encoding phase alone (rank 0's "wrote ... in S s": from the first piece to meta.json, no start-up)
    encode_s = float(re.findall(r"encoded [0-9.]+ MB in ([0-9.]+) s", stderr)[-1])
    return {"wall_s": wall, "encode_s": encode_s, "peak_rss_mb": peak / 2**20,
            "tokens": meta["train_tokens"] + meta["val_tokens"]}


REFERENCE = """
import json, sys, time
from tokenizers import Tokenizer
tok = Tokenizer.from_file(sys.argv[1])
with open(sys.argv[2]) as f:
    docs = json.load(f)
start = time.perf_counter()
for i in range(0, len(docs), 1000):
    tok.encode_batch_fast(docs[i:i + 1000], add_special_tokens=False)
print(sum(len(d.encode()) for d in docs) / 1e6 / (time.perf_counter() - start))
"""


def reference(tokenizer: Path, ref_bytes: int, workdir: Path) -> float:
    """MB/s of bare ``encode_batch_fast`` (all cores) on the first ``ref_bytes`` of the generated documents.

    Runs in a fresh Python that imports only ``tokenizers`` (as the preparation's worker processes do): HF
    ``tokenizers`` runs measurably slower in a process with a large heap (this one's, after generating the
    corpora), which would flatter shardlm.
    """
    docs = workdir / f"reference-{ref_bytes}.json"
    if not docs.exists():
        docs.write_text(json.dumps(list(documents(ref_bytes))))
    e = {k: v for k, v in os.environ.items() if k != "TOKENIZERS_PARALLELISM"}
    out = subprocess.run([sys.executable, "-c", REFERENCE, str(tokenizer), str(docs)], env=e, check=True,
                         capture_output=True, text=True).stdout
    return float(out.strip())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="200,1000,2000", help="corpus sizes in MB of text (comma-separated)")
    ap.add_argument("--formats", default=",".join(FORMATS), help=f"of {FORMATS}")
    ap.add_argument("--runs", default="w1,w2,r2", help="runs at the smallest size (w1, w2, r2)")
    ap.add_argument("--big-runs", default="w2", help="runs at the larger sizes")
    ap.add_argument("--shakespeare", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--ref-mb", type=int, default=20, help="MB of text for the bare encode_batch reference")
    ap.add_argument("--workdir", default="/tmp/shardlm-bench-prepare")
    ap.add_argument("--out", default="", help="also write the results as JSON here")
    args = ap.parse_args()
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    sizes = [int(s) for s in args.sizes.split(",")]
    tokenizer = workdir / "tokenizer-8192.json"
    if not tokenizer.exists():
        train_tokenizer(read_documents("shakespeare"), 8192).save(str(tokenizer))
    cores = len(os.sched_getaffinity(0))
    rows = []
    plan = []
    if args.shakespeare:
        plan += [("shakespeare", None, run) for run in args.runs.split(",")]
    for fmt in args.formats.split(","):
        for i, size in enumerate(sizes):
            for run in (args.runs if i == 0 else args.big_runs).split(","):
                plan.append((fmt, size, run))
    for fmt, size, run in plan:
        if fmt == "shakespeare":
            corpus, text_bytes = "shakespeare", sum(f.stat().st_size for f in shakespeare_dir().rglob("*.md"))
        else:
            path, text_bytes = make_corpus(fmt, size, workdir)
            corpus = str(path)
        tag = f"{fmt}-{size}-{run}".replace(".", "_")
        ref = statistics.median(reference(tokenizer, args.ref_mb * 1_000_000, workdir) for _ in range(3))
        r = run_prepare(corpus, run, workdir, tokenizer, tag)
        row = {"format": fmt, "text_mb": text_bytes / 1e6, "run": run, **r,
               "mb_per_s": text_bytes / 1e6 / r["wall_s"],
               "encode_mb_per_s": text_bytes / 1e6 / r["encode_s"], "reference_mb_per_s": ref,
               "vs_reference": text_bytes / 1e6 / r["encode_s"] / ref}
        rows.append(row)
        print(f"{fmt:12s} {row['text_mb']:8.1f} MB  {run}  {r['wall_s']:8.1f} s  {row['mb_per_s']:6.2f} MB/s "
              f" encoding {r['encode_s']:7.1f} s {row['encode_mb_per_s']:6.2f} MB/s "
              f"({row['vs_reference']:.2f}x ref {ref:.2f} MB/s)  "
              f"peak RSS {r['peak_rss_mb']:7.0f} MB", flush=True)
    print()
    print(f"| corpus | text MB | run | wall s | MB/s (wall) | encoding MB/s | bare encode_batch ({cores} "
          "cores) MB/s | vs bare | peak RSS (tree) |")
    print("|---|---:|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['format']} | {r['text_mb']:.0f} | {r['run']} | {r['wall_s']:.1f} | {r['mb_per_s']:.2f} "
              f"| {r['encode_mb_per_s']:.2f} | {r['reference_mb_per_s']:.2f} | {r['vs_reference']:.2f}x | "
              f"{r['peak_rss_mb']:.0f} MB |")
    if args.out:
        Path(args.out).write_text(json.dumps({"cores": cores, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
