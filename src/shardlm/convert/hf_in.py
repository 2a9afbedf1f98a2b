"""Reading Hugging Face model directories (every family of ``shardlm.model.families.FAMILIES``): whole
(:func:`load_model_dir`) or sharded per rank (:func:`load_pretrained_`).

A directory holds ``config.json`` (``LlamaForCausalLM``, ``Qwen2ForCausalLM``...) and one or more
``*.safetensors`` files. A sharded checkpoint's ``model.safetensors.index.json`` decides which file holds each
tensor (:func:`tensor_files`: files it does not name are ignored, with a note); without one, each tensor must
be in exactly one file. :func:`load_pretrained_` fills a model whose parameters are FSDP shards (``Shard(0)``
DTensors) by reading, on each rank, only the rows of its own shard with safetensors'
``safe_open(...).get_slice``, so no rank ever materialises a whole tensor; it counts the bytes each
rank reads.
"""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from shardlm.convert.hf_experts import disk_shapes, read_rows
from shardlm.data.tokenizer import load_tokenizer
from shardlm.data.tokenizer_files import (
    eos_ids_of,
    json_line,
    model_special_ids,
    read_tokenizer_config,
    token_text,
)
from shardlm.errors import DataError, ModelDirError
from shardlm.json_file import read_json
from shardlm.model.decoder import CausalLM
from shardlm.model.hf_config import read_model_dir_config
from shardlm.model.lora import is_nf4, set_from_full_

#: tensors some older HF checkpoints carry that hold no weights (recomputed, never loaded)
_IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)


#: the file naming which safetensors file holds each tensor of a sharded checkpoint (transformers'
#: SAFE_WEIGHTS_INDEX_NAME)
INDEX_NAME = "model.safetensors.index.json"


def _note(message: str) -> None:
    """Print ``note: message`` on stderr, once per job (rank 0 only under torchrun)."""
    if os.environ.get("RANK", "0") == "0":
        print(f"note: {message}", file=sys.stderr, flush=True)


def _tensor_names(file: Path) -> set[str]:
    """Tensor names in the header of a safetensors file.

    Raises:
        ModelDirError: the file is not a readable safetensors file (named, with safetensors' reason).
    """
    try:
        with safe_open(str(file), framework="pt") as st:
            return set(st.keys())
    except Exception as e:
        # safetensors raises SafetensorError (not an OSError) on a corrupt or truncated header
        raise ModelDirError(f"{file}: not a readable safetensors file ({e})") from None


def _index_weight_map(path: Path) -> dict[str, str]:
    """``weight_map`` of ``path/model.safetensors.index.json``: ``{tensor name: file name}``, checked.

    Raises:
        ModelDirError: invalid JSON, no ``weight_map`` object, or a value that is not a file name of
        this directory.
    """
    index = path / INDEX_NAME
    index_json = read_json(index, ModelDirError, message="{path}: not a safetensors index ({reason})")
    weight_map = index_json.get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise ModelDirError(f"{index}: no \"weight_map\" object (tensor name -> file name)")
    for name, file in weight_map.items():
        if not isinstance(file, str) or not file or Path(file).name != file:
            raise ModelDirError(f"{index}: weight_map[{name!r}] = {file!r} is not a file name of {path}")
    return weight_map


def tensor_files(path: str | Path) -> dict[str, Path]:
    """``{tensor name: safetensors file}`` of an HF model directory (headers only).

    With ``model.safetensors.index.json`` (a sharded checkpoint), the index decides: every file it names must
    exist, each tensor is taken from the file the index names for it and must be there, a file it names may
    hold no tensor it does not list, and ``*.safetensors`` files it does not name (mistralai's
    ``consolidated.safetensors``, a stale ``model.safetensors``) are ignored, with a note on stderr. Without
    an index, every ``*.safetensors`` file is read and a tensor name may occur in only one of them.

    Raises:
        ModelDirError: no safetensors file; an invalid index, a file it names that is missing (named), a
            tensor it lists that is not in its file, or one its files hold that it does not list; without an
            index, one tensor name in two files (both named).
    """
    path = Path(path)
    if (path / INDEX_NAME).is_file():
        return _indexed_tensor_files(path)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelDirError(f"{path}: no *.safetensors weights found")
    where: dict[str, Path] = {}
    for f in files:
        for name in sorted(_tensor_names(f)):
            if name in where:
                raise ModelDirError(f"{path}: tensor {name} is in both {where[name].name} and {f.name} (and "
                                    f"no {INDEX_NAME} says which to read); remove the file that does not "
                                    "belong")
            where[name] = f
    return where


def _indexed_tensor_files(path: Path) -> dict[str, Path]:
    """:func:`tensor_files` of a directory with ``model.safetensors.index.json``."""
    index = path / INDEX_NAME
    weight_map = _index_weight_map(path)
    named = sorted(set(weight_map.values()))
    missing = [f for f in named if not (path / f).is_file()]
    if missing:
        raise ModelDirError(f"{index} names {len(missing)} file(s) that do not exist: {', '.join(missing)} "
                            f"(e.g. holding {next(t for t, f in weight_map.items() if f == missing[0])})")
    for f in named:
        held = _tensor_names(path / f)
        listed = {t for t, g in weight_map.items() if g == f}
        if listed - held:
            raise ModelDirError(f"{index} lists tensor {sorted(listed - held)[0]} in {f}, which does not "
                                "hold it")
        if held - listed:
            t = sorted(held - listed)[0]
            elsewhere = f"lists it in {weight_map[t]}" if t in weight_map else "does not list it"
            raise ModelDirError(f"{path / f} holds tensor {t}, but {index} {elsewhere}; the index and its "
                                "files disagree")
    ignored = sorted(f.name for f in path.glob("*.safetensors") if f.name not in set(named))
    if ignored:
        _note(f"{path}: ignoring {', '.join(ignored)}: not named by {INDEX_NAME} (the index decides which "
              "files hold the weights)")
    return {name: path / f for name, f in weight_map.items()}


def check_weights(
    path: str | Path, model: nn.Module, skip: set[str] | frozenset[str] = frozenset(),
    elsewhere: set[str] | frozenset[str] = frozenset(),
) -> dict[str, Path]:
    """Check that the directory holds exactly the model's tensors with the model's shapes (headers only).

    Parameters named in ``skip`` (LoRA adapters) are not expected in the files; a mixture of experts' stacked
    tensors are expected in the hub's per-expert layout (:func:`shardlm.convert.hf_experts.disk_shapes`).
    Tensors named in ``elsewhere`` (a pipeline stage's: the other stages' parameters) may be in the files and
    are not read.
    Returns :func:`tensor_files`. Raises ModelDirError naming a missing, unexpected or wrongly-shaped tensor
    (with both shapes).
    """
    where = tensor_files(path)
    cfg = getattr(model, "cfg", None)
    expected = {}
    for name, p in model.named_parameters():
        if name not in skip:
            expected.update(
                disk_shapes(cfg, name, tuple(p.shape)) if cfg is not None else {name: tuple(p.shape)}
            )
    for name, buf in persistent_buffers(model):  # saved with the weights (DeepSeek V3's routing bias)
        expected[name] = tuple(buf.shape)
    tied = getattr(cfg, "tie_embeddings", False)
    for name, shape in expected.items():
        if name not in where:
            raise ModelDirError(f"{path}: tensor {name} is missing from the weights")
        with safe_open(str(where[name]), framework="pt") as st:
            found = tuple(st.get_slice(name).get_shape())
        if found != shape:
            raise ModelDirError(f"{path}: tensor {name} has shape {found}, config.json implies {shape}")
    for name in where:
        if (
            name not in expected
            and name not in elsewhere
            and not name.endswith(_IGNORED_SUFFIXES)
            and not (tied and name == "lm_head.weight")
        ):
            raise ModelDirError(f"{path}: unexpected tensor {name} (config.json does not describe it)")
    return where


def persistent_buffers(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The buffers of ``model`` that its state dict holds (not in a module's non-persistent set), by name:
    none in shardlm's decoder (its rotary tables are not saved); a transformers model may have some (DeepSeek
    V3's
    ``e_score_correction_bias``), saved with the weights and loaded whole."""
    out = []
    for module_name, module in model.named_modules():
        for name, buf in module.named_buffers(recurse=False):
            if buf is not None and name not in module._non_persistent_buffers_set:
                out.append((f"{module_name}.{name}" if module_name else name, buf))
    return out


def local_rows(param: torch.Tensor) -> tuple[int, int]:
    """(first row, number of rows) of this rank's shard of ``param`` along dim 0; the whole for a
    plain tensor.

    Uses the DTensor's own layout (``compute_local_shape_and_global_offset``), i.e. the ``torch.chunk``
    split of dim 0 for ``Shard(0)``.

    Raises:
        ValueError: a DTensor sharded on another dimension than 0.
    """
    if not isinstance(param, DTensor):
        return 0, param.shape[0] if param.dim() else 1
    if any(isinstance(p, Shard) and p.dim != 0 for p in param.placements):
        raise ValueError(f"only Shard(0) parameters can be loaded by rows, got {param.placements}")
    shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
    return int(offset[0]), int(shape[0])


@torch.no_grad()
def load_pretrained_(
    model: nn.Module, path: str | Path, skip: set[str] | frozenset[str] = frozenset(),
    elsewhere: set[str] | frozenset[str] = frozenset(),
) -> dict[str, Any]:
    """Fill ``model``'s parameters (plain or ``Shard(0)`` DTensors) from an HF model directory, in place.

    Each parameter's local rows ``[offset, offset + rows)`` are read with
    ``safe_open(...).get_slice(name)[offset:offset + rows]`` and copied (cast to the parameter's dtype) into
    its local tensor, so each rank materialises only its own rows; persistent buffers
    (:func:`persistent_buffers`, a transformers model's) are read whole on every rank. Rotary tables are
    recomputed afterwards (``init_rotary``). Parameters named in ``skip`` (LoRA adapters) are left alone, and
    the files' tensors named in ``elsewhere`` (another pipeline stage's) are not read. An
    NF4 base weight (QLoRA) is read whole and quantised whole before its rows are kept
    (:func:`shardlm.model.lora.set_from_full_`), so it counts as a full read.

    Returns:
        ``{"bytes_read": bytes materialised from the files on this rank, "total_bytes": bytes of
        every tensor in the files that the model uses, "max_slice_bytes": the largest single slice read,
        "full_tensors": names read whole although the parameter is sharded over > 1 rank}``.

    Raises:
        ModelDirError: a missing, unexpected or wrongly-shaped tensor (named), before anything is read.
    """
    where = check_weights(path, model, skip, elsewhere)
    stats: dict[str, Any] = {"bytes_read": 0, "total_bytes": 0, "max_slice_bytes": 0, "full_tensors": []}
    handles: dict[Path, Any] = {}
    try:
        for name, param in model.named_parameters():
            if name in skip:
                continue
            disk = disk_shapes(model.cfg, name, tuple(param.shape))
            start, rows = local_rows(param)
            local = param.to_local() if isinstance(param, DTensor) else param
            if next(iter(disk)) != name:  # a MoE layer's stacked experts: only this rank's experts' tensors
                piece = read_rows(model.cfg, name, tuple(param.shape), start, start + rows,
                                  lambda n: _open(handles, where[n]).get_tensor(n))
                stats["bytes_read"] += piece.numel() * piece.element_size()
                stats["max_slice_bytes"] = max(stats["max_slice_bytes"], piece.numel() * piece.element_size())
                stats["total_bytes"] += math.prod(param.shape) * piece.element_size()
                local.copy_(piece.to(local.dtype))
                continue
            f = where[name]
            tslice = _open(handles, f).get_slice(name)
            full_rows = param.shape[0]
            if is_nf4(local):  # quantised from the whole tensor: the same codes at any world size
                full = tslice[:]
                set_from_full_(param, full)
                stats["bytes_read"] += full.numel() * full.element_size()
                stats["max_slice_bytes"] = max(stats["max_slice_bytes"], full.numel() * full.element_size())
            elif rows:
                piece = tslice[start:start + rows]
                nbytes = piece.numel() * piece.element_size()
                stats["bytes_read"] += nbytes
                stats["max_slice_bytes"] = max(stats["max_slice_bytes"], nbytes)
                sharded = isinstance(param, DTensor) and param.device_mesh.size() > 1
                if sharded and rows == full_rows:
                    stats["full_tensors"].append(name)
                local.copy_(piece.to(local.dtype))
            stats["total_bytes"] += math.prod(param.shape) * _itemsize(tslice.get_dtype())
        for name, buf in persistent_buffers(model):  # small and not sharded: read whole on every rank
            value = _open(handles, where[name]).get_tensor(name)
            buf.copy_(value.to(buf.dtype))
            stats["bytes_read"] += value.numel() * value.element_size()
            stats["total_bytes"] += value.numel() * value.element_size()
    finally:
        handles.clear()
    model.init_rotary()
    return stats


def _open(handles: dict[Path, Any], file: Path) -> Any:
    """The open safetensors handle of ``file`` (opened once, kept in ``handles``)."""
    if file not in handles:
        handles[file] = safe_open(str(file), framework="pt")
    return handles[file]


def _itemsize(safetensors_dtype: str) -> int:
    """Bytes per element of a safetensors dtype name (``F32``, ``BF16``...)."""
    return {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
            "BOOL": 1}[safetensors_dtype]


def load_model_dir(path: str | Path, device: torch.device | str = "cpu") -> CausalLM:
    """Load an HF model directory (``config.json`` + ``*.safetensors``) into a whole :class:`CausalLM` of
    its family.

    Weights are read with safetensors (no pickle). Raises ModelDirError naming the missing file, a
    missing or unexpected tensor, or a shape mismatch (tensor name and both shapes).
    """
    path = Path(path)
    cfg = read_model_dir_config(path)
    with torch.device("meta"):
        model = CausalLM(cfg)
    where = check_weights(path, model)  # the index's files, or every file with each tensor in one
    model.to_empty(device=device)
    handles: dict[Path, Any] = {}
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(read_rows(cfg, name, tuple(param.shape), 0, param.shape[0],
                                  lambda n: _open(handles, where[n]).get_tensor(n)))
    handles.clear()
    model.init_rotary()
    return model


def model_dir_special_ids(path: str | Path) -> dict[str, Any]:
    """The special ids of a model directory, checked: ``{"bos": int | None, "eos": [int, ...], "pad": int
    | None}``.

    ``eos`` is every id generation stops at: ``config.json``'s and ``generation_config.json``'s
    ``eos_token_id`` (an int or a list) and the tokenizer's ``eos_token`` (see
    :func:`shardlm.data.tokenizer_files.model_special_ids`). Without ``tokenizer.json`` only the two
    config files count.

    Raises:
        ModelDirError: naming the file and line: the tokenizer's ``eos_token`` (``tokenizer_config.json``)
            is not a token of ``tokenizer.json``, or is not among the ``eos_token_id`` of
            ``config.json`` / ``generation_config.json``; or unreadable tokenizer files.
    """
    path = Path(path)
    try:
        declared = eos_ids_of(path)
        if not (path / "tokenizer.json").is_file():
            ids = [i for v in declared.values() for i in v]
            return {"bos": None, "eos": list(dict.fromkeys(ids)), "pad": None}
        files = read_tokenizer_config(path / "tokenizer.json")
        special = model_special_ids(path / "tokenizer.json")
        eos_text = token_text(files.config.get("eos_token"))
        if files.config_path is not None and eos_text is not None:
            eos_id = load_tokenizer(str(path / "tokenizer.json")).token_to_id(eos_text)
            where = f"{files.config_path}:{json_line(files.config_path, 'eos_token')}"
            if eos_id is None:
                raise ModelDirError(f"{where}: eos_token {eos_text!r} is not a token of "
                                    f"{path / 'tokenizer.json'}")
            if declared and not any(eos_id in ids for ids in declared.values()):
                file = path / ("config.json" if "config.json" in declared else "generation_config.json")
                written = " / ".join(str(v[0] if len(v) == 1 else v) for v in declared.values())
                raise ModelDirError(f"{file}:{json_line(file, 'eos_token_id')}: eos_token_id {written} "
                                    f"disagrees with the tokenizer: {where} says eos_token {eos_text!r}, id "
                                    f"{eos_id}; make them agree (generation stops at these ids)")
    except DataError as e:
        raise ModelDirError(str(e)) from None
    return special
