"""The training job: set-up, the training step, evaluation, logging, and the final export (in
``final_export.py``).

One optimizer step over a global batch of G sequences reads, on each of N ranks, k = G / (N · m)
micro-batches of m sequences. Per micro-batch, FSDP all-gathers each block's shards before its
forward and frees them after; backward all-gathers again and reduce-scatters the gradients
(averaged over ranks), after every micro-batch by default (``parallel.grad_sync``). Every rank then
clips by the global norm and updates its own shard.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from shardlm.checkpoint.dcp import Checkpointer
from shardlm.checkpoint.resume import check_resume_target
from shardlm.checkpoint.run import resume_command, write_run_config
from shardlm.config import Config, gradient_accumulation_steps
from shardlm.config.layout import check_ranks
from shardlm.data import eval_windows, load_meta
from shardlm.data.build import data_dir, prepare_data
from shardlm.data.instruct import IGNORE_INDEX
from shardlm.data.mixture import MixtureSampler
from shardlm.data.sync import check_same_data
from shardlm.errors import ConfigError
from shardlm.metrics import MetricsLogger, model_flops_per_token, shard_bytes
from shardlm.metrics.per_rank import per_rank_summaries
from shardlm.metrics.progress import progress
from shardlm.metrics.trackers import check_packages, start_trackers
from shardlm.model.freeze import apply_freeze
from shardlm.parallel import (
    DistInfo,
    all_reduce_sum,
    build_mesh,
    init_distributed,
)
from shardlm.parallel.cp import build_context_parallel
from shardlm.parallel.dist import HostScalar, data_parallel_rank, set_matmul_precision, to_device
from shardlm.parallel.faults import FaultMonitor, guard_collectives
from shardlm.train.build import build_model_parts, unwrap
from shardlm.train.datasets import build_datasets, resolve_attention, training_attention_backend
from shardlm.train.defaults import Chooser, resolve_defaults
from shardlm.train.final_export import export_model, model_special_ids_of, written_line
from shardlm.train.mfu import peak_flops_per_rank
from shardlm.train.nonfinite import NonFiniteGuard
from shardlm.train.objectives import (
    Objective,
    ObjectiveContext,
    build_auxiliary_terms,
    build_objective,
)
from shardlm.train.objectives.token import TokenObjective
from shardlm.train.optim import (
    apply_train_config,
    build_optimizer,
    build_scheduler,
    clip_grad_norm_,
    rebuild_optimizer,
)
from shardlm.train.pipeline import build_micro_batches
from shardlm.train.run_dir import check_run_dir, prepare_run_dir, run_dir
from shardlm.train.step_metrics import mixture_metrics, per_rank_values, step_model_flops, step_shapes
from shardlm.train.summary import job_summary

__all__ = ["Trainer", "model_special_ids_of", "run_dir"]  # both importable from here as before


class Trainer:
    """Builds everything a run needs from a :class:`Config`, then :meth:`train` runs it.

    Attributes of interest to tests: ``history`` (the logged records: every one with ``keep_history``, else
    only the latest, so memory does not grow with the run), ``sample_ids`` ({step: the sample ids this rank
    consumed}, kept only with ``keep_history``), ``local_shard_bytes`` (this rank's parameter, gradient and
    optimizer bytes, measured at the first step), ``model``, ``optimizer``, ``objective``.

    ``objective``: a factory of the step's :class:`~shardlm.train.objectives.Objective` from an
    :class:`~shardlm.train.objectives.ObjectiveContext`; by default the config's
    (:func:`~shardlm.train.objectives.build_objective`).

    ``defaults``: chooses the settings left ``"auto"`` for a new run (:mod:`shardlm.train.defaults`;
    ``shardlm train`` passes the planner's :func:`shardlm.plan.defaults.choose_defaults`); without it they
    take their fixed defaults. A resumed run keeps its checkpoint's values.
    """

    def __init__(self, cfg: Config, info: DistInfo | None = None, keep_history: bool = False,
                 objective: Callable[[ObjectiveContext], Objective] | None = None,
                 defaults: Chooser | None = None) -> None:
        self.cfg = cfg
        # a tracker switched on without its package: one clear error before anything starts
        check_packages(cfg)
        self.keep_history = keep_history
        self.info = info or init_distributed(cfg.parallel)
        set_matmul_precision(self.info.device, cfg.parallel)  # TF32 on CUDA unless parallel.tf32 = false
        #: this rank's index among the ranks that read different samples, and their number (the ranks of a
        #: tensor-parallel or context-parallel group share samples)
        self.dp_rank, self.dp_size = data_parallel_rank(self.info, cfg.parallel)
        self.accum_steps = gradient_accumulation_steps(cfg, self.dp_size)
        check_ranks(cfg, self.info.world_size)  # the layout against the ranks, before any data is prepared
        #: the kernel of block-causal attention (shardlm/model/attention.py), None under causal attention
        self.attention_backend = training_attention_backend(cfg, self.info.device)
        self.run_dir = run_dir(cfg)
        check_run_dir(cfg, self.run_dir)  # refused unless empty, resuming or run.overwrite; cleared below
        check_resume_target(cfg)  # --resume=PATH not a checkpoint, or a refused change: before any data work
        start = time.perf_counter()
        # every rank encodes its share; waiting is on the store, not a collective
        prepare_data(cfg, self.info)
        self.prepare_s = time.perf_counter() - start  # seconds spent preparing (or finding prepared) data
        check_same_data(str(data_dir(cfg)), self.info.rank, self.info.world_size)  # shared file system?
        self.meta = load_meta(str(data_dir(cfg)))
        if self.meta["tokenizer_vocab_size"] > cfg.model.vocab_size:
            raise ConfigError(
                f"the tokenizer has {self.meta['tokenizer_vocab_size']} tokens but model.vocab_size is "
                f"{cfg.model.vocab_size}: raise model.vocab_size or use a smaller tokenizer")
        t = cfg.train
        self.special_ids = model_special_ids_of(self.meta)  # what every export and checkpoint records
        self.checkpointer = self._build_checkpointer()
        #: model.attention as this run trains (``auto`` resolved in cfg: the checkpoint's, or the data's), why
        self.attention = resolve_attention(cfg, self.checkpointer.resumed_config())
        if self.attention.warning and self.info.is_main:
            print(self.attention.warning, file=sys.stderr, flush=True)
        self.attention_backend = self.attention_backend if cfg.model.attention == "block_causal" else None
        #: the "auto" settings as this run resolved them, in place in cfg (train/defaults.py): the resumed
        #: checkpoint's, the chooser's (shardlm train: the planner's), else the fixed defaults
        self.default_choices = resolve_defaults(cfg, self.checkpointer.resumed_config(), defaults, self.info)
        # train/val samples and the sampler, per data format (train/datasets.py)
        self.train_data, self.val_data, self.sampler = build_datasets(cfg, self.meta,
                                                                      self.attention_backend is not None)
        self.mesh = build_mesh(self.info, cfg.parallel) if cfg.parallel.mode != "single" else None
        #: this rank's context-parallel group (shardlm/parallel/cp.py); one rank's, no split, at parallel.cp=1
        self.cp = build_context_parallel(self.info, cfg.parallel.cp, cfg.parallel.tp)
        self.cp.check_sequence(t.seq_len)
        #: under pipeline parallelism this rank's stages; ``parts`` the schedule's modules of each stage
        self.model, self.parts, self.pretrained_load_stats = build_model_parts(cfg, self.info, self.mesh,
                                                                               self.cp)
        #: how the step runs its micro-batches: one after the other, or through the pipeline's schedule
        self.micro_batches = build_micro_batches(cfg, self.info, self.mesh, self.model, self.parts,
                                                 self.accum_steps)
        # the data and the model are checked: only now may run.overwrite remove the previous run's files
        prepare_run_dir(cfg, self.info, self.run_dir)
        context = ObjectiveContext(cfg, self.info, self.mesh, self.model, self.train_data, self.cp,
                                   self.run_dir, sampler=self.sampler)
        #: what the step optimises (train/objectives/): the token loss, preference tuning (with its reference)
        self.objective = (objective or build_objective)(context)
        #: terms added to any objective's loss: a mixture of experts' router losses
        self.terms = build_auxiliary_terms(context)
        #: the token loss on the validation samples (evaluation, whatever the objective)
        self.tokens = TokenObjective(cfg, self.val_data, self.cp, self.info.device)
        self.optimizer = build_optimizer(self.model, t, self.info.device)
        self.scheduler = build_scheduler(self.optimizer, t)
        self.step = self.checkpointer.load(self.model, self.optimizer, self.scheduler)  # 0 unless resuming
        self.objective.load_rank_state(self.step, self.checkpointer.rank_state)  # an RL cycle's buffer
        if self.checkpointer.last_load is not None:  # the new config's schedule and AdamW settings, from here
            apply_train_config(self.optimizer, self.scheduler, t, self.step)
        #: this run's id: new on a fresh start, the checkpoint's when resuming (shardlm/checkpoint/run.py)
        self.run_id: str = self.checkpointer.run_id
        # MFU: model FLOPs per token (6N + 12·L·H·Q·T; per step: step_metrics.py), the peak that runs (mfu.py)
        self.flops_per_token = model_flops_per_token(cfg.model, t.seq_len)
        self.peak = peak_flops_per_rank(cfg, self.info)
        self.preempted = False
        self.history: list[dict[str, Any]] = []
        self.sample_ids: dict[int, list[int]] = {}
        self.local_shard_bytes: dict[str, int] | None = None
        # the first non-finite step, on the device: later updates skipped, the next read raises (nonfinite.py)
        self.nonfinite = NonFiniteGuard(self.info.device)
        self._interval = {"seconds": 0.0, "steps": 0}  # host time of the steps since the last record
        trackers = []
        if self.info.is_main:
            write_run_config(self.run_dir, self.run_id, cfg.to_dict())
            # W&B / MLflow: a resumed run continues its tracker runs (W&B opened rewound to the
            # checkpoint's step)
            trackers = start_trackers(cfg, self.run_dir, self.step if self.checkpointer.resume else None,
                                      run_id=self.run_id)
        self.logger = MetricsLogger(self.run_dir / "metrics.jsonl" if self.info.is_main else None,
                                    trackers=trackers)
        if self.checkpointer.resume:  # resuming from step N: every sink drops what it logged after N
            self.logger.rewind(self.step)
        # rank-to-host map and heartbeats: a failed collective in train() names a lost node's ranks and host
        self.fault_monitor = FaultMonitor.start(self.info, cfg.parallel)

    # ---- set-up helpers ------------------------------------------------------------------
    def _build_checkpointer(self) -> Checkpointer:
        """The run's :class:`Checkpointer`, built here only: the tokenizer and data identity of the prepared
        data (compared at resume), the model's special ids (:func:`model_special_ids_of`). Its run id is set
        by ``load``; :meth:`set_trainable` keeps it (and so the run id, save numbering and retention)."""
        return Checkpointer(self.cfg, self.info, self.run_dir, data_dir(self.cfg) / "tokenizer.json",
                            self.special_ids, self.meta)

    def summary(self) -> str:
        """A one-screen description of the job: model, parallelism, batch, memory per rank (a collective;
        :func:`shardlm.train.summary.job_summary`)."""
        return job_summary(self)

    # ---- the training step ----------------------------------------------------------------
    def train_step(self, log: bool = True) -> dict[str, Any] | None:
        """One optimizer step on global batch ``self.step``, whatever the objective
        (:mod:`shardlm.train.objectives.objective` gives the order of the calls).

        Beyond FSDP's own collectives the step issues one all-reduce, the gradient norm's (see
        :func:`shardlm.train.optim.clip_grad_norm_`), which also carries the loss sum, the preemption flag,
        the objective's statistic sums and, when ``log``, each rank's memory figures in its own slots (a
        gather inside the sum). The objective's denominator is known on the host: no collective. When
        ``log``, one transfer returns the step's record (global values and per-rank summaries); otherwise
        None, and with checkpointing on the one read is the preemption flag (a scalar, :class:`HostScalar`):
        a signal on any rank stops every rank after this step (:attr:`preempted`). A step whose loss or
        gradient norm is not finite is not applied (nor is any after it); the next read of the record raises
        :class:`NonFiniteError` naming it.
        """
        cfg, info, model, objective = self.cfg, self.info, self.model, self.objective
        start = time.perf_counter()
        micro_ids = self.sampler.micro_batches(self.step, self.dp_rank, self.dp_size,
                                               cfg.train.micro_batch_size)
        if self.keep_history:
            self.sample_ids[self.step] = [i for ids in micro_ids for i in ids]
        inputs = objective.prepare_step(self.step, micro_ids, self.sampler.step_ids(self.step))
        # The loss is the global batch's numerators over its denominator, so the update equals one step on the
        # whole batch in one process. FSDP/DDP average gradients over the N ranks of their mesh (the
        # data-parallel ranks, with the CP ranks that join the shard group; not the TP peers), hence × N.
        # scale = N / denominator in fp32, rounded as ``N / torch.tensor([d])`` rounds (1/d, then × N)
        denominator = np.float32(inputs.denominator)
        scale = float((np.float32(1.0) / denominator) * np.float32(self.grad_average_ranks))
        # the step's random stream (LoRA dropout), keyed by seed, step and rank: resume is exact
        torch.manual_seed((cfg.train.seed * 1_000_003 + self.step) * 4099 + info.rank)
        # forward and backward of every micro-batch: one after the other, or by the pipeline's schedule
        loss_sum, stats, term_sums = self.micro_batches.run(objective, self.terms, inputs, micro_ids, scale)
        # summed over ranks inside the gradient norm's all-reduce: [loss sum, preemption flag, per-rank slots,
        # the objective's statistic sums]
        per_rank = per_rank_values(self.model, self.local_shard_bytes, self.info.device) if log else {}
        n_stats = len(stats)
        extras = torch.zeros(2 + info.world_size * len(per_rank) + n_stats, dtype=torch.float64,
                             device=info.device)
        extras[0] = loss_sum if self._counts_loss() else 0.0  # a tensor-parallel group's loss, once
        extras[1].fill_(float(self.checkpointer.signal_received()))
        for j, value in enumerate(per_rank.values()):  # this rank's slots (fills: no host-to-device copy)
            extras[2 + info.rank * len(per_rank) + j].fill_(float(value))
        if n_stats:
            extras[len(extras) - n_stats:] = stats
        max_norm = cfg.train.grad_clip if cfg.train.grad_clip > 0 else math.inf
        # fp64: the same at any sharding; summed over the pipeline's stages too
        grad_norm = clip_grad_norm_(model.parameters(), max_norm, extras,
                                    across=self.mesh["pp"].get_group() if cfg.parallel.pp > 1 else None)
        # the stop flag (a signal on any rank, summed above): read every step, every rank stops after this one
        stop_flag = HostScalar(extras[1]) if cfg.checkpoint.enabled and not log else None
        loss_mean = extras[0] / float(denominator)
        self.nonfinite.check(self.step + 1, loss_mean, grad_norm, self.optimizer)
        lr = self.scheduler.get_last_lr()[0]
        self.optimizer.step()  # each rank updates only its own shard (none after a non-finite step)
        if self.local_shard_bytes is None:  # measured once, while gradients and AdamW state both exist
            self.local_shard_bytes = shard_bytes(self.model, self.optimizer)
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        self.step += 1
        self._interval["seconds"] += time.perf_counter() - start
        self._interval["steps"] += 1
        if not log:
            self.preempted = self.preempted or (stop_flag is not None and stop_flag.item() > 0)
            return None
        # the one host read of the step: global values, the sticky non-finite record, the per-rank slots and
        # statistic sums, the auxiliary terms' sums
        term_values = [s for s in term_sums if s is not None]
        values = torch.cat([torch.stack([loss_mean, grad_norm.to(loss_mean.device), extras[1]]),
                            self.nonfinite.record, extras[2:], *term_values]).tolist()
        n_terms = sum(len(s) for s in term_values)
        term_flat = values[len(values) - n_terms:]
        values = values[:len(values) - n_terms]
        loss_value, grad_norm_value, signals = values[:3]
        self.nonfinite.raise_if_recorded(values[3:6])
        self.preempted = self.preempted or signals > 0
        seconds, steps = self._interval["seconds"], self._interval["steps"]
        self._interval = {"seconds": 0.0, "steps": 0}
        elapsed = seconds / steps  # mean host time per step since the last record (synchronised by the read)
        rows = cfg.train.global_batch_size * objective.rows_per_sample
        # the positions the model computed (micro-batches padded to their longest compute fewer than seq_len)
        shapes = step_shapes(self.sampler, self.train_data, self.step - 1, self.dp_size,
                             cfg.train.micro_batch_size, objective.rows_per_sample, cfg.train.seq_len)
        tokens = sum(r * w for r, w in shapes)
        # this rank's share of the step's model FLOPs: 6N per token + attention per document (step_metrics.py)
        flops = step_model_flops(cfg, self.train_data, self.sampler.step_ids(self.step - 1), rows,
                                 shapes) / info.world_size
        record = {
            "step": self.step, "loss": loss_value, "lr": lr, "grad_norm": grad_norm_value,
            "tokens_per_s": tokens / elapsed, "tokens_per_s_per_rank": tokens / elapsed / info.world_size,
            "step_time_s": elapsed, "flops_per_step_per_rank": flops, "peak_flops_per_rank": self.peak.flops,
            "mfu": flops / (elapsed * self.peak.flops), "world_size": info.world_size,
        }
        record.update(per_rank_summaries(list(per_rank), values[6:len(values) - n_stats], info.world_size,
                                         cfg.train.log_per_rank))
        record.update(objective.metrics(values[len(values) - n_stats:], inputs))  # e.g. TRL's rewards/*
        for term, sums in zip(self.terms, term_sums):
            n = len(sums)
            record.update(term.metrics(term_flat[:n], len(inputs.batches)))
            term_flat = term_flat[n:]
        if isinstance(self.sampler, MixtureSampler):  # per source: tokens seen so far and its own epoch
            record.update(mixture_metrics(self.sampler, self.step, cfg))
        return record

    def _counts_loss(self) -> bool:
        """Whether this rank's loss enters the sums over ranks: one rank per tensor-parallel group (its
        first), whose ranks all hold the same loss of the same samples; under pipeline parallelism a rank of
        the last stage."""
        return self.info.rank % self.cfg.parallel.tp == 0 and self.micro_batches.holds_loss

    @property
    def grad_average_ranks(self) -> int:
        """The ranks FSDP/DDP average gradients over: the data-parallel ranks with the CP ranks that join the
        shard group, not the TP peers nor the other pipeline stages."""
        return self.info.world_size // (self.cfg.parallel.tp * self.cfg.parallel.pp)

    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean loss (nats/token) over the fixed validation set, split over ranks; same at any world size."""
        cfg, info = self.cfg, self.info
        batches = eval_windows(len(self.val_data), cfg.train.eval_tokens, cfg.train.seq_len,
                               self.dp_rank, self.dp_size, cfg.train.micro_batch_size)
        totals = torch.zeros(2, dtype=torch.float64, device=info.device)
        for ids in batches:
            # every rank runs the same number of forwards (FSDP all-gathers); padding batches count zero
            batch = to_device(self.val_data.get(ids or [0]), info.device)
            loss, targets = self.micro_batches.eval_loss_sum(self.tokens, batch)
            if ids and self._counts_loss():
                totals += torch.stack([loss.double(), targets.ne(IGNORE_INDEX).sum().double()])
        all_reduce_sum(totals)
        return (totals[0] / totals[1]).item()

    # ---- the loop ---------------------------------------------------------------------------
    @guard_collectives  # a lost node -> NodeLost naming its ranks and host (parallel/faults.py)
    def train(self) -> list[dict[str, Any]]:
        """Run ``train.steps`` optimizer steps, evaluating and logging as configured; export ``final/``."""
        try:
            return self._train()
        except BaseException:
            # the tracker runs end as failed; metrics.jsonl is complete up to here
            self.logger.close("failed")
            raise

    def _train(self) -> list[dict[str, Any]]:
        cfg, info = self.cfg, self.info
        t = cfg.train
        if info.is_main:
            print(self.summary(), flush=True)
        else:
            self.summary()  # the summary gathers per-rank bytes: a collective
        # a bar on a terminal; plain lines every 30 s in a log file (CI, Slurm, nohup)
        bar = progress(t.steps, "train", "step", initial=self.step, disable=not info.is_main)
        job_start = time.perf_counter()
        self.checkpointer.install_signal_handlers()
        evaluates = bool(t.eval_interval) and self.objective.val_loss  # RL: no validation loss
        if cfg.model.init_from and evaluates and self.step == 0:  # fine-tuning: the pretrained start
            start = {"step": 0, "val_loss": self.evaluate()}
            self.logger.log(start)
            self._remember(start)
            if info.is_main:
                print(f"step 0 (the pretrained model): val loss {start['val_loss']:.4f}", flush=True)
        try:  # the bar ends its line even when a step or a save fails, so an error message starts on its own
            while self.step < t.steps:
                step = self.step + 1  # the step about to run (1-based)
                last = step == t.steps
                evaluate = evaluates and (step % t.eval_interval == 0 or last)
                save = self.checkpointer.should_save(step, last)
                # the record is read on logging, evaluation and save steps only (with the non-finite check)
                log = step % t.log_interval == 0 or last or evaluate or save
                self.checkpointer.check_background(step)  # a failed background save stops the run here
                record = self.train_step(log=log)
                if record is not None:
                    if evaluate:
                        record["val_loss"] = self.evaluate()
                    record["elapsed_s"] = time.perf_counter() - job_start
                    self.logger.log(record)
                    self._remember(record)
                    bar.set_postfix(loss=f"{record['loss']:.3f}", tok_s=f"{record['tokens_per_s']:.0f}",
                                    mfu=f"{record['mfu']:.1%}",
                                    **{k.split("/")[-1]: f"{record[k]:.3f}"
                                       for k in self.objective.progress_keys},  # RL: reward
                                    **({"val": f"{record['val_loss']:.3f}"} if "val_loss" in record else {}))
                bar.update(1)  # after the postfix: a plain line printed now shows this step's values
                if save or self.preempted:
                    # preempted: SIGINT/SIGTERM/SIGUSR1 on any rank before this step's all-reduce
                    if record is None:  # a step not logged: its non-finite check before the save
                        self.nonfinite.raise_if_recorded(self.nonfinite.record.tolist())
                    path = self.checkpointer.save(self.model, self.optimizer, self.scheduler, self.step,
                                                  rank_state=self.objective.rank_state(self.step))
                    if info.is_main:
                        bar.write(self.checkpointer.save_line(path))
                if self.preempted:
                    break
        except BaseException:
            # metrics.jsonl and the event files are complete up to the last logged step
            self.logger.close("failed")
            raise
        finally:
            bar.close()
        self.checkpointer.close()  # waits for a background save still in flight
        if self.preempted:
            self.logger.close("preempted")
            if info.is_main:  # last, after the trackers' own words: the command to copy
                print(f"stopped after step {self.step} on a signal; checkpoint "
                      f"{self.checkpointer.last_save['path'] if self.checkpointer.last_save else 'written'}. "
                      f"Resume with:\n  {resume_command(self.run_dir)}", flush=True)
            # no rank exits before rank 0 has said so: torchrun stops the others when the first one exits, and
            # after a Ctrl-C their SIGTERM takes its default action
            torch.distributed.barrier()
            return self.history
        self.export(self.run_dir / "final")
        if info.is_main:
            print(written_line(cfg, self.run_dir / "final"), flush=True)
        self.logger.close("finished", self.run_dir / "final")
        return self.history

    def set_trainable(self, trainable: str, frozen: str = "") -> None:
        """Change which parameters train between steps (e.g. unfreeze blocks after a frozen start);
        a collective.

        Applies the patterns as ``train.trainable``/``train.frozen``
        (:func:`shardlm.model.freeze.apply_freeze`) to the sharded parameters (FSDP2 passes ``requires_grad``
        on to the unsharded ones at the next all-gather), then rebuilds the optimizer over the trainable
        parameters, keeping the AdamW state of those that had one, and the LR schedule at the current step.
        The run's checkpointer stays (its run id, save numbering, data identity and special ids): the next
        checkpoint is this run's, for retention and ``--resume=auto``, and records the new ``train.trainable``
        / ``train.frozen``.
        """
        self.checkpointer.wait()  # a background save still in flight
        apply_freeze(unwrap(self.model), trainable, frozen)
        self.cfg.train.trainable, self.cfg.train.frozen = trainable, frozen
        self.optimizer, self.scheduler = rebuild_optimizer(self.model, self.optimizer, self.cfg.train,
                                                           self.info.device, self.step)
        self.checkpointer.trainable_changed()  # the same run: the next save records the new trainable set
        self.local_shard_bytes = None

    def _remember(self, record: dict[str, Any]) -> None:
        """Keep ``record`` in :attr:`history`: appended with ``keep_history`` (tests), else as the
        only entry."""
        if not self.keep_history:
            self.history.clear()
        self.history.append(record)

    def export(self, out_dir: Path) -> None:
        """Write the trained weights as an HF model directory (with LoRA: merged, and the PEFT adapter in
        ``<out_dir>-adapter``); a collective (:func:`shardlm.train.final_export.export_model`)."""
        export_model(self.model, self.cfg, self.info, out_dir, self.special_ids)
