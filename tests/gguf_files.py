"""Small GGUF files written the way llama.cpp's ``convert_hf_to_gguf.py`` writes them, for tests.

From a transformers model (Llama, Qwen2, Qwen3, Gemma 3): tensor names from the ``gguf`` package's own name
map (``gguf.get_tensor_name_map``, the converter's), Llama's query/key rows permuted to llama.cpp's
interleaved RoPE layout (``LlamaModel.permute``), 1 added to Gemma's norm weights, a tied ``lm_head`` left
out, the metadata the converter writes (``TextModel.set_gguf_parameters``), and for llama3 RoPE scaling only
the ``rope_freqs`` tensor (``LlamaModel.generate_extra_tensors``, which reads
``original_max_position_embeddings`` from the top level of the config, 8192 when it is not there). The
tokenizer metadata comes from a byte-level BPE ``tokenizer.json`` (``gpt2`` model) or, for Gemma, a
SentencePiece-style vocabulary derived from it (``llama`` model).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import gguf
import numpy as np
import torch

ARCHS = {"llama": gguf.MODEL_ARCH.LLAMA, "qwen2": gguf.MODEL_ARCH.QWEN2, "qwen3": gguf.MODEL_ARCH.QWEN3,
         "gemma3": gguf.MODEL_ARCH.GEMMA3}


def llama_cpp_rope_factors(hparams: dict) -> np.ndarray | None:
    """``rope_freqs`` as llama.cpp's converter computes it for a llama3 ``rope_scaling`` (None
    for another)."""
    rope = hparams.get("rope_scaling") or hparams.get("rope_parameters") or {}
    if rope.get("rope_type", "").lower() != "llama3":
        return None
    base = rope.get("rope_theta", hparams.get("rope_theta", 10000.0))
    dim = hparams.get("head_dim") or hparams["hidden_size"] // hparams["num_attention_heads"]
    freqs = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    factor, low, high = (
        rope.get("factor", 8.0),
        rope.get("low_freq_factor", 1.0),
        rope.get("high_freq_factor", 4.0),
    )
    # top level, as llama.cpp reads it
    old_context_len = hparams.get("original_max_position_embeddings", 8192)
    low_wavelen, high_wavelen = old_context_len / low, old_context_len / high
    factors = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high_wavelen:
            factors.append(1)
        elif wavelen > low_wavelen:
            factors.append(factor)
        else:
            smooth = (old_context_len / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's ``LlamaModel.permute`` (rotate-half rows -> interleaved), per head."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def tokenizer_metadata(tokenizer_json: Path, family: str) -> dict:
    """Tokenizer fields for :func:`write_gguf` from a byte-level BPE ``tokenizer.json`` whose first added
    tokens are bos and eos (conftest.small_data's): ``{"model", "pre", "tokens", "types", "merges", "scores",
    "bos", "eos"}``.

    Gemma (``llama`` model): ``<pad> <eos> <bos> <unk>`` (control), then the BPE's tokens spelled with ``▁``
    for the space and kept where they are plain printable text, and scores falling with the rank, no merges.
    """
    t = json.loads(Path(tokenizer_json).read_text())
    vocab = sorted(t["model"]["vocab"].items(), key=lambda kv: kv[1])
    special = {a["id"] for a in t["added_tokens"] if a["special"]}
    if family != "gemma3":
        merges = [m if isinstance(m, str) else " ".join(m) for m in t["model"]["merges"]]
        return {"model": "gpt2", "pre": "llama-bpe" if family == "llama" else "qwen2",
                "tokens": [k for k, _ in vocab], "types": [3 if i in special else 1 for _, i in vocab],
                "merges": merges, "scores": None, "bos": 0, "eos": 1}
    pieces = []
    for token, i in vocab:
        text = token.replace("Ġ", "▁")
        if i not in special and all(c.isalnum() or c in "▁',.;:!?" for c in text) and text not in pieces:
            pieces.append(text)
    tokens = ["<pad>", "<eos>", "<bos>", "<unk>"] + [f"<0x{b:02X}>" for b in range(256)] + pieces
    types = [3, 3, 3, 2] + [6] * 256 + [1] * len(pieces)
    return {"model": "llama", "pre": "default", "tokens": tokens, "types": types, "merges": None,
            "scores": [0.0] * 260 + [-float(i) for i in range(len(pieces))], "bos": 2, "eos": 1, "pad": 0}


def write_gguf(path: Path, model: torch.nn.Module, tokenizer: dict | None,
               extra: dict[str, np.ndarray] | None = None) -> Path:
    """Write ``model`` (a transformers causal LM of a built family) as an F32 GGUF at ``path``;
    returns ``path``.

    ``tokenizer``: :func:`tokenizer_metadata`'s fields, or None for a file without tokenizer metadata;
    ``extra``: more tensors, written first under their GGUF names.
    """
    hp = model.config.to_dict()
    family = {"gemma3_text": "gemma3"}.get(hp["model_type"], hp["model_type"])
    arch = gguf.MODEL_ARCH_NAMES[ARCHS[family]]
    n_layers, heads, kv_heads = hp["num_hidden_layers"], hp["num_attention_heads"], hp["num_key_value_heads"]
    head_dim = hp.get("head_dim") or hp["hidden_size"] // heads
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_context_length(hp["max_position_embeddings"])
    writer.add_embedding_length(hp["hidden_size"])
    writer.add_block_count(n_layers)
    writer.add_feed_forward_length(hp["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    rope = hp.get("rope_parameters") or {}
    writer.add_rope_freq_base(float(rope.get("full_attention", rope).get("rope_theta",
                                                                         hp.get("rope_theta", 1e4))))
    writer.add_layer_norm_rms_eps(hp["rms_norm_eps"])
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    if family == "llama":
        writer.add_vocab_size(hp["vocab_size"])
        writer.add_rope_dimension_count(head_dim)
    if family == "gemma3":
        writer.add_sliding_window(hp["sliding_window"])
    if tokenizer is not None:
        writer.add_tokenizer_model(tokenizer["model"])
        writer.add_tokenizer_pre(tokenizer["pre"])
        writer.add_token_list(tokenizer["tokens"])
        writer.add_token_types(tokenizer["types"])
        if tokenizer["scores"] is not None:
            writer.add_token_scores(tokenizer["scores"])
        if tokenizer["merges"] is not None:
            writer.add_token_merges(tokenizer["merges"])
        writer.add_bos_token_id(tokenizer["bos"])
        writer.add_eos_token_id(tokenizer["eos"])
        if tokenizer.get("pad") is not None:
            writer.add_pad_token_id(tokenizer["pad"])
    for name, data in (extra or {}).items():
        writer.add_tensor(name, data)
    factors = llama_cpp_rope_factors(hp) if family == "llama" else None
    if factors is not None:
        writer.add_tensor("rope_freqs.weight", factors)
    names = gguf.get_tensor_name_map(ARCHS[family], n_layers)
    for name, w in model.state_dict().items():
        if name == "lm_head.weight" and hp.get("tie_word_embeddings"):
            continue
        data = w.detach().float().numpy().copy()
        if family == "llama" and name.endswith("q_proj.weight"):
            data = _permute(data, heads)
        elif family == "llama" and name.endswith("k_proj.weight"):
            data = _permute(data, kv_heads)
        elif family == "gemma3" and name.endswith("norm.weight"):
            data = data + 1.0
        new = names.get_name(name, try_suffixes=(".weight", ".bias"))
        assert new is not None, name
        writer.add_tensor(new, np.ascontiguousarray(data))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
