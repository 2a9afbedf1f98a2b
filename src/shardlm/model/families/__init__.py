"""The model families, one file each, and their registry (:mod:`.registry`:
:class:`Family`, :data:`FAMILIES`).

Each family file holds everything particular to its family in one :class:`Family` record, ``FAMILY``: the
fixed traits of its architecture, its Hugging Face ``config.json`` fields both ways, its GGUF tensor names and
value fixes, its refusals. The decoder, ``shardlm.convert``, the configuration checks and the planner read the
family through the registry (``cfg.arch``), never by its name. A new family: a file here and its module in
:data:`BUILT` below; a new trait: see :mod:`.registry`. Imports no torch.
"""

from shardlm.model.families import gemma3, gpt_oss, llama, mistral, mixtral, qwen2, qwen3, qwen3_moe
from shardlm.model.families.registry import (
    FAMILIES,
    Family,
    by_gguf_architecture,
    by_model_type,
    get,
    register,
)

#: the built families' modules, registered in this order (the order in which messages list them)
BUILT = (llama, qwen2, qwen3, mistral, gemma3, qwen3_moe, mixtral, gpt_oss)
for _module in BUILT:
    register(_module.FAMILY)

__all__ = ["BUILT", "FAMILIES", "Family", "by_gguf_architecture", "by_model_type", "get", "register"]
