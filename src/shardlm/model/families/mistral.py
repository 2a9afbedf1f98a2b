"""Mistral: Llama with sliding-window attention in every layer (Jiang et al., "Mistral 7B", 2023).

``config.json``: ``sliding_window`` (null: none); ``layer_types`` with full-attention layers is refused. GGUF
files of Mistral models carry llama.cpp's ``llama`` architecture and import as the ``llama`` family.
"""

from __future__ import annotations

from typing import Any

from shardlm.errors import ModelDirError
from shardlm.model.families.registry import Family, ModelFields


def hf_fields_out(cfg: ModelFields) -> dict[str, Any]:
    """Mistral's ``config.json`` field beyond the shared ones: ``sliding_window`` (None when 0)."""
    return {"sliding_window": cfg.sliding_window or None}


def hf_fields_in(cfg: ModelFields, config: dict[str, Any], local_rope: dict[str, Any], source: str) -> None:
    """Set ``cfg.sliding_window`` from ``config.json`` (every layer local), in place.

    Raises:
        ModelDirError: ``layer_types`` names full-attention layers (MistralConfig's window is in every layer).
    """
    window = config.get("sliding_window")
    if not window:
        return
    cfg.sliding_window = int(window)
    if config.get("layer_types") and set(config["layer_types"]) != {"sliding_attention"}:
        raise ModelDirError(f"{source}: layer_types with full-attention layers is not supported for mistral")


FAMILY = Family(
    "mistral", "mistral", "MistralForCausalLM", sliding_window=True, window_patterns=(0,),
    hf_fields_out=hf_fields_out, hf_fields_in=hf_fields_in,
)
