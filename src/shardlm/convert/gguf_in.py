"""Converting a GGUF file (llama.cpp's format) of a built family (Llama, Qwen2, Qwen3, Gemma 3) into a Hugging Face
model directory.

Tensors are read and dequantised to float32 with the PyPI ``gguf`` package (``GGUFReader``,
``gguf.quants.dequantize``: F32/F16/BF16, Q4_0...Q8_0, the K-quants Q2_K...Q6_K that ``*_K_M`` files use, and the
IQ types). What llama.cpp's converter (``convert_hf_to_gguf.py``) did to the tensors is undone: ggml lists shapes
innermost-first (``gguf`` already returns row-major numpy arrays, i.e. HF's (out_features, in_features)); for Llama
only, the query and key projections had their rows permuted from HF's rotate-half layout to llama.cpp's
interleaved RoPE layout, per head: ``w.reshape(n_head, 2, rows // n_head // 2, cols).swapaxes(1, 2)``, with the
key-value head count for the key projection (:func:`unpermute_rows` is its inverse); for Gemma, 1 was added to
every RMSNorm weight (llama.cpp's norm multiplies by the weight, Gemma's by 1 + weight), and is subtracted here.
Gemma 3 settings that GGUF does not store (local RoPE base 10000, every 6th layer global, query_pre_attn_scalar)
are llama.cpp's and transformers' defaults. The tokenizer (with its chat template) is rebuilt from the file's
metadata by ``transformers``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch

from shardlm.atomic import atomic_directory, save_safetensors
from shardlm.convert.hf_config import hf_config
from shardlm.convert.hf_in import model_dir_special_ids
from shardlm.data.tokenizer_files import generation_config
from shardlm.errors import ModelDirError
from shardlm.model.config import ModelConfig
from shardlm.model.llama import Llama

#: GGUF ``general.architecture`` -> our family
GGUF_FAMILIES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma3": "gemma3"}

_BLOCK_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
}
#: Gemma's four norms per block: llama.cpp names the norm before the MLP ``ffn_norm``
_GEMMA_BLOCK_NAMES = {**_BLOCK_NAMES, "post_attention_norm": "post_attention_layernorm",
                      "ffn_norm": "pre_feedforward_layernorm", "post_ffw_norm": "post_feedforward_layernorm"}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def hf_name(gguf_name: str, family: str = "llama") -> str | None:
    """HF parameter name of a GGUF tensor name (``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.weight``).

    Returns None for tensors with no HF counterpart (``rope_freqs``...).
    """
    parts = gguf_name.split(".")
    names = _GEMMA_BLOCK_NAMES if family == "gemma3" else _BLOCK_NAMES
    if parts[0] == "blk" and len(parts) == 4 and parts[2] in names:
        return f"model.layers.{parts[1]}.{names[parts[2]]}.{parts[3]}"
    if len(parts) == 2 and parts[0] in _TOP_NAMES:
        return f"{_TOP_NAMES[parts[0]]}.{parts[1]}"
    return None


def unpermute_rows(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's per-head row permutation of a query or key projection, (rows, cols) -> same.

    llama.cpp: ``w.reshape(n_head, 2, rows // n_head // 2, cols).swapaxes(1, 2).reshape(rows, cols)``
    (``convert_hf_to_gguf.py``, ``LlamaModel.permute``); its inverse swaps the same axes back.
    ``n_head`` is the query head count for ``q_proj`` and the key-value head count for ``k_proj``.
    """
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _field(reader: Any, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def _f32(value: float) -> float:
    """The shortest decimal that round-trips a float32 value (GGUF stores 1e-5 as 9.9999997e-06)."""
    return float(str(np.float32(value)))


def gguf_model_config(reader: Any, source: str, tied: bool) -> ModelConfig:
    """Our :class:`ModelConfig` from a GGUF file's ``<architecture>.*`` metadata.

    Raises:
        ModelDirError: ``general.architecture`` is not a built family (:data:`GGUF_FAMILIES`), a required key is
            missing, or a RoPE scaling type is not built (named).
    """
    arch = _field(reader, "general.architecture")
    if arch not in GGUF_FAMILIES:
        raise ModelDirError(f"{source}: general.architecture={arch!r}; the GGUF architectures built are "
                            f"{', '.join(GGUF_FAMILIES)}")
    family = GGUF_FAMILIES[arch]

    def need(key: str) -> Any:
        value = _field(reader, f"{arch}.{key}")
        if value is None:
            raise ModelDirError(f"{source}: GGUF metadata key {arch}.{key} is missing")
        return value

    dim, heads = int(need("embedding_length")), int(need("attention.head_count"))
    head_width = int(_field(reader, f"{arch}.attention.key_length", 0) or 0)
    cfg = ModelConfig(
        family=family, dim=dim, n_layers=int(need("block_count")), n_heads=heads,
        n_kv_heads=int(_field(reader, f"{arch}.attention.head_count_kv", heads)),
        head_width=0 if head_width == dim // heads and dim % heads == 0 else head_width,
        ffn_hidden=int(need("feed_forward_length")), max_seq_len=int(need("context_length")),
        rope_theta=_f32(_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        norm_eps=_f32(need("attention.layer_norm_rms_epsilon")), tie_embeddings=tied,
    )
    scaling = _field(reader, f"{arch}.rope.scaling.type")
    factor = _field(reader, f"{arch}.rope.scaling.factor")
    if family == "gemma3":
        cfg.sliding_window = int(_field(reader, f"{arch}.attention.sliding_window", 4096))
        cfg.sliding_window_pattern, cfg.rope_local_theta = 6, 10000.0
        if cfg.n_layers == 62:  # Gemma 3 27B scales by hidden / heads, not the head width (llama.cpp's rule)
            cfg.query_pre_attn_scalar = float(dim // heads)
        if scaling == "linear" and factor:
            cfg.rope_linear_factor = float(factor)
    elif factor is not None and scaling not in (None, "none", "llama3"):
        raise ModelDirError(f"{source}: GGUF metadata {arch}.rope.scaling.type={scaling!r} is not supported")
    if scaling == "linear" and family != "gemma3":
        raise ModelDirError(f"{source}: GGUF metadata {arch}.rope.scaling.type='linear' is not supported for {arch}")
    return cfg


def dequantize(tensor: Any, source: str) -> np.ndarray:
    """A GGUF tensor dequantised to a float32 numpy array, row-major (HF layout).

    Raises:
        ModelDirError: naming the tensor and its quantisation type, when ``gguf`` cannot dequantise it.
    """
    import gguf

    try:
        array = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    except (NotImplementedError, ValueError) as e:
        raise ModelDirError(f"{source}: GGUF tensor {tensor.name} has quantisation type {tensor.tensor_type.name}, "
                            f"which cannot be dequantised ({e})") from None
    return np.array(array, dtype=np.float32, copy=True).reshape(tuple(reversed(tensor.shape.tolist())))


def read_gguf_tensors(path: str | Path) -> tuple[dict[str, torch.Tensor], ModelConfig, Any]:
    """Dequantised float32 HF-named tensors, the model config, and the ``GGUFReader`` of a GGUF file.

    Raises:
        ModelDirError: not a GGUF file of a built family, a tensor of unknown name, a quantisation type that
            cannot be dequantised, or a missing embedding.
    """
    import gguf

    path = Path(path)
    if not path.is_file():
        raise ModelDirError(f"GGUF file not found: {path}")
    try:
        reader = gguf.GGUFReader(str(path))
    except Exception as e:  # the reader raises ValueError/struct.error/... on a file that is not GGUF
        raise ModelDirError(f"{path}: not a readable GGUF file ({e})") from None
    names = {t.name for t in reader.tensors}
    cfg = gguf_model_config(reader, str(path), tied="output.weight" not in names)
    tensors: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        name = hf_name(t.name, cfg.family)
        if name is None:
            if t.name == "rope_freqs.weight":  # Llama 3.1 scaling factors, recomputed from the config
                continue
            raise ModelDirError(f"{path}: GGUF tensor {t.name} has no {cfg.family} counterpart")
        w = torch.from_numpy(dequantize(t, str(path)))
        if cfg.family == "llama" and name.endswith("q_proj.weight"):
            w = unpermute_rows(w, cfg.n_heads)
        elif cfg.family == "llama" and name.endswith("k_proj.weight"):
            w = unpermute_rows(w, cfg.kv_heads)
        elif cfg.arch.gemma_norms and name.endswith("norm.weight"):
            w = w - 1.0
        tensors[name] = w.contiguous()
    cfg.vocab_size = tensors["model.embed_tokens.weight"].shape[0] if "model.embed_tokens.weight" in tensors else 0
    if not cfg.vocab_size:
        raise ModelDirError(f"{path}: GGUF tensor token_embd.weight is missing")
    return tensors, cfg, reader


def import_gguf(path: str | Path, out_dir: str | Path) -> Path:
    """Convert a GGUF file of a built family into an HF model directory ``out_dir`` (written atomically).

    Writes ``model.safetensors`` (float32), ``config.json`` and ``generation_config.json`` (the
    file's bos/eos ids, the tokenizer's pad id) and the tokenizer files (``tokenizer.json``,
    ``tokenizer_config.json`` with ``model_max_length`` = the context, ``chat_template.jinja``)
    rebuilt by ``transformers.AutoTokenizer.from_pretrained(..., gguf_file=...)``.

    Raises:
        ModelDirError: see :func:`read_gguf_tensors`; a tensor whose shape the metadata contradicts; the
            file's eos id is not its tokenizer's eos token.
        ImportError: ``gguf`` or ``transformers`` is not installed (``pip install 'shardlm[gguf]'``).
    """
    path, out = Path(path), Path(out_dir)
    tensors, cfg, reader = read_gguf_tensors(path)
    with torch.device("meta"):
        expected = {n: tuple(p.shape) for n, p in Llama(cfg).named_parameters()}
    for name, shape in expected.items():
        if name not in tensors:
            raise ModelDirError(f"{path}: tensor {name} is missing from the GGUF file")
        if tuple(tensors[name].shape) != shape:
            raise ModelDirError(f"{path}: tensor {name} has shape {tuple(tensors[name].shape)}, the metadata implies {shape}")
    special = {"bos": _field(reader, "tokenizer.ggml.bos_token_id"), "eos": _field(reader, "tokenizer.ggml.eos_token_id")}
    from transformers import AutoTokenizer

    with atomic_directory(out) as tmp:  # a failure never leaves a half-written out_dir
        tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        if tok.model_max_length >= 1e29:  # transformers' "no limit": the model's context instead
            tok.model_max_length = cfg.max_seq_len
        tok.save_pretrained(str(tmp))
        save_safetensors(tensors, tmp / "model.safetensors", metadata={"format": "pt"})
        special = {k: (int(v) if v is not None else None) for k, v in special.items()}
        special["pad"] = tok.pad_token_id
        config = hf_config(cfg, special)
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        gen = generation_config({**special, "eos": [special["eos"]] if special["eos"] is not None else []})
        (tmp / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
        model_dir_special_ids(tmp)  # the file's eos id and its tokenizer's eos token agree
    return out
