"""Training runs on one data directory with a change before each, inside one torchrun launch.

Usage (from tests/dist/test_stale_data_two_ranks.py): ``torchrun --nproc_per_node=N
tests/workers/stale_worker.py SPEC.json`` in the directory the default ``data.dir`` (``data/<run name>``) lies
in. The spec is ``{"out": DIR, "steps": [{"name", "overrides", "write": [PATH, HEX BYTES] (optional: rank 0
writes the file first), "expect_error": bool}]}``. Each rank writes ``DIR/<name>/rank<r>.json``: the steps
trained, the prepared data's content hash (None for instruction data), the token files' modification times, or
the ConfigError that refused the run.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch.distributed as dist

from shardlm.config import ConfigError, load_config
from shardlm.data.build import data_dir
from shardlm.parallel import exit_process, init_distributed
from shardlm.train.trainer import Trainer


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    for step in spec["steps"]:
        cfg = load_config(None, step["overrides"])
        info = init_distributed(cfg.parallel)
        if info.rank == 0 and step.get("write"):
            path, data = step["write"]
            Path(path).write_bytes(bytes.fromhex(data))
        dist.barrier()
        report: dict = {}
        try:
            trainer = Trainer(cfg, info)
            trainer.train()
            report["steps"] = trainer.step
        except ConfigError as e:
            if not step.get("expect_error"):
                raise
            report["error"] = str(e)
        out = data_dir(cfg)
        report["content_sha256"] = json.loads((out / "meta.json").read_text()).get("content_sha256")
        report["mtimes"] = {p.name: p.stat().st_mtime_ns for p in sorted([*out.glob("tokens/*.bin"),
                                                                          *out.glob("*.bin")])}
        d = Path(spec["out"]) / step["name"]
        d.mkdir(parents=True, exist_ok=True)
        (d / f"rank{info.rank}.json").write_text(json.dumps(report))
        dist.barrier()


if __name__ == "__main__":
    main()
    exit_process(0)
