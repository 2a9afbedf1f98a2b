"""One torchrun launch, several fine-tuning scenarios: writes what tests/dist/test_pretrained_finetune.py
asserts.

Usage: ``torchrun --nproc_per_node=N tests/workers/pretrained_worker.py SPEC.json`` with ``{"out": DIR,
"scenarios": [{"name", "config", "overrides"}]}``. Each rank writes ``DIR/<name>/rank<r>.json``: history,
pretrained load stats, and whether each loaded local shard equals the file's rows (read separately with
safetensors). A scenario with ``"loss_fp64": true`` trains with the plain loss's cross-entropy computed in
fp64 (the logits upcast to fp64, the loss rounded to fp32 at the end): the reference that the plain fp32 loss
and the chunked loss are both compared with.
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F
from safetensors import safe_open

import shardlm.train.loss as loss_module
from dist_worker import scenario_trainers, write_rank_report
from shardlm.convert.hf_in import local_rows, tensor_files
from shardlm.data.instruct import IGNORE_INDEX
from shardlm.parallel import exit_process
from shardlm.train.build import unwrap

PLAIN_LOSS = loss_module.token_loss_sum


def fp64_token_loss_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """``token_loss_sum`` with the log-softmax and the sum in fp64 (its gradient rounded to the
    logits' dtype)."""
    return F.cross_entropy(logits.flatten(0, 1).double(), targets.flatten(), ignore_index=IGNORE_INDEX,
                           reduction="sum").float()


def main() -> None:
    for scenario, trainer, out in scenario_trainers(sys.argv[1]):
        loss_module.token_loss_sum = fp64_token_loss_sum if scenario.get("loss_fp64") else PLAIN_LOSS
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
