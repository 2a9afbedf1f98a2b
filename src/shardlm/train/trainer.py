"""The training job: set-up, the training step, evaluation, logging and the final export.

One optimizer step over a global batch of G sequences reads, on each of N ranks, k = G / (N · m)
micro-batches of m sequences. Per micro-batch, FSDP all-gathers each block's shards before its
forward and frees them after; backward all-gathers again and reduce-scatters the gradients
(averaged over ranks), after every micro-batch by default (``parallel.grad_sync``). Every rank then
clips by the global norm and updates its own shard.
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from shardlm.checkpoint.dcp import Checkpointer, resume_mode
from shardlm.checkpoint.run import clear_run_dir, resume_command, write_run_config
from shardlm.config import Config, gradient_accumulation_steps
from shardlm.convert.hf_out import EXPORT_TIMEOUT, gather_full_state_dict, save_model_dir, save_sharded_model_dir
from shardlm.convert.peft_out import base_model_path, gather_full_params, save_merged_dir, save_peft_dir
from shardlm.data import GlobalBatchSampler, TokenWindows, eval_windows, load_meta
from shardlm.data.build import data_dir, prepare_data
from shardlm.data.instruct import IGNORE_INDEX, InstructionExamples, split_batch
from shardlm.data.mixture import MixtureSampler, MixtureWindows, source_names
from shardlm.data.packing import DocumentWindows, PackedExamples, batch_documents
from shardlm.data.preference import PREFERENCE, PreferencePairs
from shardlm.data.sync import check_same_data
from shardlm.errors import ConfigError, NonFiniteError
from shardlm.metrics import (
    MetricsLogger,
    device_memory,
    format_bytes,
    local_bytes,
    model_flops_per_token,
    shard_bytes,
)
from shardlm.metrics.memory import expected_shard_bytes, reset_device_peaks
from shardlm.metrics.per_rank import per_rank_summaries
from shardlm.metrics.progress import progress
from shardlm.metrics.trackers import check_packages, start_trackers
from shardlm.model.attention import resolve_backend
from shardlm.model.freeze import apply_freeze
from shardlm.model.llama import num_params
from shardlm.model.lora import LoRASpec
from shardlm.parallel import (
    DistInfo,
    all_gather_ints,
    all_reduce_sum,
    build_mesh,
    init_distributed,
    run_on_main,
    set_gradient_sync,
)
from shardlm.parallel.cp import build_context_parallel
from shardlm.parallel.dist import data_parallel_rank, set_matmul_precision, to_device
from shardlm.parallel.faults import FaultMonitor, guard_collectives
from shardlm.parallel.options import describe
from shardlm.train.build import build_model, unwrap
from shardlm.train.loss import model_loss_sum
from shardlm.train.mfu import peak_flops_per_rank
from shardlm.train.moe_loss import moe_loss_term
from shardlm.train.optim import apply_train_config, build_optimizer, build_scheduler, clip_grad_norm_
from shardlm.train.preference_step import PreferenceObjective


def run_dir(cfg: Config) -> Path:
    """The run directory: ``run.dir`` or ``runs/<run name>``."""
    return Path(cfg.run.dir or f"runs/{cfg.run.name}")


def model_special_ids_of(meta: dict[str, Any]) -> dict[str, Any] | None:
    """The bos/eos/pad ids of the model being trained, from the prepared data's ``meta.json``: the one rule for
    every exported directory (full, merged LoRA, PEFT adapter) and every checkpoint manifest (which
    ``shardlm export`` of a checkpoint writes).

    ``model_special_ids`` is read at preparation from the tokenizer's model directory
    (:func:`shardlm.data.tokenizer_files.model_special_ids`: its ``config.json`` / ``generation_config.json``, i.e.
    ``model.init_from``'s own ids when the data uses its tokenizer, the default). Data prepared before that field
    existed falls back to the data's ``special_ids`` (end of document as eos). Never the data's ids when the
    model's are known: a chat model's eos is its end-of-turn token, not the tokenizer's end of text.
    """
    return meta.get("model_special_ids") or meta.get("special_ids")


class Trainer:
    """Builds everything a run needs from a :class:`Config`, then :meth:`train` runs it.

    Attributes of interest to tests: ``history`` (the logged records: every one with ``keep_history``, else
    only the latest, so memory does not grow with the run), ``sample_ids`` ({step: the sample ids this rank
    consumed}, kept only with ``keep_history``), ``local_shard_bytes`` (this rank's parameter, gradient and
    optimizer bytes, measured at the first step), ``model``, ``optimizer``.
    """

    def __init__(self, cfg: Config, info: DistInfo | None = None, keep_history: bool = False) -> None:
        self.cfg = cfg
        check_packages(cfg)  # a tracker switched on without its package: one clear error before anything starts
        self.keep_history = keep_history
        self.info = info or init_distributed(cfg.parallel)
        set_matmul_precision(self.info.device, cfg.parallel)  # TF32 on CUDA unless parallel.tf32 = false
        #: this rank's index among the ranks that read different samples, and their number (the ranks of a
        #: tensor-parallel or context-parallel group share samples)
        self.dp_rank, self.dp_size = data_parallel_rank(self.info, cfg.parallel)
        self.accum_steps = gradient_accumulation_steps(cfg, self.dp_size)
        #: the kernel of block-causal attention (shardlm/model/attention.py), None under causal attention
        self.attention_backend = None
        if cfg.model.attention == "block_causal":
            try:
                self.attention_backend = resolve_backend(cfg.model.attention_backend, self.info.device, training=True)
            except ValueError as exc:
                raise ConfigError(str(exc)) from None
        self.run_dir = run_dir(cfg)
        self._check_run_dir()
        start = time.perf_counter()
        prepare_data(cfg, self.info)  # every rank encodes its share; waiting is on the store, not a collective
        self.prepare_s = time.perf_counter() - start  # seconds spent preparing (or finding prepared) data
        check_same_data(str(data_dir(cfg)), self.info.rank, self.info.world_size)  # shared file system?
        self.meta = load_meta(str(data_dir(cfg)))
        if self.meta["tokenizer_vocab_size"] > cfg.model.vocab_size:
            raise ConfigError(
                f"the tokenizer has {self.meta['tokenizer_vocab_size']} tokens but model.vocab_size is "
                f"{cfg.model.vocab_size}: raise model.vocab_size or use a smaller tokenizer")
        t = cfg.train
        dataset = InstructionExamples if cfg.data.format == "instruct" else TokenWindows
        if cfg.data.sources:  # a mixture: one dataset per source, drawn by weight
            names = source_names(cfg.data.sources)
            self.train_data = MixtureWindows([TokenWindows(str(data_dir(cfg) / n), "train", t.seq_len) for n in names])
            self.val_data = MixtureWindows([TokenWindows(str(data_dir(cfg) / n), "val", t.seq_len) for n in names],
                                           interleave=True)
            self.sampler = MixtureSampler([len(w) for w in self.train_data.windows],
                                          [s.weight for s in cfg.data.sources], t.global_batch_size, t.seed)
        elif cfg.data.format == PREFERENCE:  # pairs: the global batch counts pairs; validation: the chosen's NLL
            self.train_data = PreferencePairs(str(data_dir(cfg)), "train", t.seq_len)
            self.val_data = PreferencePairs(str(data_dir(cfg)), "val", t.seq_len).chosen_examples()
            self.sampler = GlobalBatchSampler(len(self.train_data), t.global_batch_size, t.seed)
        elif cfg.data.pack:  # rows of several examples (shardlm/data/packing.py); validation stays one per sample
            self.train_data = PackedExamples(InstructionExamples(str(data_dir(cfg)), "train", t.seq_len,
                                                                 skip_untrainable=True), t.seed)
            self.val_data = dataset(str(data_dir(cfg)), "val", t.seq_len)
            self.sampler = GlobalBatchSampler(len(self.train_data), t.global_batch_size, t.seed)
        else:
            self.train_data = dataset(str(data_dir(cfg)), "train", t.seq_len)
            self.val_data = dataset(str(data_dir(cfg)), "val", t.seq_len)
            self.sampler = GlobalBatchSampler(len(self.train_data), t.global_batch_size, t.seed)
        if self.attention_backend and cfg.data.format == "text":  # pre-training: document masking inside windows
            eod = (self.meta.get("special_ids") or {}).get("eod")  # when the data records no document starts
            self.train_data, self.val_data = DocumentWindows(self.train_data, eod), DocumentWindows(self.val_data, eod)
        self.mesh = build_mesh(self.info, cfg.parallel) if cfg.parallel.mode != "single" else None
        #: this rank's context-parallel group (shardlm/parallel/cp.py); one rank's, no split, at parallel.cp = 1
        self.cp = build_context_parallel(self.info, cfg.parallel.cp)
        self.cp.check_sequence(t.seq_len)
        self.model, self.pretrained_load_stats = build_model(cfg, self.info, self.mesh, self.cp)
        #: the preference objective and its reference (shardlm/train/preference_step.py), None for token losses
        self.preference = (PreferenceObjective.build(cfg, self.info, self.mesh, self.model, self.train_data,
                                                     self.run_dir) if cfg.data.format == PREFERENCE else None)
        self.optimizer = build_optimizer(self.model, t, self.info.device)
        self.scheduler = build_scheduler(self.optimizer, t)
        self.special_ids = model_special_ids_of(self.meta)  # what every export and checkpoint records
        self.checkpointer = self._build_checkpointer()
        self.step = self.checkpointer.load(self.model, self.optimizer, self.scheduler)  # 0 unless resuming
        if self.checkpointer.last_load is not None:  # the new config's schedule and AdamW settings, from here
            apply_train_config(self.optimizer, self.scheduler, t, self.step)
        #: this run's id: new on a fresh start, the checkpoint's when resuming (shardlm/checkpoint/run.py)
        self.run_id: str = self.checkpointer.run_id
        # MFU: model FLOPs per token (6N + 12·L·H·Q·T) and the peak of the precision that runs (train/mfu.py)
        self.flops_per_token = model_flops_per_token(cfg.model, t.seq_len)
        self.peak = peak_flops_per_rank(cfg, self.info)
        self.preempted = False
        self.history: list[dict[str, Any]] = []
        self.sample_ids: dict[int, list[int]] = {}
        self.local_shard_bytes: dict[str, int] | None = None
        # a non-finite step, kept on the device until the next read: (its 1-based step or 0, loss, grad norm);
        # from it on the optimizer skips every update (fused AdamW's found_inf), and the next read raises
        self._nonfinite = torch.zeros(3, dtype=torch.float64, device=self.info.device)
        self._interval = {"seconds": 0.0, "steps": 0}  # host time of the steps since the last record
        trackers = []
        if self.info.is_main:
            write_run_config(self.run_dir, self.run_id, cfg.to_dict())
            # W&B / MLflow: a resumed run continues its tracker runs (W&B opened rewound to the checkpoint's step)
            trackers = start_trackers(cfg, self.run_dir, self.step if self.checkpointer.resume else None,
                                      run_id=self.run_id)
        self.logger = MetricsLogger(self.run_dir / "metrics.jsonl" if self.info.is_main else None,
                                    trackers=trackers)
        if self.checkpointer.resume:  # resuming from step N: every sink drops what it logged after N
            self.logger.rewind(self.step)
        # rank-to-host map and heartbeats: a failed collective in train() names a lost node's ranks and host
        self.fault_monitor = FaultMonitor.start(self.info, cfg.parallel)

    # ---- set-up helpers ------------------------------------------------------------------
    def _check_run_dir(self) -> None:
        """Refuse a non-empty run directory unless resuming or ``run.overwrite``; rank 0 then creates it.

        A fresh start with ``run.overwrite`` begins a new run: rank 0 removes the previous run's files
        (checkpoints, metrics, config, final model; see :func:`shardlm.checkpoint.run.clear_run_dir`) and
        says which, so nothing of the old run can be resumed into the new one.
        """
        d = self.run_dir
        if d.exists() and not d.is_dir():
            raise ConfigError(f"run directory {d} exists and is not a directory: choose another --run.dir")
        resuming = bool(resume_mode(self.cfg))  # resuming continues this run dir: metrics are truncated, not wiped
        if d.exists() and any(d.iterdir()) and not self.cfg.run.overwrite and not resuming:
            raise ConfigError(f"run directory {d} is not empty: pass --run.overwrite=true or choose --run.dir")

        def create() -> None:
            d.mkdir(parents=True, exist_ok=True)
            if not resuming:
                removed = clear_run_dir(d)
                if removed:
                    print(f"run.overwrite: starting a new run in {d}; removed the previous run's "
                          + ", ".join(removed), flush=True)

        torch.distributed.barrier()  # every rank has looked at the directory before rank 0 changes it
        run_on_main(create, self.info)

    def _build_checkpointer(self) -> Checkpointer:
        """The run's :class:`Checkpointer`, built here only: the tokenizer and data identity of the prepared data
        (compared at resume), the model's special ids (:func:`model_special_ids_of`). Its run id is set by
        ``load``; :meth:`set_trainable` keeps it (and so the run id, save numbering and retention)."""
        return Checkpointer(self.cfg, self.info, self.run_dir, data_dir(self.cfg) / "tokenizer.json",
                            self.special_ids, self.meta)

    def summary(self) -> str:
        """A one-screen description of the job: model, parallelism, batch, memory per rank."""
        cfg, info = self.cfg, self.info
        model = unwrap(self.model)
        params = shard_bytes(self.model)["params"]
        per_rank = all_gather_ints(params, info.device)
        rows = cfg.train.global_batch_size * (2 if self.preference else 1)  # sequences per step
        samples = {"instruct": "packed rows" if cfg.data.pack else "examples", PREFERENCE: "pairs"}.get(
            cfg.data.format, "windows")
        lines = [
            f"shardlm | {cfg.run.name} -> {self.run_dir}",
            f"  model      {num_params(model):,} parameters, {cfg.model.n_layers} layers, dim {cfg.model.dim}, "
            f"heads {cfg.model.n_heads}/{cfg.model.kv_heads} (q/kv), vocab {cfg.model.vocab_size}"
            f"{', tied embeddings' if cfg.model.tie_embeddings else ''}",
            f"  parallel   {cfg.parallel.mode}, world size {info.world_size}, backend {info.backend}, device "
            f"{info.device.type}, mesh " + (" x ".join(f"{name} {size}" for name, size in zip(
                self.mesh.mesh_dim_names, self.mesh.shape)) if self.mesh is not None else "none")
            + (f"; context parallel {self.cp.size}: each sequence split over {self.cp.size} ranks "
               f"({info.world_size // self.cp.size} data-parallel)" if self.cp.size > 1 else ""),
            f"  settings   {describe(cfg.parallel, info.device.type)}",
            f"  batch      global {cfg.train.global_batch_size} "
            + (f"pairs ({2 * cfg.train.global_batch_size} seqs)" if self.preference else "seqs")
            + f" x {cfg.train.seq_len} tokens = {rows * cfg.train.seq_len:,} tokens/step; micro-batch "
            f"{cfg.train.micro_batch_size}/{'data-parallel ' if self.cp.size > 1 else ''}rank; gradient accumulation "
            f"{self.accum_steps}",
            f"  attention  {cfg.model.attention}" + (f" (backend {self.attention_backend}, per-document positions)"
                                                     if self.attention_backend else "")
            + ({"recorded": "; documents from the recorded starts", "eod": "; documents cut at each end-of-document "
                "token (the data records no starts: prepare it again for exact boundaries)"}[self.train_data.source]
               if isinstance(self.train_data, DocumentWindows) else ""),
            f"  data       {len(self.train_data):,} train {samples}, {len(self.val_data):,} val {samples}, "
            f"unigram entropy {self.meta['unigram_entropy_nats']:.3f} nats",
            *([f"  packing    {self.train_data.summary()}"] if isinstance(self.train_data, PackedExamples) else []),
            *([f"  preference {self.preference.describe()}"] if self.preference is not None else []),
            f"  MFU        {self.flops_per_token * cfg.train.seq_len:,.0f} model FLOPs per sequence (6N + 12·L·H·Q·T), "
            f"peak {self.peak.flops / 1e12:.2f} TFLOP/s per rank ({self.peak.precision}, {self.peak.source})",
        ]
        trainable = [p for p in model.parameters() if p.requires_grad]
        if len(trainable) == len(list(model.parameters())):
            lines.append("  per rank   parameter shards " + ", ".join(format_bytes(b) for b in per_rank)
                         + f" (+ grads and AdamW state: ~{format_bytes(4 * max(per_rank))} per rank)")
        else:  # frozen parameters: no gradient, no optimizer state
            n_train = sum(p.numel() for p in trainable)
            train_bytes = all_gather_ints(sum(local_bytes(p) for p in trainable), info.device)
            lines += [
                f"  trainable  {n_train:,} of {num_params(model):,} parameters ({100 * n_train / num_params(model):.2f}%)"
                + (f"; LoRA r={cfg.lora.rank} alpha={cfg.lora.alpha:g} on {cfg.lora.targets}, base "
                   f"{cfg.lora.base_dtype}" if cfg.lora.enabled else ""),
                "  per rank   parameter shards " + ", ".join(format_bytes(b) for b in per_rank) + " (frozen base "
                + ", ".join(format_bytes(a - b) for a, b in zip(per_rank, train_bytes)) + "; trainable "
                + ", ".join(format_bytes(b) for b in train_bytes) + f", + grads and AdamW state ~"
                f"{format_bytes(3 * max(train_bytes))} per rank)",
            ]
        stats = self.pretrained_load_stats
        if stats is not None:  # model.init_from: bytes each rank read from the safetensors files
            read = all_gather_ints(stats["bytes_read"], info.device)
            lines.append(f"  pretrained {cfg.model.init_from}: read " + ", ".join(format_bytes(b) for b in read)
                         + f" per rank of {format_bytes(stats['total_bytes'])}")
        return "\n".join(lines)

    # ---- the training step ----------------------------------------------------------------
    def train_step(self, log: bool = True) -> dict[str, Any] | None:
        """One optimizer step on global batch ``self.step``.

        Beyond FSDP's own collectives the step issues one all-reduce, the gradient norm's (see
        :func:`shardlm.train.optim.clip_grad_norm_`), which also carries the loss sum, the preemption flag
        and, when ``log``, each rank's memory figures in its own slots (a gather inside the sum). The target
        count of the global batch is known on the host (see :meth:`_global_targets`): no collective. Nothing
        is read to the host unless ``log``: then one transfer returns the step's record (global values and
        per-rank summaries); otherwise None. A step whose loss or gradient norm is not finite is not applied
        (nor is any after it); the next read raises :class:`NonFiniteError` naming it.
        """
        cfg, info, model = self.cfg, self.info, self.model
        start = time.perf_counter()
        micro_ids = self.sampler.micro_batches(self.step, self.dp_rank, self.dp_size, cfg.train.micro_batch_size)
        if self.keep_history:
            self.sample_ids[self.step] = [i for ids in micro_ids for i in ids]
        # The loss is the mean over every target token of the global batch, so the update equals one
        # step on the whole batch in one process. FSDP/DDP average gradients over the N ranks of their mesh (the
        # data-parallel ranks, with the CP ranks that join the shard group; not the TP peers), hence × N.
        # scale = N / n_tokens in fp32, rounded as ``N / torch.tensor([n_tokens])`` rounds (1/n, then × N)
        pref = self.preference  # its micro-batch losses are already shares of the global mean: divided by 1 here
        norm = pref.normalisers(self.sampler.step_ids(self.step)) if pref is not None else None
        n_tokens = np.float32(1 if pref is not None else self._global_targets(self.step))
        scale = float((np.float32(1.0) / n_tokens) * np.float32(info.world_size // cfg.parallel.tp))
        batches = [to_device(self.train_data.get(ids), info.device) for ids in micro_ids]  # pinned, async on CUDA
        loss_sum = torch.zeros((), dtype=torch.float64, device=info.device)
        moe_sums = torch.zeros(0, dtype=torch.float64, device=info.device)  # [aux, z, counts (layers, E)], MoE
        stats = PreferenceObjective.zero_stats(info.device) if pref is not None else None
        if cfg.lora.enabled and cfg.lora.dropout > 0:  # LoRA dropout: seeded per step and rank (resume is exact)
            torch.manual_seed((cfg.train.seed * 1_000_003 + self.step) * 4099 + info.rank)
        for i, batch in enumerate(batches):
            # parallel.grad_sync: reduce-scatter on every micro-batch or on the last only
            set_gradient_sync(model, last_micro_batch=(i == len(batches) - 1), policy=cfg.parallel.grad_sync)
            # per block: all-gather shards, compute, reshard; then the loss (chunked: never the whole logits)
            if pref is None:
                loss, _ = self._loss_sum(batch)
            else:  # chosen and rejected rows in one forward; the reference's log-probs first, without gradients
                loss, batch_stats = pref.loss(model, batch, micro_ids[i], norm)
                stats += batch_stats
            # a mixture of experts: + the load-balancing loss over all ranks' tokens of this micro-step (one
            # all-reduce), averaged over the micro-steps; its shares sum to it over ranks, hence × N as the loss
            moe = moe_loss_term(model, cfg.model.router_aux_loss_coef, cfg.model.router_z_loss_coef)
            objective = loss * scale
            if moe is not None:
                objective = objective + moe.term * (info.world_size / len(batches))
                sums = torch.cat([torch.stack([moe.aux, moe.z]), moe.counts.reshape(-1)]).double()
                moe_sums = sums if i == 0 else moe_sums + sums
            objective.backward()  # per block: all-gather, grads, reduce-scatter (per grad_sync)
            loss_sum += loss.detach()
        # summed over ranks inside the gradient norm's all-reduce: [loss sum, preemption flag, per-rank slots]
        per_rank = self._per_rank_values() if log else {}
        n_stats = 0 if stats is None else len(stats)  # the preference metrics' sums, in the last slots
        extras = torch.zeros(2 + info.world_size * len(per_rank) + n_stats, dtype=torch.float64, device=info.device)
        extras[0] = loss_sum if self._counts_loss() else 0.0  # a tensor-parallel group's loss, once
        extras[1].fill_(float(self.checkpointer.signal_received()))
        for j, value in enumerate(per_rank.values()):  # this rank's slots (fills: no host-to-device copy)
            extras[2 + info.rank * len(per_rank) + j].fill_(float(value))
        if stats is not None:
            extras[len(extras) - n_stats:] = stats
        max_norm = cfg.train.grad_clip if cfg.train.grad_clip > 0 else math.inf
        grad_norm = clip_grad_norm_(model.parameters(), max_norm, extras)  # fp64: the same at any sharding
        loss_mean = extras[0] / float(n_tokens)
        self._skip_if_nonfinite(loss_mean, grad_norm)
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
            return None
        # the one host read of the step: global values, the sticky non-finite record, the per-rank slots
        values = torch.cat([torch.stack([loss_mean, grad_norm.to(loss_mean.device), extras[1]]),
                            self._nonfinite, extras[2:], moe_sums]).tolist()
        moe_values = values[len(values) - len(moe_sums):]
        values = values[:len(values) - len(moe_sums)]
        loss_value, grad_norm_value, signals = values[:3]
        self._raise_if_nonfinite(values[3:6])
        self.preempted = self.preempted or signals > 0
        seconds, steps = self._interval["seconds"], self._interval["steps"]
        self._interval = {"seconds": 0.0, "steps": 0}
        elapsed = seconds / steps  # mean host time per step since the last record (synchronised by the read)
        tokens = cfg.train.global_batch_size * cfg.train.seq_len * (2 if pref is not None else 1)  # a pair: 2 rows
        flops = self.flops_per_token * tokens / info.world_size  # this rank's model FLOPs (host arithmetic)
        record = {
            "step": self.step, "loss": loss_value, "lr": lr, "grad_norm": grad_norm_value,
            "tokens_per_s": tokens / elapsed, "tokens_per_s_per_rank": tokens / elapsed / info.world_size,
            "step_time_s": elapsed, "flops_per_step_per_rank": flops, "peak_flops_per_rank": self.peak.flops,
            "mfu": flops / (elapsed * self.peak.flops), "world_size": info.world_size,
        }
        record.update(per_rank_summaries(list(per_rank), values[6:len(values) - n_stats], info.world_size,
                                         cfg.train.log_per_rank))
        if pref is not None:  # TRL's names: rewards/*, logps/*, logits/*
            record.update(pref.metrics(values[len(values) - n_stats:], norm[0]))
        if moe_values:  # a mixture of experts: the step's means over micro-steps; tokens per (layer, expert) pair
            counts = moe_values[2:]
            record.update({"moe_aux_loss": moe_values[0] / len(batches), "moe_z_loss": moe_values[1] / len(batches),
                           "tokens_per_expert_min": min(counts), "tokens_per_expert_max": max(counts),
                           "tokens_per_expert_mean": sum(counts) / len(counts)})
            if cfg.train.log_moe_layers:  # per MoE layer (block index), min and max over its experts
                layers = [i for i in range(cfg.model.n_layers) if cfg.model.is_moe_layer(i)]
                for j, i in enumerate(layers):
                    row = counts[j * cfg.model.n_experts:(j + 1) * cfg.model.n_experts]
                    record[f"tokens_per_expert_min/layer{i}"] = min(row)
                    record[f"tokens_per_expert_max/layer{i}"] = max(row)
        if isinstance(self.sampler, MixtureSampler):  # per source: tokens seen so far and its own epoch
            drawn = self.sampler.drawn_before(self.step * cfg.train.global_batch_size)
            for name, n, source in zip(source_names(cfg.data.sources), drawn, self.sampler.sources):
                record[f"tokens_seen/{name}"] = int(n) * cfg.train.seq_len
                record[f"epoch/{name}"] = int(n) / source.num_windows
        return record

    def _loss_sum(self, batch: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The summed token loss of this rank's share of ``batch`` (its sequence chunks under ``parallel.cp``) and
        the targets it scored: (0-dim fp32, (B, T / cp) int64, -100 where nothing is scored)."""
        inputs, targets = split_batch(batch)  # instruction data: targets are -100 off-response
        documents, extra = batch_documents(batch), {}
        if self.cp.size > 1:  # this rank's head and tail chunks, rotary positions and masks by global position
            inputs, targets, extra = self.cp.shard_batch(inputs, targets, documents)
            documents = None
        loss = model_loss_sum(self.model, inputs, targets, self.cfg.train.loss_chunk_tokens, documents, **extra)
        return loss, targets

    def _global_targets(self, step: int) -> int:
        """Target tokens of global batch ``step`` over all ranks, counted on the host (every rank knows every id
        of the batch; windows count ``seq_len`` each, instruction examples their precomputed response tokens)."""
        return self.train_data.num_targets(self.sampler.step_ids(step))

    def _per_rank_values(self) -> dict[str, int]:
        """This rank's figures for the per-rank summaries of a record: shard bytes (parameters, gradients, AdamW
        state) and memory (on CUDA the peaks since the last record, then reset)."""
        measured = self.local_shard_bytes or expected_shard_bytes(self.model)  # the same figure, before step 1
        out = {"shard_bytes": measured["total"], **device_memory(self.info.device)}
        reset_device_peaks(self.info.device)  # the next record's peaks cover its own logging interval
        return out

    def _counts_loss(self) -> bool:
        """Whether this rank's loss enters the sums over ranks: one rank per tensor-parallel group (its first), whose
        ranks all hold the same loss of the same samples."""
        return self.info.rank % self.cfg.parallel.tp == 0

    def _skip_if_nonfinite(self, loss: torch.Tensor, grad_norm: torch.Tensor) -> None:
        """On the device: remember the first step whose loss or gradient norm is not finite, and from it on make
        the optimizer skip its updates (fused AdamW's ``found_inf``; its step counts do not advance)."""
        bad = ~(torch.isfinite(loss) & torch.isfinite(grad_norm.to(loss.device)))
        first = bad & (self._nonfinite[0] == 0)
        now = torch.stack([torch.full_like(loss, self.step + 1), loss, grad_norm.to(loss.device)])
        self._nonfinite = torch.where(first, now, self._nonfinite)
        if self.optimizer.defaults.get("fused"):
            self.optimizer.found_inf = (self._nonfinite[0] > 0).float()
        # (a non-fused optimizer has no found_inf: the step is then applied and reported at the next read)

    def _raise_if_nonfinite(self, record: list[float]) -> None:
        """Raise :class:`NonFiniteError` when the device-side record says a step was not finite."""
        step, loss, grad_norm = record
        if step > 0:
            raise NonFiniteError(
                f"step {int(step)}: loss={loss} grad_norm={grad_norm} is not finite; stopping with the weights from "
                "before that step (its update and any after it were skipped; lower train.lr, check the data, or "
                "use fp32)")

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
            loss, targets = self._loss_sum(batch)
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
            self.logger.close("failed")  # the tracker runs end as failed; metrics.jsonl is complete up to here
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
        if cfg.model.init_from and t.eval_interval and self.step == 0:  # fine-tuning: the pretrained start
            start = {"step": 0, "val_loss": self.evaluate()}
            self.logger.log(start)
            self._remember(start)
            if info.is_main:
                print(f"step 0 (the pretrained model): val loss {start['val_loss']:.4f}", flush=True)
        try:  # the bar ends its line even when a step or a save fails, so an error message starts on its own
            while self.step < t.steps:
                step = self.step + 1  # the step about to run (1-based)
                last = step == t.steps
                evaluate = bool(t.eval_interval) and (step % t.eval_interval == 0 or last)
                save = self.checkpointer.should_save(step, last)
                # read to the host on logging, evaluation and save steps only (the read also checks for a
                # non-finite step and a preemption signal on any rank)
                log = step % t.log_interval == 0 or last or evaluate or save
                self.checkpointer.check_background(step)  # a failed background save stops the run here
                record = self.train_step(log=log)
                if record is None:
                    bar.update(1)
                    continue
                if evaluate:
                    record["val_loss"] = self.evaluate()
                record["elapsed_s"] = time.perf_counter() - job_start
                self.logger.log(record)
                self._remember(record)
                bar.set_postfix(loss=f"{record['loss']:.3f}", tok_s=f"{record['tokens_per_s']:.0f}",
                                mfu=f"{record['mfu']:.1%}",
                                **({"val": f"{record['val_loss']:.3f}"} if "val_loss" in record else {}))
                bar.update(1)  # after the postfix: a plain line printed now shows this step's values
                if save or self.preempted:  # preempted: SIGINT/SIGTERM/SIGUSR1 on any rank before this step's all-reduce
                    path = self.checkpointer.save(self.model, self.optimizer, self.scheduler, self.step)
                    if info.is_main:
                        bar.write(self.checkpointer.save_line(path))
                if self.preempted:
                    break
        except BaseException:
            self.logger.close("failed")  # metrics.jsonl and the event files are complete up to the last logged step
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
            print(self.written_line(self.run_dir / "final"), flush=True)
        self.logger.close("finished", self.run_dir / "final")
        return self.history

    def set_trainable(self, trainable: str, frozen: str = "") -> None:
        """Change which parameters train between steps (e.g. unfreeze blocks after a frozen start); a collective.

        Applies the patterns as ``train.trainable``/``train.frozen`` (:func:`shardlm.model.freeze.apply_freeze`)
        to the sharded parameters (FSDP2 passes ``requires_grad`` on to the unsharded ones at the next
        all-gather), then rebuilds the optimizer over the trainable parameters, keeping the AdamW state of
        those that had one, and the LR schedule at the current step. The run's checkpointer stays (its run id,
        save numbering, data identity and special ids): the next checkpoint is this run's, for retention and
        ``--resume=auto``, and records the new ``train.trainable`` / ``train.frozen``.
        """
        self.checkpointer.wait()  # a background save still in flight
        apply_freeze(unwrap(self.model), trainable, frozen)
        self.cfg.train.trainable, self.cfg.train.frozen = trainable, frozen
        old = self.optimizer
        self.optimizer = build_optimizer(self.model, self.cfg.train, self.info.device)
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                if p in old.state:
                    self.optimizer.state[p] = old.state[p]
        self.scheduler = build_scheduler(self.optimizer, self.cfg.train)
        for _ in range(self.step):
            self.scheduler.step()
        self.checkpointer.trainable_changed()  # the same run: the next save records the new trainable set
        self.local_shard_bytes = None

    def _remember(self, record: dict[str, Any]) -> None:
        """Keep ``record`` in :attr:`history`: appended with ``keep_history`` (tests), else as the only entry."""
        if not self.keep_history:
            self.history.clear()
        self.history.append(record)

    def export(self, out_dir: Path) -> None:
        """Write the trained weights as an HF model directory: one ``model.safetensors`` gathered on rank 0 for a
        model up to ``run.export_single_file_bytes``, else every rank writing its own shard file plus the index
        (:func:`shardlm.convert.hf_out.save_sharded_model_dir`). Either way the other ranks wait for the
        writers on a process group with the export's own long timeout, not the training one.

        With LoRA the directory holds the merged weights (base + scaled B·A, fp32), and ``<out_dir>-adapter``
        the adapters in PEFT's format (:mod:`shardlm.convert.peft_out`), both written by rank 0 whatever the
        size (:meth:`export_lora`).
        """
        if self.cfg.lora.enabled:
            self.export_lora(out_dir, Path(f"{out_dir}-adapter"))
            return
        info = self.info
        named = list(unwrap(self.model).named_parameters())
        total = sum(p.numel() * p.element_size() for _, p in named)
        tokenizer = data_dir(self.cfg) / "tokenizer.json"
        if total > self.cfg.run.export_single_file_bytes:
            save_sharded_model_dir(named, self.cfg.model, out_dir, info.rank, info.world_size, tokenizer,
                                   self.special_ids)
            return
        state = gather_full_state_dict(self.model)
        group = self._export_group()
        if info.is_main:
            save_model_dir(state, self.cfg.model, out_dir, tokenizer, self.special_ids)
        del state
        self._wait_for_writers(group)

    def written_line(self, out_dir: Path) -> str:
        """The end-of-run line: every directory :meth:`export` wrote to ``out_dir`` (and ``<out_dir>-adapter``)."""
        if not self.cfg.lora.enabled:
            return f"model written to {out_dir} (Hugging Face model directory)"
        return (f"model written to {out_dir} (Hugging Face model directory, LoRA merged into the "
                f"{self.cfg.lora.merge_into.replace('_', ' ')}) and {out_dir}-adapter (PEFT adapter on "
                f"{base_model_path(self.cfg.model.init_from) or 'no pretrained base'})")

    def export_lora(self, merged_dir: Path | None, adapter_dir: Path | None) -> None:
        """Write the merged model to ``merged_dir`` and the PEFT adapter to ``adapter_dir`` (either may be None).

        The full parameters are gathered to rank 0, which merges and writes both (merging needs base and
        adapters side by side, an NF4 base dequantised whole); the other ranks wait on the export's group.
        Both carry the model's special ids (:func:`model_special_ids_of`) and the tokenizer; the merge goes
        into ``lora.merge_into``'s base and is recorded in ``lora_merge.json`` and printed
        (:func:`shardlm.convert.peft_out.save_merged_dir`); the adapter names the base by its absolute path.
        """
        lora = self.cfg.lora
        spec = LoRASpec(lora.rank, lora.alpha, lora.dropout, lora.targets, lora.base_dtype)
        state = gather_full_params(unwrap(self.model), self.info.is_main)
        group = self._export_group()
        tokenizer = data_dir(self.cfg) / "tokenizer.json"
        if self.info.is_main:
            if merged_dir is not None:
                record = save_merged_dir(state, self.cfg.model, spec, lora.merge_into, self.cfg.model.init_from,
                                         merged_dir, tokenizer, self.special_ids)
                print(f"{merged_dir}: {record['description']}", flush=True)
            if adapter_dir is not None:
                save_peft_dir(state, spec, adapter_dir, base_model_path(self.cfg.model.init_from), tokenizer,
                              self.special_ids)
        del state
        self._wait_for_writers(group)

    def _export_group(self) -> torch.distributed.ProcessGroup | None:
        """A gloo group with :data:`~shardlm.convert.hf_out.EXPORT_TIMEOUT` for the ranks to wait on while rank 0
        writes (a collective; None in one process)."""
        if self.info.world_size == 1:
            return None
        return torch.distributed.new_group(backend="gloo", timeout=EXPORT_TIMEOUT)

    @staticmethod
    def _wait_for_writers(group: torch.distributed.ProcessGroup | None) -> None:
        """Wait on ``group`` until rank 0 has written (under the export's timeout), then destroy the group."""
        if group is not None:
            torch.distributed.barrier(group=group)
            torch.distributed.destroy_process_group(group)
