"""The run's final export: the trained model as a Hugging Face model directory (``<run dir>/final``), with
LoRA the merged model and a PEFT adapter beside it, and the special ids every export and
checkpoint records."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from shardlm.config import Config
from shardlm.convert.hf_out import (
    EXPORT_TIMEOUT,
    gather_full_state_dict,
    save_model_dir,
    save_sharded_model_dir,
)
from shardlm.convert.peft_out import base_model_path, gather_full_params, save_merged_dir, save_peft_dir
from shardlm.convert.quantized_out import save_quantized_dir
from shardlm.data.build import data_dir
from shardlm.model.lora import LoRASpec
from shardlm.model.qat import qat_excluded
from shardlm.parallel import DistInfo
from shardlm.parallel.dist import data_parallel_rank
from shardlm.train.build import unwrap


def model_special_ids_of(meta: dict[str, Any]) -> dict[str, Any] | None:
    """The bos/eos/pad ids of the model being trained, from the prepared data's ``meta.json``: the one rule
    for every exported directory (full, merged LoRA, PEFT adapter) and every checkpoint manifest (which
    ``shardlm export`` of a checkpoint writes).

    ``model_special_ids`` is read at preparation from the tokenizer's model directory
    (:func:`shardlm.data.tokenizer_files.model_special_ids`: its ``config.json`` / ``generation_config.json``,
    i.e. ``model.init_from``'s own ids when the data uses its tokenizer, the default). Data prepared before
    that field existed falls back to the data's ``special_ids`` (end of document as eos). Never the data's ids
    when the model's are known: a chat model's eos is its end-of-turn token, not the tokenizer's end of text.
    """
    return meta.get("model_special_ids") or meta.get("special_ids")


def export_model(model: torch.nn.Module, cfg: Config, info: DistInfo, out_dir: Path,
                 special_ids: dict[str, Any] | None) -> None:
    """Write the trained weights of ``model`` (sharded or not) as an HF model directory: one
    ``model.safetensors`` gathered on rank 0 for a model up to ``run.export_single_file_bytes``, else every
    rank writing its own shard file plus the index (:func:`shardlm.convert.hf_out.save_sharded_model_dir`).
    Either way the other ranks wait for the writers on a process group with the export's own long timeout, not
    the training one. A collective.

    With LoRA the directory holds the merged weights (base + scaled B·A, fp32), and ``<out_dir>-adapter``
    the adapters in PEFT's format (:mod:`shardlm.convert.peft_out`), both written by rank 0 whatever the
    size (:func:`export_lora`). With ``train.qat`` rank 0 then writes :func:`quantized_dir` from ``out_dir``
    (:func:`shardlm.convert.quantized_out.save_quantized_dir`). ``special_ids``: :func:`model_special_ids_of`.
    """
    if cfg.lora.enabled:
        export_lora(model, cfg, info, out_dir, Path(f"{out_dir}-adapter"), special_ids)
        return
    named = list(unwrap(model).named_parameters())
    total = sum(p.numel() * p.element_size() for _, p in named)
    tokenizer = data_dir(cfg) / "tokenizer.json"
    # pipeline stages each hold some of the names, and the transformers backend writes through
    # save_pretrained: both from the whole state, gathered onto rank 0
    if cfg.parallel.pp > 1 or total <= cfg.run.export_single_file_bytes or cfg.model.backend != "native":
        state = gather_pipeline_state_dict(model, info, cfg) if cfg.parallel.pp > 1 else \
            gather_full_state_dict(model)
        group = _export_group(info)
        if info.is_main:
            save_model_dir(state, cfg.model, out_dir, tokenizer, special_ids)
        del state
        _wait_for_writers(group)
    else:
        save_sharded_model_dir(named, cfg.model, out_dir, info.rank, info.world_size, tokenizer, special_ids)
    if cfg.train.qat != "none":  # the trained weights quantised as they were fake-quantised in training
        group = _export_group(info)
        if info.is_main:
            t = cfg.train
            save_quantized_dir(out_dir, quantized_dir(out_dir), t.qat,
                               qat_excluded(unwrap(model), t.qat, t.qat_group_size), t.qat_group_size)
        _wait_for_writers(group)


def quantized_dir(out_dir: Path) -> Path:
    """Where a quantisation-aware run writes its quantised model: ``<out_dir>-quantized``."""
    return Path(f"{out_dir}-quantized")


def written_line(cfg: Config, out_dir: Path) -> str:
    """The end-of-run line: every directory :func:`export_model` wrote to ``out_dir`` (and
    ``<out_dir>-adapter``)."""
    if not cfg.lora.enabled:
        line = f"model written to {out_dir} (Hugging Face model directory)"
        if cfg.train.qat != "none":
            line += (f" and {quantized_dir(out_dir)} (quantized with torchao's {cfg.train.qat}, as trained; "
                     "transformers loads it with torchao installed)")
        return line
    return (f"model written to {out_dir} (Hugging Face model directory, LoRA merged into the "
            f"{cfg.lora.merge_into.replace('_', ' ')}) and {out_dir}-adapter (PEFT adapter on "
            f"{base_model_path(cfg.model.init_from) or 'no pretrained base'})")


def export_lora(model: torch.nn.Module, cfg: Config, info: DistInfo, merged_dir: Path | None,
                adapter_dir: Path | None, special_ids: dict[str, Any] | None) -> None:
    """Write the merged model to ``merged_dir`` and the PEFT adapter to ``adapter_dir`` (either may be None).

    The full parameters are gathered to rank 0, which merges and writes both (merging needs base and
    adapters side by side, an NF4 base dequantised whole); the other ranks wait on the export's group.
    Both carry the model's special ids (:func:`model_special_ids_of`) and the tokenizer; the merge goes
    into ``lora.merge_into``'s base and is recorded in ``lora_merge.json`` and printed
    (:func:`shardlm.convert.peft_out.save_merged_dir`); the adapter names the base by its absolute path.
    """
    lora = cfg.lora
    spec = LoRASpec(lora.rank, lora.alpha, lora.dropout, lora.targets, lora.base_dtype)
    state = gather_full_params(unwrap(model), info.is_main)
    group = _export_group(info)
    tokenizer = data_dir(cfg) / "tokenizer.json"
    if info.is_main:
        if merged_dir is not None:
            record = save_merged_dir(state, cfg.model, spec, lora.merge_into, cfg.model.init_from,
                                     merged_dir, tokenizer, special_ids)
            print(f"{merged_dir}: {record['description']}", flush=True)
        if adapter_dir is not None:
            save_peft_dir(state, spec, adapter_dir, base_model_path(cfg.model.init_from), tokenizer,
                          special_ids)
    del state
    _wait_for_writers(group)


def gather_pipeline_state_dict(model: torch.nn.Module, info: DistInfo, cfg: Config
                               ) -> dict[str, torch.Tensor]:
    """The whole model's full state dict on rank 0 (CPU tensors; ``{}`` elsewhere) from the pipeline's stages:
    each stage's parameters all-gathered over its data-parallel ranks (a collective of the stage), then sent
    by the stage's first rank to rank 0 with ``gather_object`` (the whole model passes through rank 0's
    memory once, as the one-file export's does)."""
    part = {}
    for name, p in unwrap(model).named_parameters():
        full = p.full_tensor() if isinstance(p, DTensor) else p
        part[name] = full.detach().cpu()
    inner = cfg.parallel.tp * cfg.parallel.cp
    leader = data_parallel_rank(info, cfg.parallel)[0] == 0 and info.rank % inner == 0  # one rank per stage
    parts: list[Any] = [None] * info.world_size if info.is_main else None
    torch.distributed.gather_object(part if leader else {}, parts, dst=0)
    state: dict[str, torch.Tensor] = {}
    for piece in parts or []:
        state.update(piece)
    return state


def _export_group(info: DistInfo) -> torch.distributed.ProcessGroup | None:
    """A gloo group with :data:`~shardlm.convert.hf_out.EXPORT_TIMEOUT` for the ranks to wait on while rank 0
    writes (a collective; None in one process)."""
    if info.world_size == 1:
        return None
    return torch.distributed.new_group(backend="gloo", timeout=EXPORT_TIMEOUT)


def _wait_for_writers(group: torch.distributed.ProcessGroup | None) -> None:
    """Wait on ``group`` until rank 0 has written (under the export's timeout), then destroy the group."""
    if group is not None:
        torch.distributed.barrier(group=group)
        torch.distributed.destroy_process_group(group)
