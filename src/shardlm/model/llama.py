"""A Llama-3-style decoder in the Hugging Face layout, with no distributed code.

Parameter names equal ``transformers.LlamaForCausalLM``'s (``model.layers.0.self_attn.q_proj.weight``,
``lm_head.weight``...), so importing or exporting HF weights is a plain copy. Rotary embeddings use
HF's rotate-half convention and compute their tables the way HF's ``LlamaRotaryEmbedding`` does.

References: Touvron et al., "LLaMA" (2023) and the Llama 3 report (2024); RoPE: Su et al. (2021);
SwiGLU: Shazeer (2020); GQA: Ainslie et al. (2023).
"""

from __future__ import annotations

import math
import zlib

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from shardlm.model.config import ModelConfig


class RMSNorm(nn.Module):
    """Root-mean-square layer norm (Zhang & Sennrich, 2019), computed in fp32 as HF's LlamaRMSNorm.

    Input and output: (..., dim), any float dtype; the weight has shape (dim,).
    """

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """Inverse rotary frequencies, (head_dim / 2,) float32, as HF's ``ROPE_INIT_FUNCTIONS`` compute them.

    Default: ``inv_freq[i] = 1 / theta^(2i / head_dim)``. With ``rope_scaling_factor > 0``, Llama 3.1's
    scaling (HF ``_compute_llama3_parameters``, same operations in the same order, so bit-identical):
    wavelengths 2π/inv_freq above ``original / low_freq_factor`` are divided by ``factor``, those
    below ``original / high_freq_factor`` are kept, and those in between are interpolated with
    ``s = (original / wavelen - low) / (high - low)``: ``(1 - s) · f / factor + s · f``.
    """
    head_dim = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if cfg.rope_scaling_factor <= 0:
        return inv_freq
    factor, low, high = cfg.rope_scaling_factor, cfg.rope_low_freq_factor, cfg.rope_high_freq_factor
    old_context_len = cfg.rope_original_max_seq_len
    low_freq_wavelen = old_context_len / low
    high_freq_wavelen = old_context_len / high
    wavelen = 2 * math.pi / inv_freq
    inv_freq_llama = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth_factor = (old_context_len / wavelen - low) / (high - low)
    smoothed_inv_freq = (1 - smooth_factor) * inv_freq_llama / factor + smooth_factor * inv_freq_llama
    is_medium_freq = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium_freq, smoothed_inv_freq, inv_freq_llama)


def rotary_tables(head_dim: int, max_seq_len: int, theta: float,
                  inv_freq: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables of rotary embeddings, each (max_seq_len, head_dim) float32, as HF computes them.

    ``inv_freq[i] = 1 / theta^(2i / head_dim)`` unless ``inv_freq`` is given (see :func:`rope_inv_freq`);
    angle[t, i] = t · inv_freq[i]; the table is the angle vector concatenated with itself (rotate-half).
    """
    if inv_freq is None:
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    positions = torch.arange(max_seq_len, dtype=torch.int64).float()
    freqs = torch.outer(positions, inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """(x1, x2) -> (-x2, x1) over the last dimension, split in halves."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class LayerKVCache:
    """One layer's keys and values, (batch, n_kv_heads, capacity, head_dim), owned by a :class:`KVCache`."""

    def __init__(self, owner: KVCache, k: torch.Tensor, v: torch.Tensor) -> None:
        self.owner, self.k, self.v = owner, k, v

    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Store new keys/values (batch, n_kv_heads, seq, head_dim) at the cache's position.

        Returns all keys and values so far, (batch, n_kv_heads, pos + seq, head_dim), and the boolean
        attention mask (batch, 1, seq, pos + seq) that goes with them (True = attend).
        """
        start, t = self.owner.length, k.shape[2]
        self.k[:, :, start:start + t] = k
        self.v[:, :, start:start + t] = v
        return self.k[:, :, :start + t], self.v[:, :, :start + t], self.owner.mask(t)


class KVCache:
    """Key-value cache for incremental decoding (Pope et al., "Efficiently Scaling Transformer
    Inference", 2022): each new token attends to the stored keys/values of all earlier ones, so a
    step costs one token's forward instead of the whole sequence's.

    Rows may be left-padded to a common length: ``pad[b]`` leading positions of row b are padding,
    masked out as keys; each row's rotary positions start at 0 at its first real token. A padded
    query attends to itself only, which keeps its (unused) output finite.

    Args:
        cfg: the model's shape (layers, kv heads, head_dim); ``capacity`` defaults to ``max_seq_len``.
        pad: (batch,) int64 number of left-padding tokens per row.
        dtype, device: of the cached tensors (the model's compute dtype and device).
    """

    def __init__(self, cfg: ModelConfig, pad: torch.Tensor, dtype: torch.dtype, device: torch.device | str,
                 capacity: int | None = None) -> None:
        self.capacity = capacity or cfg.max_seq_len
        if self.capacity > cfg.max_seq_len:
            raise ValueError(f"cache capacity {self.capacity} exceeds max_seq_len={cfg.max_seq_len}")
        n_kv, head_dim = cfg.kv_heads, cfg.head_dim
        self.pad = pad.to(device=device, dtype=torch.long)
        batch = self.pad.shape[0]
        self.length = 0
        shape = (batch, n_kv, self.capacity, head_dim)
        self.layers = [LayerKVCache(self, torch.zeros(shape, dtype=dtype, device=device),
                                    torch.zeros(shape, dtype=dtype, device=device)) for _ in range(cfg.n_layers)]

    def positions(self, t: int) -> torch.Tensor:
        """Rotary positions (batch, t) of the next t tokens; raises ValueError past the capacity."""
        if self.length + t > self.capacity:
            raise ValueError(f"{self.length} cached + {t} new tokens exceed the cache capacity {self.capacity}")
        pos = torch.arange(self.length, self.length + t, device=self.pad.device)
        return (pos.unsqueeze(0) - self.pad.unsqueeze(1)).clamp(min=0)

    def mask(self, t: int) -> torch.Tensor:
        """Boolean mask (batch, 1, t, length + t): causal, padding keys excluded, padded queries see themselves."""
        q = torch.arange(self.length, self.length + t, device=self.pad.device).view(1, t, 1)
        k = torch.arange(self.length + t, device=self.pad.device).view(1, 1, -1)
        real_key = k >= self.pad.view(-1, 1, 1)
        return ((k <= q) & real_key | (k == q)).unsqueeze(1)

    def advance(self, t: int) -> None:
        """Move the write position on by t tokens (called by :meth:`Llama.forward` after all layers)."""
        self.length += t


class Attention(nn.Module):
    """Causal self-attention with rotary embeddings and grouped-query heads, through SDPA.

    Input (batch, seq, dim) -> output (batch, seq, dim). Query head h uses key/value head
    h // (n_heads / n_kv_heads) (HF's repeat_kv), read by SDPA without copies (:func:`attention`).
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.n_kv_heads = cfg.kv_heads
        self.head_dim = cfg.head_dim
        self.q_proj = nn.Linear(cfg.dim, self.n_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.dim, self.n_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.dim, self.n_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                cache: LayerKVCache | None = None) -> torch.Tensor:
        """(batch, seq, dim) -> (batch, seq, dim). ``cos``/``sin``: (seq, head_dim), or (batch, 1, seq,
        head_dim) with a cache. With ``cache``, the new keys/values are written at the cache's current
        position and attention runs over everything cached so far, under the cache's mask."""
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.n_kv_heads, self.head_dim).transpose(1, 2)
        cos, sin = cos.to(q.dtype), sin.to(q.dtype)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        mask = None
        if cache is not None:
            k, v, mask = cache.update(k, v)
        out = attention(q, k, v, mask)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


def sdpa_has_enable_gqa() -> bool:
    """Whether this PyTorch's ``scaled_dot_product_attention`` takes ``enable_gqa`` (PyTorch >= 2.5)."""
    doc = F.scaled_dot_product_attention.__doc__ or ""
    return "enable_gqa" in doc.split("->", 1)[0]


#: SDPA reads grouped key/value heads itself (no repeated copies of K and V)
SDPA_ENABLE_GQA = sdpa_has_enable_gqa()


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None,
              enable_gqa: bool = SDPA_ENABLE_GQA) -> torch.Tensor:
    """Scaled dot-product attention with grouped query heads; causal when ``mask`` is None.

    Args:
        q: (batch, n_heads, seq, head_dim); k, v: (batch, n_kv_heads, kv_seq, head_dim), n_kv_heads
            dividing n_heads; query head h reads key/value head h // (n_heads / n_kv_heads).
        mask: None (causal over equal lengths) or a boolean/additive mask broadcastable to
            (batch, n_heads, seq, kv_seq).
        enable_gqa: pass the grouped heads to SDPA as they are (``enable_gqa=True``; no K/V copies, which
            at Llama 3 8B's 32/8 heads would be 4x the K/V memory); False repeats K and V with
            ``repeat_interleave`` first (HF's ``repeat_kv``), for a PyTorch without ``enable_gqa``.
            Both give the same result (tested within 1e-6 in fp32).

    Returns:
        (batch, n_heads, seq, head_dim), the dtype of ``q``.
    """
    repeat = q.shape[1] // k.shape[1]
    extra = {}
    if repeat > 1 and enable_gqa:
        extra["enable_gqa"] = True
    elif repeat > 1:
        k = k.repeat_interleave(repeat, dim=1)
        v = v.repeat_interleave(repeat, dim=1)
    if mask is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, **extra)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, **extra)


class MLP(nn.Module):
    """SwiGLU feed-forward: down(silu(gate(x)) * up(x)); (batch, seq, dim) -> same."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        hidden = cfg.ffn_dim
        self.gate_proj = nn.Linear(cfg.dim, hidden, bias=False)
        self.up_proj = nn.Linear(cfg.dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    """One pre-norm transformer block: x + attn(norm(x)), then h + mlp(norm(h))."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                cache: LayerKVCache | None = None) -> torch.Tensor:
        h = x + self.self_attn(self.input_layernorm(x), cos, sin, cache)
        return h + self.mlp(self.post_attention_layernorm(h))


class Decoder(nn.Module):
    """Embedding, blocks and final norm (HF's ``LlamaModel``); holds the rotary tables as buffers."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        cos, sin = rotary_tables(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta, rope_inv_freq(cfg))
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)


class Llama(nn.Module):
    """Llama-style causal language model.

    ``forward(tokens)``: tokens (batch, seq) int64 with seq <= ``max_seq_len`` -> logits
    (batch, seq, vocab_size) in the compute dtype. With ``tie_embeddings`` the output projection
    is the embedding tensor itself, and ``named_parameters()`` lists it once, as HF does.
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.model = Decoder(cfg)
        self.lm_head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def to_empty(self, *, device: torch.device | str | None, recurse: bool = True) -> Llama:
        """``nn.Module.to_empty``, keeping the tied output weight the same tensor as the embedding.

        Plain tensors are replaced one by one by ``to_empty``, which would untie them; sharded
        (DTensor) parameters are swapped in place and stay tied.
        """
        super().to_empty(device=device, recurse=recurse)
        if self.cfg.tie_embeddings and self.lm_head.weight is not self.model.embed_tokens.weight:
            self.lm_head.weight = self.model.embed_tokens.weight
        return self

    def forward(self, tokens: torch.Tensor, cache: KVCache | None = None) -> torch.Tensor:
        """tokens (batch, seq) int64 -> logits (batch, seq, vocab_size).

        Without ``cache`` (training, evaluation) the tokens are positions 0..seq-1 under a causal
        mask. With a :class:`KVCache` they continue the cached sequences: each row's positions
        start at the cache's length minus that row's left padding, and the cache advances by seq.

        Raises:
            ValueError: the sequence (or cache length + seq) exceeds ``max_seq_len``.
        """
        t = tokens.shape[1]
        if cache is None:
            if t > self.cfg.max_seq_len:
                raise ValueError(f"sequence of {t} tokens exceeds max_seq_len={self.cfg.max_seq_len}")
            cos, sin = self.model.rope_cos[:t], self.model.rope_sin[:t]
        else:
            positions = cache.positions(t)  # (batch, seq), raises past the cache's capacity
            cos = self.model.rope_cos[positions].unsqueeze(1)  # (batch, 1, seq, head_dim)
            sin = self.model.rope_sin[positions].unsqueeze(1)
        h = self.model.embed_tokens(tokens)
        for i, layer in enumerate(self.model.layers):
            h = layer(h, cos, sin) if cache is None else layer(h, cos, sin, cache.layers[i])
        if cache is not None:
            cache.advance(t)
        return self.lm_head(self.model.norm(h))

    # ---- initialisation -------------------------------------------------------------------
    def initial_value(self, name: str, seed: int) -> torch.Tensor:
        """The full, unsharded initial value of parameter ``name``: fp32 on CPU, its full shape.

        Weight matrices and the embedding are N(0, init_std²) (output projections ``o_proj`` and
        ``down_proj`` scaled by 1/sqrt(2·n_layers), as GPT-2); norm weights are ones. Each tensor
        comes from its own generator seeded by (seed, name), so the value does not depend on the
        order of construction, on the device, or on how the model is sharded.
        """
        param = self.get_parameter(name)
        if name.endswith("layernorm.weight") or name.endswith("norm.weight"):
            return torch.ones(param.shape)
        std = self.cfg.init_std
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            std = std / math.sqrt(2 * self.cfg.n_layers)
        gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
        return torch.randn(param.shape, generator=gen) * std

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """Initialise every parameter from :meth:`initial_value` and recompute the rotary tables.

        Works on a whole model and on one whose parameters are sharded DTensors (after
        ``to_empty``): each rank then copies only its own slice of the full value, so the result is
        bit-identical to the whole model's. Tied weights stay one tensor.
        """
        for name, param in self.named_parameters():
            full = self.initial_value(name, seed).to(param.dtype)
            if isinstance(param, DTensor):
                local = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None)
                param.to_local().copy_(local.to_local())
            else:
                param.copy_(full)
        self.init_rotary()

    @torch.no_grad()
    def init_rotary(self) -> None:
        """Recompute the rotary tables in place (needed after ``to_empty`` or a dtype change)."""
        cfg = self.cfg
        cos, sin = rotary_tables(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta, rope_inv_freq(cfg))
        device = self.model.rope_cos.device
        self.model.rope_cos = cos.to(device)
        self.model.rope_sin = sin.to(device)


def num_params(model: nn.Module, exclude_embedding: bool = False) -> int:
    """Number of unique parameters (tied tensors once); works on meta and sharded models.

    With ``exclude_embedding`` the input embedding table is left out (the N of MFU's 6N, PaLM app. B);
    when tied, the shared tensor is still counted once as the output projection.
    """
    total = sum(p.numel() for p in model.parameters())
    if exclude_embedding and isinstance(model, Llama) and not model.cfg.tie_embeddings:
        total -= model.model.embed_tokens.weight.numel()
    return total
