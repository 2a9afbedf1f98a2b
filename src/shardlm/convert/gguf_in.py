"""Converting a GGUF file (llama.cpp's format) of a built family (Llama, Qwen2, Qwen3, Gemma 3) into a Hugging
Face model directory.

Tensors are read and dequantised to float32 with the PyPI ``gguf`` package (``GGUFReader``,
``gguf.quants.dequantize``: F32/F16/BF16, Q4_0...Q8_0, the K-quants Q2_K...Q6_K that ``*_K_M`` files use, and
the IQ types). What llama.cpp's converter (``convert_hf_to_gguf.py``) did to the tensors is undone: ggml lists
shapes innermost-first (``gguf`` already returns row-major numpy arrays, i.e. HF's (out_features,
in_features)); for Llama only, the query and key projections had their rows permuted from HF's rotate-half
layout to llama.cpp's interleaved RoPE layout, per head: ``w.reshape(n_head, 2, rows // n_head // 2,
cols).swapaxes(1, 2)``, with the key-value head count for the key projection (:func:`unpermute_rows` is its
inverse); for Gemma, 1 was added to every RMSNorm weight (llama.cpp's norm multiplies by the weight, Gemma's
by 1 + weight), and is subtracted here. Gemma 3 settings that GGUF does not store (local RoPE base 10000,
every 6th layer global, query_pre_attn_scalar) are llama.cpp's and transformers' defaults. Llama 3's RoPE
scaling, which llama.cpp keeps only as the ``rope_freqs`` tensor, is rebuilt into the config
(:func:`rope_scaling_from_factors`). The tokenizer (with its chat template) is rebuilt from the file's
metadata by ``transformers``, less the tokens it adds beyond the file's vocabulary
(:func:`_drop_tokens_not_in_file`).
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch

from shardlm.atomic import atomic_directory, save_safetensors
from shardlm.convert.hf_in import model_dir_special_ids
from shardlm.data.tokenizer_files import generation_config
from shardlm.errors import ModelDirError
from shardlm.model import families
from shardlm.model.config import ModelConfig
from shardlm.model.decoder import CausalLM
from shardlm.model.hf_config import hf_config
from shardlm.model.rope import rope_inv_freq

#: llama.cpp's names of the tensors outside the blocks -> HF's
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def hf_name(gguf_name: str, family: str = "llama") -> str | None:
    """HF parameter name of a GGUF tensor name (``blk.3.attn_q.weight`` ->
    ``model.layers.3.self_attn.q_proj.weight``) in ``family``'s naming
    (:attr:`~shardlm.model.families.Family.gguf_block_names`).

    Returns None for tensors with no HF counterpart (``rope_freqs``...).
    """
    parts = gguf_name.split(".")
    names = families.get(family).gguf_block_names
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
        ModelDirError: ``general.architecture`` is not a built family's (``Family.gguf_architecture``), a
            required key is missing, or a RoPE scaling type is not built (named).
    """
    arch = _field(reader, "general.architecture")
    family = families.by_gguf_architecture(arch, source)

    def need(key: str) -> Any:
        value = _field(reader, f"{arch}.{key}")
        if value is None:
            raise ModelDirError(f"{source}: GGUF metadata key {arch}.{key} is missing")
        return value

    dim, heads = int(need("embedding_length")), int(need("attention.head_count"))
    head_width = int(_field(reader, f"{arch}.attention.key_length", 0) or 0)
    cfg = ModelConfig(
        family=family.name, dim=dim, n_layers=int(need("block_count")), n_heads=heads,
        n_kv_heads=int(_field(reader, f"{arch}.attention.head_count_kv", heads)),
        head_width=0 if head_width == dim // heads and dim % heads == 0 else head_width,
        ffn_hidden=int(need("feed_forward_length")), max_seq_len=int(need("context_length")),
        rope_theta=_f32(_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        norm_eps=_f32(need("attention.layer_norm_rms_epsilon")), tie_embeddings=tied,
    )
    scaling = _field(reader, f"{arch}.rope.scaling.type")
    factor = _field(reader, f"{arch}.rope.scaling.factor")
    if scaling == "linear" and family.gguf_linear_rope:
        if factor:
            cfg.rope_linear_factor = float(factor)
    elif factor is not None and scaling not in (None, "none", "llama3"):
        raise ModelDirError(f"{source}: GGUF metadata {arch}.rope.scaling.type={scaling!r} is not supported")
    elif scaling == "linear":
        raise ModelDirError(f"{source}: GGUF metadata {arch}.rope.scaling.type='linear' is not supported for "
                            f"{arch}")
    family.gguf_fields_in(cfg, lambda key, default=None: _field(reader, f"{arch}.{key}", default))
    return cfg


#: per-dimension RoPE frequency tensors llama.cpp writes: the name and what it holds (for refusals)
_ROPE_FACTOR_TENSORS = {"rope_freqs.weight": "per-dimension RoPE frequency factors",
                        "rope_factors_long.weight": "LongRoPE long-context frequency factors",
                        "rope_factors_short.weight": "LongRoPE short-context frequency factors"}


def _llama3_factors(cfg: ModelConfig, factor: float, low: float, high: float, original: int) -> np.ndarray:
    """The ``rope_freqs`` llama3 scaling (factor, low, high, original) gives ``cfg``'s
    frequencies, (head_dim/2,)."""
    trial = dataclasses.replace(cfg, rope_scaling_factor=factor, rope_low_freq_factor=low,
                                rope_high_freq_factor=high, rope_original_max_seq_len=original)
    plain = dataclasses.replace(cfg, rope_scaling_factor=0.0)
    return (rope_inv_freq(plain).double() / rope_inv_freq(trial).double()).numpy()


def _snap(x: float) -> float:
    """``x`` rounded to 6 significant digits when that is within 1e-6 of it (fits recover 4.0,
    not 3.9999998)."""
    rounded = float(f"{x:.6g}")
    return rounded if abs(rounded - x) <= 1e-6 * abs(x) else x


def _llama3_candidates(cfg: ModelConfig, r: np.ndarray, factor: float) -> list[tuple[float, float, int]]:
    """(low_freq_factor, high_freq_factor, original context) that could have written the factors ``r``.

    Llama 3.x's published values (1, 4, 8192) first. Then a fit: with ``f`` the inverse frequencies, HF's rule
    is ``r = 1`` above ``F_hi = 2π·high/original``, ``r = factor`` below ``F_lo = 2π·low/original``, and in
    between ``1/r = (1 - s)/factor + s`` with ``s = (f - F_lo)/(F_hi - F_lo)``. ``s`` of the in-between
    dimensions gives ``F_lo`` and ``F_hi`` (a least-squares line through two or more; with one or none,
    thresholds between the neighbouring frequencies, any of which gives the same factors); ``original`` is
    chosen so that ``low`` is about 1, as in Llama 3.x (only the ratios low/original and high/original are
    determined by the factors).
    """
    head_dim = cfg.head_dim
    f = 1.0 / (float(cfg.rope_theta) ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    at_factor, at_one = np.isclose(r, factor, rtol=1e-6, atol=0), np.isclose(r, 1.0, rtol=1e-6, atol=0)
    medium = ~(at_factor | at_one)
    s = (1.0 / r[medium] - 1.0 / factor) / (1.0 - 1.0 / factor)
    f_a = f[at_factor].max() if at_factor.any() else 0.0  # highest frequency scaled fully
    f_b = f[at_one].min() if at_one.any() else math.inf  # lowest frequency kept
    if medium.sum() >= 2:
        slope, intercept = np.polyfit(f[medium], s, 1)
        if slope <= 0:
            return [(1.0, 4.0, 8192)]
        f_lo, f_hi = -intercept / slope, (1.0 - intercept) / slope
    elif medium.sum() == 1:
        f1, s1 = float(f[medium][0]), float(s[0])
        width = 0.5 * min((f1 - f_a) / s1 if s1 > 0 else math.inf,
                          (f_b - f1) / (1 - s1) if s1 < 1 else math.inf)
        if not math.isfinite(width):
            width = f1
        f_lo, f_hi = f1 - s1 * width, f1 + (1 - s1) * width
    elif math.isfinite(f_b) and f_a > 0:
        f_lo, f_hi = f_a + (f_b - f_a) / 3, f_a + 2 * (f_b - f_a) / 3
    else:
        f_lo, f_hi = (2 * f_a, 4 * f_a) if f_a > 0 else (f_b / 4, f_b / 2)
    if not 0 < f_lo < f_hi:
        return [(1.0, 4.0, 8192)]
    original = max(1, round(2 * math.pi / f_lo))
    low, high = _snap(f_lo * original / (2 * math.pi)), _snap(f_hi * original / (2 * math.pi))
    return [(1.0, 4.0, 8192), (low, high, original)]


def rope_scaling_from_factors(factors: np.ndarray, cfg: ModelConfig, source: str) -> None:
    """Set ``cfg``'s llama3 RoPE scaling from llama.cpp's ``rope_freqs`` tensor, in place.

    llama.cpp's converter (``convert_hf_to_gguf.py``, ``LlamaModel.generate_extra_tensors``) keeps Llama 3's
    ``rope_scaling`` only as this tensor: one factor per rotary dimension pair, (head_dim / 2,) float32, by
    which the inverse frequency ``1 / theta^(2i / head_dim)`` is divided (``ggml_rope_ext``'s
    ``freq_factors``): 1 for short wavelengths, ``factor`` for long ones, interpolated between. The scaling is
    rebuilt (``factor`` = the largest factor; low/high/original from :func:`_llama3_candidates`) and accepted
    only if HF's llama3 rule (:func:`shardlm.model.rope.rope_inv_freq`) gives every factor back within 1e-5
    (relative). All factors 1: no scaling.

    Raises:
        ModelDirError: the tensor's shape is not (head_dim / 2,), a factor is not finite and positive, or no
            llama3 scaling gives these factors (the first dimension that differs named).
    """
    name = "rope_freqs.weight"
    r = np.asarray(factors, dtype=np.float64).reshape(-1)
    half = cfg.head_dim // 2
    if r.shape != (half,):
        raise ModelDirError(f"{source}: GGUF tensor {name} has {r.size} factors; the head width "
                            f"{cfg.head_dim} needs {half}")
    if not np.all(np.isfinite(r)) or (r <= 0).any():
        raise ModelDirError(f"{source}: GGUF tensor {name} holds a factor that is not finite and positive")
    if np.allclose(r, 1.0, rtol=0, atol=1e-7):
        return
    factor = _f32(float(r.max()))
    best = None
    for low, high, original in _llama3_candidates(cfg, r, factor):
        ours = _llama3_factors(cfg, factor, low, high, original)
        if np.allclose(ours, r, rtol=1e-5, atol=0):
            cfg.rope_scaling_factor, cfg.rope_low_freq_factor = factor, low
            cfg.rope_high_freq_factor, cfg.rope_original_max_seq_len = high, original
            return
        best = ours if best is None else best
    i = int(np.argmax(np.abs(best - r) / r))
    raise ModelDirError(f"{source}: GGUF tensor {name} ({_ROPE_FACTOR_TENSORS[name]}) is not a llama3 RoPE "
                        f"scaling (dimension pair {i}: factor {r[i]:.7g}, llama3 with factor {factor:g} "
                        f"gives {best[i]:.7g}); not supported")


def dequantize(tensor: Any, source: str) -> np.ndarray:
    """A GGUF tensor dequantised to a float32 numpy array, row-major (HF layout).

    Raises:
        ModelDirError: naming the tensor and its quantisation type, when ``gguf`` cannot dequantise it.
    """
    import gguf

    try:
        array = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    except (NotImplementedError, ValueError) as e:
        raise ModelDirError(f"{source}: GGUF tensor {tensor.name} has quantisation type "
                            f"{tensor.tensor_type.name}, which cannot be dequantised ({e})") from None
    shape = tuple(reversed(tensor.shape.tolist()))
    try:
        return np.array(array, dtype=np.float32, copy=True).reshape(shape)
    except ValueError:
        raise ModelDirError(f"{source}: GGUF tensor {tensor.name} holds {array.size} values, not the {shape} "
                            "its header states (a truncated or damaged file)") from None


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
            if t.name == "rope_freqs.weight" and cfg.arch.gguf_rope_freqs:
                # Llama 3's scaling, rebuilt into cfg
                rope_scaling_from_factors(dequantize(t, str(path)), cfg, str(path))
                continue
            if t.name in _ROPE_FACTOR_TENSORS:
                raise ModelDirError(f"{path}: GGUF tensor {t.name} ({_ROPE_FACTOR_TENSORS[t.name]}) is not "
                                    f"supported for {cfg.family}; shardlm's {cfg.family} RoPE has no "
                                    "per-dimension factors")
            raise ModelDirError(f"{path}: GGUF tensor {t.name} has no {cfg.family} counterpart")
        w = torch.from_numpy(dequantize(t, str(path)))
        if cfg.arch.gguf_qk_permuted and name.endswith("q_proj.weight"):
            w = unpermute_rows(w, cfg.n_heads)
        elif cfg.arch.gguf_qk_permuted and name.endswith("k_proj.weight"):
            w = unpermute_rows(w, cfg.kv_heads)
        elif cfg.arch.gguf_norm_offset and name.endswith("norm.weight"):
            w = w - cfg.arch.gguf_norm_offset
        tensors[name] = w.contiguous()
    cfg.vocab_size = (
        tensors["model.embed_tokens.weight"].shape[0] if "model.embed_tokens.weight" in tensors else 0
    )
    if not cfg.vocab_size:
        raise ModelDirError(f"{path}: GGUF tensor token_embd.weight is missing")
    return tensors, cfg, reader


def _file_token_count(reader: Any, source: str, vocab_size: int) -> int:
    """Number of tokens of the file's vocabulary (``tokenizer.ggml.tokens``), checked against the
    embedding rows.

    Raises:
        ModelDirError: the file has no tokenizer metadata, or more tokens than ``token_embd.weight`` has rows.
    """
    field = reader.fields.get("tokenizer.ggml.tokens")
    if field is None or not field.data:
        raise ModelDirError(f"{source}: the GGUF file has no tokenizer metadata (tokenizer.ggml.tokens); "
                            "shardlm import needs the tokenizer inside the file")
    n = len(field.data)
    if n > vocab_size:
        raise ModelDirError(f"{source}: the GGUF vocabulary has {n} tokens but token_embd.weight has "
                            f"{vocab_size} rows")
    return n


def _gguf_tokenizer(path: Path) -> Any:
    """``transformers.AutoTokenizer.from_pretrained(dir, gguf_file=name)`` with its failures as
    one ModelDirError."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    except ImportError:
        raise
    except Exception as e:  # transformers raises ValueError/KeyError/... on metadata it cannot build from
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ModelDirError(f"{path}: transformers cannot build the tokenizer from the GGUF metadata "
                            f"({reason})") \
            from None


def _drop_tokens_not_in_file(tok_dir: Path, file_tokens: int, source: str) -> None:
    """Remove from the saved tokenizer every token with an id >= ``file_tokens`` (the file's vocabulary size).

    transformers' GGUF tokenizer builder hands the vocabulary to a tokenizer class whose default special
    tokens it adds when missing (``GPT2Tokenizer``: ``<|endoftext|>``; ``GemmaTokenizer``: ``<mask>``...),
    after the file's tokens: ids the model has no trained embedding row for (llama.cpp never produces them).
    They are dropped from ``tokenizer.json`` (added tokens, and the model's vocabulary), and from
    ``tokenizer_config.json`` (the added-token table, extra special tokens, and any role ``*_token`` naming
    one, which becomes null; the file's own bos/eos/pad are ids within its vocabulary). A note on stderr names
    the dropped tokens.
    """
    tj = tok_dir / "tokenizer.json"
    data = json.loads(tj.read_text())
    dropped = sorted(
        {a["content"]: a["id"] for a in data.get("added_tokens", []) if a["id"] >= file_tokens}.items(),
        key=lambda kv: kv[1],
    )
    vocab = data.get("model", {}).get("vocab")
    if isinstance(vocab, dict):
        dropped += [(t, i) for t, i in vocab.items() if i >= file_tokens and t not in dict(dropped)]
        data["model"]["vocab"] = {t: i for t, i in vocab.items() if i < file_tokens}
    elif isinstance(vocab, list) and len(vocab) > file_tokens:  # Unigram: [(piece, score)] by id
        dropped += [(piece[0], i) for i, piece in enumerate(vocab) if i >= file_tokens]
        data["model"]["vocab"] = vocab[:file_tokens]
    if not dropped:
        return
    names = {t for t, _ in dropped}
    data["added_tokens"] = [a for a in data.get("added_tokens", []) if a["id"] < file_tokens]
    tj.write_text(json.dumps(data, ensure_ascii=False, indent=2))
    tc = tok_dir / "tokenizer_config.json"
    if tc.is_file():
        config = json.loads(tc.read_text())
        if isinstance(config.get("added_tokens_decoder"), dict):
            config["added_tokens_decoder"] = {k: v for k, v in config["added_tokens_decoder"].items()
                                              if int(k) < file_tokens}
        for key in ("extra_special_tokens", "additional_special_tokens"):
            if isinstance(config.get(key), list):
                config[key] = [
                    t for t in config[key] if (t.get("content") if isinstance(t, dict) else t) not in names
                ]
        for key, value in list(config.items()):
            if (
                key.endswith("_token")
                and (value.get("content") if isinstance(value, dict) else value) in names
            ):
                config[key] = None
        tc.write_text(json.dumps(config, ensure_ascii=False, indent=2) + "\n")
    shown = ", ".join(f"{t} (id {i})" for t, i in dropped[:5]) + (
        f" and {len(dropped) - 5} more" if len(dropped) > 5 else ""
    )
    print(f"note: {source}: dropped {len(dropped)} token(s) that transformers' GGUF tokenizer adds beyond "
          f"the file's {file_tokens}-token vocabulary: {shown}", file=sys.stderr, flush=True)


def import_gguf(path: str | Path, out_dir: str | Path) -> Path:
    """Convert a GGUF file (of a family with a GGUF architecture) to an HF model directory ``out_dir``
    (written atomically).

    Writes ``model.safetensors`` (float32), ``config.json`` and ``generation_config.json`` (the
    file's bos/eos ids, the tokenizer's pad id) and the tokenizer files (``tokenizer.json``,
    ``tokenizer_config.json`` with ``model_max_length`` = the context, ``chat_template.jinja``)
    rebuilt by ``transformers.AutoTokenizer.from_pretrained(..., gguf_file=...)``. Tokens that builder adds
    beyond the file's vocabulary (``<|endoftext|>`` for a Llama 3 vocabulary, ``<mask>`` for Gemma) are
    dropped (:func:`_drop_tokens_not_in_file`), so every id of the tokenizer is one of the file's tokens and
    fits the embedding.

    Raises:
        ModelDirError: see :func:`read_gguf_tensors`; a tensor whose shape the metadata contradicts; no
            tokenizer metadata, or more tokens than embedding rows; a tokenizer transformers cannot build (its
            reason); the file's eos id is not its tokenizer's eos token.
        ImportError: ``gguf`` or ``transformers`` is not installed (``pip install 'shardlm[gguf]'``).
    """
    path, out = Path(path), Path(out_dir)
    tensors, cfg, reader = read_gguf_tensors(path)
    with torch.device("meta"):
        expected = {n: tuple(p.shape) for n, p in CausalLM(cfg).named_parameters()}
    for name, shape in expected.items():
        if name not in tensors:
            raise ModelDirError(f"{path}: tensor {name} is missing from the GGUF file")
        if tuple(tensors[name].shape) != shape:
            raise ModelDirError(f"{path}: tensor {name} has shape {tuple(tensors[name].shape)}, the metadata "
                                f"implies {shape}")
    special = {"bos": _field(reader, "tokenizer.ggml.bos_token_id"),
               "eos": _field(reader, "tokenizer.ggml.eos_token_id")}
    file_tokens = _file_token_count(reader, str(path), cfg.vocab_size)
    with atomic_directory(out) as tmp:  # a failure never leaves a half-written out_dir
        tok = _gguf_tokenizer(path)
        if tok.model_max_length >= 1e29:  # transformers' "no limit": the model's context instead
            tok.model_max_length = cfg.max_seq_len
        tok.save_pretrained(str(tmp))
        _drop_tokens_not_in_file(tmp, file_tokens, str(path))
        save_safetensors(tensors, tmp / "model.safetensors", metadata={"format": "pt"})
        special = {k: (int(v) if v is not None else None) for k, v in special.items()}
        special["pad"] = (
            tok.pad_token_id if tok.pad_token_id is not None and tok.pad_token_id < file_tokens else None
        )
        config = hf_config(cfg, special)
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        gen = generation_config({**special, "eos": [special["eos"]] if special["eos"] is not None else []})
        (tmp / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
        model_dir_special_ids(tmp)  # the file's eos id and its tokenizer's eos token agree
    return out
