"""How much the stale-data check costs: describing a corpus (stat + 16 sampled 4 KiB blocks per file) against
hashing every byte of it, on a generated corpus of ``--files`` files of ``--mb`` MB each.

    python bench/bench_identity.py --files 200 --mb 5

Prints the corpus size, the check's wall time and bytes read, and a full SHA-256's wall time. The page cache
is not dropped (both read warm data); on a cold or network file system the check reads 64 KiB per file.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import tempfile
import time
from pathlib import Path

from shardlm.data.identity import describe_corpus


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--files", type=int, default=200)
    ap.add_argument("--mb", type=float, default=5.0)
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "corpus"
        root.mkdir()
        line = (json.dumps({"text": "the quick brown fox jumps over the lazy dog " * 4}) + "\n").encode()
        size = int(args.mb * 1e6)
        block = line * (size // len(line) + 1)
        for i in range(args.files):
            (root / f"{i:05d}.jsonl").write_bytes(block[:size - size % len(line)])
        total = sum(p.stat().st_size for p in root.iterdir())
        check = []
        for _ in range(args.runs):
            t0 = time.perf_counter()
            describe_corpus(str(root), "text", None, 32000, 0.05, 64 << 20, 100_000_000)
            check.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        for p in sorted(root.iterdir()):
            h = hashlib.sha256()
            with open(p, "rb") as f:
                while chunk := f.read(1 << 20):
                    h.update(chunk)
        full = time.perf_counter() - t0
    read = args.files * min(16 * 4096, size)
    print(f"corpus: {args.files} files, {total / 1e9:.2f} GB; cpus {os.cpu_count()}")
    print(f"identity check: best {min(check) * 1e3:.1f} ms of {args.runs} ({read / 1e6:.1f} MB read at "
          f"most); full SHA-256 of every byte: {full:.2f} s")


if __name__ == "__main__":
    main()
