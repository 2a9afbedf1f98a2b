"""Converting a GGUF Llama file (llama.cpp's format) into a Hugging Face Llama directory.

Tensors are read and dequantised to float32 with the PyPI ``gguf`` package (``GGUFReader``,
``gguf.quants.dequantize``). Two things llama.cpp's converter (``convert_hf_to_gguf.py``) did are
undone: ggml lists shapes innermost-first (``gguf`` already returns row-major numpy arrays, i.e.
HF's (out_features, in_features)), and the query and key projections had their rows permuted from
HF's rotate-half layout to llama.cpp's interleaved RoPE layout, per head:
``w.reshape(n_head, 2, rows // n_head // 2, cols).swapaxes(1, 2)``, with the key-value head count for
the key projection. :func:`unpermute_rows` is its inverse. The tokenizer (with its chat template)
is rebuilt from the file's metadata by ``transformers``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch

from shardlm.atomic import atomic_directory, save_safetensors
from shardlm.convert.hf_config import hf_config
from shardlm.errors import ModelDirError
from shardlm.model.config import ModelConfig
from shardlm.model.llama import Llama

_BLOCK_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def hf_name(gguf_name: str) -> str | None:
    """HF parameter name of a GGUF tensor name (``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.weight``).

    Returns None for tensors with no HF counterpart (``rope_freqs``...).
    """
    parts = gguf_name.split(".")
    if parts[0] == "blk" and len(parts) == 4 and parts[2] in _BLOCK_NAMES:
        return f"model.layers.{parts[1]}.{_BLOCK_NAMES[parts[2]]}.{parts[3]}"
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
    """Our :class:`ModelConfig` from a GGUF file's ``llama.*`` metadata.

    Raises:
        ModelDirError: ``general.architecture`` is not ``llama`` or a required key is missing (named).
    """
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise ModelDirError(f"{source}: general.architecture={arch!r}; only 'llama' GGUF files are supported")

    def need(key: str) -> Any:
        value = _field(reader, f"llama.{key}")
        if value is None:
            raise ModelDirError(f"{source}: GGUF metadata key llama.{key} is missing")
        return value

    cfg = ModelConfig(
        dim=int(need("embedding_length")), n_layers=int(need("block_count")), n_heads=int(need("attention.head_count")),
        n_kv_heads=int(_field(reader, "llama.attention.head_count_kv", need("attention.head_count"))),
        ffn_hidden=int(need("feed_forward_length")), max_seq_len=int(need("context_length")),
        rope_theta=_f32(_field(reader, "llama.rope.freq_base", 10000.0)),
        norm_eps=_f32(need("attention.layer_norm_rms_epsilon")), tie_embeddings=tied,
    )
    factor = _field(reader, "llama.rope.scaling.factor")
    if factor is not None and _field(reader, "llama.rope.scaling.type", "llama3") not in ("none", "llama3"):
        raise ModelDirError(f"{source}: RoPE scaling type {_field(reader, 'llama.rope.scaling.type')!r} is not supported")
    return cfg


def read_gguf_tensors(path: str | Path) -> tuple[dict[str, torch.Tensor], ModelConfig, Any]:
    """Dequantised float32 HF-named tensors, the model config, and the ``GGUFReader`` of a GGUF Llama file.

    Raises:
        ModelDirError: not a Llama GGUF file, a tensor of unknown name, or a missing tensor.
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
        name = hf_name(t.name)
        if name is None:
            if t.name == "rope_freqs.weight":  # Llama 3.1 scaling factors, recomputed from the config
                continue
            raise ModelDirError(f"{path}: GGUF tensor {t.name} has no Llama counterpart")
        array = gguf.quants.dequantize(t.data, t.tensor_type)
        w = torch.from_numpy(np.array(array, dtype=np.float32, copy=True)).reshape(tuple(reversed(t.shape.tolist())))
        if name.endswith("q_proj.weight"):
            w = unpermute_rows(w, cfg.n_heads)
        elif name.endswith("k_proj.weight"):
            w = unpermute_rows(w, cfg.n_kv_heads)
        tensors[name] = w.contiguous()
    cfg.vocab_size = tensors["model.embed_tokens.weight"].shape[0] if "model.embed_tokens.weight" in tensors else 0
    if not cfg.vocab_size:
        raise ModelDirError(f"{path}: GGUF tensor token_embd.weight is missing")
    return tensors, cfg, reader


def import_gguf(path: str | Path, out_dir: str | Path) -> Path:
    """Convert a GGUF Llama file into an HF Llama directory ``out_dir`` (written atomically).

    Writes ``model.safetensors`` (float32), ``config.json`` and the tokenizer files
    (``tokenizer.json``, ``tokenizer_config.json`` with the chat template) rebuilt by
    ``transformers.AutoTokenizer.from_pretrained(..., gguf_file=...)``.

    Raises:
        ModelDirError: see :func:`read_gguf_tensors`; a tensor whose shape the metadata contradicts.
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
        tok.save_pretrained(str(tmp))
        save_safetensors(tensors, tmp / "model.safetensors", metadata={"format": "pt"})
        config = hf_config(cfg, {k: (int(v) if v is not None else None) for k, v in special.items()})
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out
