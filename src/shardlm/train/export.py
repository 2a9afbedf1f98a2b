"""Checkpoint to Hugging Face directory (``shardlm export``).

Runs in one process without a process group. Export reads only the model's tensors (not the
optimizer state) with ``dcp.load(no_dist=True)``, which assembles each full tensor from the shards
of whatever world size wrote them, so the process holds exactly one full copy of the weights; they
leave as safetensors through :func:`shardlm.convert.hf_out.save_model_dir`, the writer of ``final/``.

A checkpoint of trainable parameters only (LoRA adapters, or unfrozen layers) refers to its base (the
manifest's ``base``): the model is rebuilt in this process as training built it (``model.init_from``'s
weights, checked against the SHA-256 the checkpoint recorded, or the seeded initialisation; an NF4 base
quantised the same way), the trainable tensors are read into it, and it leaves through the writers of
``final/`` and ``final-adapter/`` (:mod:`shardlm.convert.peft_out`): merged (``format="hf"``) or as a PEFT
adapter (``format="peft"``). Every directory carries the special ids the manifest recorded (the model's own).
"""

from __future__ import annotations

import warnings
from copy import copy
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from shardlm.checkpoint.dcp import check_shapes, verify_checkpoint
from shardlm.checkpoint.manifest import read_manifest, sha256_file
from shardlm.checkpoint.safe_load import SafeFileSystemReader, SafeLoadPlanner
from shardlm.config import Config, LoRAConfig, ParallelConfig, TrainConfig
from shardlm.convert.hf_in import persistent_buffers
from shardlm.convert.hf_out import save_model_dir
from shardlm.convert.peft_out import base_model_path, gather_full_params, save_merged_dir, save_peft_dir
from shardlm.errors import CheckpointError, ConfigError
from shardlm.model.config import ModelConfig
from shardlm.model.hf_backend import build_causal_lm
from shardlm.model.lora import LoRASpec
from shardlm.parallel.dist import DistInfo
from shardlm.train.build import build_model


def checkpoint_model_config(manifest: dict[str, Any]) -> ModelConfig:
    """The :class:`ModelConfig` recorded in a checkpoint's manifest.

    Raises:
        CheckpointError: the manifest has no usable model config.
    """
    try:
        return ModelConfig(**manifest["config"]["model"])
    except (KeyError, TypeError, ConfigError) as e:
        raise CheckpointError(f"the checkpoint manifest has no usable model config: {e}") from None


def load_model_weights(ckpt: str | Path) -> tuple[dict[str, torch.Tensor], ModelConfig, dict[str, Any]]:
    """Verify a checkpoint and read its full model weights into one process (no process group needed).

    Returns ``({HF parameter name: full CPU tensor}, model config, manifest)``. With tied embeddings
    the shared tensor appears once, as ``model.embed_tokens.weight``.

    Raises:
        CheckpointError: not a checkpoint, damaged, unsafe metadata, tensors that do not fit the
            recorded model config, or a checkpoint of trainable parameters only (LoRA, frozen layers).
    """
    path = Path(ckpt)
    manifest, metadata = verify_checkpoint(path)
    if manifest.get("base") is not None:
        raise CheckpointError(f"checkpoint {path} holds only the trainable parameters (LoRA adapters or "
                              "unfrozen layers) on top of a base it refers to: read it with "
                              "load_partial_checkpoint")
    cfg = checkpoint_model_config(manifest)
    with torch.device("meta"):
        model = build_causal_lm(cfg)  # shardlm's decoder or transformers' (model.backend)
    stored = metadata.state_dict_metadata
    state: dict[str, torch.Tensor] = {}
    # tied weights are listed once; persistent buffers (a transformers model's) are saved with the weights
    for name, p in [*model.named_parameters(), *persistent_buffers(model)]:
        entry = stored.get(f"model.{name}")
        dtype = entry.properties.dtype if isinstance(entry, TensorStorageMetadata) else p.dtype
        state[name] = torch.empty(p.shape, dtype=dtype)
    check_shapes(path, _only_model(metadata, cfg.tie_embeddings), {"model": state})
    _load_model_state(path, state, "the weights")
    return state, cfg, manifest


def _load_model_state(path: Path, state: dict[str, torch.Tensor], what: str) -> None:
    """Fill ``state`` ({name: tensor}, allocated to the stored shapes) from the ``model.*`` entries of the DCP
    checkpoint ``path``, in this one process.

    Raises:
        CheckpointError: DCP could not read them (``what`` names them in the message).
    """
    try:
        with warnings.catch_warnings():  # DCP warns that it loads in one process: that is the intent
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load({"model": state}, storage_reader=SafeFileSystemReader(path), planner=SafeLoadPlanner(),
                     no_dist=True)
    except CheckpointException as e:  # derives from BaseException
        raise CheckpointError(f"reading {what} of {path} failed: {e}") from None


def _only_model(metadata: Any, tied: bool) -> Any:
    """A shallow copy of DCP metadata restricted to ``model.*`` entries that are actual parameters.

    With tied embeddings the checkpoint also holds ``model.lm_head.weight``, which ``named_parameters``
    lists once; :func:`check_shapes` should not call it an unknown tensor.
    """
    md = copy(metadata)
    md.state_dict_metadata = {k: v for k, v in metadata.state_dict_metadata.items()
                              if k.startswith("model.") and not (tied and k == "model.lm_head.weight")}
    return md


def _base_config(path: Path, manifest: dict[str, Any]) -> Config:
    """The :class:`~shardlm.config.Config` that rebuilds a partial checkpoint's model in one process: the
    recorded model shape, ``[lora]`` and freezing settings and seed, ``parallel.mode = "single"``.

    Raises:
        CheckpointError: the manifest lacks them, or the base directory is gone or holds other weights than
            the checkpoint's base (SHA-256 of its safetensors files).
    """
    recorded, base = manifest.get("config") or {}, manifest["base"]
    try:
        train = recorded["train"]
        cfg = Config(model=checkpoint_model_config(manifest), lora=LoRAConfig(**recorded["lora"]),
                     train=TrainConfig(seed=train["seed"], trainable=train["trainable"],
                                       frozen=train["frozen"]),
                     parallel=ParallelConfig(mode="single", device="cpu"))
    except (KeyError, TypeError, ConfigError) as e:
        raise CheckpointError(
            f"the checkpoint manifest of {path} has no usable [lora] / train settings: {e}"
        ) from None
    init_from = base.get("init_from") or ""
    if init_from:
        where = Path(init_from)
        if not where.is_dir():
            raise CheckpointError(f"checkpoint {path} was trained on the base model directory {init_from!r} "
                                  "(model.init_from), which is not there (a relative path is taken from the "
                                  "current directory: run from the training's working directory)")
        files = sorted(where.glob("*.safetensors"))
        if [sha256_file(f) for f in files] != base.get("weights_sha256"):
            raise CheckpointError(f"checkpoint {path}: the weights in {init_from} are not the ones the "
                                  "adapters were trained on (SHA-256 of its safetensors files differs from "
                                  "the manifest's base)")
        cfg.model.init_from = str(where.resolve())
    return cfg


def rebuild_partial_model(ckpt: str | Path) -> tuple[torch.nn.Module, Config, dict[str, Any]]:
    """Rebuild the model of a checkpoint of trainable parameters only (LoRA adapters or unfrozen layers) in
    this process, on the CPU: its base as training built it (see the module docstring), the checkpoint's
    trainable tensors read in.

    Returns ``(model (a plain ``CausalLM``, with ``LoRALinear`` layers under LoRA), the rebuilding
    :class:`~shardlm.config.Config`, manifest)``.

    Raises:
        CheckpointError: not such a checkpoint, damaged, its base missing or changed, or tensors that do
        not fit.
    """
    path = Path(ckpt)
    manifest, metadata = verify_checkpoint(path)
    if manifest.get("base") is None:
        raise CheckpointError(f"checkpoint {path} holds every parameter: it has no adapters or base to "
                              "rebuild")
    cfg = _base_config(path, manifest)
    model, _ = build_model(cfg, DistInfo(0, 0, 1, torch.device("cpu"), "gloo"), None)
    trainable = {name: p.detach() for name, p in model.named_parameters() if p.requires_grad}
    check_shapes(path, _only_model(metadata, cfg.model.tie_embeddings), {"model": trainable})
    _load_model_state(path, trainable, "the trainable parameters")
    return model, cfg, manifest


def load_partial_checkpoint(ckpt: str | Path) -> tuple[dict[str, torch.Tensor], Config, dict[str, Any]]:
    """:func:`rebuild_partial_model`, then every parameter's full value: ``({name: CPU tensor} (LoRA: the base
    under its HF name, an NF4 base dequantised, plus ``*.lora_A/B.weight``), config, manifest)``.

    Raises:
        CheckpointError: see :func:`rebuild_partial_model`.
    """
    model, cfg, manifest = rebuild_partial_model(ckpt)
    return gather_full_params(model, True), cfg, manifest


def export_checkpoint(
    ckpt: str | Path, out_dir: str | Path, fmt: str = "hf", merge_into: str | None = None
) -> Path:
    """Write a checkpoint's weights as the same directory as a run's ``final/`` (``fmt="hf"``) or, for a LoRA
    checkpoint, ``final-adapter/`` (``fmt="peft"``); return it.

    The directory gets ``model.safetensors``, ``config.json`` and (when the checkpoint carries it)
    ``tokenizer.json``; it is written to a temporary name and renamed, so a failure leaves nothing. A
    checkpoint of trainable parameters only is rebuilt on its base (:func:`load_partial_checkpoint`); a LoRA
    one exported as ``hf`` is merged into ``merge_into``'s base (default: the run's ``lora.merge_into``),
    recorded in ``lora_merge.json``. The special ids are the manifest's (the model's own).

    Raises:
        CheckpointError: see :func:`load_model_weights` and :func:`load_partial_checkpoint`.
        ConfigError: ``fmt="peft"`` or ``merge_into`` for a checkpoint without LoRA adapters.
    """
    path = Path(ckpt)
    tokenizer = path / "tokenizer.json"
    tokenizer_path = tokenizer if tokenizer.is_file() else None
    manifest = read_manifest(path)  # which kind of checkpoint; the loaders below verify it
    lora = (manifest.get("base") or {}).get("lora") or None
    if lora is None and (fmt == "peft" or merge_into):
        raise ConfigError(f"checkpoint {path} has no LoRA adapters: --format peft and --merge-into apply to "
                          "LoRA checkpoints only (export it with --format hf)")
    if manifest.get("base") is None:
        state, cfg, manifest = load_model_weights(path)
        return save_model_dir(state, cfg, out_dir, tokenizer_path, manifest.get("special_ids"))
    state, run_cfg, manifest = load_partial_checkpoint(path)
    special = manifest.get("special_ids")
    if lora is None:  # unfrozen layers on a frozen base: every parameter, as final/
        return save_model_dir(state, run_cfg.model, out_dir, tokenizer_path, special)
    lc = run_cfg.lora
    spec = LoRASpec(lc.rank, lc.alpha, lc.dropout, lc.targets, lc.base_dtype)
    if fmt == "peft":
        return save_peft_dir(state, spec, out_dir, base_model_path(run_cfg.model.init_from), tokenizer_path,
                             special)
    record = save_merged_dir(state, run_cfg.model, spec, merge_into or lc.merge_into, run_cfg.model.init_from,
                             out_dir, tokenizer_path, special)
    print(f"{out_dir}: {record['description']}", flush=True)
    return Path(out_dir)
