"""One readable decoder for every model family (:mod:`shardlm.model.families`), in the Hugging Face layout,
with no distributed code: :class:`CausalLM`.

Parameter names equal transformers' ``*ForCausalLM`` names (``model.layers.0.self_attn.q_proj.weight``,
``lm_head.weight``...), so importing or exporting HF weights is a plain copy. Rotary embeddings use
HF's rotate-half convention and compute their tables the way HF's rotary embeddings do.

The families differ in a few places, each switched by :class:`~shardlm.model.config.ModelConfig` (``cfg.arch``
for the fixed traits of ``cfg.family``, a :class:`~shardlm.model.families.Family`; fields for the sizes).
Rotary tables are in :mod:`shardlm.model.rope`, the KV cache in :mod:`shardlm.model.kv_cache`:

=========  =====================================================================================
Llama      the reference: pre-norm blocks, SwiGLU, grouped-query attention, RoPE (llama3 scaling)
Qwen2/2.5  + bias on the q/k/v projections
Qwen3      + RMSNorm over each q and k head before RoPE; explicit ``head_dim``
Mistral    + sliding-window attention in every layer
Gemma 3    + q/k norm, (1 + weight) RMSNorm, norms before and after attention and MLP, GeGLU (tanh),
           embedding × sqrt(dim), local (sliding, own RoPE base) and global layers, query_pre_attn_scalar
Qwen3-MoE  Qwen3's attention; sparse layers' MLP a mixture of experts (:mod:`shardlm.model.moe`)
Mixtral    Mistral's attention; every layer's MLP a mixture of experts, top-k renormalised
=========  =====================================================================================

References: Touvron et al., "LLaMA" (2023) and the Llama 3 report (2024); RoPE: Su et al. (2021);
SwiGLU: Shazeer (2020); GQA: Ainslie et al. (2023); Mistral 7B (Jiang et al., 2023); Qwen2 and Qwen3
technical reports (2024, 2025); Gemma 3 technical report (2025).
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from shardlm.model import attention as doc_attention
from shardlm.model.attention import SDPA_ENABLE_GQA, attention, sdpa_has_enable_gqa
from shardlm.model.config import ModelConfig
from shardlm.model.kv_cache import KVCache, LayerKVCache
from shardlm.model.moe import build_moe
from shardlm.model.rope import rope_buffers, rope_inv_freq, rotary_tables, rotate_half

__all__ = [  # with the KV cache and RoPE names, importable from here as well as from their own modules
    "INIT_BLOCK_ELEMENTS", "MLP", "SDPA_ENABLE_GQA", "Attention", "Block", "CausalLM", "Decoder", "KVCache",
    "LayerKVCache", "RMSNorm", "attention", "num_params", "rope_buffers", "rope_inv_freq",
    "rotary_tables", "rotate_half", "sdpa_has_enable_gqa", "sliding_window_mask",
]

#: values drawn per generator when initialising (at least one row): a rank draws only the blocks its
#: rows touch
INIT_BLOCK_ELEMENTS = 1 << 16


class RMSNorm(nn.Module):
    """Root-mean-square layer norm (Zhang & Sennrich, 2019), normalised in fp32.

    Input and output: (..., dim), any float dtype; the weight has shape (dim,). Llama's form
    (``LlamaRMSNorm``): ``weight * norm(x)`` with the norm rounded to x's dtype first. Gemma's form
    (``plus_one``, ``Gemma3RMSNorm``): ``norm(x) * (1 + weight)`` in fp32, then rounded; its weight starts
    at 0.
    """

    def __init__(self, dim: int, eps: float, plus_one: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim) if plus_one else torch.ones(dim))
        self.eps = eps
        self.plus_one = plus_one

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.plus_one:
            return (h * (1.0 + self.weight.float())).to(dtype)
        return self.weight * h.to(dtype)


def sliding_window_mask(t: int, window: int, device: torch.device) -> torch.Tensor:
    """Boolean (t, t) mask, True = attend: query i sees keys j with i - window < j <= i (HF's
    sliding window)."""
    q = torch.arange(t, device=device).view(t, 1)
    k = torch.arange(t, device=device).view(1, t)
    return (k <= q) & (k > q - window)


class Attention(nn.Module):
    """Causal self-attention with rotary embeddings and grouped-query heads, through SDPA.

    Input (batch, seq, dim) -> output (batch, seq, dim). Query head h uses key/value head
    h // (n_heads / n_kv_heads) (HF's repeat_kv), read by SDPA without copies (:func:`attention`).
    Per family: q/k/v biases (Qwen2), an RMSNorm over each q and k head before RoPE (Qwen3, Gemma 3),
    the score scale ``cfg.attn_scale`` (Gemma's query_pre_attn_scalar). ``window`` > 0 makes the layer
    local: each query sees its last ``window`` keys (its own included).
    """

    def __init__(self, cfg: ModelConfig, window: int = 0) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.n_kv_heads = cfg.kv_heads
        self.head_dim = cfg.head_dim
        self.scale = cfg.attn_scale
        self.window = window
        bias = cfg.arch.qkv_bias
        self.q_proj = nn.Linear(cfg.dim, self.n_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(cfg.dim, self.n_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(cfg.dim, self.n_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, cfg.dim, bias=cfg.arch.attention_out_bias)
        # gpt-oss: one learned logit per head in every query's softmax normaliser (None: no sinks)
        self.sinks = nn.Parameter(torch.zeros(self.n_heads)) if cfg.arch.attention_sinks else None
        if cfg.arch.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, cfg.norm_eps, cfg.arch.gemma_norms)
            self.k_norm = RMSNorm(self.head_dim, cfg.norm_eps, cfg.arch.gemma_norms)
        #: the attention kernel ``attend(q, k, v, mask, scale=..., sinks=...)``: :func:`attention`, or a hook
        #: set from outside (context parallelism's, ``shardlm/parallel/cp.py``: attention across a sequence
        #: split over ranks); every mask form, and the sinks, go through it
        self.attend = attention

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                cache: LayerKVCache | None = None, doc_mask: Any = None) -> torch.Tensor:
        """(batch, seq, dim) -> (batch, seq, dim). ``cos``/``sin``: (seq, head_dim), or (batch, 1, seq,
        head_dim) with a cache or per-token positions. With ``cache``, the new keys/values are written at the
        cache's current position and attention runs over everything cached so far, under the cache's mask.

        Without a cache the mask is SDPA's own causal one (``is_causal``, a fused kernel) unless the
        window is shorter than the sequence; then it is one (seq, seq) boolean mask shared by all rows.
        ``doc_mask`` (block-causal attention, see :mod:`shardlm.model.attention`) replaces both: this layer's
        dense (batch, 1, seq, seq) boolean mask or flex ``BlockMask``, its window already applied."""
        b, t, _ = x.shape
        # the head counts from the projections' widths: all heads here, or this rank's share when the
        # projections are split by columns from outside (tensor parallel, shardlm/parallel/tp.py)
        q = self.q_proj(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        cos, sin = cos.to(q.dtype), sin.to(q.dtype)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        mask = None
        if doc_mask is not None:
            mask = doc_mask
        elif cache is not None:
            k, v, mask = cache.update(k, v, self.window)
        elif self.window and self.window < t:
            mask = sliding_window_mask(t, self.window, x.device)
        out = self.attend(q, k, v, mask, scale=self.scale, sinks=self.sinks)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    """Gated feed-forward: down(act(gate(x)) * up(x)), SwiGLU (SiLU) or GeGLU (tanh GELU, Gemma);
    (batch, seq, dim) -> same."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        hidden = cfg.ffn_dim
        self.gate_proj = nn.Linear(cfg.dim, hidden, bias=False)
        self.up_proj = nn.Linear(cfg.dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, cfg.dim, bias=False)
        self.gelu = cfg.arch.activation == "gelu_tanh"

    def forward(self, x: torch.Tensor, real_tokens: torch.Tensor | None = None) -> torch.Tensor:
        """``real_tokens`` is the feed-forward's common signature (:class:`~shardlm.model.moe.MoE` counts
        them); a dense layer keeps no statistics and ignores it."""
        gate = self.gate_proj(x)
        gate = F.gelu(gate, approximate="tanh") if self.gelu else F.silu(gate)
        return self.down_proj(gate * self.up_proj(x))


class Block(nn.Module):
    """One pre-norm transformer block: x + attn(norm(x)), then h + mlp(norm(h)).

    Gemma (``cfg.arch.gemma_norms``) adds a norm after each: x + norm(attn(norm(x))), then h +
    norm(mlp(norm(h))); its names are HF's (``post_attention_layernorm`` is then the norm *after* attention,
    ``pre_feedforward_layernorm`` / ``post_feedforward_layernorm`` those around the MLP). Block ``layer`` is
    local (sliding window) when ``cfg.is_local(layer)``, and its ``mlp`` a mixture of experts
    (:class:`~shardlm.model.moe.MoE`) when ``cfg.is_moe_layer(layer)``.
    """

    def __init__(self, cfg: ModelConfig, layer: int = 0) -> None:
        super().__init__()
        plus_one = cfg.arch.gemma_norms
        self.local = cfg.is_local(layer)
        self.input_layernorm = RMSNorm(cfg.dim, cfg.norm_eps, plus_one)
        self.self_attn = Attention(cfg, cfg.sliding_window if self.local else 0)
        self.post_attention_layernorm = RMSNorm(cfg.dim, cfg.norm_eps, plus_one)
        if plus_one:
            self.pre_feedforward_layernorm = RMSNorm(cfg.dim, cfg.norm_eps, plus_one)
            self.post_feedforward_layernorm = RMSNorm(cfg.dim, cfg.norm_eps, plus_one)
        self.mlp = build_moe(cfg) if cfg.is_moe_layer(layer) else MLP(cfg)  # MoE: shardlm/model/moe.py

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                cache: LayerKVCache | None = None, doc_mask: Any = None,
                real_tokens: torch.Tensor | None = None) -> torch.Tensor:
        if hasattr(self, "post_feedforward_layernorm"):  # Gemma: norms before and after
            h = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), cos, sin, cache,
                                                                 doc_mask))
            return h + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h),
                                                                real_tokens=real_tokens))
        h = x + self.self_attn(self.input_layernorm(x), cos, sin, cache, doc_mask)
        return h + self.mlp(self.post_attention_layernorm(h), real_tokens=real_tokens)


class Decoder(nn.Module):
    """Embedding, blocks and final norm (HF's ``LlamaModel``); holds the rotary tables as buffers:
    ``rope_cos``/``rope_sin`` for global layers and, when local layers have their own base,
    ``rope_local_cos``/``rope_local_sin``."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg, i) for i in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps, cfg.arch.gemma_norms)
        for name, table in rope_buffers(cfg).items():
            self.register_buffer(name, table, persistent=False)

    def rope_at(self, positions: torch.Tensor) -> dict[bool, tuple[torch.Tensor, torch.Tensor]]:
        """The rotary cos and sin of per-token ``positions`` (batch, seq) int64, each (batch, 1, seq,
        head_dim) float32, by ``local`` (True: the local layers' own tables, present only when they have their
        own base)."""
        rope = {False: (self.rope_cos[positions].unsqueeze(1), self.rope_sin[positions].unsqueeze(1))}
        if hasattr(self, "rope_local_cos"):
            rope[True] = (self.rope_local_cos[positions].unsqueeze(1),
                          self.rope_local_sin[positions].unsqueeze(1))
        return rope


class CausalLM(nn.Module):
    """Causal language model of any family of :data:`~shardlm.model.families.FAMILIES`
    (HF's ``*ForCausalLM``).

    ``forward(tokens)``: tokens (batch, seq) int64 with seq <= ``max_seq_len`` -> logits
    (batch, seq, vocab_size) in the compute dtype. With ``tie_embeddings`` the output projection
    is the embedding tensor itself, and ``named_parameters()`` lists it once, as HF does.
    A part (a pipeline stage, :mod:`shardlm.parallel.pp`) has ``None`` for what it lacks, names unchanged: no
    embedding: the input is hidden states (batch, seq, dim), or a rank's (batch, seq / T, dim) under sequence
    parallel with ``seq_len=seq``; a None block is skipped; no norm: returns those.
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.model = Decoder(cfg)
        self.lm_head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def to_empty(self, *, device: torch.device | str | None, recurse: bool = True) -> CausalLM:
        """``nn.Module.to_empty``, keeping the tied output weight the same tensor as the embedding.

        Plain tensors are replaced one by one by ``to_empty``, which would untie them; sharded
        (DTensor) parameters are swapped in place and stay tied.
        """
        super().to_empty(device=device, recurse=recurse)
        if self.cfg.tie_embeddings and self.lm_head.weight is not self.model.embed_tokens.weight:
            self.lm_head.weight = self.model.embed_tokens.weight
        return self

    def forward(self, tokens: torch.Tensor, cache: KVCache | None = None,
                documents: torch.Tensor | None = None,
                head: Callable[[CausalLM, torch.Tensor], torch.Tensor] | None = None,
                positions: torch.Tensor | None = None, masks: dict[int, Any] | None = None,
                real_tokens: torch.Tensor | None = None, seq_len: int | None = None) -> torch.Tensor:
        """tokens (batch, seq) int64 -> logits (batch, seq, vocab_size), or ``head``'s result.

        With ``head`` the output projection is left to it: it gets this model and the final norm's output
        (batch, seq, dim) in the compute dtype, and its result is returned (the chunked loss of
        :mod:`shardlm.train.loss` projects and scores a chunk of tokens at a time, never the whole logits).

        Without ``cache`` (training, evaluation) the tokens are positions 0..seq-1 under a causal
        mask. With a :class:`KVCache` they continue the cached sequences: each row's positions
        start at the cache's length minus that row's left padding, and the cache advances by seq.

        ``documents`` (batch, seq) int64, padding -1: the document index of each token of a packed
        row. Under ``cfg.attention = "block_causal"``, and ``"auto"`` (which resolves to block-causal when the
        samples hold documents, as training resolves it before building the model), each token attends only
        to earlier tokens of its own document, and its rotary position restarts at 0 at the document's first
        token (:mod:`shardlm.model.attention`, backend ``cfg.attention_backend``). Under ``"causal"`` the
        documents would attend to each other: refused.

        ``positions`` (batch, seq) int64 and ``masks`` (by window, 0 = global layers) come together: the
        rotary position of each token and each layer's attention mask, made outside for tokens that are a part
        of a longer sequence (context parallelism, :meth:`shardlm.parallel.cp.ContextParallel.shard_batch`);
        they replace the causal and block-causal set-up above, and each layer hands its mask to its
        ``attend`` hook.

        ``real_tokens`` (batch, seq) bool: True at every token that is not padding (transformers'
        ``attention_mask``); the mixture-of-experts layers count only these in their router statistics
        (:class:`~shardlm.model.moe.MoE`). None: every token is real. Attention and outputs ignore it.
        ``seq_len``: seq when ``tokens`` are a part's hidden states of seq / T tokens (the class docstring).

        Raises:
            ValueError: the sequence (or cache length + seq) exceeds ``max_seq_len``; ``documents`` with a
                cache, of another shape than (batch, seq) or under ``cfg.attention = "causal"``; a backend
                this PyTorch lacks; ``positions`` without ``masks`` (or the other way round), or with a cache
                or ``documents``; ``real_tokens`` of another shape than ``tokens``.
        """
        t = tokens.shape[1] if seq_len is None else seq_len
        decoder = self.model
        doc_masks = None
        if (positions is None) != (masks is None) or (
            masks is not None and (cache is not None or documents is not None)
        ):
            raise ValueError("positions and masks come together, without a cache or documents")
        if real_tokens is not None and real_tokens.shape != tokens.shape:
            raise ValueError(f"real_tokens {tuple(real_tokens.shape)} needs the shape of the tokens "
                             f"{tuple(tokens.shape)}")
        if masks is not None:  # a part of a longer sequence: positions and masks made outside
            doc_masks = masks
            rope = decoder.rope_at(positions)
        elif documents is not None:
            if self.cfg.attention == "causal":
                raise ValueError("documents= given to a model with attention = 'causal', under which every "
                                 "token attends to the earlier tokens of the other documents of its row: "
                                 "set attention = 'block_causal' (or 'auto') to keep the documents apart, or "
                                 "pass no documents for plain causal attention")
            if cache is not None or documents.shape != (tokens.shape[0], t):
                raise ValueError(f"documents {tuple(documents.shape)} need {(tokens.shape[0], t)}, no cache")
            if t > self.cfg.max_seq_len:
                raise ValueError(f"sequence of {t} tokens exceeds max_seq_len={self.cfg.max_seq_len}")
            backend = doc_attention.resolve_backend(self.cfg.attention_backend, tokens.device,
                                                      torch.is_grad_enabled())
            doc_masks = doc_attention.document_masks(
                documents, {layer.self_attn.window for layer in decoder.layers if layer is not None}, backend,
                decoder.embed_tokens.weight.dtype if decoder.embed_tokens is not None else tokens.dtype)
            positions = doc_attention.document_positions(documents)  # (batch, seq), 0 at each document start
            rope = decoder.rope_at(positions)
        elif cache is None:
            if t > self.cfg.max_seq_len:
                raise ValueError(f"sequence of {t} tokens exceeds max_seq_len={self.cfg.max_seq_len}")
            rope = {False: (decoder.rope_cos[:t], decoder.rope_sin[:t])}
            if hasattr(decoder, "rope_local_cos"):
                rope[True] = (decoder.rope_local_cos[:t], decoder.rope_local_sin[:t])
        else:
            positions = cache.positions(t)  # (batch, seq), raises past the cache's capacity
            rope = decoder.rope_at(positions)
        h = tokens if decoder.embed_tokens is None else decoder.embed_tokens(tokens)  # a part: hidden states
        if self.cfg.arch.gemma_norms and decoder.embed_tokens is not None:  # Gemma: sqrt(dim), rounded (HF)
            h = h * torch.tensor(self.cfg.dim ** 0.5).to(h.dtype)
        for i, layer in ((i, b) for i, b in enumerate(decoder.layers) if b is not None):  # a part: its own
            cos, sin = rope[layer.local and len(rope) > 1]
            if doc_masks is not None:
                h = layer(h, cos, sin, None, doc_masks[layer.self_attn.window], real_tokens=real_tokens)
            else:
                h = layer(h, cos, sin, None if cache is None else cache.layers[i], real_tokens=real_tokens)
        if cache is not None:
            cache.advance(t)
        if decoder.norm is None:  # a part without the final norm: the blocks' output
            return h
        h = decoder.norm(h)
        if head is not None:
            return head(self, h)
        logits = self.lm_head(h)
        if self.cfg.final_logit_softcap:
            c = self.cfg.final_logit_softcap
            logits = torch.tanh(logits / c) * c
        return logits

    # ---- initialisation -------------------------------------------------------------------
    def initial_rows(self, name: str, seed: int, start: int, stop: int,
                     device: torch.device | str = "cpu") -> torch.Tensor:
        """Rows ``[start, stop)`` (along dim 0) of parameter ``name``'s initial value: fp32 on ``device``.

        Weight matrices and the embedding are N(0, init_std²) (output projections ``o_proj`` and
        ``down_proj`` scaled by 1/sqrt(2·n_layers), as GPT-2); biases are zeros; norm weights are ones
        (zeros for Gemma's ``1 + weight`` norms: the same unit scale). The rows are cut into
        blocks of :data:`INIT_BLOCK_ELEMENTS` values (at least one row); block ``b`` of a parameter is drawn
        from its own generator on ``device`` seeded by (seed, name, b). So any range of rows is produced
        without drawing the others, and the value does not depend on the order of construction or on how
        the model is sharded; it does depend on the device type (CPU and CUDA generators differ).

        Raises:
            ValueError: ``0 <= start <= stop <= rows`` does not hold.
        """
        shape = self.get_parameter(name).shape
        rows = shape[0]
        if not 0 <= start <= stop <= rows:
            raise ValueError(f"{name}: rows [{start}, {stop}) outside [0, {rows})")
        if name.endswith("norm.weight"):
            fill = torch.zeros if self.cfg.arch.gemma_norms else torch.ones
            return fill((stop - start, *shape[1:]), device=device)
        if name.endswith((".bias", "_bias")):
            return torch.zeros((stop - start, *shape[1:]), device=device)
        std = self.cfg.init_std
        if name.endswith(("o_proj.weight", "down_proj.weight", "experts.down_proj")):
            std = std / math.sqrt(2 * self.cfg.n_layers)
        block = max(1, INIT_BLOCK_ELEMENTS // max(1, math.prod(shape[1:])))  # rows per generator
        base = seed * 1_000_003 + zlib.crc32(name.encode())
        pieces = []
        for b in range(start // block, -(-stop // block)):
            lo, hi = b * block, min((b + 1) * block, rows)
            gen = torch.Generator(device).manual_seed((base * 1_000_003 + b) % 2**63)
            values = torch.randn((hi - lo, *shape[1:]), generator=gen, device=device)
            pieces.append(values[max(start, lo) - lo:min(stop, hi) - lo])
        out = torch.cat(pieces) if pieces else torch.empty((0, *shape[1:]), device=device)
        return out * std

    def initial_value(self, name: str, seed: int) -> torch.Tensor:
        """The full, unsharded initial value of parameter ``name``: fp32 on CPU (see :meth:`initial_rows`)."""
        return self.initial_rows(name, seed, 0, self.get_parameter(name).shape[0])

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """Initialise every parameter from :meth:`initial_rows` and recompute the rotary tables.

        Works on a whole model and on one whose parameters are sharded DTensors (after ``to_empty``): each
        rank then draws only the rows of its own shard, on the parameter's device, so the time and memory
        are proportional to the shard, and the result is bit-identical to the whole model's on the same
        device type. Tied weights stay one tensor.
        """
        for name, param in self.named_parameters():
            if isinstance(param, DTensor):
                local = param.to_local()
                shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh,
                                                                      param.placements)
                if tuple(shape[1:]) == tuple(param.shape[1:]):
                    # sharded along dim 0 only (FSDP, HSDP): own rows
                    local.copy_(self.initial_rows(name, seed, offset[0], offset[0] + shape[0], local.device))
                else:  # any other layout: the full value, then this rank's piece
                    full = self.initial_value(name, seed).to(param.dtype)
                    piece = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None)
                    local.copy_(piece.to_local())
            else:
                param.copy_(self.initial_rows(name, seed, 0, param.shape[0], param.device))
        self.init_rotary()

    @torch.no_grad()
    def init_rotary(self) -> None:
        """Recompute the rotary tables in place (needed after ``to_empty`` or a dtype change)."""
        device = self.model.rope_cos.device
        for name, table in rope_buffers(self.cfg).items():
            setattr(self.model, name, table.to(device))


def num_params(model: nn.Module, exclude_embedding: bool = False) -> int:
    """Number of unique parameters (tied tensors once); works on meta and sharded models.

    With ``exclude_embedding`` the input embedding table is left out (the N of MFU's 6N, PaLM app. B);
    when tied, the shared tensor is still counted once as the output projection.
    """
    total = sum(p.numel() for p in model.parameters())
    if exclude_embedding and isinstance(model, CausalLM) and not model.cfg.tie_embeddings:
        total -= model.model.embed_tokens.weight.numel()
    return total

