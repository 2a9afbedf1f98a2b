"""Runs several training scenarios inside one torchrun launch and writes what tests assert on.

Usage (from tests): ``torchrun --nproc_per_node=N tests/workers/dist_worker.py SPEC.json``. The spec is
``{"out": DIR, "scenarios": [{"name": ..., "config": PATH|null, "overrides": [...]}, ...]}``.
Each rank writes ``DIR/<name>/rank<r>.json`` with the logged history, the sample ids it consumed,
its shards (placements, local rows, bytes) and how its initial shards compare with a whole model.
"""

from __future__ import annotations

import hashlib
import json
import sys
from collections.abc import Iterator
from pathlib import Path

import torch

from shardlm.config import load_config
from shardlm.metrics import local_bytes
from shardlm.model.decoder import CausalLM
from shardlm.parallel import exit_process, init_distributed
from shardlm.train.build import unwrap
from shardlm.train.trainer import Trainer


def shard_coordinate(p: torch.Tensor, rank: int, world: int) -> tuple[int, int]:
    """(index of this rank's shard, number of shards): the ``dp_shard`` mesh coordinate, else
    (rank, world)."""
    mesh = getattr(p, "device_mesh", None)
    if mesh is not None and "dp_shard" in (mesh.mesh_dim_names or ()):
        return mesh.get_local_rank("dp_shard"), mesh["dp_shard"].size()
    return rank, world


def local_digests(trainer: Trainer) -> dict[str, str]:
    """SHA-256 of the bytes of this rank's local shard of every parameter (to compare replicas exactly)."""
    out = {}
    for name, p in unwrap(trainer.model).named_parameters():
        local = (p.to_local() if hasattr(p, "to_local") else p).detach().cpu().contiguous()
        out[name] = hashlib.sha256(local.view(torch.uint8).numpy().tobytes()).hexdigest()
    return out


def shard_report(trainer: Trainer) -> dict:
    """Placements, local rows and init difference of every parameter on this rank."""
    model = unwrap(trainer.model)
    ref = CausalLM(trainer.cfg.model)
    ref.init_weights(trainer.cfg.train.seed)
    ref_params = dict(ref.named_parameters())
    rank, world = trainer.info.rank, trainer.info.world_size
    params = {}
    for name, p in model.named_parameters():
        full = ref_params[name]
        local = p.to_local() if hasattr(p, "to_local") else p
        shard_rank, shard_size = shard_coordinate(p, rank, world)  # HSDP: the rank within its shard group
        expected_rows = torch.chunk(full, shard_size, dim=0)[shard_rank] if hasattr(p, "to_local") else full
        params[name] = {
            "dtensor": hasattr(p, "to_local"),
            "placements": [str(pl) for pl in getattr(p, "placements", [])],
            "full_rows": full.shape[0],
            "local_rows": local.shape[0],
            "local_bytes": local_bytes(p),
            "init_max_abs_diff": (local.detach().cpu() - expected_rows).abs().max().item()
            if local.shape == expected_rows.shape else float("inf"),
        }
    return {
        "params": params,
        "rope_equal": torch.equal(model.model.rope_cos.cpu(), ref.model.rope_cos)
        and torch.equal(model.model.rope_sin.cpu(), ref.model.rope_sin),
        "tied_same_tensor": model.lm_head is not None and model.model.embed_tokens is not None
        and model.lm_head.weight is model.model.embed_tokens.weight,  # (a pipeline stage holds one or none)
    }


def write_rank_report(out: Path, scenario: str, rank: int, report: dict) -> None:
    """Write this rank's ``out/<scenario>/rank<r>.json``, then wait until every rank has written its own."""
    d = out / scenario
    d.mkdir(parents=True, exist_ok=True)
    (d / f"rank{rank}.json").write_text(json.dumps(report))
    torch.distributed.barrier()


def scenario_trainers(spec_path: str) -> Iterator[tuple[dict, Trainer, Path]]:
    """For each scenario of the spec at ``spec_path``: the scenario, a ``Trainer`` built from its config and
    overrides (the process group started on first use), and the output folder of the reports."""
    spec = json.loads(Path(spec_path).read_text())
    for scenario in spec["scenarios"]:
        cfg = load_config(scenario.get("config"), scenario.get("overrides", []))
        yield scenario, Trainer(cfg, init_distributed(cfg.parallel), keep_history=True), Path(spec["out"])


def main() -> None:
    for scenario, trainer, out in scenario_trainers(sys.argv[1]):
        info = trainer.info
        report = shard_report(trainer)
        report["init_digest"] = local_digests(trainer)
        history = trainer.train()
        report.update({
            "history": history,
            "sample_ids": {str(k): v for k, v in trainer.sample_ids.items()},
            "shard_bytes": trainer.local_shard_bytes,
            "world_size": info.world_size,
            "final_digest": local_digests(trainer),
            "mesh": list(trainer.mesh.mesh_dim_names) if trainer.mesh is not None else None,
            # the global ranks of this rank's context-parallel group (parallel.cp), None without one
            "cp_ranks": (torch.distributed.get_process_group_ranks(trainer.cp.group) if trainer.cp.group
                         else None),
            "prepare_s": trainer.prepare_s,
            "rows": getattr(trainer.train_data, "rows", None),  # packed instruction data: example ids per row
            # block-causal windows: starts or eod
            "document_source": getattr(trainer.train_data, "source", None),
            # train.float8 = "tensorwise" under FSDP: the weights all-gathered in float8, and the optimizer's
            # post-step hooks (the scales' precomputation)
            "float8_all_gather_weights": sum(
                type(getattr(p, "_local_tensor", None)).__name__ == "WeightWithDynamicFloat8CastTensor"
                for p in unwrap(trainer.model).parameters()),
            "optimizer_post_hooks": len(trainer.optimizer._optimizer_step_post_hooks),
        })
        write_rank_report(out, scenario["name"], info.rank, report)


if __name__ == "__main__":
    main()
    exit_process(0)  # destroys the process group; skips a teardown that can abort (SIGABRT)
