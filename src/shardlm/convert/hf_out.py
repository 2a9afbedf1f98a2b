"""Writing Hugging Face style model directories: ``config.json`` + ``model.safetensors`` + tokenizer files.

Our parameter names are HF's (``LlamaForCausalLM``, ``Qwen2ForCausalLM``, ``Gemma3ForCausalLM``...), so the state
dict is written as is; a tied
output weight is written once (as ``model.embed_tokens.weight``, with ``tie_word_embeddings``).
:func:`save_model_dir` writes a run's ``final/`` and every export; :func:`copy_model_dir` is
``shardlm import DIR`` and ``shardlm export --format hf`` of a model directory: it checks every tensor
against the shape ``config.json`` implies and writes a directory that
``transformers.AutoModelForCausalLM.from_pretrained`` loads offline.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from shardlm.atomic import atomic_directory, save_safetensors
from shardlm.convert.hf_config import hf_config, read_model_dir_config, written_special_ids
from shardlm.convert.hf_in import check_weights, model_dir_special_ids
from shardlm.data.tokenizer_files import generation_config, write_tokenizer_files
from shardlm.errors import ModelDirError
from shardlm.model.config import ModelConfig
from shardlm.model.llama import Llama


def gather_full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """All-gather the model's full (unsharded) state dict onto rank 0, on CPU.

    A collective: every rank must call it. Rank 0 gets ``{name: full fp tensor}``; other ranks get
    an empty dict. Uses ``get_model_state_dict(full_state_dict=True, cpu_offload=True)``
    (torch.distributed.checkpoint.state_dict), which gathers one tensor at a time.
    """
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def save_model_dir(state: dict[str, torch.Tensor], cfg: ModelConfig, out_dir: str | Path,
                   tokenizer_path: str | Path | None = None, special_ids: dict | None = None,
                   extra_files: list[Path] = ()) -> Path:
    """Write an HF model directory (``config.json`` in the family's layout) atomically (temp dir, then rename);
    return its path.

    ``state`` maps our (= HF) parameter names to full tensors; with tied embeddings
    ``lm_head.weight`` is dropped so the shared tensor is stored once. With ``tokenizer_path`` the
    tokenizer's files go along (``tokenizer.json``, ``tokenizer_config.json`` with the chat template
    and ``model_max_length`` = ``cfg.max_seq_len`` when it has none, see
    :func:`shardlm.data.tokenizer_files.write_tokenizer_files`). ``config.json`` and
    ``generation_config.json`` carry the bos/eos/pad ids of ``special_ids`` (see
    :func:`shardlm.convert.hf_config.written_special_ids`). ``extra_files`` (e.g. a source's
    ``generation_config.json``) are copied in by name last.
    """
    out = Path(out_dir)
    tensors = {k: v.detach().contiguous().cpu() for k, v in state.items()}
    if cfg.tie_embeddings:
        tensors.pop("lm_head.weight", None)
    dtype = next(iter(tensors.values())).dtype
    special = written_special_ids(special_ids)
    eos = [] if special["eos"] is None else [special["eos"]] if isinstance(special["eos"], int) else special["eos"]
    with atomic_directory(out) as tmp:
        save_safetensors(tensors, tmp / "model.safetensors", metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(hf_config(cfg, special_ids, dtype), indent=2) + "\n")
        gen = generation_config({"bos": special["bos"], "eos": eos, "pad": special["pad"]})
        (tmp / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
        if tokenizer_path is not None:
            write_tokenizer_files(tokenizer_path, tmp, model_max_length=cfg.max_seq_len)
        for extra in extra_files:
            shutil.copyfile(extra, tmp / extra.name)
    return out


def resolve_model_dir(path: str | Path) -> Path:
    """A model directory itself, or a run directory's ``final/`` model (``runs/NAME`` -> ``runs/NAME/final``).

    A run directory also holds a ``config.json`` (the training config), so ``final/`` is looked for first.
    """
    path = Path(path)
    if (path / "final" / "config.json").is_file():
        return path / "final"
    return path


def copy_model_dir(src: str | Path, out_dir: str | Path, dtype: torch.dtype | None = None) -> Path:
    """Check the model directory ``src`` and write it to ``out_dir`` (atomically) as an HF directory.

    Tensors keep their source dtype unless ``dtype`` is given; a tied output weight is stored once.
    The tokenizer's files and ``generation_config.json`` are copied (one is written when the source
    has none); ``bos``/``eos``/``pad`` ids are kept from ``config.json`` (from the tokenizer where it
    has none). Runs in one process and holds one directory's tensors in memory.

    Raises:
        ModelDirError: not a model directory of a built family, a missing/unexpected/wrongly-shaped tensor (named),
            ``out_dir`` is ``src`` itself, or config and tokenizer disagree on eos (see
            :func:`shardlm.convert.hf_in.model_dir_special_ids`).
    """
    src, out = resolve_model_dir(src), Path(out_dir)
    cfg = read_model_dir_config(src)
    if out.resolve() == src.resolve():
        raise ModelDirError(f"output directory {out} is the source directory")
    special = model_dir_special_ids(src)
    with torch.device("meta"):
        model = Llama(cfg)
    where = check_weights(src, model)
    state: dict[str, torch.Tensor] = {}
    for name, _ in model.named_parameters():
        with safe_open(str(where[name]), framework="pt") as st:
            t = st.get_tensor(name)
        state[name] = t if dtype is None else t.to(dtype)
    source_config = json.loads((src / "config.json").read_text())
    for key, name in (("bos", "bos_token_id"), ("eos", "eos_token_id"), ("pad", "pad_token_id")):
        if source_config.get(name) is not None:
            special[key] = source_config[name]
    tokenizer = src / "tokenizer.json"
    extra = [src / "generation_config.json"] if (src / "generation_config.json").is_file() else []
    return save_model_dir(state, cfg, out, tokenizer if tokenizer.is_file() else None, special, extra)
