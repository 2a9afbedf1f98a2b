"""Writing Hugging Face style model directories: ``config.json`` + ``model.safetensors`` + tokenizer files.

Our parameter names are HF's (``LlamaForCausalLM``, ``Qwen2ForCausalLM``, ``Gemma3ForCausalLM``...), so the
state dict is written as is; a tied output weight is written once (as ``model.embed_tokens.weight``, with
``tie_word_embeddings``). :func:`save_model_dir` writes a run's ``final/`` and every export;
:func:`copy_model_dir` is ``shardlm import DIR`` and ``shardlm export --format hf`` of a model directory: it
checks every tensor against the shape ``config.json`` implies and writes a directory that
``transformers.AutoModelForCausalLM.from_pretrained`` loads offline.
"""

from __future__ import annotations

import json
import logging
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors import safe_open
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.tensor import DTensor

from shardlm.atomic import atomic_directory, save_safetensors
from shardlm.convert.hf_experts import disk_shapes, read_rows, to_disk
from shardlm.convert.hf_in import check_weights, model_dir_special_ids
from shardlm.data.tokenizer_files import generation_config, write_tokenizer_files
from shardlm.errors import ModelDirError
from shardlm.json_file import read_json
from shardlm.model.config import ModelConfig
from shardlm.model.decoder import CausalLM
from shardlm.model.hf_backend import read_hf_config
from shardlm.model.hf_config import hf_config, read_model_dir_config, written_special_ids


class _SequentialAllGatherNote(logging.Filter):
    """Leaves out DTensor's note (a warning per rank) that an FSDP x TP parameter (``_StridedShard`` over dp,
    ``Shard`` over tp) is gathered by two sequential all-gathers "that may give inconsistent results between
    ranks due to different reduction orders": an all-gather reduces nothing, so every rank gets the same exact
    value (the export equals the unsharded model: tests/dist/test_tp_parity.py)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "sequential all_gather" not in record.getMessage()


@contextmanager
def _without_sequential_all_gather_note() -> Iterator[None]:
    """DTensor's redistribute logger without :class:`_SequentialAllGatherNote`'s note, for the ``with``."""
    log, note = logging.getLogger("torch.distributed.tensor._redistribute"), _SequentialAllGatherNote()
    log.addFilter(note)
    try:
        yield
    finally:
        log.removeFilter(note)


def plain_tensor(t: torch.Tensor) -> torch.Tensor:
    """``t``, or the one tensor a wrapper subclass holds (torchao's MXFP8 training weights,
    ``train.float8 = "mxfp8"``: same shape, dtype and values), so that it can be written; a subclass of
    several inner tensors (NF4) is returned as it is."""
    plain = type(t) in (torch.Tensor, nn.Parameter) or isinstance(t, DTensor)
    if plain or not hasattr(t, "__tensor_flatten__"):
        return t
    inner = t.__tensor_flatten__()[0]
    return getattr(t, inner[0]) if len(inner) == 1 else t


def gather_full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """All-gather the model's full (unsharded) state dict onto rank 0, on CPU.

    A collective: every rank must call it. Rank 0 gets ``{name: full fp tensor}``; other ranks get
    an empty dict. Uses ``get_model_state_dict(full_state_dict=True, cpu_offload=True)``
    (torch.distributed.checkpoint.state_dict), which gathers one tensor at a time.
    """
    with _without_sequential_all_gather_note():
        return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def save_model_dir(state: dict[str, torch.Tensor], cfg: ModelConfig, out_dir: str | Path,
                   tokenizer_path: str | Path | None = None, special_ids: dict | None = None,
                   extra_files: list[Path] = ()) -> Path:
    """Write an HF model directory (``config.json`` in the family's layout) atomically (temp dir, then
    rename); return its path.

    ``state`` maps our (= HF) parameter names to full tensors; with tied embeddings
    ``lm_head.weight`` is dropped so the shared tensor is stored once. With ``tokenizer_path`` the
    tokenizer's files go along (``tokenizer.json``, ``tokenizer_config.json`` with the chat template
    and ``model_max_length`` = ``cfg.max_seq_len`` when it has none, see
    :func:`shardlm.data.tokenizer_files.write_tokenizer_files`). ``config.json`` and
    ``generation_config.json`` carry the bos/eos/pad ids of ``special_ids`` (see
    :func:`shardlm.model.hf_config.written_special_ids`). ``extra_files`` (e.g. a source's
    ``generation_config.json``) are copied in by name last.
    """
    if cfg.backend == "transformers":
        return save_transformers_dir(state, cfg, out_dir, tokenizer_path)
    out = Path(out_dir)
    tensors = {k: plain_tensor(v.detach()).contiguous().cpu() for k, v in state.items()}
    if cfg.tie_embeddings:
        tensors.pop("lm_head.weight", None)
    tensors = to_disk(cfg, tensors)  # a mixture of experts: the hub's per-expert tensors
    dtype = next(iter(tensors.values())).dtype
    with atomic_directory(out) as tmp:
        save_safetensors(tensors, tmp / "model.safetensors", metadata={"format": "pt"})
        write_model_files(tmp, cfg, dtype, tokenizer_path, special_ids, extra_files)
    return out


def save_transformers_dir(state: dict[str, torch.Tensor], cfg: ModelConfig, out_dir: str | Path,
                          tokenizer_path: str | Path | None = None) -> Path:
    """Write the weights of a ``model.backend = "transformers"`` model as transformers' own
    ``save_pretrained`` writes them (its on-disk names, e.g. per-expert tensors; ``config.json`` from
    ``cfg.init_from``'s config), atomically; return the path. The model is built on the meta device and takes
    ``state``'s tensors (names are transformers'); ``generation_config.json`` is the source directory's when
    it has one; the tokenizer's files go along with ``tokenizer_path``.

    Raises:
        RuntimeError: ``state`` does not hold exactly the model's tensors (load_state_dict's message).
    """
    from transformers import AutoModelForCausalLM

    config = read_hf_config(cfg.init_from)
    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(config, trust_remote_code=False)
    hf.load_state_dict({k: v.detach().contiguous().cpu() for k, v in state.items()}, assign=True)
    if cfg.tie_embeddings:
        hf.tie_weights()
    out = Path(out_dir)
    with atomic_directory(out) as tmp:
        hf.save_pretrained(tmp)
        generation = Path(cfg.init_from) / "generation_config.json"
        if generation.is_file():
            shutil.copyfile(generation, tmp / generation.name)
        if tokenizer_path is not None:
            write_tokenizer_files(tokenizer_path, tmp, model_max_length=cfg.max_seq_len)
    return out


def write_model_files(tmp: Path, cfg: ModelConfig, dtype: torch.dtype,
                      tokenizer_path: str | Path | None = None, special_ids: dict | None = None,
                      extra_files: list[Path] = ()) -> None:
    """Everything of a model directory but the weights, into ``tmp``: ``config.json`` (weights of ``dtype``),
    ``generation_config.json``, the tokenizer's files when ``tokenizer_path`` is given, then ``extra_files``
    (see :func:`save_model_dir`)."""
    special = written_special_ids(special_ids)
    eos = (
        []
        if special["eos"] is None
        else [special["eos"]]
        if isinstance(special["eos"], int)
        else special["eos"]
    )
    (tmp / "config.json").write_text(json.dumps(hf_config(cfg, special_ids, dtype), indent=2) + "\n")
    gen = generation_config({"bos": special["bos"], "eos": eos, "pad": special["pad"]})
    (tmp / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    if tokenizer_path is not None:
        write_tokenizer_files(tokenizer_path, tmp, model_max_length=cfg.max_seq_len)
    for extra in extra_files:
        shutil.copyfile(extra, tmp / extra.name)


#: how long the ranks of a sharded export wait for each other while they write (a group of its own, not the
#: training timeout: one rank may write gigabytes while the others wait)
EXPORT_TIMEOUT = timedelta(hours=4)

#: the index file beside sharded safetensors files (Hugging Face's name)
INDEX_FILE = "model.safetensors.index.json"


def shard_owners(sizes: list[int], world_size: int) -> list[int]:
    """The rank that writes each tensor of a sharded export: consecutive tensors (in ``sizes`` order, bytes
    each) go to the same rank, cut where the running total crosses ``k / world_size`` of the whole (by each
    tensor's middle byte). Every rank then writes at most its share of the bytes plus one tensor; some may
    write none.
    """
    total = max(1, sum(sizes))
    owners, done = [], 0
    for size in sizes:
        owners.append(min(world_size - 1, (2 * done + size) * world_size // (2 * total)))
        done += size
    return owners


def gather_full(p: torch.Tensor, owner: int, rank: int) -> torch.Tensor | None:
    """The full value of parameter ``p`` on rank ``owner`` (None elsewhere); a collective of all ranks.

    A DTensor sharded ``Shard(0)`` on a one-dimensional mesh (FSDP) is gathered to the owner only
    (``dist.gather`` of the shards padded to ``torch.chunk``'s row count), so the other ranks allocate
    nothing beyond their shard; another layout is all-gathered (``full_tensor``); a plain tensor is returned
    as it is (every rank holds it whole).
    """
    if not isinstance(p, DTensor):
        return p if owner == rank else None
    if p.device_mesh.ndim != 1 or not p.placements[0].is_shard(0):
        with _without_sequential_all_gather_note():
            full = plain_tensor(p.full_tensor())
        return full if owner == rank else None
    group = p.device_mesh.get_group()
    n = dist.get_world_size(group)
    rows = -(-p.shape[0] // n)  # torch.chunk's rows per rank; the last ranks may hold fewer, or none
    local = plain_tensor(p.to_local())
    padded = local.new_zeros((rows, *p.shape[1:]))
    padded[:local.shape[0]] = local
    if rank != owner:
        dist.gather(padded, None, dst=owner, group=group)
        return None
    full = local.new_empty((n * rows, *p.shape[1:]))
    # straight into one buffer: no extra copy
    dist.gather(padded, list(full.split(rows)), dst=owner, group=group)
    return full[:p.shape[0]]


def save_sharded_model_dir(named_params: list[tuple[str, torch.Tensor]], cfg: ModelConfig,
                           out_dir: str | Path, rank: int, world_size: int,
                           tokenizer_path: str | Path | None = None, special_ids: dict | None = None) -> Path:
    """Write an HF-style Llama directory from every rank at once: ``model-0000K-of-0000M.safetensors`` (one
    per rank that owns a tensor, see :func:`shard_owners`), ``model.safetensors.index.json``, ``config.json``.

    A collective: every rank calls it with the model's ``named_parameters()`` (DTensor shards or whole
    tensors; a tied output weight listed once). Each tensor is gathered in turn to its owner only
    (:func:`gather_full`) and kept there on CPU, so no rank holds more than its share plus one tensor. Then
    each rank writes its own file; the ranks meet on a process group of their own with :data:`EXPORT_TIMEOUT`,
    so a rank waiting for a slow writer is not stopped by the training timeout. Rank 0 writes the index and
    the config and renames the temporary directory into place (atomically: a failure anywhere leaves
    ``out_dir`` as it was). Returns ``out_dir`` on every rank.

    Raises:
        ModelDirError: a rank could not write its file (names the rank, the path and the cause).
    """
    out = Path(out_dir)
    group = dist.new_group(backend="gloo", timeout=EXPORT_TIMEOUT) if world_size > 1 else None
    sizes = [p.numel() * p.element_size() for _, p in named_params]
    owners = shard_owners(sizes, world_size)
    writers = sorted(set(owners))
    files = {r: f"model-{i + 1:05d}-of-{len(writers):05d}.safetensors" for i, r in enumerate(writers)}
    mine: dict[str, torch.Tensor] = {}
    for (name, p), owner in zip(named_params, owners):
        full = gather_full(p, owner, rank)  # a collective: every rank, in the same order
        if owner == rank:  # a copy only when it is not already this rank's own CPU tensor
            mine.update(to_disk(cfg, {name: full.detach().cpu().contiguous() if isinstance(p, DTensor) else
                                      full.detach().to("cpu", copy=True).contiguous()}))
        del full
    dtype = named_params[0][1].dtype

    def write(tmp: Path | None) -> None:
        where = [str(tmp) if tmp is not None else None]
        if group is not None:
            dist.broadcast_object_list(where, src=0, group=group)
        error = None
        if mine:
            path = Path(where[0]) / files[rank]
            try:
                save_safetensors(mine, path, metadata={"format": "pt"})
            except OSError as e:
                error = f"rank {rank} could not write {path}: {e}"
        mine.clear()
        errors = [error]
        if group is not None:
            errors = [None] * world_size
            dist.all_gather_object(errors, error, group=group)
        failed = [e for e in errors if e]
        if failed:
            raise ModelDirError("; ".join(failed))

    try:
        if rank == 0:
            with atomic_directory(out) as tmp:
                write(tmp)
                index = {"metadata": {"total_size": sum(sizes)},
                         "weight_map": {disk: files[o] for (name, p), o in zip(named_params, owners)
                                        for disk in disk_shapes(cfg, name, tuple(p.shape))}}
                (tmp / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
                write_model_files(tmp, cfg, dtype, tokenizer_path, special_ids)
        else:
            write(None)
        if group is not None:
            dist.barrier(group=group)  # the directory is in place before any rank goes on
    finally:
        if group is not None:
            dist.destroy_process_group(group)
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
        ModelDirError: not a model directory of a built family, a missing/unexpected/wrongly-shaped tensor
            (named), ``out_dir`` is ``src`` itself, or config and tokenizer disagree on eos (see
            :func:`shardlm.convert.hf_in.model_dir_special_ids`).
    """
    src, out = resolve_model_dir(src), Path(out_dir)
    cfg = read_model_dir_config(src)
    if out.resolve() == src.resolve():
        raise ModelDirError(f"output directory {out} is the source directory")
    special = model_dir_special_ids(src)
    with torch.device("meta"):
        model = CausalLM(cfg)
    where = check_weights(src, model)
    state: dict[str, torch.Tensor] = {}

    def read(name: str) -> torch.Tensor:
        with safe_open(str(where[name]), framework="pt") as st:
            return st.get_tensor(name)

    for name, p in model.named_parameters():
        t = read_rows(cfg, name, tuple(p.shape), 0, p.shape[0], read)
        state[name] = t if dtype is None else t.to(dtype)
    source_config = read_json(src / "config.json", ModelDirError)
    for key, name in (("bos", "bos_token_id"), ("eos", "eos_token_id"), ("pad", "pad_token_id")):
        if source_config.get(name) is not None:
            special[key] = source_config[name]
    tokenizer = src / "tokenizer.json"
    extra = [src / "generation_config.json"] if (src / "generation_config.json").is_file() else []
    return save_model_dir(state, cfg, out, tokenizer if tokenizer.is_file() else None, special, extra)
