"""Preference tuning as an objective of the training step: DPO, IPO, hinge, SimPO and ORPO
(:mod:`shardlm.train.preference`), each micro-batch's loss a share of the global batch's mean, with the
reference policy of :mod:`shardlm.train.reference`."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from shardlm.atomic import save_safetensors
from shardlm.config import Config
from shardlm.data.instruct import split_batch
from shardlm.data.preference import PreferencePairs
from shardlm.metrics import format_bytes, local_bytes
from shardlm.parallel.dist import DistInfo, to_device
from shardlm.train.objectives.objective import Objective, ObjectiveContext, StepInputs
from shardlm.train.preference import (
    STAT_NAMES,
    adapters_off,
    completion_logps,
    metrics_of,
    micro_batch_loss,
    nll_token_set,
    nll_weight,
)
from shardlm.train.reference import (
    build_reference,
    check_reference_tokenizer,
    precompute_reference,
    reference_kind,
    reference_table_path,
)


class PreferenceObjective(Objective):
    """The per-micro-batch preference loss of a run (see the module docstring for the reference).

    Args:
        cfg: the run's config (``[preference]``, ``train.loss_chunk_tokens``). data: the training pairs (the
        sampler's ids index them). reference: the frozen reference model (kind ``model``, not precomputed),
        else None. table: (n, 2) fp64 precomputed reference log-probs (chosen, rejected) of every training
        pair, else None.
    """

    name = "preference"
    stat_names = STAT_NAMES
    rows_per_sample = 2  # chosen and rejected

    def __init__(self, cfg: Config, data: PreferencePairs, kind: str, reference: nn.Module | None = None,
                 table: torch.Tensor | None = None, device: torch.device | None = None) -> None:
        self.cfg, self.data, self.kind, self.reference, self.table = cfg, data, kind, reference, table
        self.device = device or torch.device("cpu")
        self.reused = False  # the table was read from an earlier pass (set by build)

    @classmethod
    def build(cls, ctx: ObjectiveContext) -> PreferenceObjective:
        """The objective of ``ctx``'s run (:meth:`build_for`)."""
        return cls.build_for(ctx.cfg, ctx.info, ctx.mesh, ctx.model, ctx.train_data, ctx.run_dir)

    @classmethod
    def build_for(cls, cfg: Config, info: DistInfo, mesh: DeviceMesh | None, policy: nn.Module,
                  data: PreferencePairs, run_dir: Path) -> PreferenceObjective:
        """The objective with its reference built (and, with ``precompute_reference``, its table computed
        or read).

        Raises:
            ConfigError: a reference model whose tokenizer differs from the policy's
            (:func:`check_reference_tokenizer`).
        """
        kind = reference_kind(cfg)
        device = info.device
        pref = cfg.preference
        if kind == "none":
            return cls(cfg, data, kind, device=device)
        if kind == "model" and pref.reference_from:
            check_reference_tokenizer(pref.reference_from, cfg.data.tokenizer)
        reference = build_reference(cfg, info, mesh) if kind == "model" else None
        if not pref.precompute_reference:
            return cls(cfg, data, kind, reference, device=device)
        path = reference_table_path(cfg, kind, run_dir, data, info)
        if path.is_file():
            objective = cls(cfg, data, kind, None, load_file(str(path))["ref_logps"].to(device), device)
            objective.reused = True
            return objective
        ref_model = reference if reference is not None else policy
        table = precompute_reference(ref_model, kind == "lora_base", data, cfg.train.micro_batch_size,
                                     cfg.train.loss_chunk_tokens, info)
        if info.is_main:
            path.parent.mkdir(parents=True, exist_ok=True)
            save_safetensors({"ref_logps": table.cpu()}, path, metadata={"key": path.stem})
            print(f"preference: reference log-probs of {len(data):,} pairs written to {path}",
                  file=sys.stderr, flush=True)
        del reference
        return cls(cfg, data, kind, None, table, device)

    def describe(self) -> str:
        """One line for the run summary."""
        p = self.cfg.preference
        ref = {"none": "no reference", "model": "reference: a frozen model",
               "lora_base": "reference: the base with " "the LoRA adapters off"}[self.kind]
        if self.reference is not None:
            ref += (f" ({format_bytes(sum(local_bytes(q) for q in self.reference.parameters()))} of shards "
                    "on this rank)")
        if self.table is not None:
            ref += ", log-probs precomputed" + (" (reused)" if self.reused else "")
        return (f"{p.loss}, beta {p.beta:g}" + (f", gamma {p.simpo_gamma:g}" if p.loss == "simpo" else "")
                + (f", label smoothing {p.label_smoothing:g}" if p.label_smoothing else "")
                + (f", rpo_alpha {p.rpo_alpha:g}" if p.rpo_alpha else "")
                + (f", NLL over the chosen {self.nll_tokens().replace('_', ' ')}"
                   if nll_weight(p.loss, p.rpo_alpha) else "") + f"; {ref}; {self.data.summary()}")

    def nll_tokens(self) -> str:
        """The NLL term's tokens, ``preference.nll_tokens`` resolved (:func:`nll_token_set`)."""
        p = self.cfg.preference
        return nll_token_set(p.loss, p.nll_tokens)

    def prepare_step(self, step: int, micro_ids: list[list[int]], step_ids: list[int]) -> StepInputs:
        """The micro-batches (each 2·m rows, chosen first) and the step's normalisers in ``context``
        (:meth:`normalisers`); the numerators are already shares of the global mean (denominator 1)."""
        batches = [to_device(self.data.get(ids), self.device) for ids in micro_ids]
        return StepInputs(batches, 1, self.normalisers(step_ids))

    def normalisers(self, step_ids: list[int]) -> tuple[int, int]:
        """The pairs and the NLL term's chosen tokens (the completions', or the whole sequences' targets) of
        a global batch (host arithmetic)."""
        prompt = self.nll_tokens() == "prompt_and_completion"
        return len(step_ids), self.data.num_chosen_targets(step_ids, prompt=prompt)

    def reference_logps(self, model: nn.Module, batch: torch.Tensor, ids: list[int]) -> torch.Tensor | None:
        """(2P,) fp32 reference log-probs of a micro-batch's rows (chosen first), or None without
        a reference."""
        if self.kind == "none":
            return None
        if self.table is not None:
            rows = self.table[torch.as_tensor(ids, device=self.table.device)]
            return torch.cat([rows[:, 0], rows[:, 1]]).float().to(batch.device)
        inputs, targets = split_batch(batch)
        chunk = self.cfg.train.loss_chunk_tokens
        with torch.no_grad():
            if self.kind == "lora_base":
                with adapters_off(model):
                    return completion_logps(model, inputs, targets, chunk)[0]
            return completion_logps(self.reference, inputs, targets, chunk)[0]

    def loss(self, model: nn.Module, batch: torch.Tensor, ids: list[int], inputs: StepInputs
             ) -> tuple[torch.Tensor, torch.Tensor]:
        """This micro-batch's share of the step's loss (0-dim, with gradient) and its metric sums (fp64):
        chosen and rejected rows in one forward, the reference's log-probs first, without gradients."""
        p, norm = self.cfg.preference, inputs.context
        ref = self.reference_logps(model, batch, ids)
        return micro_batch_loss(model, batch, p.loss, p.beta, p.label_smoothing, p.simpo_gamma, p.rpo_alpha,
                                self.cfg.train.loss_chunk_tokens, ref, norm[0], norm[1], p.nll_tokens)

    def metrics(self, sums: list[float], inputs: StepInputs) -> dict[str, float]:
        """TRL's metrics (rewards/*, logps/*, logits/*) from the step's all-reduced sums
        (:func:`shardlm.train.preference.metrics_of`)."""
        return metrics_of(sums, inputs.context[0])
