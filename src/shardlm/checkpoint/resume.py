"""Resuming: which checkpoint ``--resume`` picks (the run's newest save first under ``auto``, passing over
damaged ones), the checks before loading it (the base of a checkpoint of trainable parameters, every changed
setting, the data), and the load (:class:`Resuming`, a part of
:class:`shardlm.checkpoint.dcp.Checkpointer`)."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

from shardlm.checkpoint.manifest import (
    read_manifest,
    sha256_file,
)
from shardlm.checkpoint.rank_state import read_rank_state
from shardlm.checkpoint.resume_config import REFUSED, config_changes, data_problems
from shardlm.checkpoint.run import (
    RUN_CONFIG,
    new_run_id,
    newest_first,
    read_entries,
    run_checkpoints,
    run_dir_run_id,
)
from shardlm.checkpoint.safe_load import SafeFileSystemReader, SafeLoadPlanner
from shardlm.checkpoint.state import check_shapes, frozen_any, training_state, verify_checkpoint
from shardlm.config import Config
from shardlm.errors import CheckpointError, ConfigError
from shardlm.parallel import run_on_main


def resume_mode(cfg: Config) -> str:
    """``checkpoint.resume``, or ``auto`` when it is empty and torchrun restarted the job.

    torchrun sets ``TORCHELASTIC_RESTART_COUNT`` (> 0 after a restart,
    https://pytorch.org/docs/stable/elastic/run.html).
    """
    if cfg.checkpoint.resume:
        return cfg.checkpoint.resume
    return "auto" if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0) > 0 else ""


#: what a refused resume advises
RESUME_ADVICE = ("Resume with the checkpoint's values (the run's --config FILE, or --resume=auto "
                 "--run.dir=RUN_DIR, which reads them from the run's config.json), or start a new run")


def run_dir_hint(path: Path) -> str:
    """When ``path`` is a run directory (it has ``checkpoints/`` or ``config.json``) rather than a checkpoint,
    what to pass instead: ``--resume=auto --run.dir=PATH``, or its newest checkpoint; else ``""``."""
    if not ((path / "checkpoints").is_dir() or (path / RUN_CONFIG).is_file()):
        return ""
    root = path / "checkpoints"
    entries = run_checkpoints(root, run_dir_run_id(path)) or newest_first(read_entries(root))
    newest = (f"; or pass one of its checkpoints, the newest is --resume={entries[0].path}" if entries
              else " (it has no complete checkpoint yet)")
    return (f"{path} is a run directory, not a checkpoint: to continue its run, pass --resume=auto "
            f"--run.dir={path}{newest}")


def check_resume_target(cfg: Config) -> None:
    """Refuse an explicit ``--resume=PATH`` (``checkpoint.resume`` neither ``auto`` nor empty) before any
    data is prepared or model built: a path that is a run directory, not a checkpoint (:func:`run_dir_hint`
    says what to pass), one without a readable manifest, or a checkpoint whose recorded config differs from
    ``cfg`` in a setting a resume cannot change (:mod:`shardlm.checkpoint.resume_config`; ``model.attention
    = "auto"`` is left to :func:`shardlm.train.datasets.resolve_attention`, which takes the checkpoint's).
    The full checks (files, shapes, data) follow at :meth:`Resuming.load`.

    Raises:
        CheckpointError: not a checkpoint (naming the run directory's alternatives when it is one).
        ConfigError: a refused setting differs, naming each with its old and new value.
    """
    mode = resume_mode(cfg)
    if mode in ("", "auto"):
        return
    path = Path(mode)
    try:
        manifest = read_manifest(path)
    except CheckpointError as e:
        hint = run_dir_hint(path)
        raise CheckpointError(hint if hint else str(e)) from None
    refused = [f"{c.key} changed {json.dumps(c.old)} -> {json.dumps(c.new)} ({c.why})"
               for c in config_changes(manifest.get("config") or {}, cfg.to_dict())
               if c.rule == REFUSED and not (c.key == "model.attention" and c.new == "auto")]
    if refused:
        raise ConfigError(f"cannot resume from {path}: " + "; ".join(refused) + ". " + RESUME_ADVICE)


class Resuming:
    """The resuming half of a :class:`~shardlm.checkpoint.dcp.Checkpointer`, whose ``__init__`` sets the state
    it uses (the run's ``cfg``, ``info``, ``root``, the resume mode, the data identity, the cached
    base reference)."""

    # ---- the base of a checkpoint of trainable parameters only ------------------------------
    def base_reference(self) -> dict[str, Any]:
        """What the frozen parameters are: ``{"init_from", "weights_sha256"}`` for a pretrained base (SHA-256
        over its safetensors files, computed once), else ``{"seed", "model"}`` (the seeded initialisation's
        shape), plus the LoRA settings (which fix the adapters' shapes and how the base is stored)."""
        if self._base is None:
            cfg = self.cfg
            if cfg.model.init_from:
                files = sorted(Path(cfg.model.init_from).glob("*.safetensors"))
                base: dict[str, Any] = {"init_from": cfg.model.init_from,
                                        "weights_sha256": [sha256_file(f) for f in files]}
            else:
                base = {"seed": cfg.train.seed, "model": cfg.to_dict()["model"]}
            lora = cfg.to_dict()["lora"]
            lora.pop("merge_into", None)  # only what the export merges into: no part of the base
            base["lora"] = lora if cfg.lora.enabled else None
            base["trainable"], base["frozen"] = cfg.train.trainable, cfg.train.frozen
            self._base = base
        return self._base

    def trainable_changed(self) -> None:
        """Forget the cached :meth:`base_reference`: ``train.trainable`` / ``train.frozen`` changed during the
        run (``Trainer.set_trainable``), so the next save records the new ones; the run id, save numbering,
        data identity and special ids stay the run's."""
        self._base = None

    def check_base(self, path: Path, stored: dict[str, Any] | None) -> None:
        """Refuse to resume a checkpoint of trainable parameters onto another base (every rank raises).

        Raises:
            CheckpointError: the checkpoint holds all parameters but this run freezes some (or the reverse),
                or its base (pretrained weights, seed and shape, LoRA or freezing settings) differs from
                this run's.
        """
        if stored is None:
            raise CheckpointError(f"checkpoint {path} holds every parameter, but this run freezes some (LoRA "
                                  "or train.trainable): start from its exported model with model.init_from "
                                  "instead")
        ours = self.base_reference()
        for key in sorted(set(stored) | set(ours)):
            if stored.get(key) != ours.get(key):
                what = {"weights_sha256": "the base model's weights", "init_from": "the base model directory",
                        "seed": "train.seed (the base's initialisation)", "model": "the base model's shape",
                        "lora": "the [lora] settings", "trainable": "train.trainable",
                        "frozen": "train.frozen"}
                raise CheckpointError(
                    f"checkpoint {path} holds adapters / trainable parameters for another base: "
                    f"{what.get(key, key)} differs (checkpoint: {str(stored.get(key))[:120]}; this run: "
                    f"{str(ours.get(key))[:120]})")

    # ---- load ---------------------------------------------------------------------------
    def _resume_plan(self) -> tuple[str, list[str]]:
        """(run id, checkpoints to try, best first) for this job; rank 0 reads the disk.

        Fresh start: a new run id, nothing to try. ``auto``: the run directory's run
        (:func:`shardlm.checkpoint.run.run_dir_run_id`) and its complete checkpoints, newest save first
        (a new id when there is none at all). A path: that checkpoint and its run id.
        """
        if not self.resume:
            return new_run_id(), []
        if self.resume == "auto":
            run_id = run_dir_run_id(self.run_dir)
            return run_id or new_run_id(), [str(e.path) for e in run_checkpoints(self.root, run_id)]
        try:
            run_id = read_manifest(self.resume).get("run_id")
        except CheckpointError:  # verify_checkpoint below reports it on every rank
            run_id = None
        return run_id or new_run_id(), [self.resume]

    def resumed_config(self) -> dict[str, Any] | None:
        """The config (``Config.to_dict()``) recorded by the checkpoint this job resumes: the first one of
        :meth:`_resume_plan`'s whose manifest reads, ``{}`` when it recorded none; None on a fresh start or
        when there is none (:meth:`load` then reports it). A collective under torchrun (rank 0
        reads, broadcasts)."""
        def read() -> dict[str, Any] | None:
            for candidate in self._resume_plan()[1]:
                try:
                    return read_manifest(candidate).get("config") or {}
                except CheckpointError:  # a damaged one: load() passes over it or reports it
                    continue
            return None
        if not self.resume:
            return None
        box = [run_on_main(read, self.info)]
        if self.info.world_size > 1:
            dist.broadcast_object_list(box, src=0)
        return box[0]

    def _skip_damaged(self, path: Path, error: CheckpointError) -> None:
        """``--resume=auto`` passes over a damaged checkpoint: say so and move it aside (rank 0)
        for inspection.

        It becomes ``step-<N>.damaged`` (``.damaged-2``... if taken): never picked again, never pruned.
        """
        self.skipped.append({"path": str(path), "reason": str(error)})
        if not self.info.is_main:
            return
        target, n = path.with_name(path.name + ".damaged"), 1
        while target.exists():
            n += 1
            target = path.with_name(f"{path.name}.damaged-{n}")
        os.replace(path, target)
        print(f"warning: skipping damaged checkpoint {path}: {error}; resuming from an earlier one. "
              f"The damaged one is kept for inspection as {target}", file=sys.stderr, flush=True)

    def _compare_config(
        self, path: Path, manifest: dict[str, Any], metadata: Metadata, state: dict[str, Any]
    ) -> None:
        """Print every setting that differs from the checkpoint's (rank 0); refuse the ones that
        cannot change.

        See :mod:`shardlm.checkpoint.resume_config` for the rule of each field.

        Raises:
            CheckpointError: a tensor does not fit the model (:func:`check_shapes`), naming the refused
            fields. ConfigError: a refused field changed, or the prepared data differs; names each field
            and why.
        """
        self.changes = config_changes(manifest.get("config") or {}, self.cfg.to_dict())
        if self.changes and self.info.is_main:
            many = len(self.changes) > 1
            print(f"resume from {path}: {len(self.changes)} setting{'s' if many else ''} "
                  f"differ{'' if many else 's'} from the checkpoint's (old -> new):\n"
                  + "\n".join("  " + c.line() for c in self.changes), flush=True)
        refused = [f"{c.key} changed {json.dumps(c.old)} -> {json.dumps(c.new)} ({c.why})"
                   for c in self.changes if c.rule == REFUSED]
        try:
            check_shapes(path, metadata, state, part=self.cfg.parallel.pp > 1)  # a stage: not every tensor
        except CheckpointError as e:
            raise CheckpointError("; ".join([str(e), *refused])) from None
        tokenizer = None
        if self.tokenizer_path is not None and self.tokenizer_path.is_file():
            tokenizer = sha256_file(self.tokenizer_path)
        refused += data_problems(manifest, self.data_meta, tokenizer)
        if refused:
            raise ConfigError(f"cannot resume from {path}: " + "; ".join(refused) + ". " + RESUME_ADVICE)

    def load(self, model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any) -> int:
        """Resume as configured: load model, optimizer, LR scheduler; return the step (0 when starting fresh).

        Sets ``self.run_id``: a new id on a fresh start, the resumed checkpoint's run otherwise. ``auto``
        tries the run directory's run's checkpoints newest save first; one that fails verification is
        skipped with a warning and moved aside (:meth:`_skip_damaged`). The trainer then rewinds its metrics
        sinks to the returned step (:meth:`shardlm.metrics.logger.MetricsLogger.rewind`).

        Sets ``self.rank_state``: this rank's state besides DCP's (:mod:`shardlm.checkpoint.rank_state`), None
        when the checkpoint holds none.

        Raises:
            CheckpointError: see :func:`verify_checkpoint` and :func:`check_shapes`; every rank raises it.
            ConfigError: a refused setting changed, or the checkpoint holds per-rank state of another world
                size (:func:`~shardlm.checkpoint.rank_state.read_rank_state`).
        """
        plan = [run_on_main(self._resume_plan, self.info)]
        if self.info.world_size > 1:
            dist.broadcast_object_list(plan, src=0)
        self.run_id, candidates = plan[0]
        path, manifest, metadata, step = None, None, None, 0
        start = time.perf_counter()
        for candidate in map(Path, candidates):
            try:
                manifest, metadata = verify_checkpoint(candidate, self.info.rank, self.info.world_size)
            except CheckpointError as e:
                if self.resume != "auto":  # an explicit --resume=PATH fails as it is
                    raise
                self._skip_damaged(candidate, e)
                continue
            path = candidate
            break
        if candidates and path is None:
            raise CheckpointError(f"--resume=auto: no intact checkpoint of run {self.run_id} in {self.root}: "
                                  + "; ".join(s["reason"] for s in self.skipped))
        if manifest is not None:
            self._save_seq = int(manifest.get("save_seq", 0) or 0)
        if path is not None:
            partial = frozen_any(model)
            if partial or manifest.get("base") is not None:  # trainable parameters only: the same base?
                self.check_base(path, manifest.get("base"))
            state = training_state(model, optimizer, scheduler, 0)
            self._compare_config(path, manifest, metadata, state)
            # per-rank state (an RL buffer): only at the world size that wrote it, refused before loading
            self.rank_state = read_rank_state(path, manifest, self.info.rank, self.info.world_size)
            own_names = [list(group["params"]) for group in state["optimizer"]["param_groups"]]
            try:
                dcp.load(state, storage_reader=SafeFileSystemReader(path), planner=SafeLoadPlanner())
            except CheckpointException as e:  # derives from BaseException
                raise CheckpointError(f"loading checkpoint {path} failed: {e}") from None
            # DCP keeps one copy of a value every rank saves under the same key: under pipeline parallelism
            # each stage's list of its parameters' names (``optimizer.param_groups.<i>.params``) collides
            # with the others' and one stage's list was written. The lists only tell set_state_dict which
            # loaded group holds a parameter's settings; every rank builds the same groups in the same order
            # (train/optim.py: decayed, then not), so group i takes this rank's names and the checkpoint's
            # settings (without this a stage matched no group and lost them, the fused kernel's flag included)
            for group, names in zip(state["optimizer"]["param_groups"], own_names):
                group["params"] = names
            set_state_dict(model, optimizer, model_state_dict=state["model"],
                           optim_state_dict=state["optimizer"], options=StateDictOptions(strict=not partial))
            scheduler.load_state_dict(state["lr_scheduler"])
            step = int(state["train"]["step"].item())
            self.last_load = {"step": step, "seconds": time.perf_counter() - start, "path": str(path)}
        if path is not None and self.info.is_main:
            print(f"resumed run {self.run_id} from {path} at step {step} ({self.last_load['seconds']:.2f} s)",
                  flush=True)
        elif self.resume == "auto" and self.info.is_main:  # said, so that a fresh start is not a surprise
            print(f"--resume=auto: no checkpoint found in {self.root}; training starts from step 0",
                  flush=True)
        return step

