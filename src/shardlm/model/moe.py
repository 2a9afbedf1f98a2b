"""Mixture-of-experts feed-forward layer (sparse MoE), in the Hugging Face layout, with no distributed code.

A layer routes each token to ``top_k`` of ``n_experts`` SwiGLU experts and sums their outputs weighted by the
router (Shazeer et al., "Outrageously Large Neural Networks", 2017; Fedus et al., "Switch Transformers", 2021;
Jiang et al., "Mixtral of Experts", 2024; the Qwen3 technical report, 2025). Parameter names and shapes are
transformers 5.x's in memory (``mlp.gate.weight`` (E, dim); ``mlp.experts.gate_up_proj`` (E, 2·hidden, dim),
gate rows first; ``mlp.experts.down_proj`` (E, dim, hidden)); the hub's per-expert files
(``mlp.experts.{i}.gate_proj.weight``...) are mapped in :mod:`shardlm.convert.hf_experts`.

The forward, in four steps that expert parallelism can wrap from outside (``shardlm.parallel.ep``):

1. :func:`route`: router logits -> top-k experts and weights, each family's normalisation;
2. tokens sorted by expert (a stable sort of the (token, slot) pairs), ``tokens_per_expert`` counted;
3. ``experts(x_sorted, tokens_per_expert)``: a grouped matmul over contiguous row groups
   (:func:`grouped_linear`);
4. the outputs weighted and summed back per token (``index_add_``, in ascending expert order as transformers).

Each forward stores its router statistics (:class:`RouterStats`) on the layer for the load-balancing loss
(:mod:`shardlm.train.moe_loss`), which needs them over the whole batch of all ranks. They count the *real*
tokens only: ``forward(x, real_tokens)`` takes a (batch, seq) boolean mask, True at every input token that is
not padding, as transformers' ``attention_mask`` in ``load_balancing_loss_func``: prompt and response tokens
alike, whether or not they are scored; the padding of a padded sample, the padding tail of a packed row and
context parallelism's padding are routed like any token (their outputs are unused) but left out. Without a
mask every token counts (pre-training windows, which hold no padding).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from shardlm.model.config import ModelConfig

#: routing functions the layer builds (``Family.routing``)
ROUTINGS = ("softmax_topk", "topk_softmax")


def route(logits: torch.Tensor, top_k: int, routing: Literal["softmax_topk", "topk_softmax"],
          norm_topk_prob: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Top-k routing of router logits (tokens, E) -> (weights (tokens, k), experts (tokens, k) int64,
    probabilities (tokens, E) fp32).

    ``softmax_topk`` (Qwen3-MoE, Mixtral; HF ``Qwen3MoeTopKRouter``): softmax over all experts in fp32, the k
    largest; with ``norm_topk_prob`` divided by their sum (Mixtral always: the softmax over the top k).
    Weights are rounded to the logits' dtype. ``topk_softmax`` (gpt-oss, HF ``GptOssTopKRouter``): the k
    largest logits, softmax over those k. ``probabilities`` is the softmax over all experts in fp32, the
    load-balancing loss's P (HF ``load_balancing_loss_func``), for both.

    Raises:
        ValueError: an unknown ``routing``.
    """
    probs = F.softmax(logits, dim=-1, dtype=torch.float32)
    if routing == "softmax_topk":
        top, experts = torch.topk(probs, top_k, dim=-1)
        if norm_topk_prob:
            top = top / top.sum(dim=-1, keepdim=True)
        return top.to(logits.dtype), experts, probs
    if routing == "topk_softmax":
        top, experts = torch.topk(logits, top_k, dim=-1)
        return F.softmax(top, dim=-1, dtype=top.dtype), experts, probs
    raise ValueError(f"routing {routing!r} is not built (built: {', '.join(ROUTINGS)})")


def grouped_linear(x: torch.Tensor, weight: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
    """Per-expert ``F.linear`` over contiguous row groups: x (N, in) sorted by expert, weight (E, out, in),
    ``tokens_per_expert`` (E,) int64 summing to N -> (N, out) in x's dtype.

    The one place that chooses the kernel: ``torch._grouped_mm`` on CUDA for bf16 (one launch for all experts;
    Hopper and later), a loop of ``F.linear`` elsewhere. The loop runs every expert, an empty group too, so
    that every weight takes part in the graph (its gradient is then zeros, never None).
    """
    if x.is_cuda and x.dtype == torch.bfloat16 and hasattr(torch, "_grouped_mm"):
        offsets = torch.cumsum(tokens_per_expert, 0, dtype=torch.int32)
        return torch._grouped_mm(x, weight.transpose(-2, -1), offs=offsets)
    groups = x.split(tokens_per_expert.tolist())
    return torch.cat([F.linear(g, weight[e]) for e, g in enumerate(groups)])


class Experts(nn.Module):
    """``n`` SwiGLU experts as stacked 3-D tensors (HF ``Qwen3MoeExperts`` / ``MixtralExperts`` names).

    ``gate_up_proj`` (n, 2·hidden, dim): expert e's gate rows ``[:hidden]`` then up rows; ``down_proj``
    (n, dim, hidden). ``forward(x_sorted, tokens_per_expert)``: x (N, dim) with expert e's tokens in the
    e-th contiguous group, counts (n,) int64 -> (N, dim): ``down(silu(gate(x)) · up(x))`` per group.
    Under expert parallelism the module holds only its rank's experts and is called with their tokens.
    """

    def __init__(self, n_experts: int, dim: int, hidden: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(n_experts, 2 * hidden, dim))
        self.down_proj = nn.Parameter(torch.empty(n_experts, dim, hidden))

    def forward(self, x: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
        gate_up, down = local_tensor(self.gate_up_proj), local_tensor(self.down_proj)
        gate, up = grouped_linear(x, gate_up, tokens_per_expert).chunk(2, dim=-1)
        return grouped_linear(F.silu(gate) * up, down, tokens_per_expert)


class ClampedSwiGLUExperts(nn.Module):
    """gpt-oss's experts (HF ``GptOssExperts``): stacked tensors with biases, gate and up interleaved
    by column.

    ``gate_up_proj`` (n, dim, 2·hidden) with ``gate_up_proj_bias`` (n, 2·hidden): columns 0, 2, 4... are the
    gate, 1, 3, 5... the up projection; ``down_proj`` (n, hidden, dim), ``down_proj_bias`` (n, dim). Per
    token: ``gate = min(gate, limit)``, ``up = clamp(up, -limit, limit)``, ``h = (up + 1) · gate ·
    sigmoid(alpha · gate)``, output ``h @ down + bias``. ``forward(x_sorted, tokens_per_expert)``
    as :class:`Experts`.
    """

    def __init__(self, n_experts: int, dim: int, hidden: int, alpha: float, limit: float) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(n_experts, dim, 2 * hidden))
        self.gate_up_proj_bias = nn.Parameter(torch.empty(n_experts, 2 * hidden))
        self.down_proj = nn.Parameter(torch.empty(n_experts, hidden, dim))
        self.down_proj_bias = nn.Parameter(torch.empty(n_experts, dim))
        self.alpha, self.limit = alpha, limit

    def forward(self, x: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
        rows = int(x.shape[0])
        gate_up = grouped_linear(x, local_tensor(self.gate_up_proj).transpose(-2, -1), tokens_per_expert)
        gate_up = gate_up + local_tensor(self.gate_up_proj_bias).repeat_interleave(tokens_per_expert, 0,
                                                                                     output_size=rows)
        gate, up = gate_up[..., ::2].clamp(max=self.limit), gate_up[..., 1::2].clamp(-self.limit, self.limit)
        h = (up + 1) * (gate * torch.sigmoid(gate * self.alpha))
        out = grouped_linear(h, local_tensor(self.down_proj).transpose(-2, -1), tokens_per_expert)
        return out + local_tensor(self.down_proj_bias).repeat_interleave(tokens_per_expert, 0,
                                                                         output_size=rows)


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself, or a DTensor's local part: under expert parallelism a rank computes with its
    own experts."""
    return t.to_local() if hasattr(t, "to_local") else t


@dataclass
class RouterStats:
    """One forward's router statistics of one MoE layer (what the load-balancing loss needs of it)."""

    prob_sum: torch.Tensor
    """(E,) fp32, differentiable: the router probabilities summed over this forward's counted tokens."""
    counts: torch.Tensor
    """(E,) fp32, no gradient: how many (token, slot) assignments each expert received from the counted
    tokens (sums to tokens · k)."""
    z_sum: torch.Tensor
    """() fp32, differentiable: sum over the counted tokens of logsumexp(router logits)², the router
    z-loss's numerator."""
    tokens: torch.Tensor
    """() fp32, no gradient: the counted tokens of this forward (all routed tokens without a mask; the real
    ones with ``real_tokens``)."""


class MoE(nn.Module):
    """Sparse MoE feed-forward (HF ``Qwen3MoeSparseMoeBlock`` / ``MixtralSparseMoeBlock``): (batch, seq, dim)
    -> (batch, seq, dim).

    ``gate`` (gpt-oss: ``router``, ``router_name``): ``nn.Linear(dim, n_experts)`` (bias only for gpt-oss);
    ``experts``: :class:`Experts`, or the module given (:class:`ClampedSwiGLUExperts`), called as
    ``experts(x_sorted, tokens_per_expert)``. :func:`build_moe` makes a family's layer.
    After each forward :attr:`stats` holds this forward's :class:`RouterStats`.
    """

    def __init__(self, dim: int, n_experts: int, hidden: int, top_k: int,
                 routing: Literal["softmax_topk", "topk_softmax"] = "softmax_topk",
                 norm_topk_prob: bool = False, router_bias: bool = False, router_name: str = "gate",
                 experts: nn.Module | None = None) -> None:
        super().__init__()
        if routing not in ROUTINGS:
            raise ValueError(f"routing {routing!r} is not built (built: {', '.join(ROUTINGS)})")
        if not 1 <= top_k <= n_experts:
            raise ValueError(f"top_k={top_k} must be between 1 and n_experts={n_experts}")
        self.n_experts, self.top_k = n_experts, top_k
        self.routing, self.norm_topk_prob = routing, norm_topk_prob
        self.router_name = router_name
        setattr(self, router_name, nn.Linear(dim, n_experts, bias=router_bias))
        self.experts = experts if experts is not None else Experts(n_experts, dim, hidden)
        self.stats: RouterStats | None = None

    def forward(self, x: torch.Tensor, real_tokens: torch.Tensor | None = None) -> torch.Tensor:
        """(..., dim) -> (..., dim), and :attr:`stats` of this forward.

        ``real_tokens``: bool of x's shape without ``dim`` (e.g. (batch, seq)), True at the tokens the router
        statistics count (the real ones: transformers' ``attention_mask``), or None: all. Every token is
        routed and gets its output either way. The counting multiplies by the mask instead of selecting
        rows, so an all-True mask gives the statistics of no mask bit for bit (and no read to the host).

        Raises:
            ValueError: ``real_tokens`` of another shape than ``x.shape[:-1]``.
        """
        shape = x.shape
        if real_tokens is not None and tuple(real_tokens.shape) != tuple(shape[:-1]):
            raise ValueError(f"real_tokens {tuple(real_tokens.shape)} must have the input's shape without "
                             f"its last dimension: {tuple(shape[:-1])}")
        x = x.reshape(-1, shape[-1])
        logits = getattr(self, self.router_name)(x)  # (tokens, E)
        weights, chosen, probs = route(logits, self.top_k, self.routing, self.norm_topk_prob)
        flat = chosen.reshape(-1)  # (tokens · k,): slot j of token t at t·k + j
        order = torch.argsort(flat, stable=True)
        token_of = order // self.top_k
        counts = torch.bincount(flat, minlength=self.n_experts)
        out = self.experts(x[token_of], counts)  # (tokens · k, dim), grouped by expert
        out = out * weights.reshape(-1)[order].unsqueeze(-1)
        y = torch.zeros_like(x).index_add_(0, token_of, out.to(x.dtype))
        z = torch.logsumexp(logits.float(), dim=-1).pow(2)  # (tokens,)
        if real_tokens is None:
            self.stats = RouterStats(probs.sum(0), counts.detach().float(), z.sum(),
                                     torch.tensor(float(x.shape[0]), device=x.device))
        else:
            real = real_tokens.reshape(-1).to(device=x.device, dtype=torch.int64)  # (tokens,) 1 = counted
            kept = torch.zeros(self.n_experts, dtype=torch.int64, device=x.device).index_add_(
                0, flat, real.repeat_interleave(self.top_k))
            weight = real.to(probs.dtype)
            self.stats = RouterStats((probs * weight.unsqueeze(-1)).sum(0), kept.float(), (z * weight).sum(),
                                     real.sum().float())
        return y.reshape(shape)


def inactive_expert_params(model: nn.Module) -> int:
    """Parameters a token does not use: per MoE layer, the experts it is not routed to,
    ``numel(experts) · (E - k) / E``. Total minus this is the *active* count (Qwen3-30B-A3B's "A3B"); works on
    meta-device models."""
    out = 0
    for m in model.modules():
        if isinstance(m, MoE):
            out += sum(p.numel() for p in m.experts.parameters()) * (m.n_experts - m.top_k) // m.n_experts
    return out


def build_moe(cfg: ModelConfig) -> MoE:
    """A MoE layer of shape ``cfg`` with its family's traits (routing, router name and bias, experts' MLP)."""
    arch = cfg.arch
    experts = None
    if arch.experts == "clamped_swiglu":
        experts = ClampedSwiGLUExperts(cfg.n_experts, cfg.dim, cfg.expert_ffn_dim, cfg.swiglu_alpha,
                                       cfg.swiglu_limit)
    return MoE(cfg.dim, cfg.n_experts, cfg.expert_ffn_dim, cfg.n_experts_per_token, arch.routing,
               cfg.norm_topk_prob or arch.always_norm_topk, arch.router_bias, arch.router_name, experts)
