"""Hugging Face ``config.json`` <-> :class:`ModelConfig`, both directions, for the built families (each
family's own fields are its entry of :mod:`shardlm.model.families`).

Reads transformers 4.x and 5.x layouts (``rope_scaling`` or ``rope_parameters``) and refuses, naming the
field, what the model does not build. Imports no torch and nothing above ``model/``: the configuration reads
it (``model.init_from``'s shape, :func:`shardlm.config.load.apply_init_from`), and so do the converters of
``convert/`` and the planner's presets.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from shardlm.errors import ModelDirError
from shardlm.json_file import read_json
from shardlm.model.config import ModelConfig
from shardlm.model.families import by_model_type
from shardlm.model.families.registry import HF_ACTIVATIONS


def written_special_ids(special_ids: dict[str, Any] | None) -> dict[str, Any]:
    """``{"bos", "eos", "pad"}`` as a model directory records them: ``eos`` an int, or a list when several.

    Takes :func:`shardlm.data.tokenizer_files.model_special_ids`' dict; an older one with ``eod``
    (data prepared before the tokenizer's files were kept) gives the end-of-document id as eos,
    the token that ends each document of the training data.
    """
    special = dict(special_ids or {})
    eos = special["eod"] if special.get("eod") is not None else special.get("eos")
    if isinstance(eos, list):
        eos = eos[0] if len(eos) == 1 else (eos or None)
    return {"bos": special.get("bos"), "eos": eos, "pad": special.get("pad")}


def hf_config(cfg: ModelConfig, special_ids: dict[str, Any] | None = None,
              dtype: object = "float32") -> dict:
    """The ``config.json`` dict for a model of shape ``cfg``, in its family's layout (``model_type`` from
    :data:`~shardlm.model.families.FAMILIES`).

    ``special_ids`` gives the ``bos``/``eos``/``pad`` token ids (see :func:`written_special_ids`);
    ``dtype`` (a ``torch.dtype`` or its name) is recorded as ``torch_dtype``. RoPE is written in the
    transformers 4.x form (``rope_theta``, ``rope_scaling``), which 5.x also reads.
    """
    special_ids = written_special_ids(special_ids)
    arch = cfg.arch
    config = {
        "architectures": [arch.architecture],
        "model_type": arch.model_type,
        "hidden_size": cfg.dim,
        "intermediate_size": cfg.ffn_dim,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.kv_heads,
        "head_dim": cfg.head_dim,
        "vocab_size": cfg.vocab_size,
        "max_position_embeddings": cfg.max_seq_len,
        "rope_theta": cfg.rope_theta,
        "rms_norm_eps": cfg.norm_eps,
        "tie_word_embeddings": cfg.tie_embeddings,
        "bos_token_id": special_ids.get("bos"),
        "eos_token_id": special_ids.get("eos"),
        "pad_token_id": special_ids.get("pad"),
        "torch_dtype": str(dtype).removeprefix("torch."),
    }
    config[arch.hf_activation_key] = HF_ACTIVATIONS[arch.activation]
    config.update({flag: False for flag in arch.hf_false_flags})
    config.update(arch.hf_fields_out(cfg))
    scaling = rope_scaling_out(cfg)
    if scaling or arch.hf_default_rope:  # a family whose transformers default is a scaling: say "default"
        config["rope_scaling"] = scaling or {"rope_type": "default"}
    return config


def rope_scaling_out(cfg: ModelConfig) -> dict[str, Any]:
    """``cfg``'s RoPE scaling as a transformers ``rope_scaling`` dict (llama3, linear, yarn or dynamic, with
    the fields :func:`_rope_fields` reads back); {} without scaling."""
    if cfg.rope_scaling_factor > 0:  # Llama 3.1 RoPE scaling
        return {"rope_type": "llama3", "factor": cfg.rope_scaling_factor,
                "low_freq_factor": cfg.rope_low_freq_factor, "high_freq_factor": cfg.rope_high_freq_factor,
                "original_max_position_embeddings": cfg.rope_original_max_seq_len}
    if cfg.rope_linear_factor > 0:
        return {"rope_type": "linear", "factor": cfg.rope_linear_factor}
    if cfg.rope_yarn_factor > 0:
        yarn = {"rope_type": "yarn", "factor": cfg.rope_yarn_factor,
                "original_max_position_embeddings": cfg.rope_original_max_seq_len,
                "beta_fast": cfg.rope_yarn_beta_fast, "beta_slow": cfg.rope_yarn_beta_slow,
                "truncate": cfg.rope_yarn_truncate}
        if cfg.rope_yarn_attention_factor > 0:
            yarn["attention_factor"] = cfg.rope_yarn_attention_factor
        return yarn
    if cfg.rope_dynamic_factor > 0:
        return {"rope_type": "dynamic", "factor": cfg.rope_dynamic_factor}
    return {}


def _rope_number(rope: dict[str, Any], name: str, where: str) -> float:
    """``rope[name]`` as a float: a RoPE scaling dict's factor or length (``where`` names the dict in errors).

    Raises:
        ModelDirError: the field is missing, not a number (``null``, a string, a boolean), not finite, or not
            positive: every factor and length transformers reads there is > 0 (0 here would mean "off").
    """
    if name not in rope:
        raise ModelDirError(f"{where} lacks field {name!r}")
    value = rope[name]
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not number or not math.isfinite(value) or value <= 0:
        raise ModelDirError(f"{where} field {name!r} must be a positive number, got {value!r}")
    return float(value)


def _rope_fields(cfg: ModelConfig, rope: dict[str, Any], source: str, key: str) -> None:
    """Set ``cfg``'s RoPE scaling from a ``rope_scaling`` / ``rope_parameters`` dict (``key`` names it).

    Raises:
        ModelDirError: a rope type not built, or a factor or length missing, not a number or not positive.
    """
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    where = f"{source}: {key} ({rope_type})"
    if rope_type == "llama3":
        cfg.rope_scaling_factor = _rope_number(rope, "factor", where)
        cfg.rope_low_freq_factor = _rope_number(rope, "low_freq_factor", where)
        cfg.rope_high_freq_factor = _rope_number(rope, "high_freq_factor", where)
        if "original_max_position_embeddings" in rope:
            cfg.rope_original_max_seq_len = int(_rope_number(rope, "original_max_position_embeddings", where))
        else:
            cfg.rope_original_max_seq_len = cfg.max_seq_len
    elif rope_type == "linear":
        cfg.rope_linear_factor = _rope_number(rope, "factor", where)
    elif rope_type == "yarn":
        for name in ("factor", "original_max_position_embeddings"):  # may be absent or null (_yarn_fields)
            if rope.get(name) is not None:
                _rope_number(rope, name, where)
        _yarn_fields(cfg, rope)
    elif rope_type == "dynamic":
        cfg.rope_dynamic_factor = _rope_number(rope, "factor", where)
    elif rope_type != "default":
        raise ModelDirError(f"{source}: {key} rope_type {rope_type!r} is not supported (built: default, "
                            "linear, llama3, yarn, dynamic)")


def _yarn_fields(cfg: ModelConfig, rope: dict[str, Any]) -> None:
    """Set ``cfg``'s YaRN fields from a ``rope_type = "yarn"`` dict as transformers 5.24 reads it
    (``_compute_yarn_parameters``): ``original_max_position_embeddings`` defaults to
    ``max_position_embeddings``, a missing ``factor`` is their ratio, ``beta_fast`` / ``beta_slow`` default to
    32 / 1, ``truncate`` to true; the attention factor is ``attention_factor``, else DeepSeek's ``mscale(s,
    mscale) / mscale(s, mscale_all_dim)`` with ``mscale(s, m) = 0.1 · m · ln(s) + 1`` (1 when s <= 1) when
    both are set, else left to the default (0)."""
    original = int(rope.get("original_max_position_embeddings") or cfg.max_seq_len)
    factor = float(rope["factor"]) if rope.get("factor") is not None else cfg.max_seq_len / original

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention = rope.get("attention_factor")
    if attention is None and rope.get("mscale") and rope.get("mscale_all_dim"):
        attention = mscale(factor, float(rope["mscale"])) / mscale(factor, float(rope["mscale_all_dim"]))
    cfg.rope_yarn_factor, cfg.rope_original_max_seq_len = factor, original
    cfg.rope_yarn_attention_factor = float(attention or 0.0)
    cfg.rope_yarn_beta_fast = float(rope.get("beta_fast") or 32)
    cfg.rope_yarn_beta_slow = float(rope.get("beta_slow") or 1)
    cfg.rope_yarn_truncate = bool(rope.get("truncate", True))


def model_config_from_hf_dict(config: dict[str, Any], source: str = "config.json") -> ModelConfig:
    """Our :class:`ModelConfig` from an HF ``config.json`` dict (transformers 4.x or 5.x layout) of a built
    family: ``llama``, ``qwen2``, ``qwen3``, ``mistral`` or ``gemma3_text``
    (:data:`~shardlm.model.families.FAMILIES`).

    Reads the shape (with an explicit ``head_dim``), ``rope_theta`` (top level or in ``rope_parameters``, per
    layer type for Gemma 3), RoPE scaling (``llama3``, ``linear``), the sliding window and which layers use
    it, Gemma's ``query_pre_attn_scalar`` and soft-capping, ``rms_norm_eps`` and ``tie_word_embeddings``.

    Raises:
        ModelDirError: naming the field: a ``model_type``/``architectures`` not built (e.g. a mixture of
            experts), a missing required field, an activation or bias the family does not have, a RoPE type
            not built, attention soft-capping, or a layer pattern other than Gemma's every-n-th-global;
            weights quantised with torchao (a QAT run's ``final-quantized/``).
    """
    model_type = config.get("model_type")
    arch = by_model_type(model_type, config.get("architectures"), source)
    quant = config.get("quantization_config")
    if isinstance(quant, dict) and quant.get("quant_method") == "torchao":
        raise ModelDirError(f"{source}: weights quantised with torchao (quantization_config), as a QAT "
                            "run's final-quantized/ holds them: shardlm reads unquantised weights, which "
                            "that run's final/ holds (final-quantized/ loads in transformers with torchao "
                            "installed)")
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size"):
        if key not in config:
            raise ModelDirError(f"{source}: missing field {key!r}")
    dim, heads = int(config["hidden_size"]), int(config["num_attention_heads"])
    act_key, built_act = arch.hf_activation_key, HF_ACTIVATIONS[arch.activation]
    act = config.get(act_key) or built_act
    if act != built_act:
        raise ModelDirError(f"{source}: {act_key}={act!r} is not supported for {model_type}")
    for key in arch.hf_false_flags:
        if config.get(key):
            raise ModelDirError(f"{source}: {key}=true is not supported for {model_type}")
    for key in ("attn_logit_softcapping",):
        if config.get(key):
            raise ModelDirError(f"{source}: {key}={config[key]} is not supported (attention soft-capping is "
                                "not built)")
    rope = dict(config.get("rope_parameters") or {})
    per_layer_type = "full_attention" in rope or "sliding_attention" in rope  # Gemma 3 in the 5.x layout
    global_rope = dict(rope.get("full_attention") or {}) if per_layer_type else rope
    local_rope = dict(rope.get("sliding_attention") or {}) if per_layer_type else {}
    theta = config.get("rope_theta", global_rope.get("rope_theta", arch.hf_default_rope_theta))
    head_width = int(config.get("head_dim") or 0) or arch.hf_default_head_dim
    cfg = ModelConfig(
        family=arch.name, dim=dim, n_layers=int(config["num_hidden_layers"]), n_heads=heads,
        n_kv_heads=int(config.get("num_key_value_heads") or heads),
        head_width=0 if head_width == dim // heads and dim % heads == 0 else head_width,
        ffn_hidden=int(config["intermediate_size"]),
        vocab_size=int(config["vocab_size"]), max_seq_len=int(config.get("max_position_embeddings", 2048)),
        rope_theta=float(theta), norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        tie_embeddings=bool(config.get("tie_word_embeddings", arch.hf_default_tie)),
    )
    scaling = config.get("rope_scaling")
    if scaling is not None and not isinstance(scaling, dict):
        raise ModelDirError(f"{source}: rope_scaling must be an object (a dict with rope_type), "
                            f"got {scaling!r}")
    if not scaling and config.get("rope_parameters") is None:
        # transformers' default for the family (gpt-oss: YaRN)
        scaling = arch.hf_default_rope
    _rope_fields(cfg, dict(scaling) if scaling else global_rope, source,
                 "rope_scaling" if scaling else "rope_parameters")
    if local_rope.get("rope_type", "default") != "default":
        raise ModelDirError(f"{source}: rope_parameters.sliding_attention rope_type "
                            f"{local_rope['rope_type']!r} is not supported (local layers: default only)")
    arch.hf_fields_in(cfg, config, local_rope, source)
    return cfg


def read_model_dir_config(path: str | Path) -> ModelConfig:
    """The :class:`ModelConfig` of an HF model directory, from its ``config.json``.

    Raises:
        ModelDirError: the directory or its ``config.json`` is missing or invalid, or of a family not built.
    """
    path = Path(path)
    file = path / "config.json"
    if not file.is_file():
        raise ModelDirError(f"{path} is not a model directory: config.json not found")
    return model_config_from_hf_dict(read_json(file, ModelDirError), str(file))
