"""The start-up summary of a training job: one screen on the model, the parallelism, the batch, the data and
the memory per rank, printed by rank 0 before step 1."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from shardlm.config import Config
from shardlm.data.attention_choice import AttentionChoice
from shardlm.data.packing import DocumentWindows, PackedExamples
from shardlm.data.preference import PREFERENCE
from shardlm.data.prompts import PROMPTS
from shardlm.metrics import format_bytes, local_bytes, shard_bytes
from shardlm.model.decoder import num_params
from shardlm.model.moe import inactive_expert_params
from shardlm.model.qat import qat_filter
from shardlm.parallel import DistInfo, all_gather_ints
from shardlm.parallel.cp import ContextParallel
from shardlm.parallel.float8 import float8_emulated, float8_layers
from shardlm.parallel.host_memory import freed_memory_kept
from shardlm.parallel.options import describe
from shardlm.parallel.shared_memory import shared_memory_chosen
from shardlm.train.build import unwrap
from shardlm.train.defaults import DefaultChoice, describe_defaults
from shardlm.train.mfu import PeakFlops
from shardlm.train.objectives import Objective


class SummarySource(Protocol):
    """What the summary reads of a run: the attributes of :class:`shardlm.train.trainer.Trainer` it names
    (declared here so that this module, which the trainer imports, does not import it back)."""

    cfg: Config
    info: DistInfo
    mesh: DeviceMesh | None
    model: nn.Module
    objective: Objective
    cp: ContextParallel
    run_dir: Path
    accum_steps: int
    dp_size: int
    attention: AttentionChoice
    attention_backend: str | None
    default_choices: list[DefaultChoice]
    train_data: Any
    val_data: Any
    meta: dict[str, Any]
    flops_per_token: float
    peak: PeakFlops
    pretrained_load_stats: dict[str, int] | None


def job_summary(trainer: SummarySource) -> str:
    """A one-screen description of ``trainer``'s job: model, parallelism, batch, data, MFU's peak, memory
    per rank.

    A collective: every rank must call it (it all-gathers each rank's shard bytes, and with
    ``model.init_from`` the bytes each rank read); every rank gets the same text.
    """
    cfg, info = trainer.cfg, trainer.info
    model = unwrap(trainer.model)
    # as build_model resolved the collectives
    shm = info.device.type == "cpu" and shared_memory_chosen()
    params = shard_bytes(trainer.model)["params"]
    per_rank = all_gather_ints(params, info.device)
    rows = cfg.train.global_batch_size * trainer.objective.rows_per_sample  # sequences per step
    samples = {"instruct": "packed rows" if cfg.data.pack else "examples", PREFERENCE: "pairs",
               PROMPTS: "prompts"}.get(cfg.data.format, "windows")
    lines = [
        f"shardlm | {cfg.run.name} -> {trainer.run_dir}",
        f"  model      {num_params(model):,} parameters, {cfg.model.n_layers} layers, dim {cfg.model.dim}, "
        f"heads {cfg.model.n_heads}/{cfg.model.kv_heads} (q/kv), vocab {cfg.model.vocab_size}"
        f"{', tied embeddings' if cfg.model.tie_embeddings else ''}" + model_experts(cfg, model),
        f"  parallel   {cfg.parallel.mode}, world size {info.world_size}, backend {info.backend}, device "
        f"{info.device.type}, mesh "
        + (
            " x ".join(
                f"{name} {size}" for name, size in zip(trainer.mesh.mesh_dim_names, trainer.mesh.shape)
            )
            if trainer.mesh is not None
            else "none"
        )
        + (
            f"; context parallel {trainer.cp.size}: each sequence split over {trainer.cp.size} ranks "
            f"({trainer.dp_size} data-parallel), {trainer.cp.attention_path}"
            if trainer.cp.size > 1
            else ""
        )
        + (
            f"; expert parallel {cfg.parallel.ep} (experts' mesh efsdp {info.world_size // cfg.parallel.ep} "
            f"x ep {cfg.parallel.ep}): {cfg.model.n_experts // cfg.parallel.ep} of {cfg.model.n_experts} "
            "experts per rank"
            if cfg.parallel.ep > 1
            else ""
        ),
        f"  settings   {describe(cfg.parallel, info.device.type, shm)}"
        + (", freed host memory kept for reuse" if freed_memory_kept() else ""),
        *[f"  auto       {line}" for line in describe_defaults(trainer.default_choices)],
        f"  batch      global {cfg.train.global_batch_size} "
        + (f"{samples} ({rows} seqs)" if rows != cfg.train.global_batch_size else "seqs")
        + f" x {cfg.train.seq_len} tokens = {rows * cfg.train.seq_len:,} tokens/step"
        + (" at most (each micro-batch padded to its longest, a multiple of "
           f"{trainer.train_data.pad_multiple})" if getattr(trainer.train_data, "pad_multiple", 0) else "")
        + (f", grouped by length {cfg.data.group_by_length_steps} steps at a time"
           if cfg.data.group_by_length_steps else "")
        + "; micro-batch "
        f"{cfg.train.micro_batch_size}/{'data-parallel ' if trainer.cp.size > 1 else ''}rank; gradient "
        f"accumulation {trainer.accum_steps}",
        f"  attention  {cfg.model.attention}"
        + (
            f" (backend {trainer.attention_backend}, per-document positions)"
            if trainer.attention_backend
            else ""
        )
        + "; "
        f"{trainer.attention.why}"
        + (
            {
                "recorded": "; documents from the recorded starts",
                "eod": "; documents cut at each end-of-document "
                "token (the data records no starts: prepare it again for exact boundaries)",
            }[trainer.train_data.source]
            if isinstance(trainer.train_data, DocumentWindows)
            else ""
        ),
        f"  data       {len(trainer.train_data):,} train {samples}, {len(trainer.val_data):,} val {samples}, "
        + (f"unigram entropy {trainer.meta['unigram_entropy_nats']:.3f} nats"
           if trainer.objective.val_loss else "no validation loss (the objective does not evaluate one)"),
        *(
            [f"  packing    {trainer.train_data.summary()}"]
            if isinstance(trainer.train_data, PackedExamples)
            else []
        ),
        *([f"  {trainer.objective.name:<10} {line}"] if (line := trainer.objective.describe()) else []),
        *low_precision_lines(cfg, model, info.device),
        f"  MFU        {trainer.flops_per_token * cfg.train.seq_len:,.0f} model FLOPs per sequence (6N + "
        "12·L·H·Q·T"
        + (
            " per token at most: block-causal counts 12·L·H·Q·Σ n² over each sequence's documents, per step"
            if cfg.model.attention == "block_causal"
            else ""
        )
        + "), "
        f"peak {trainer.peak.flops / 1e12:.2f} TFLOP/s per rank ({trainer.peak.precision}, "
        f"{trainer.peak.source})",
    ]
    trainable = [p for p in model.parameters() if p.requires_grad]
    if len(trainable) == len(list(model.parameters())):
        lines.append("  per rank   parameter shards " + ", ".join(format_bytes(b) for b in per_rank)
                     + f" (+ grads and AdamW state: ~{format_bytes(4 * max(per_rank))} per rank)")
    else:  # frozen parameters: no gradient, no optimizer state
        n_train = sum(p.numel() for p in trainable)
        train_bytes = all_gather_ints(sum(local_bytes(p) for p in trainable), info.device)
        lines += [
            f"  trainable  {n_train:,} of {num_params(model):,} parameters "
            f"({100 * n_train / num_params(model):.2f}%)"
            + (
                f"; LoRA r={cfg.lora.rank} alpha={cfg.lora.alpha:g} on {cfg.lora.targets}, base "
                f"{cfg.lora.base_dtype}"
                if cfg.lora.enabled
                else ""
            ),
            "  per rank   parameter shards "
            + ", ".join(format_bytes(b) for b in per_rank)
            + " (frozen base "
            + ", ".join(format_bytes(a - b) for a, b in zip(per_rank, train_bytes))
            + "; trainable "
            + ", ".join(format_bytes(b) for b in train_bytes)
            + f", + grads and AdamW state ~"
            f"{format_bytes(3 * max(train_bytes))} per rank)",
        ]
    stats = trainer.pretrained_load_stats
    if stats is not None:  # model.init_from: bytes each rank read from the safetensors files
        read = all_gather_ints(stats["bytes_read"], info.device)
        lines.append(f"  pretrained {cfg.model.init_from}: read " + ", ".join(format_bytes(b) for b in read)
                     + f" per rank of {format_bytes(stats['total_bytes'])}")
    return "\n".join(lines)


def model_experts(cfg: Config, model: nn.Module) -> str:
    """The model line's mixture-of-experts part: experts, top-k, MoE layers and the parameters a
    token uses."""
    m = cfg.model
    if not m.n_experts:
        return ""
    moe_layers = sum(m.is_moe_layer(i) for i in range(m.n_layers))
    return (
        f"; mixture of experts: {m.n_experts} experts, top-{m.n_experts_per_token}, in {moe_layers} of "
        f"{m.n_layers} layers, {num_params(model) - inactive_expert_params(model):,} parameters active per "
        "token"
    )


def low_precision_lines(cfg: Config, model: nn.Module, device: torch.device) -> list[str]:
    """The ``train.float8`` / ``train.qat`` line of the summary: the recipe or scheme, how many linear layers
    it covers, and on a CPU that float8 runs emulated (numerics, not speed); none when both are off."""
    t = cfg.train
    if t.float8 != "none":
        n = len(float8_layers(model, t.float8))  # the converted layers still pass the rule that chose them
        fsdp8 = t.float8 == "tensorwise" and cfg.parallel.mode == "fsdp"
        gather = ", weights all-gathered in float8" if fsdp8 else ""
        where = (" (emulated on the CPU: float8 numerics, not float8 speed)" if float8_emulated(device)
                 else "; MFU against the bf16 peak, as torchtitan states it")
        return [f"  float8     {t.float8} on {n} linear layers{gather}{where}"]
    if t.qat != "none":
        targeted = qat_filter(model, t.qat, t.qat_group_size)
        n = sum(targeted(m, name) for name, m in model.named_modules())
        return [f"  qat        {t.qat}: {n} linear layers fake-quantised; "
                "the quantised model is written to final-quantized"]
    return []

