"""Exporting a LoRA model: merged (a normal HF Llama directory) or as a PEFT-format adapter directory.

- Merged: every targeted weight becomes ``W + (alpha / r) · B · A`` in fp32 (an NF4 base dequantised first),
  the adapters are dropped; :func:`shardlm.convert.hf_out.save_model_dir` writes it.
  Into which base (``lora.merge_into``): the base as training held it (exact), or the original weights of
  ``model.init_from`` (approximate when the training base was rounded); ``lora_merge.json`` in the directory
  says which (:func:`merge_record`).
- PEFT (https://huggingface.co/docs/peft): ``adapter_config.json`` (``peft_type = "LORA"``, r, lora_alpha,
  target_modules...) and ``adapter_model.safetensors`` with the adapters under PEFT's names
  (``base_model.model.<our name>``, e.g. ``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``).
  ``base_model_name_or_path`` is the base directory's absolute path, so
  ``peft.AutoPeftModelForCausalLM.from_pretrained(dir)`` works from any working directory; the tokenizer's
  files and ``generation_config.json`` (the model's bos/eos/pad ids) go along.

Both get the model's own special ids (the ones the trainer and the checkpoint manifest carry), never
the data's.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import nn
from torch.distributed.tensor import DTensor

from shardlm.atomic import atomic_directory
from shardlm.convert.hf_in import load_model_dir
from shardlm.convert.hf_out import save_model_dir
from shardlm.data.tokenizer_files import generation_config, write_tokenizer_files
from shardlm.errors import ModelDirError
from shardlm.model.config import ModelConfig
from shardlm.model.hf_config import written_special_ids
from shardlm.model.lora import LoRASpec, is_nf4, target_names

#: PEFT's prefix of adapter tensor names in ``adapter_model.safetensors``
PEFT_PREFIX = "base_model.model."


@torch.no_grad()
def gather_full_params(model: nn.Module, is_main: bool) -> dict[str, torch.Tensor]:
    """Every parameter's full value on the main rank, on CPU, one tensor gathered at a time (a collective).

    NF4 shards are dequantised on their rank before the all-gather (dequantisation is per block, so this
    equals dequantising the whole tensor). Other ranks get an empty dict.
    """
    out: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters():
        if isinstance(p, DTensor):
            local = p.to_local()
            if is_nf4(local):
                local = local.get_original_weight()
            full = DTensor.from_local(local, p.device_mesh, p.placements, shape=p.shape,
                                      stride=torch.empty(p.shape, device="meta").stride()).full_tensor()
        else:
            full = p.get_original_weight() if is_nf4(p) else p
        if is_main:
            out[name] = full.detach().cpu().clone()
    return out


def merge_lora(state: dict[str, torch.Tensor], scaling: float) -> dict[str, torch.Tensor]:
    """The merged state dict: ``W + scaling · B · A`` (fp32) for each adapted ``W``, adapters removed."""
    merged = {k: v for k, v in state.items() if ".lora_A." not in k and ".lora_B." not in k}
    for key, a in state.items():
        if key.endswith(".lora_A.weight"):
            prefix = key[: -len(".lora_A.weight")]
            b = state[f"{prefix}.lora_B.weight"]
            merged[f"{prefix}.weight"] = merged[f"{prefix}.weight"].float() + scaling * (
                b.float() @ a.float()
            )
    return {k: v.float() if v.is_floating_point() else v for k, v in merged.items()}


def peft_config(spec: LoRASpec, base: str) -> dict[str, Any]:
    """``adapter_config.json`` of a PEFT LoRA adapter for a causal LM (fields PEFT's ``LoraConfig`` reads)."""
    return {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base,
        "r": spec.rank, "lora_alpha": spec.alpha, "lora_dropout": spec.dropout,
        "target_modules": target_names(spec.targets), "bias": "none", "fan_in_fan_out": False,
        "inference_mode": True, "init_lora_weights": True, "use_rslora": False, "use_dora": False,
        "modules_to_save": None,
    }


def base_model_path(init_from: str) -> str:
    """``base_model_name_or_path`` for an adapter trained on ``init_from``: its absolute path (resolved from
    the current working directory), so the adapter loads from anywhere; empty without a pretrained base."""
    return str(Path(init_from).expanduser().resolve()) if init_from else ""


def save_peft_dir(
    state: dict[str, torch.Tensor],
    spec: LoRASpec,
    out_dir: str | Path,
    base: str = "",
    tokenizer_path: str | Path | None = None,
    special_ids: dict[str, Any] | None = None,
) -> Path:
    """Write a PEFT LoRA adapter directory (atomically) from a full state dict holding ``*.lora_A/B.weight``.

    ``base`` is recorded as ``base_model_name_or_path`` as given (callers pass :func:`base_model_path`). With
    ``tokenizer_path`` the tokenizer's files are copied in (``AutoTokenizer.from_pretrained(out_dir)`` works;
    PEFT's auto class reads them too); with ``special_ids`` (the model's, see
    :func:`shardlm.model.hf_config.written_special_ids`) a ``generation_config.json`` records bos/eos/pad.
    """
    tensors = {PEFT_PREFIX + k: v.detach().float().contiguous().cpu() for k, v in state.items()
               if k.endswith((".lora_A.weight", ".lora_B.weight"))}
    with atomic_directory(Path(out_dir)) as tmp:
        save_file(tensors, str(tmp / "adapter_model.safetensors"), metadata={"format": "pt"})
        (tmp / "adapter_config.json").write_text(json.dumps(peft_config(spec, base), indent=2) + "\n")
        if tokenizer_path is not None:
            write_tokenizer_files(tokenizer_path, tmp)
        if special_ids is not None:
            special = written_special_ids(special_ids)
            eos = (
                []
                if special["eos"] is None
                else [special["eos"]]
                if isinstance(special["eos"], int)
                else special["eos"]
            )
            gen = generation_config({"bos": special["bos"], "eos": eos, "pad": special["pad"]})
            (tmp / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    return Path(out_dir)


#: the file beside a merged export's weights that says which base the adapters were merged into
MERGE_RECORD = "lora_merge.json"


def merge_record(spec: LoRASpec, merge_into: str, init_from: str) -> dict[str, Any]:
    """What ``lora_merge.json`` records of a merged export (and the log says): ``merged_into``
    (``training_base`` / ``original_base``, see ``lora.merge_into``), ``base_dtype``, ``init_from`` (absolute,
    or None), ``approximate`` (True when the merge used the original weights while training held a rounded
    base: ``nf4``, or ``bfloat16``), ``description`` (one sentence) and the LoRA shape (rank,
    alpha, targets)."""
    dtype = spec.base_dtype
    if merge_into == "original_base":
        approximate = dtype != "float32"
        description = (f"adapters merged into the original weights of {base_model_path(init_from)}"
                       + ("; approximate: they were trained against the "
                          f"{dtype.upper() if dtype == 'nf4' else dtype} base, so the merged model differs "
                          "from the trained one" if approximate else
                          " (equal to the float32 training base)"))
    else:
        approximate = False
        what = {"nf4": "the dequantised NF4 base weights (what training computed with)",
                "bfloat16": "the bfloat16 base weights (as training held them)",
                "float32": "the float32 base weights (as training held them)"}[dtype]
        description = f"adapters merged into {what}; the merged model equals the trained one"
    return {"merged_into": merge_into, "base_dtype": dtype, "init_from": base_model_path(init_from) or None,
            "approximate": approximate, "description": description,
            "lora": {"rank": spec.rank, "alpha": spec.alpha, "targets": target_names(spec.targets)}}


def merged_state(state: dict[str, torch.Tensor], spec: LoRASpec, merge_into: str,
                 init_from: str) -> dict[str, torch.Tensor]:
    """The merged state dict (fp32) of a LoRA model's full parameters ``state`` (:func:`gather_full_params`).

    ``training_base``: ``state``'s own base weights (an NF4 base already dequantised); ``original_base``: the
    weights of the model directory ``init_from`` (read with safetensors, upcast to fp32) replace every base
    tensor, the adapters are ``state``'s. Either way :func:`merge_lora` with ``alpha / rank``.

    Raises:
        ModelDirError: ``original_base`` and ``init_from`` is empty, unreadable, or holds other tensors than
            the trained model's base.
    """
    scaling = spec.alpha / spec.rank
    if merge_into != "original_base":
        return merge_lora(state, scaling)
    if not init_from:
        raise ModelDirError("lora.merge_into='original_base' needs model.init_from: there are no original "
                            "weights")
    original = {name: p.detach() for name, p in load_model_dir(init_from).named_parameters()}
    base_names = {k for k in state if ".lora_A." not in k and ".lora_B." not in k}
    if set(original) != base_names:
        raise ModelDirError(f"{init_from}: its tensors are not the trained model's base (e.g. "
                            f"{sorted(set(original) ^ base_names)[:3]}): lora.merge_into='original_base' "
                            "needs the model directory the run started from")
    adapters = {k: v for k, v in state.items() if k not in base_names}
    return merge_lora({**original, **adapters}, scaling)


def save_merged_dir(state: dict[str, torch.Tensor], cfg: ModelConfig, spec: LoRASpec, merge_into: str,
                    init_from: str, out_dir: str | Path, tokenizer_path: str | Path | None,
                    special_ids: dict[str, Any] | None) -> dict[str, Any]:
    """Merge (:func:`merged_state`) and write an HF model directory atomically, with :data:`MERGE_RECORD`
    inside; return the record (:func:`merge_record`). ``special_ids``: the model's own (config.json,
    generation_config.json).

    Raises:
        ModelDirError: see :func:`merged_state`.
    """
    record = merge_record(spec, merge_into, init_from)
    merged = merged_state(state, spec, merge_into, init_from)
    with tempfile.TemporaryDirectory() as scratch:
        path = Path(scratch) / MERGE_RECORD
        path.write_text(json.dumps(record, indent=2) + "\n")
        save_model_dir(merged, cfg, out_dir, tokenizer_path, special_ids, extra_files=[path])
    return record
