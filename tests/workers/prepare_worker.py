"""Prepares several corpora inside one torchrun launch, every rank taking its share of each.

Usage (from tests): ``torchrun --nproc_per_node=N tests/workers/prepare_worker.py SPEC.json``; the spec is
``{"jobs": [{"corpus": ..., "out": ..., "tokenizer": ..., "vocab_size": ..., "piece_bytes": ...}]}``; a job
with ``"sources": [{"path", "weight", "name"}]`` instead of ``corpus`` prepares a mixture.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from shardlm.config import DataSource, ParallelConfig
from shardlm.data.mixture import prepare_mixture
from shardlm.data.prepare import prepare_corpus
from shardlm.data.sync import StoreSync, default_store
from shardlm.parallel import exit_process, init_distributed


def main() -> None:
    info = init_distributed(ParallelConfig(timeout_s=30))
    for job in json.loads(Path(sys.argv[1]).read_text())["jobs"]:
        sync = StoreSync(default_store(), info.rank, info.world_size, job["out"])
        if "sources" in job:
            prepare_mixture([DataSource(**s) for s in job["sources"]], job["out"], job.get("tokenizer"),
                            job["vocab_size"], 0.1, piece_bytes=job["piece_bytes"], workers=1, sync=sync)
            continue
        prepare_corpus(job["corpus"], job["out"], job.get("tokenizer"), job["vocab_size"], 0.1,
                       piece_bytes=job["piece_bytes"], workers=1, sync=sync)


if __name__ == "__main__":
    main()
    exit_process(0)
