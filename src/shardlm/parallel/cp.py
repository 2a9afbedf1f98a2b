"""Context parallelism: each sequence split over the ``cp`` ranks of a group, attention across the split.

The split is the load-balanced one of torchtitan and Megatron-LM ("zigzag"): a sequence of T tokens, padded to
``T_pad`` (the next multiple of ``2·cp``), is cut into ``2·cp`` chunks of ``c = T_pad / (2·cp)`` tokens; CP
rank r holds chunk r (the head) and chunk ``2·cp - 1 - r`` (the tail). Under a causal mask a query's work
grows with its position, so a head chunk and its mirrored tail chunk together cost every rank the same.

Attention across the split (:meth:`ContextParallel.attend`) is blockwise where a kernel with a log-sum-exp
exists (CPU, :mod:`shardlm.parallel.cp_attention`): K and V passed around the CP group's ring one rank's
chunks at a time, each of the rank's chunks attended to the key chunks it may see, the parts merged by their
log-sum-exp, and only the rank's own q, k, v, output and log-sum-exp saved for the backward. Elsewhere (CUDA,
not wired) the fallback all-gathers keys and values through an autograd function (saved for the backward) and
runs this rank's queries against all ``T_pad`` keys under a dense boolean mask built from the global token
indices. Either way query i sees key j when j <= i (global indices), within the window (i - window < j) and in
the same document (block-causal), and the key/value gradients reach their owners summed over the group (around
the ring, or by a reduce-scatter: one all-to-all and a local sum, as :mod:`shardlm.parallel.reduce_scatter`),
so gradients are exact. Every CP rank of a group holds the same batch (they are one data-parallel replica), so
each builds its masks and rotary positions locally, with no collective; only K and V travel. Padding tokens
sit after every real token: no real query attends to them, their labels are ignored (-100), and each pad token
forms a document of its own. A mixture of experts needs nothing more for its outputs (routing is per token);
its router statistics leave the padding out: each rank's chunks carry their slice of the batch's real-token
mask, CP's padding False (:meth:`ContextParallel.shard_batch`). Attention sinks (gpt-oss:
a logit per head in each query's softmax normaliser) pass through :meth:`ContextParallel.attend` like the
mask: joined once to each query's normaliser over the whole sequence (blockwise: to the merged log-sum-exp).

Memory per rank, blockwise: activations of ``T_pad / cp`` tokens (attention's saved tensors included); K and V
of two ranks' tokens (held and incoming) and in the backward their gradients, for one layer at a time; one
block's mask (``c²`` values) at a time. The fallback keeps the gathered K and V of every layer for the
backward, a ``T_pad²/cp`` mask per window, and on the causal path query and output rows up to the end of the
rank's tail chunk.

PyTorch's own ``torch.distributed.tensor.experimental.context_parallel`` maps only CUDA's flash / efficient /
cuDNN SDPA kernels and refuses CPU SDPA, hence this implementation (checked against one-rank attention).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from shardlm.config.layout import padded_length
from shardlm.errors import ConfigError
from shardlm.model.attention import document_positions
from shardlm.model.decoder import attention
from shardlm.parallel.cp_attention import BlockwiseAttention, SequenceMask, lse_kernels, visible
from shardlm.parallel.dist import DistInfo

#: the target id the loss ignores (padding tokens' labels), as ``shardlm.data.instruct.IGNORE_INDEX``
IGNORE_INDEX = -100


def chunk_indices(seq_len: int, cp: int, cp_rank: int) -> torch.Tensor:
    """Global indices (2·c,) int64 of the tokens CP rank ``cp_rank`` holds: its head chunk, then its
    tail chunk.

    ``c = padded_length(seq_len, cp) / (2·cp)``; indices at or past ``seq_len`` are padding. At ``cp = 1``:
    ``0 .. seq_len - 1`` in order.
    """
    if cp == 1:
        return torch.arange(seq_len)
    c = padded_length(seq_len, cp) // (2 * cp)
    head = torch.arange(cp_rank * c, (cp_rank + 1) * c)
    tail = torch.arange((2 * cp - 1 - cp_rank) * c, (2 * cp - cp_rank) * c)
    return torch.cat([head, tail])


def gathered_indices(seq_len: int, cp: int) -> torch.Tensor:
    """Global indices (T_pad,) int64 of the keys after the all-gather: rank 0's chunks, rank 1's, ...
    in order."""
    return torch.cat([chunk_indices(seq_len, cp, r) for r in range(cp)])


class _GatherSequence(torch.autograd.Function):
    """All-gather (batch, heads, s, d) over the CP group into (batch, heads, cp·s, d) in rank order; the
    backward sums each rank's slice of the gradient over the group (a reduce-scatter by one all-to-all, in
    rank order). The fallback path of :meth:`ContextParallel.attend`."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        world = group.size()
        b, h, s, d = x.shape
        out = torch.empty((world * b, h, s, d), dtype=x.dtype, device=x.device)
        dist.all_gather_single(out, x.contiguous(), group=group)
        return out.view(world, b, h, s, d).permute(1, 2, 0, 3, 4).reshape(b, h, world * s, d)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        world = ctx.group.size()
        b, h, ws, d = grad.shape
        pieces = grad.reshape(b, h, world, ws // world, d).permute(2, 0, 1, 3, 4).contiguous()
        received = torch.empty_like(pieces)
        shape = (world * b, h, ws // world, d)
        dist.all_to_all_single(received.view(shape), pieces.view(shape), group=ctx.group)
        out = received[0].clone()
        for piece in received[1:]:
            out.add_(piece)
        return out, None


class ContextParallel:
    """One CP group's split of a sequence and its attention across the split (see the module docstring).

    Args:
        group: the CP process group (its ranks hold the same batch); None for one rank (no split, no
            collective: the same code path runs unchanged).
        device_type: where attention runs (``cpu``, ``cuda``): decides the blockwise kernels or the fallback.
    """

    def __init__(self, group: dist.ProcessGroup | None, device_type: str = "cpu") -> None:
        self.group = group
        self.size = group.size() if group is not None else 1
        self.rank = dist.get_rank(group) if group is not None else 0
        #: the blockwise path's kernels (:func:`~shardlm.parallel.cp_attention.lse_kernels`), None: fallback
        self.kernels = lse_kernels(device_type)
        #: the attention windows of the model's layers (0 = global), set by :func:`apply_cp`
        self.windows: set[int] = {0}
        #: whether the model attends block-causally (document masks), set by :func:`apply_cp`
        self.block_causal = False
        #: the fallback's additive dense masks of this batch, by (id(mask), dtype) (see :meth:`attend`)
        self._additive: dict[tuple[int, torch.dtype], torch.Tensor] = {}

    @property
    def attention_path(self) -> str:
        """How :meth:`attend` runs, in words (the start-up summary names it)."""
        if self.kernels is not None:
            return "blockwise attention merged by log-sum-exp"
        return ("fallback attention: gathered K/V kept for the backward, dense masks (no log-sum-exp kernel "
                "wired)")

    def check_sequence(self, seq_len: int) -> None:
        """Refuse a sequence too short to split: with fewer than ``cp`` tokens some rank would hold padding
        only. (Any longer length is split: it is padded to a multiple of 2·cp, and padding takes rotary
        position 0, so ``T_pad`` may pass ``model.max_seq_len``.)

        Raises:
            ConfigError: ``seq_len < cp``, naming both.
        """
        if seq_len < self.size:
            raise ConfigError(
                f"train.seq_len={seq_len} is shorter than parallel.cp={self.size}: a sequence "
                f"split over {self.size} ranks needs at least {self.size} tokens (one per rank)"
            )

    def local_indices(self, seq_len: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """Global indices (2·c,) int64 of this rank's tokens (:func:`chunk_indices`)."""
        return chunk_indices(seq_len, self.size, self.rank).to(device)

    def shard(self, x: torch.Tensor, pad_value: int | float = 0, dim: int = 1) -> torch.Tensor:
        """This rank's tokens of ``x`` along ``dim`` (the sequence), padded with ``pad_value`` to ``T_pad``
        first: (..., T, ...) -> (..., 2·c, ...), same dtype."""
        t = x.shape[dim]
        extra = padded_length(t, self.size) - t
        if extra:
            pad_shape = list(x.shape)
            pad_shape[dim] = extra
            x = torch.cat([x, torch.full(pad_shape, pad_value, dtype=x.dtype, device=x.device)], dim=dim)
        return x.index_select(dim, self.local_indices(t, x.device))

    def rope_positions(self, batch: int, seq_len: int, documents: torch.Tensor | None,
                       device: torch.device | str) -> torch.Tensor:
        """Rotary positions (batch, 2·c) int64 of this rank's tokens by their global place: the global index,
        or under block-causal attention (``documents`` (batch, seq_len)) the index within the token's
        document. A padding token takes position 0 (its output is never used)."""
        if documents is None:
            positions = torch.arange(seq_len, device=device).expand(batch, seq_len)
        else:
            positions = document_positions(documents)
        return self.shard(positions, 0)

    def masks(self, seq_len: int, documents: torch.Tensor | None, windows: set[int],
              device: torch.device | str) -> dict[int, SequenceMask | None]:
        """The attention masks of this batch, one per window (0 = global): None where attention is plain
        causal by global position (no documents, no window shorter than the sequence), else a
        :class:`~shardlm.parallel.cp_attention.SequenceMask` (the padded documents and the window), from which
        :meth:`attend` builds each block's mask (or the fallback its dense one, :meth:`dense_mask`).

        ``documents`` (batch, seq_len) int64; padding (index >= seq_len) is a document of its own per token
        (ids -2, -3, ...: below the data's own padding document, -1, :data:`shardlm.data.packing.PADDING`),
        so no real query sees it.
        """
        causal_only = documents is None and all(w == 0 or w >= seq_len for w in windows)
        if causal_only:
            return dict.fromkeys(windows)
        docs = None
        if documents is not None:
            t_pad = padded_length(seq_len, self.size)
            docs = torch.cat([documents, torch.arange(-2, seq_len - t_pad - 2, -1, device=device)
                              .expand(documents.shape[0], -1)], dim=1)
        return {w: SequenceMask(docs, w if 0 < w < seq_len else 0) for w in sorted(windows)}

    def dense_mask(self, spec: SequenceMask, t_pad: int, device: torch.device | str) -> torch.Tensor:
        """The fallback's boolean (1 or batch, 1, 2·c, T_pad) mask of this rank's queries over the gathered
        keys, True = attend: key j of query i when j <= i (global indices), i - window < j and in the same
        document."""
        keys = gathered_indices(t_pad, self.size).to(device)
        return visible(self.local_indices(t_pad, device), keys, spec).unsqueeze(1)

    def shard_batch(self, inputs: torch.Tensor, targets: torch.Tensor, documents: torch.Tensor | None,
                    real_tokens: torch.Tensor | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
        """This rank's share of a batch: inputs and targets (B, T) int64 -> (B, 2·c) each (padding: token 0,
        target ``IGNORE_INDEX``), and the model's keyword arguments ``positions`` (:meth:`rope_positions`),
        ``masks`` (:meth:`masks`) and ``real_tokens``. ``documents`` (B, T) is used under block-causal
        attention only.

        ``real_tokens`` (B, T) bool, True at the batch's real tokens (None: all real): this rank's slice of
        it, (B, 2·c), False at CP's padding; None when there is no padding at all. A mixture of experts'
        layers count only these tokens in their router statistics, so the load-balancing and z-loss, pooled
        over every rank (:func:`shardlm.train.moe_loss.moe_loss_term`), are those of the unsplit sequences."""
        b, t = inputs.shape
        self._additive.clear()  # the previous batch's masks
        docs = documents if self.block_causal else None
        extra = {"positions": self.rope_positions(b, t, docs, inputs.device),
                 "masks": self.masks(t, docs, self.windows, inputs.device)}
        if real_tokens is not None or padded_length(t, self.size) > t:
            if real_tokens is None:
                real_tokens = torch.ones((b, t), dtype=torch.bool, device=inputs.device)
            extra["real_tokens"] = self.shard(real_tokens, False)
        return self.shard(inputs, 0), self.shard(targets, IGNORE_INDEX), extra

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """All-gather keys or values (batch, heads, 2·c, head_dim) into (batch, heads, T_pad, head_dim) in the
        order of :func:`gathered_indices`, with an exact backward (see :class:`_GatherSequence`)."""
        if self.group is None or self.size == 1:
            return x
        return _GatherSequence.apply(x, self.group)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: SequenceMask | None = None,
               scale: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
        """Attention of this rank's queries q (batch, n_heads, 2·c, head_dim) over the keys and values of the
        whole sequence: k, v (batch, n_kv_heads, 2·c, head_dim) are all-gathered, then attended to under
        ``mask`` from :meth:`masks` (None: causal by global position). ``sinks`` (n_heads,): attention sinks
        (gpt-oss), one logit per head in each query's softmax normaliser over the whole sequence (blockwise:
        joined once to the merged log-sum-exp; the fallback: :func:`~shardlm.model.attention.attention`'s).
        Returns q's shape and dtype.

        Blockwise (:class:`~shardlm.parallel.cp_attention.BlockwiseAttention`) where :attr:`kernels` exist:
        memory linear in ``T_pad`` and transient. Else the fallback: the all-gather saves K and V of all
        ``T_pad`` keys; a mask runs SDPA over them under the dense mask (:meth:`dense_mask`, as an additive
        mask made once per batch and dtype and shared by the layers: ``T_pad² / cp`` values), and causal
        attention scatters this rank's queries into zeros at their global places up to the end of its tail
        chunk and runs SDPA's causal kernel (the zero queries' outputs are dropped and give the keys no
        gradient).
        """
        if self.kernels is not None and self.group is not None and self.size > 1:
            return BlockwiseAttention.apply(q, k, v, mask, self.group, self.rank, scale, self.kernels, sinks)
        k, v = self.gather(k), self.gather(v)
        if mask is None:
            return self._causal(q, k, v, scale, sinks)
        key = (id(mask), q.dtype)
        if key not in self._additive:
            dense = self.dense_mask(mask, q.shape[2] * self.size, q.device)
            self._additive[key] = torch.zeros(dense.shape, dtype=q.dtype, device=q.device).masked_fill_(
                ~dense, float("-inf"))
        return attention(q, k, v, self._additive[key], scale=scale, sinks=sinks)

    def _causal(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None,
                sinks: torch.Tensor | None = None) -> torch.Tensor:
        """Causal attention by global position of this rank's q (b, h, 2·c, d) over gathered k, v
        (see :meth:`attend`)."""
        b, h, n, d = q.shape
        t_pad = n * self.size
        length = (2 * self.size - self.rank) * (n // 2)  # up to the end of this rank's tail chunk
        order = torch.argsort(gathered_indices(t_pad, self.size))[:length].to(q.device)
        local = self.local_indices(t_pad, q.device)
        queries = q.new_zeros(b, h, length, d).index_copy(2, local, q)
        out = attention(queries, k.index_select(2, order), v.index_select(2, order), None, scale=scale,
                        sinks=sinks)
        return out.index_select(2, local)


def apply_cp(model: nn.Module, cp: ContextParallel) -> nn.Module:
    """Route every attention layer of ``model`` through ``cp.attend`` (the recipe: one hook per layer).

    The model then expects each rank's tokens as :meth:`ContextParallel.shard` gives them, with
    ``positions`` from :meth:`ContextParallel.rope_positions` and ``masks`` from
    :meth:`ContextParallel.masks`, and ``real_tokens`` (its MoE layers, whose routing is per token, then leave
    CP's padding out of their router statistics; :meth:`ContextParallel.shard_batch`). Returns the same
    model.

    Raises:
        ValueError: the model has no attention layer with an ``attend`` hook.
    """
    cp.block_causal = model.cfg.attention == "block_causal"
    cp.windows = set()
    for module in model.modules():
        if hasattr(module, "attend") and hasattr(module, "q_proj"):
            module.attend = cp.attend
            cp.windows.add(module.window)
    if not cp.windows:
        raise ValueError(f"{type(model).__name__} has no attention layer with an ``attend`` hook to route "
                         "through CP")
    return model


def build_context_parallel(info: DistInfo, cp: int, tp: int = 1) -> ContextParallel:
    """The CP group of this rank (``parallel.cp``): in torchtitan's mesh order ``(dp, cp, tp)``, tp innermost,
    the ``cp`` ranks with this rank's data-parallel and tensor-parallel coordinates, ``tp`` apart: rank
    ``(d·cp + c)·tp + t`` for c = 0 .. cp - 1. They hold the same samples; under tensor parallel (``tp`` > 1)
    each holds its ``n_heads / tp`` local heads, and the keys and values gathered over the CP group are those
    heads' over the whole sequence. One rank's (no collective) at ``cp = 1``.

    Raises:
        ConfigError: ``cp × tp`` does not divide the world size.
    """
    if cp == 1:
        return ContextParallel(None, info.device.type)
    if info.world_size % (cp * tp):
        inner = f"parallel.cp={cp} × parallel.tp={tp} = {cp * tp}" if tp > 1 else f"parallel.cp={cp}"
        raise ConfigError(f"{inner} must divide the world size {info.world_size}")
    mesh = init_device_mesh(info.device.type, (info.world_size // (cp * tp), cp, tp),
                            mesh_dim_names=("dp_outer", "cp", "tp_inner"))
    return ContextParallel(mesh.get_group("cp"), info.device.type)
