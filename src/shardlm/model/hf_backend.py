"""Any causal language model of transformers (``model.backend = "transformers"``) behind :class:`CausalLM`'s
contract: :class:`HFCausalLM`.

The model is transformers' own ``AutoModelForCausalLM.from_config`` of ``model.init_from``'s ``config.json``
(``trust_remote_code`` is never turned on: a model whose code is not in transformers is refused). The adapter
keeps the two halves of that model under the names transformers gives them, ``model`` (the decoder: embedding,
decoder layers, final norm) and ``lm_head``, so its parameter names, its state dict and its checkpoints are
transformers' names, and everything shardlm applies from outside finds what it finds on :class:`CausalLM`:
``model.layers`` (the decoder layers: FSDP groups, activation checkpointing, compile), ``model.embed_tokens``,
``model.norm``, ``lm_head`` (the chunked loss reads it), ``cfg.tie_embeddings`` and
``cfg.final_logit_softcap``.

``forward(tokens, documents=..., head=...)`` runs the decoder (``model(input_ids, position_ids,
attention_mask)``) to its final hidden states and either returns ``head(self, hidden)`` (the chunked loss of
:mod:`shardlm.train.loss`: no whole logits) or the logits ``lm_head(hidden)`` with the model's final soft-cap.

What a head may do to the logits is read from the config (:data:`APPLIED_LOGIT_FIELDS`,
:data:`REFUSED_LOGIT_FIELDS`); a transform not in either list, written into a model's own ``forward``, is not
detected. Packed documents reach the attention as per-document ``position_ids`` and a 4-D block-causal boolean
``attention_mask`` (transformers uses a 4-D mask as given), for the architectures where a test checked that
this keeps documents apart (:data:`PACKING_VERIFIED`).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from shardlm.errors import ConfigError, ModelDirError
from shardlm.model.attention import dense_mask, document_positions
from shardlm.model.config import ModelConfig
from shardlm.model.decoder import CausalLM

#: config.json fields that change the logits after the output projection and are applied here (by the chunked
#: loss and by ``forward``): Gemma 2/3's final soft-cap
APPLIED_LOGIT_FIELDS = ("final_logit_softcapping",)

#: config.json fields that scale the logits in some models' own ``forward`` (Cohere's ``logit_scale``,
#: Granite's ``logits_scaling``, ...), not applied by this backend: a model with one of them set (to other
#: than 1) is refused by name
REFUSED_LOGIT_FIELDS = ("logit_scale", "logits_scaling", "output_multiplier_scale", "lm_head_multiplier",
                        "mup_width_multiplier", "output_mult")

#: model types whose packed rows were checked to equal each document alone, and a perturbation of one document
#: to change no other's logits (tests/unit/test_hf_backend.py); hybrid linear-attention models (Qwen3-Next,
#: Qwen3.5) run their recurrent layers over the whole row and are not in it
PACKING_VERIFIED = frozenset({"llama", "qwen3", "qwen3_moe", "deepseek_v3", "glm4", "phi3", "olmo2"})


def read_hf_config(path: str | Path) -> Any:
    """The transformers config of the model directory ``path`` (``AutoConfig``, never remote code).

    Raises:
        ModelDirError: no ``config.json``; a ``model_type`` transformers does not know (or one that needs
            ``trust_remote_code``, which shardlm never turns on); a head transform of
            :data:`REFUSED_LOGIT_FIELDS`.
    """
    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    file = Path(path) / "config.json"
    if not file.is_file():
        raise ModelDirError(f"model.init_from={str(path)!r}: no config.json there "
                            "(model.backend='transformers' reads the architecture from it)")
    raw = json.loads(file.read_text())
    if raw.get("auto_map"):
        raise ModelDirError(f"{file}: a remote-code model (auto_map {sorted(raw['auto_map'])}): its "
                            "modelling code is not part of transformers, and shardlm never turns on "
                            "trust_remote_code")
    model_type = raw.get("model_type")
    if model_type not in CONFIG_MAPPING:
        raise ModelDirError(f"{file}: model_type {model_type!r} is not an architecture transformers "
                            f"{_transformers_version()} knows (and shardlm never runs remote code)")
    check_causal_lm(file, raw)
    config = AutoConfig.from_pretrained(str(path), trust_remote_code=False)
    for field in REFUSED_LOGIT_FIELDS:
        value = getattr(config, field, None)
        if value not in (None, 1, 1.0):
            raise ModelDirError(f"{file}: {field}={value} scales the logits in the model's own forward, "
                                "which the transformers backend's loss does not apply: not supported yet")
    return config


def check_causal_lm(file: Path, raw: dict) -> None:
    """Refuse a ``config.json`` whose ``architectures`` are all something else than a causal language model
    with its head: a base model saved without it (``LlamaModel``), a masked LM (``BertForMaskedLM``), a
    classifier. Causal LMs are transformers' ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`` (and its image-text-to-text
    models, whose language model shardlm trains); a config without ``architectures`` is not checked.

    Raises:
        ModelDirError: naming the architectures and the causal LM of the ``model_type``.
    """
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES,
    )

    architectures = raw.get("architectures") or []
    causal = {*MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values(),
              *MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES.values()}
    if not architectures or any(name in causal or name.endswith("ForCausalLM") for name in architectures):
        return
    head = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(raw.get("model_type"))
    raise ModelDirError(f"{file}: architectures {architectures} is not a causal language model with its head"
                        + (f" ({head})" if head else "") + ": shardlm trains causal LMs; save the model "
                        "with its LM head (AutoModelForCausalLM's save_pretrained)")


def _transformers_version() -> str:
    import transformers

    return transformers.__version__


def fill_model_config(cfg: ModelConfig, config: Any) -> None:
    """Set ``cfg``'s shape fields from the transformers ``config`` that they describe (in place): what the
    rest of shardlm reads of a model's shape (the summary, FLOPs, the planner's activation estimate, the
    sequence limit, tied embeddings, the final soft-cap). ``family`` and the mixture-of-experts fields keep
    their defaults: the transformers model, not the native families, defines the architecture."""
    text = config.get_text_config()
    heads = int(getattr(text, "num_attention_heads", 1) or 1)
    dim = int(text.hidden_size)
    cfg.dim, cfg.n_layers, cfg.n_heads = dim, int(text.num_hidden_layers), heads
    cfg.n_kv_heads = int(getattr(text, "num_key_value_heads", 0) or 0)
    head_dim = getattr(text, "head_dim", None)
    cfg.head_width = int(head_dim) if isinstance(head_dim, int) and head_dim > 0 else 0
    cfg.ffn_hidden = int(getattr(text, "intermediate_size", 0) or 0)
    cfg.vocab_size = int(text.vocab_size)
    cfg.max_seq_len = int(getattr(text, "max_position_embeddings", cfg.max_seq_len) or cfg.max_seq_len)
    cfg.tie_embeddings = bool(getattr(text, "tie_word_embeddings", False))
    cfg.final_logit_softcap = float(getattr(text, "final_logit_softcapping", None) or 0.0)
    cfg.norm_eps = float(getattr(text, "rms_norm_eps", None) or getattr(text, "layer_norm_eps", None)
                         or cfg.norm_eps)


def decoder_layer_list(hf_model: nn.Module) -> nn.ModuleList:
    """The ``nn.ModuleList`` of decoder layers at ``hf_model.model.layers``, recognised by its elements being
    instances of the model's ``_no_split_modules`` classes (transformers' own list of the blocks that must not
    be split), not by the family's name.

    Raises:
        ConfigError: the model's decoder has no such list at ``model.layers`` (named with what was found).
    """
    name = type(hf_model).__name__
    blocks = set(getattr(hf_model, "_no_split_modules", None) or ())
    decoder = getattr(hf_model, "model", None)
    layers = getattr(decoder, "layers", None)
    if not isinstance(layers, nn.ModuleList) or not len(layers) or not blocks:
        raise ConfigError(f"{name}: no decoder-layer list at model.layers (found {type(layers).__name__}): "
                          "the transformers backend shards and checkpoints one decoder layer at a time")
    kinds = {type(layer).__name__ for layer in layers}
    if not kinds <= blocks:
        raise ConfigError(f"{name}: model.layers holds {sorted(kinds)}, not the model's decoder layers "
                          f"{sorted(blocks)} (_no_split_modules)")
    for part in ("embed_tokens", "norm"):
        if not isinstance(getattr(decoder, part, None), nn.Module):
            raise ConfigError(f"{name}: its decoder has no {part} module (the layout the transformers "
                              "backend groups for FSDP: model.embed_tokens, model.layers, model.norm, "
                              "lm_head)")
    return layers


class HFCausalLM(nn.Module):
    """A transformers ``*ForCausalLM`` seen as shardlm's :class:`~shardlm.model.decoder.CausalLM`.

    ``model``: the transformers decoder (``hf.model``); ``lm_head``: its output projection; ``cfg``: the run's
    :class:`ModelConfig` (shape fields filled by :func:`fill_model_config`); ``hf_config``: the transformers
    config. The whole ``*ForCausalLM`` is kept out of the module tree (its parameters are these two), so the
    names are transformers' own and listed once.
    """

    def __init__(self, cfg: ModelConfig, hf_config: Any) -> None:
        from transformers import AutoModelForCausalLM

        super().__init__()
        self.cfg, self.hf_config = cfg, hf_config
        # always sdpa (any device): a model whose attention needs another kernel (eager-only soft-capping,
        # flash-only code) is refused here with transformers' own reason
        try:
            hf = AutoModelForCausalLM.from_config(hf_config, attn_implementation="sdpa",
                                                  trust_remote_code=False)
        except ValueError as err:
            raise ConfigError(f"{cfg.init_from}: transformers cannot build {type(hf_config).__name__} as a "
                              f"causal LM with sdpa attention: {err}") from None
        decoder_layer_list(hf)
        self.model, self.lm_head = hf.model, hf.lm_head
        object.__setattr__(self, "hf", hf)  # not a submodule: its parameters are model's and lm_head's
        self.model_type = str(hf_config.model_type)

    def to_empty(self, *, device: torch.device | str | None, recurse: bool = True) -> HFCausalLM:
        """``nn.Module.to_empty``, keeping a tied output weight the same tensor as the embedding."""
        super().to_empty(device=device, recurse=recurse)
        embed = self.model.embed_tokens
        if self.cfg.tie_embeddings and self.lm_head.weight is not embed.weight:
            self.lm_head.weight = embed.weight
        return self

    @torch.no_grad()
    def init_rotary(self) -> None:
        """Recompute the tables of every parameter-free module that holds buffers (the rotary embeddings), by
        transformers' own ``_init_weights`` (needed after ``to_empty``)."""
        for module in self.model.modules():
            if any(True for _ in module.buffers(recurse=False)) and not any(
                    True for _ in module.parameters(recurse=False)):
                self.hf._init_weights(module)

    def forward(self, tokens: torch.Tensor, cache: Any = None, documents: torch.Tensor | None = None,
                head: Callable[[nn.Module, torch.Tensor], torch.Tensor] | None = None,
                positions: torch.Tensor | None = None, masks: Any = None,
                real_tokens: torch.Tensor | None = None) -> torch.Tensor:
        """tokens (batch, seq) int64 -> logits (batch, seq, vocab) in the compute dtype, or ``head(self,
        hidden)`` with hidden the decoder's final hidden states (batch, seq, dim).

        ``documents`` (batch, seq) int64 (padding -1): each token's document in a packed row; the decoder gets
        per-document ``position_ids`` and a (batch, 1, seq, seq) boolean block-causal ``attention_mask``.
        ``real_tokens`` is accepted for the contract and not used (this backend adds no router statistics).

        Raises:
            ValueError: a KV cache or context parallelism's ``positions``/``masks`` (not built for this
                backend); documents for a model type outside :data:`PACKING_VERIFIED`, of another shape than
                ``tokens``, or under ``attention = "causal"``.
        """
        if cache is not None or positions is not None or masks is not None:
            raise ValueError("the transformers backend runs no KV cache and no context parallelism")
        kwargs: dict[str, Any] = {}
        if documents is not None:
            check_packing(self.model_type, self.cfg.attention)
            if documents.shape != tokens.shape:
                raise ValueError(f"documents {tuple(documents.shape)} need the tokens' shape "
                                 f"{tuple(tokens.shape)}")
            kwargs = {"position_ids": document_positions(documents), "attention_mask": dense_mask(documents)}
        out = self.model(input_ids=tokens, use_cache=False, **kwargs)
        hidden = out[0]
        if head is not None:
            return head(self, hidden)
        logits = self.lm_head(hidden)
        if self.cfg.final_logit_softcap:
            c = self.cfg.final_logit_softcap
            logits = torch.tanh(logits / c) * c
        return logits


def check_packing(model_type: str, attention: str) -> None:
    """Refuse packed documents where this backend cannot keep them apart.

    Raises:
        ValueError: ``attention = "causal"``; a model type outside :data:`PACKING_VERIFIED` (named).
    """
    if attention == "causal":
        raise ValueError("documents= given to a model with attention = 'causal': set 'block_causal' (or "
                         "'auto')")
    if model_type not in PACKING_VERIFIED:
        raise ValueError(f"packed documents on model_type {model_type!r}: not verified to keep documents "
                         "apart under the transformers backend (verified: "
                         f"{', '.join(sorted(PACKING_VERIFIED))}); "
                         "train it unpacked (data.pack = false)")


def build_hf_model(cfg: ModelConfig) -> HFCausalLM:
    """The transformers model of ``cfg.init_from``'s ``config.json`` behind :class:`HFCausalLM`, built on the
    current default device (the meta device when training builds it).

    Raises:
        ModelDirError: see :func:`read_hf_config`. ConfigError: see :func:`decoder_layer_list`.
    """
    return HFCausalLM(cfg, read_hf_config(cfg.init_from))


def build_causal_lm(cfg: ModelConfig) -> nn.Module:
    """The model of ``cfg`` on the current default device: :class:`CausalLM` (``backend = "native"``) or
    :func:`build_hf_model`'s (``"transformers"``). The one place that chooses; training, FLOPs and the planner
    build through it."""
    return build_hf_model(cfg) if cfg.backend == "transformers" else CausalLM(cfg)
