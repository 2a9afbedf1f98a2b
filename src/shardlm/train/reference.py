"""The reference policy of preference tuning (and of any objective that compares the policy with a frozen
model), one of:

* ``model`` (reference (b)): a frozen copy built like the policy (FSDP-sharded on the same mesh, no LoRA,
  every parameter ``requires_grad=False``, eval mode) from ``preference.reference_from`` or
  ``model.init_from`` (or the policy's own random initialisation), run under ``torch.no_grad`` on the same
  rows before the policy's forward;
* ``lora_base`` (reference (c)): the policy itself with its adapters switched off
  (:func:`~shardlm.train.preference.adapters_off`): the base, no second copy;
* either of them precomputed (reference (a), ``preference.precompute_reference``): one pass over every
  training pair before step 1, the pairs split over the ranks (each rank the same number of forwards), the
  table summed over ranks, written to ``<run dir>/reference_logps/<key>.safetensors`` where the key is the
  SHA-256 of the reference's identity by content (the SHA-256 of the model directory's weights and settings
  files, or the random initialisation's seed and shape, and which reference) and of the prepared pairs' tokens
  (their files' SHA-256, ``train.seq_len``); a resume or a second run with the same key reads it instead, a
  changed model or changed data (of any size or date) makes another key. The reference model is freed
  before training.

simpo and orpo have no reference. The objective that uses it is
:class:`shardlm.train.objectives.preference.PreferenceObjective`.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import math
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from shardlm.checkpoint.manifest import sha256_file
from shardlm.config import Config, apply_init_from
from shardlm.data.build import data_dir
from shardlm.data.instruct import split_batch
from shardlm.data.preference import PreferencePairs
from shardlm.errors import ConfigError
from shardlm.parallel.dist import DistInfo, all_reduce_sum, run_on_main, to_device
from shardlm.train.build import build_model
from shardlm.train.preference import NEEDS_REFERENCE, adapters_off, completion_logps


def reference_kind(cfg: Config) -> str:
    """``model`` or ``lora_base`` (``preference.reference`` with ``auto`` resolved), or ``none``
    (simpo, orpo)."""
    pref = cfg.preference
    if pref.loss not in NEEDS_REFERENCE:
        return "none"
    if pref.reference == "auto":
        return "lora_base" if cfg.lora.enabled and not pref.reference_from else "model"
    return pref.reference


def check_reference_tokenizer(reference_dir: str, tokenizer_path: str, key: str = "preference.reference_from",
                              role: str = "reference", of: str = "policy") -> None:
    """Refuse a reference model (or a distillation teacher: ``key``, ``role`` and ``of`` name them in the
    message) whose tokenizer is not the trained model's (its log-probs would be of other tokens).

    Raises:
        ConfigError: ``reference_dir`` has no ``tokenizer.json``, or its vocabulary (ids and added tokens)
            differs from ``tokenizer_path``'s.
    """
    theirs = Path(reference_dir) / "tokenizer.json"
    if not theirs.is_file():
        raise ConfigError(f"{key} {reference_dir} has no tokenizer.json: cannot check that the {role} reads "
                          f"the same token ids as the {of}")
    a, b = Tokenizer.from_file(str(theirs)), Tokenizer.from_file(str(tokenizer_path))
    added_a = {i: t.content for i, t in a.get_added_tokens_decoder().items()}
    added_b = {i: t.content for i, t in b.get_added_tokens_decoder().items()}
    if a.get_vocab(with_added_tokens=True) != b.get_vocab(with_added_tokens=True) or added_a != added_b:
        raise ConfigError(f"{key} {reference_dir}: its tokenizer differs from the {of}'s ({tokenizer_path}; "
                          f"{a.get_vocab_size()} vs {b.get_vocab_size()} tokens): the {role} would score "
                          f"other tokens than the {of}; use a {role} with the {of}'s tokenizer")


def reference_identity(cfg: Config, kind: str) -> dict[str, Any]:
    """What the reference log-probs depend on besides the data, by content: the SHA-256 of every file of the
    reference's model directory that holds weights or their settings (``*.safetensors``, ``*.json``,
    ``*.gguf``; the whole file, streamed: about a second per GB), or of the file itself; for a random
    initialisation its seed and the model shape; and the kind of reference. Another directory with the same
    content has the same identity."""
    src = cfg.preference.reference_from or cfg.model.init_from
    if src:
        root = Path(src)
        files = [root] if root.is_file() else sorted(p for p in root.iterdir() if p.is_file() and p.suffix in
                                                     (".safetensors", ".json", ".gguf"))
        return {"kind": kind, "files": {p.name: sha256_file(p) for p in files}}
    return {"kind": kind, "random_init": cfg.train.seed, "model": dataclasses.asdict(cfg.model)}


def table_key(cfg: Config, kind: str, data: PreferencePairs) -> str:
    """The precomputed table's key: the hex SHA-256 of the reference's identity (:func:`reference_identity`)
    and of the scored data by content (the SHA-256 of the prepared ``train.bin`` and ``train.idx``, the number
    of pairs, ``train.seq_len``)."""
    root = data_dir(cfg)
    tokens = {name: sha256_file(root / name) for name in ("train.bin", "train.idx")}
    key = json.dumps({"reference": reference_identity(cfg, kind), "data": tokens, "pairs": len(data),
                      "seq_len": cfg.train.seq_len}, sort_keys=True)
    return hashlib.sha256(key.encode()).hexdigest()


def reference_config(cfg: Config, reference_from: str | None = None) -> Config:
    """The frozen reference model's config: the policy's (same parallelism, mesh and seed) without LoRA,
    freezing or activation checkpointing, in the shape of ``reference_from`` when set (None:
    ``preference.reference_from``; online RL passes ``rl.reference_from``).

    Raises:
        ModelDirError: ``preference.reference_from`` has no readable ``config.json``
        (:func:`apply_init_from`).
    """
    ref_cfg = copy.deepcopy(cfg)
    ref_cfg.lora = type(cfg.lora)()
    ref_cfg.train.trainable = ref_cfg.train.frozen = ""
    ref_cfg.parallel.activation_checkpoint = "none"  # no backward: nothing to recompute
    source = cfg.preference.reference_from if reference_from is None else reference_from
    if source:
        ref_cfg.model.init_from = source
        apply_init_from(ref_cfg)
    return ref_cfg


def build_reference(cfg: Config, info: DistInfo, mesh: DeviceMesh | None,
                    reference_from: str | None = None) -> nn.Module:
    """The frozen reference model: built as the policy would be (:func:`reference_config`) from
    ``reference_from`` (None: ``preference.reference_from``; its own shape) or ``model.init_from``; eval mode,
    no gradients."""
    model, _ = build_model(reference_config(cfg, reference_from), info, mesh)
    model.requires_grad_(False)
    return model.eval()


def reference_table_path(
    cfg: Config, kind: str, run_dir: Path, data: PreferencePairs, info: DistInfo
) -> Path:
    """``<run dir>/reference_logps/<key>.safetensors``, the key the first 16 hex digits of :func:`table_key`:
    computed on rank 0 (it reads the reference's files once) and broadcast as its 32 bytes.

    Raises:
        RankFailed: on the other ranks when rank 0 could not read the files (rank 0 raises its own error).
    """
    key = run_on_main(lambda: table_key(cfg, kind, data), info)
    digest = torch.zeros(32, dtype=torch.uint8, device=info.device)
    if info.is_main:
        digest.copy_(torch.tensor(list(bytes.fromhex(key)), dtype=torch.uint8))
    if info.world_size > 1:
        torch.distributed.broadcast(digest, src=0)
    return run_dir / "reference_logps" / f"{bytes(digest.tolist()).hex()[:16]}.safetensors"


@torch.no_grad()
def precompute_reference(model: nn.Module, lora_base: bool, data: PreferencePairs, micro_batch_size: int,
                         chunk_tokens: int, info: DistInfo) -> torch.Tensor:
    """(len(data), 2) fp64 reference log-probs (chosen, rejected) of every pair: rank r takes pairs r, r + N,
    ..., in micro-batches; every rank runs the same number of forwards (FSDP all-gathers: a rank with none
    left runs one on pair 0 and discards it); the table is summed over ranks (one all-reduce)."""
    n = len(data)
    table = torch.zeros((n, 2), dtype=torch.float64, device=info.device)
    mine = list(range(info.rank, n, info.world_size))
    most = math.ceil(n / info.world_size)  # pairs of the rank with the most
    steps = math.ceil(most / micro_batch_size)
    context = adapters_off(model) if lora_base else torch.no_grad()
    with context:
        for b in range(steps):
            ids = mine[b * micro_batch_size:(b + 1) * micro_batch_size]
            batch = to_device(data.get(ids or [0]), info.device)
            inputs, targets = split_batch(batch)
            logps = completion_logps(model, inputs, targets, chunk_tokens)[0]
            if ids:
                p = len(ids)
                table[torch.as_tensor(ids, device=info.device)] = torch.stack(
                    [logps[:p], logps[p:]], 1
                ).double()
    return all_reduce_sum(table)

