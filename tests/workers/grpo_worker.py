"""Runs online-RL scenarios in one torchrun launch and writes what tests/dist/test_grpo_ranks.py asserts on.

Usage: ``torchrun --nproc_per_node=N tests/workers/grpo_worker.py SPEC.json`` with a spec as
tests/workers/dist_worker.py's. Each rank writes ``DIR/<name>/rank<r>.json``: the logged history and, per
step, the generation batch's completions (token ids) and reward table as the objective gathered them, the
largest |log-prob - old log-prob| of the step's completion tokens over this rank's micro-batches and whether
they were all equal bit for bit (``ratio``: None at one update per generation, where no old log-probs
exist), and the trained policy's fp32 logits on :data:`PROBE` (every rank runs the forward; the FSDP shards
are gathered as in training); the run's export (``<run dir>/final``) holds the trained weights.
"""

from __future__ import annotations

import sys

import torch

from dist_worker import scenario_trainers, write_rank_report
from shardlm.parallel import exit_process
from shardlm.train.objectives import grpo

#: (2, 16) token ids the trained policy's logits are recorded on (tests/dist/test_grpo_ranks.py feeds the
#: same ids to the export loaded in transformers); below the tiny test models' vocabulary of 400
PROBE = torch.randint(0, 400, (2, 16), generator=torch.Generator().manual_seed(0)).tolist()


def policy_logits(trainer) -> list:
    """The trained model's logits on :data:`PROBE`: (2, 16, vocab) fp32, as nested lists."""
    with torch.no_grad():
        return trainer.model(torch.tensor(PROBE)).float().tolist()


def run_grpo_scenarios(spec_path: str) -> None:
    """Train every scenario of the spec at ``spec_path`` and write each rank's report (the module docstring;
    also called by tests/workers/rollout_worker.py inside its 4-rank launch)."""
    policy_loss_sum = grpo.policy_loss_sum
    for scenario, trainer, out in scenario_trainers(spec_path):
        steps: list[dict] = []
        prepare = trainer.objective.prepare_step

        def recording(*args, prepare=prepare, steps=steps):
            inputs = prepare(*args)
            steps.append({"completions": inputs.context["completion_ids"],
                          "rewards": inputs.context["rewards"].tolist(), "ratio": None})
            return inputs

        def ratio_spy(rl, logps, advantages, mask, *, old_logps=None, steps=steps, **kw):
            if old_logps is not None:  # the step's log-probs against the old policy's, on the loss's tokens
                m = mask.bool()
                new, old = logps.detach()[m], old_logps[m]
                gap, same = float((new - old).abs().max()) if m.any() else 0.0, bool(torch.equal(new, old))
                prev = steps[-1]["ratio"] or {"gap": 0.0, "exact": True}
                steps[-1]["ratio"] = {"gap": max(prev["gap"], gap), "exact": prev["exact"] and same}
            return policy_loss_sum(rl, logps, advantages, mask, old_logps=old_logps, **kw)

        grpo.policy_loss_sum = ratio_spy
        trainer.objective.prepare_step = recording
        history = trainer.train()
        report = {"history": history, "steps": steps, "probe": PROBE, "logits": policy_logits(trainer)}
        write_rank_report(out, scenario["name"], trainer.info.rank, report)
    grpo.policy_loss_sum = policy_loss_sum


def main() -> None:
    run_grpo_scenarios(sys.argv[1])


if __name__ == "__main__":
    main()
    exit_process(0)  # destroys the process group; skips a teardown that can abort (SIGABRT)
