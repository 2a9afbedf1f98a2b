"""Runs online-RL scenarios in one torchrun launch and writes what tests/dist/test_grpo_ranks.py asserts on.

Usage: ``torchrun --nproc_per_node=N tests/workers/grpo_worker.py SPEC.json`` with a spec as
tests/workers/dist_worker.py's. Each rank writes ``DIR/<name>/rank<r>.json``: the logged history and, per
step, the global batch's completions (token ids) and reward table as the objective gathered them, and the
trained policy's fp32 logits on :data:`PROBE` (every rank runs the forward; the FSDP shards are gathered as in
training); the run's export (``<run dir>/final``) holds the trained weights.
"""

from __future__ import annotations

import sys

import torch

from dist_worker import scenario_trainers, write_rank_report
from shardlm.parallel import exit_process

#: (2, 16) token ids the trained policy's logits are recorded on (tests/dist/test_grpo_ranks.py feeds the
#: same ids to the export loaded in transformers); below the tiny test models' vocabulary of 400
PROBE = torch.randint(0, 400, (2, 16), generator=torch.Generator().manual_seed(0)).tolist()


def policy_logits(trainer) -> list:
    """The trained model's logits on :data:`PROBE`: (2, 16, vocab) fp32, as nested lists."""
    with torch.no_grad():
        return trainer.model(torch.tensor(PROBE)).float().tolist()


def main() -> None:
    for scenario, trainer, out in scenario_trainers(sys.argv[1]):
        steps: list[dict] = []
        prepare = trainer.objective.prepare_step

        def recording(*args, prepare=prepare, steps=steps):
            inputs = prepare(*args)
            steps.append({"completions": inputs.context["completion_ids"],
                          "rewards": inputs.context["rewards"].tolist()})
            return inputs

        trainer.objective.prepare_step = recording
        history = trainer.train()
        report = {"history": history, "steps": steps, "probe": PROBE, "logits": policy_logits(trainer)}
        write_rank_report(out, scenario["name"], trainer.info.rank, report)


if __name__ == "__main__":
    main()
    exit_process(0)  # destroys the process group; skips a teardown that can abort (SIGABRT)
