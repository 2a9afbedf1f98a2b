"""Exporting a LoRA model: merged (a normal HF Llama directory) or as a PEFT-format adapter directory.

- Merged: every targeted weight becomes ``W + (alpha / r) · B · A`` in fp32 (an NF4 base dequantised first),
  the adapters are dropped; :func:`shardlm.convert.hf_out.save_model_dir` writes it.
- PEFT (https://huggingface.co/docs/peft): ``adapter_config.json`` (``peft_type = "LORA"``, r, lora_alpha,
  target_modules...) and ``adapter_model.safetensors`` with the adapters under PEFT's names
  (``base_model.model.<our name>``, e.g. ``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``).
  ``peft.PeftModel.from_pretrained(LlamaForCausalLM.from_pretrained(base), dir)`` loads it onto the base.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import nn
from torch.distributed.tensor import DTensor

from shardlm.atomic import atomic_directory
from shardlm.model.lora import LoRASpec, is_nf4, target_names

#: PEFT's prefix of adapter tensor names in ``adapter_model.safetensors``
PEFT_PREFIX = "base_model.model."


@torch.no_grad()
def gather_full_params(model: nn.Module, is_main: bool) -> dict[str, torch.Tensor]:
    """Every parameter's full value on the main rank, on CPU, one tensor gathered at a time (a collective).

    NF4 shards are dequantised on their rank before the all-gather (dequantisation is per block, so this equals
    dequantising the whole tensor). Other ranks get an empty dict.
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
            merged[f"{prefix}.weight"] = merged[f"{prefix}.weight"].float() + scaling * (b.float() @ a.float())
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


def save_peft_dir(state: dict[str, torch.Tensor], spec: LoRASpec, out_dir: str | Path, base: str = "") -> Path:
    """Write a PEFT LoRA adapter directory (atomically) from a full state dict holding ``*.lora_A/B.weight``.

    ``base`` is recorded as ``base_model_name_or_path`` (the pretrained directory, or empty).
    """
    tensors = {PEFT_PREFIX + k: v.detach().float().contiguous().cpu() for k, v in state.items()
               if k.endswith((".lora_A.weight", ".lora_B.weight"))}
    with atomic_directory(Path(out_dir)) as tmp:
        save_file(tensors, str(tmp / "adapter_model.safetensors"), metadata={"format": "pt"})
        (tmp / "adapter_config.json").write_text(json.dumps(peft_config(spec, base), indent=2) + "\n")
    return Path(out_dir)
