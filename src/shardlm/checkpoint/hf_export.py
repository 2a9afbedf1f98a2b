"""Copying a Llama model directory in or out, checked: ``shardlm import DIR`` and ``shardlm export --format hf``.

Both read an HF-style Llama directory (``config.json`` + ``*.safetensors`` + tokenizer files), check
every tensor against the shape ``config.json`` implies, and write a directory that
``transformers.AutoModelForCausalLM.from_pretrained`` loads offline, with the tensors bit-equal in
their source dtype (or cast to ``dtype``).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from shardlm.checkpoint.hf import save_model_dir
from shardlm.checkpoint.hf_load import check_weights, read_model_dir_config

#: tokenizer files copied along with the weights when present
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "generation_config.json")


def resolve_model_dir(path: str | Path) -> Path:
    """A model directory itself, or a run directory's ``final/`` model (``runs/NAME`` -> ``runs/NAME/final``).

    A run directory also holds a ``config.json`` (the training config), so ``final/`` is looked for first.
    """
    path = Path(path)
    if (path / "final" / "config.json").is_file():
        return path / "final"
    return path


def copy_model_dir(src: str | Path, out_dir: str | Path, dtype: torch.dtype | None = None) -> Path:
    """Check the Llama directory ``src`` and write it to ``out_dir`` (atomically) as an HF directory.

    Tensors keep their source dtype unless ``dtype`` is given; a tied output weight is stored once.
    Tokenizer files (:data:`TOKENIZER_FILES`) are copied; ``bos``/``eos`` ids are kept from
    ``config.json``. Runs in one process and holds one directory's tensors in memory.

    Raises:
        ModelDirError: not a Llama directory, a missing/unexpected/wrongly-shaped tensor (named),
            or ``out_dir`` is ``src`` itself.
    """
    from shardlm.checkpoint.hf import ModelDirError
    from shardlm.model import Llama

    src, out = resolve_model_dir(src), Path(out_dir)
    cfg = read_model_dir_config(src)
    if out.resolve() == src.resolve():
        raise ModelDirError(f"output directory {out} is the source directory")
    with torch.device("meta"):
        model = Llama(cfg)
    where = check_weights(src, model)
    state: dict[str, torch.Tensor] = {}
    for name, _ in model.named_parameters():
        with safe_open(str(where[name]), framework="pt") as st:
            t = st.get_tensor(name)
        state[name] = t if dtype is None else t.to(dtype)
    source_config = json.loads((src / "config.json").read_text())
    special = {"bos": source_config.get("bos_token_id"), "eos": source_config.get("eos_token_id")}
    tokenizer = src / "tokenizer.json"
    extra = [src / name for name in TOKENIZER_FILES[1:] if (src / name).is_file()]
    return save_model_dir(state, cfg, out, tokenizer if tokenizer.is_file() else None, special, extra)
