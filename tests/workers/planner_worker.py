"""Measures the peak memory of a steady-state training step for several configs in one torchrun launch.

Usage (from tests): ``torchrun --nproc_per_node=N tests/workers/planner_worker.py SPEC.json``, with the spec
``{"out": DIR, "scenarios": [{"name": ..., "overrides": [...], "ac": "none"|"full"}]}``. For each
scenario every rank trains 2 steps, then measures steps 3-5 (clip and optimizer step included) with
:func:`shardlm.metrics.peak.measure_train_step_peak` and keeps the median: with several ranks the peak of one
rank's step varies from step to step by one group-sized buffer (measured: 131,328 bytes, the final norm +
output group of the tiny model, in 1 step of 4), with the timing between the ranks. Rank 0 writes
``DIR/<name>.json`` with the per-rank measured peaks (and each rank's 3 steps) and the planner's prediction
(computed without running anything); with ``parallel.pp`` > 1 the prediction of each rank's pipeline
stage (:func:`shardlm.plan.pipeline.plan_pp_memory`).

``ac: "full"`` wraps every block's forward in ``torch.utils.checkpoint`` (non-reentrant) when the
config has no ``parallel.activation_checkpoint`` field of its own yet.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from shardlm.config import load_config
from shardlm.metrics.peak import measure_train_step_peak
from shardlm.parallel import all_gather_ints, exit_process, init_distributed
from shardlm.plan import plan_memory
from shardlm.plan.pipeline import plan_pp_memory
from shardlm.plan.preference import preference_rows
from shardlm.train.trainer import Trainer


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    out = Path(spec["out"])
    for scenario in spec["scenarios"]:
        overrides = list(scenario["overrides"])
        ac = scenario.get("ac", "none")
        cfg = load_config(None, overrides + [f'--parallel.activation_checkpoint="{ac}"'])
        info = init_distributed(cfg.parallel)
        trainer = Trainer(cfg, info)
        trainer.train_step()
        trainer.train_step()
        steps = [measure_train_step_peak(trainer) for _ in range(3)]
        each = [all_gather_ints(m["peak"], info.device) for m in steps]  # [step][rank]
        peaks = [sorted(step[r] for step in each)[1] for r in range(info.world_size)]
        starts = all_gather_ints(steps[0]["start"], info.device)
        if info.is_main and cfg.parallel.pp > 1:  # per pipeline rank; pp is the mesh's outermost dimension
            stages = plan_pp_memory(cfg, info.world_size, "cpu")
            per_stage = info.world_size // cfg.parallel.pp
            (out / f"{scenario['name']}.json").write_text(json.dumps({
                "measured_peaks": peaks, "measured_step_peaks": each, "measured_starts": starts,
                "predicted_per_rank": [stages[r // per_stage].peak for r in range(info.world_size)],
                "breakdowns": [s.breakdown for s in stages], "world_size": info.world_size,
            }))
        elif info.is_main:
            plan = plan_memory(preference_rows(cfg), info.world_size, "cpu")  # pairs: 2 rows each
            (out / f"{scenario['name']}.json").write_text(json.dumps({
                "measured_peaks": peaks, "measured_step_peaks": each, "measured_starts": starts,
                "predicted": plan.peak, "breakdown": plan.breakdown, "phase": plan.phase,
                "world_size": info.world_size,
            }))
        torch.distributed.barrier()


if __name__ == "__main__":
    main()
    exit_process(0)  # destroys the process group; skips a teardown that can abort (SIGABRT)
