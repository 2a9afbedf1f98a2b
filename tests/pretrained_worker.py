"""One torchrun launch, several fine-tuning scenarios: writes what tests/test_pretrained.py and test_instruct.py assert.

Usage: ``torchrun --nproc_per_node=N tests/pretrained_worker.py SPEC.json`` with
``{"out": DIR, "scenarios": [{"name", "config", "overrides"}]}``. Each rank writes
``DIR/<name>/rank<r>.json``: history, pretrained load stats, and whether each loaded local shard
equals the file's rows (read separately with safetensors).
"""

from __future__ import annotations

import sys

import torch
from safetensors import safe_open

from dist_worker import scenario_trainers, write_rank_report
from shardlm.convert.hf_in import local_rows, tensor_files
from shardlm.parallel import exit_process
from shardlm.train.build import unwrap


def main() -> None:
    for scenario, trainer, out in scenario_trainers(sys.argv[1]):
        cfg, info = trainer.cfg, trainer.info
        model = unwrap(trainer.model)
        report: dict = {"world_size": info.world_size, "load": trainer.pretrained_load_stats}
        if cfg.model.init_from:  # the loaded shards equal the file's rows for this rank
            where = tensor_files(cfg.model.init_from)
            equal = {}
            for name, p in model.named_parameters():
                start, rows = local_rows(p)
                with safe_open(str(where[name]), framework="pt") as st:
                    expected = st.get_slice(name)[start:start + rows]
                local = p.to_local() if hasattr(p, "to_local") else p
                equal[name] = torch.equal(local.detach().cpu(), expected.to(local.dtype))
            report["shards_equal_file_rows"] = equal
        report["history"] = trainer.train()
        write_rank_report(out, scenario["name"], info.rank, report)


if __name__ == "__main__":
    main()
    exit_process(0)  # destroys the process group; skips a teardown that can abort (SIGABRT)
