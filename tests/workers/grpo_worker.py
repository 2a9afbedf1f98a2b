"""Runs online-RL scenarios in one torchrun launch and writes what tests/dist/test_grpo_ranks.py asserts on.

Usage: ``torchrun --nproc_per_node=N tests/workers/grpo_worker.py SPEC.json`` with a spec as
tests/workers/dist_worker.py's. Each rank writes ``DIR/<name>/rank<r>.json``: the logged history and, per
step, the global batch's completions (token ids) and reward table as the objective gathered them; the run's
export (``<run dir>/final``) holds the trained weights.
"""

from __future__ import annotations

import sys

from dist_worker import scenario_trainers, write_rank_report
from shardlm.parallel import exit_process


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
        write_rank_report(out, scenario["name"], trainer.info.rank, {"history": history, "steps": steps})


if __name__ == "__main__":
    main()
    exit_process(0)  # destroys the process group; skips a teardown that can abort (SIGABRT)
