"""One torchrun launch, several transformers-backend scenarios: writes what tests/dist/test_hf_backend_fsdp.py
asserts.

Usage: ``torchrun --nproc_per_node=N tests/workers/hf_backend_worker.py SPEC.json`` with ``{"out": DIR,
"scenarios": [{"name", "config", "overrides"}]}``. Each rank writes ``DIR/<name>/rank<r>.json``: the history,
and the trained model's logits (fp32 lists) on a fixed probe batch (every rank runs the forward: a collective
under FSDP).
"""

from __future__ import annotations

import sys

import torch

from dist_worker import scenario_trainers, write_rank_report
from shardlm.parallel import exit_process

#: the probe batch whose logits the test compares with transformers' reload of the export
PROBE = torch.arange(2 * 12).reshape(2, 12) * 37 % 500 + 3


def main() -> None:
    for scenario, trainer, out in scenario_trainers(sys.argv[1]):
        history = trainer.train()
        trainer.model.eval()
        with torch.no_grad():
            logits = trainer.model(PROBE.to(trainer.info.device)).float().cpu()
        report = {"history": history, "logits": logits.tolist(), "world_size": trainer.info.world_size}
        write_rank_report(out, scenario["name"], trainer.info.rank, report)


if __name__ == "__main__":
    main()
    exit_process(0)  # destroys the process group; skips a teardown that can abort (SIGABRT)
