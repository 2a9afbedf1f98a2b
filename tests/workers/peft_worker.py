"""Runs parameter-efficient training scenarios (frozen parameters, LoRA, QLoRA) in one torchrun launch.

Usage (from tests/dist/test_peft_training.py): ``torchrun --nproc_per_node=N tests/workers/peft_worker.py
SPEC.json`` with a spec as tests/workers/dist_worker.py's. Scenario keys beyond ``name``/``overrides``:
``unfreeze_after`` (train that many steps, then make every parameter trainable with
``Trainer.set_trainable("")`` and go on; ``save_steps``: save a
checkpoint after each of these steps, before and after the switch), ``expect_error`` (building
or training must raise: the message is reported). Each rank writes ``<out>/<name>/rank<r>.json``; rank 0 also
writes ``trainable.safetensors`` (the full trainable parameters after training).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch.distributed.fsdp import FSDPModule

from dist_worker import write_rank_report
from shardlm.config import load_config
from shardlm.convert.peft_out import gather_full_params
from shardlm.metrics import local_bytes
from shardlm.model.lora import is_nf4, lora_modules
from shardlm.parallel import exit_process, init_distributed
from shardlm.train.build import unwrap
from shardlm.train.trainer import Trainer


def local_copy(p: torch.Tensor) -> torch.Tensor:
    """This rank's stored bytes of ``p`` (NF4: its 4-bit codes), cloned."""
    local = p.to_local() if hasattr(p, "to_local") else p
    return (local.quantized_data if is_nf4(local) else local).detach().clone()


def run(scenario: dict, trainer: Trainer) -> dict:
    model = unwrap(trainer.model)
    frozen0 = {n: local_copy(p) for n, p in model.named_parameters() if not p.requires_grad}
    report: dict = {
        "frozen_bytes": sum(local_bytes(p) for p in model.parameters() if not p.requires_grad),
        "trainable_bytes": sum(local_bytes(p) for p in model.parameters() if p.requires_grad),
        "frozen_bf16_bytes": sum(
            p.to_local().numel() * 2 if hasattr(p, "to_local") else p.numel() * 2
            for p in model.parameters()
            if not p.requires_grad
        ),
        "summary": trainer.summary(),
    }
    bases = [m.weight for _, m in lora_modules(model)]  # the LoRA base: its bytes here and as bf16
    report["lora_base_bytes"] = sum(local_bytes(w) for w in bases)
    report["lora_base_bf16_bytes"] = sum(
        2 * (w.to_local() if hasattr(w, "to_local") else w).numel() for w in bases
    )
    report["nf4_names"] = sorted(n for n, p in model.named_parameters() if is_nf4(p))
    report["tied"] = model.lm_head.weight is model.model.embed_tokens.weight
    if "unfreeze_after" in scenario:
        history = []
        saves = set(scenario.get("save_steps", []))

        def step() -> None:
            history.append(trainer.train_step())
            if trainer.step in saves:
                trainer.checkpointer.save(trainer.model, trainer.optimizer, trainer.scheduler, trainer.step)

        for _ in range(scenario["unfreeze_after"]):
            step()
        trainer.set_trainable("")
        report["after_unfreeze_trainable"] = sum(p.requires_grad for p in model.parameters())
        while trainer.step < trainer.cfg.train.steps:
            step()
        report["frozen_after_first_phase"] = sorted(frozen0)
    else:
        history = trainer.train()
    for module in model.modules():
        # a forward without backward (the last evaluation) leaves groups that do not
        if isinstance(module, FSDPModule):  # reshard after forward (root, output) unsharded: compare shards
            module.reshard()
    names = {p: n for n, p in model.named_parameters()}
    report.update(
        {
            "history": history,
            "optimizer_state_names": sorted(names[p] for p in trainer.optimizer.state),
            "frozen_unchanged": {
                n: torch.equal(v, local_copy(model.get_parameter(n))) for n, v in frozen0.items()
            },
            "shard_bytes": trainer.local_shard_bytes,
            "step_time_s": [r["step_time_s"] for r in history if "step_time_s" in r],
            "run_id": trainer.run_id,
            "last_load": trainer.checkpointer.last_load,
        }
    )
    full = gather_full_params(model, trainer.info.is_main)
    if trainer.info.is_main:
        train_names = {n for n, p in model.named_parameters() if p.requires_grad}
        save_file({n: t.contiguous() for n, t in full.items() if n in train_names},
                  str(trainer.run_dir / "trainable.safetensors"))
    return report


def main() -> None:
    spec_path = sys.argv[1]
    for scenario, trainer, out in scenario_trainers_or_errors(spec_path):
        if isinstance(trainer, str):
            report = {"error": trainer}
            rank = torch.distributed.get_rank()
        else:
            report = run(scenario, trainer)
            rank = trainer.info.rank
        write_rank_report(out, scenario["name"], rank, report)


def scenario_trainers_or_errors(spec_path: str) -> Iterator[tuple[dict, Trainer | str, Path]]:
    """As :func:`dist_worker.scenario_trainers`, but a scenario with ``expect_error`` yields the error message
    (or "no error") in place of a trainer."""
    spec = json.loads(Path(spec_path).read_text())
    for scenario in spec["scenarios"]:
        cfg = load_config(scenario.get("config"), scenario.get("overrides", []))
        if scenario.get("expect_error"):
            try:
                trainer = Trainer(cfg, init_distributed(cfg.parallel), keep_history=True)
                trainer.train()
                yield scenario, "no error", Path(spec["out"])
            except Exception as e:  # noqa: BLE001 - the test asserts on the message
                yield scenario, f"{type(e).__name__}: {e}", Path(spec["out"])
            continue
        yield scenario, Trainer(cfg, init_distributed(cfg.parallel), keep_history=True), Path(spec["out"])


if __name__ == "__main__":
    main()
    exit_process(0)
