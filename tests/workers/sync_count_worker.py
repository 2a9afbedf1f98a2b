"""Counts, per training step, the collectives shardlm issues outside FSDP and the host reads, for
tests/dist/test_collectives_per_step.py.

Usage: ``torchrun --nproc_per_node=N tests/workers/sync_count_worker.py SPEC.json`` (a spec as
tests/workers/dist_worker.py's). Every ``torch.distributed`` collective is wrapped to count calls made while a
step runs, except those made from inside FSDP or tensor parallel (:data:`PARALLELISM_FILES`: their
all-gathers, reduce-scatters and the vocabulary-parallel loss's all-reduces); ``Tensor.item``,
``Tensor.tolist`` and ``Tensor.cpu`` are wrapped to count host reads (except those called from
``shardlm/data/``, whose tensors are host tensors by construction: the sampler's CPU-generator permutation).
Each rank writes ``OUT/<name>/rank<r>.json``: ``{"steps": [{"step", "logged", "collectives": [names],
"host_reads": [names]}, and on logged steps "mfu" and this rank's "shard_bytes" (with
``train.log_per_rank``)], "measured_shard_bytes", "expected_shard_bytes" (the prediction made before step 1,
evaluated at the end), "trainable", "frozen" (parameter counts)}``.
"""

from __future__ import annotations

import functools
import sys

import torch
import torch.distributed as dist

from dist_worker import scenario_trainers, write_rank_report
from shardlm.metrics.memory import expected_shard_bytes
from shardlm.parallel import exit_process

COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_single", "all_gather_object",
               "reduce_scatter", "reduce_scatter_tensor", "broadcast", "broadcast_object_list", "barrier",
               "all_to_all", "all_to_all_single", "gather", "scatter", "reduce", "gather_object", "send",
               "recv")
HOST_READS = ("item", "tolist", "cpu")
counts: dict[str, list[str]] | None = None  # None: not inside a step


#: callers whose collectives belong to a parallelism, not to the step: FSDP's all-gathers and reduce-scatters,
#: tensor parallel's (DTensor redistributions, the vocabulary-parallel loss's two all-reduces per chunk)
PARALLELISM_FILES = ("/torch/distributed/fsdp/", "/torch/distributed/tensor/",
                     "/shardlm/train/vocab_parallel_loss.py")


def inside_fsdp() -> bool:
    frame = sys._getframe(2)
    while frame is not None:
        if any(part in frame.f_code.co_filename for part in PARALLELISM_FILES):
            return True
        frame = frame.f_back
    return False


def wrap(owner: object, name: str, kind: str) -> None:
    original = getattr(owner, name)

    @functools.wraps(original)
    def counted(*args, **kwargs):
        if counts is not None and not (kind == "collectives" and inside_fsdp()):
            caller = sys._getframe(1).f_code.co_filename
            if not (kind == "host_reads" and "/shardlm/data/" in caller):
                # the host-side data pipeline: CPU only
                counts[kind].append(name)
        return original(*args, **kwargs)

    setattr(owner, name, counted)


def main() -> None:
    global counts
    for name in COLLECTIVES:
        wrap(dist, name, "collectives")
    for name in HOST_READS:
        wrap(torch.Tensor, name, "host_reads")
    for scenario, trainer, out in scenario_trainers(sys.argv[1]):
        steps = []
        train_step = trainer.train_step

        def step(log: bool = True, train_step=train_step, steps=steps, trainer=trainer) -> dict | None:
            global counts
            counts = {"collectives": [], "host_reads": []}
            record = None
            try:
                record = train_step(log=log)
                return record
            finally:
                steps.append({"step": trainer.step, "logged": log, **counts})
                if record is not None:  # what the one read delivered: MFU and this rank's shard bytes
                    steps[-1].update(
                        mfu=record["mfu"],
                        shard_bytes=record["shard_bytes_per_rank"][trainer.info.rank]
                        if "shard_bytes_per_rank" in record
                        else None,
                    )
                counts = None

        trainer.train_step = step
        trainer.train()
        write_rank_report(out, scenario["name"], trainer.info.rank, {
            "steps": steps, "measured_shard_bytes": trainer.local_shard_bytes["total"],
            "expected_shard_bytes": expected_shard_bytes(trainer.model)["total"],
            "trainable": sum(p.requires_grad for p in trainer.model.parameters()),
            "frozen": sum(not p.requires_grad for p in trainer.model.parameters())})


if __name__ == "__main__":
    main()
    exit_process(0)
