"""The token loss, one function for training, evaluation and perplexity: plain, or fused with the
output projection.

The plain loss (:func:`token_loss_sum`) takes the model's logits, ``(tokens, vocab)``; at a large vocabulary
they are the step's largest allocation (4,096 tokens × 151,936 Qwen3 ids: 2.5 GB in fp32, and autograd keeps
as much again for the backward). The chunked loss (:func:`linear_cross_entropy_sum`,
``train.loss_chunk_tokens`` > 0) computes the output projection and the cross-entropy together, a chunk of
scored tokens at a time: each chunk's logits are made, turned into that chunk's loss and its gradients with
respect to the hidden states and the output weight (and LoRA adapters), and freed. Nothing of size ``tokens ×
vocab`` exists, nor is anything of it kept for the backward. The gradients are computed in the forward (Liger
Kernel's fused linear cross-entropy, Hsu et al. 2024; the same matrix products as the plain loss's backward,
so no extra compute) and the backward only scales them by the incoming gradient. Related: Wijmans et al., "Cut
Your Losses in Large-Vocabulary Language Models" (2024); torchtune's chunked output loss.

Per chunk of c scored tokens (z: logits, t: targets; the softmax in fp32 as transformers computes it)::

    z = h_c · Wᵀ  [+ (alpha/r) · u_c · Bᵀ, LoRA]     (c, V) in the compute dtype, then fp32
    z = cap · tanh(z / cap)                          (Gemma's final logit soft-cap, when set)
    loss_c = Σ_i [ logsumexp(z_i) - z_i,t_i ]
    g = softmax(z) - onehot(t)  [· (1 - tanh²(z / cap))]
    dh_c = g · W,   dW += gᵀ · h_c   [dB += (alpha/r) gᵀ · u_c,  du_c = (alpha/r) g · B]
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from shardlm.data.instruct import IGNORE_INDEX
from shardlm.model.cpu_matmul import Fp32MatmulLinear
from shardlm.model.lora import LoRALinear
from shardlm.parallel.tp import tp_degree
from shardlm.train.vocab_parallel_loss import vocab_parallel_loss_sum


def token_loss_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Summed next-token cross-entropy over every target that is not ``IGNORE_INDEX`` (-100).

    Args:
        logits: (B, T, V) in any float dtype; upcast to fp32 before the softmax (as transformers does).
        targets: (B, T) int64 token ids, ``IGNORE_INDEX`` where nothing is scored.

    Returns a 0-dim fp32 tensor: the sum, in nats, over the scored positions. Divide by the number of
    scored targets (summed over ranks and micro-batches) for the mean.
    """
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=IGNORE_INDEX,
                           reduction="sum")


def model_loss_sum(model: nn.Module, inputs: Tensor, targets: Tensor, chunk_tokens: int,
                   documents: Tensor | None = None, backward_twice: bool = False,
                   **model_kwargs: Any) -> Tensor:
    """The summed token loss of ``model`` on ``inputs``: plain (``chunk_tokens == 0``) or chunked.

    Args:
        model: a :class:`~shardlm.model.decoder.CausalLM`, or it wrapped (FSDP2, DDP): called once, so every
            wrapper's hooks run (FSDP's all-gather of the output projection with the final norm, as for the
            plain loss).
        inputs: (B, T) int64 token ids; targets: (B, T) int64, ``IGNORE_INDEX`` where nothing is scored.
        chunk_tokens: ``train.loss_chunk_tokens``: 0 = logits, then :func:`token_loss_sum` (the logits
        are freed
            when this returns); > 0 = :func:`output_loss_sum` through the model's ``head`` argument. Under
            tensor parallel (the output projection split over the vocabulary) 0 means one chunk of all the
            tokens: the vocabulary-parallel loss (:mod:`shardlm.train.vocab_parallel_loss`), whose logits
            stay split.
        documents: (B, T) int64 document index per token for block-causal attention (packed rows; see
            ``CausalLM.forward``), or None for a plain causal mask.
        backward_twice: the chunked loss's gradients may be asked for twice (see
            :func:`linear_cross_entropy_sum`).
        model_kwargs: passed on to the model's forward (context parallelism's ``positions`` and ``masks``).

    Returns a 0-dim fp32 tensor (nats, summed over the scored targets).

    Raises:
        ValueError: a negative ``chunk_tokens``.
    """
    if chunk_tokens < 0:
        raise ValueError(f"loss chunk of {chunk_tokens} tokens: must be >= 0 (0 = the plain loss)")
    if chunk_tokens == 0 and tp_degree(getattr(model, "module", model).lm_head.weight) > 1:  # (DDP: .module)
        chunk_tokens = inputs.numel()  # the logits are split over the vocabulary: one chunk of every token
    if chunk_tokens == 0:
        return token_loss_sum(model(inputs, documents=documents, **model_kwargs), targets)

    def head(llama: nn.Module, hidden: Tensor) -> Tensor:
        return output_loss_sum(llama, hidden, targets, chunk_tokens, backward_twice)

    return model(inputs, documents=documents, head=head, **model_kwargs)


def output_loss_sum(llama: nn.Module, hidden: Tensor, targets: Tensor, chunk_tokens: int,
                    backward_twice: bool = False) -> Tensor:
    """The chunked loss of a :class:`~shardlm.model.decoder.CausalLM` output head on its final hidden states.

    Reads the head as the model's own forward would apply it: ``lm_head`` (an ``nn.Linear``, its CPU
    fp32-multiply form :class:`~shardlm.model.cpu_matmul.Fp32MatmulLinear`, or a
    :class:`~shardlm.model.lora.LoRALinear` with a frozen, possibly bf16 or NF4, base), tied or not, and
    ``cfg.final_logit_softcap``. An NF4 or narrower weight is dequantised / cast once to the compute dtype. A
    weight split over the vocabulary (a DTensor in the forward: tensor parallel) goes to
    :func:`vocab_parallel_loss_sum`.

    Args:
        hidden: (B, T, D), the final norm's output, compute dtype; targets: (B, T) int64.

    Returns a 0-dim fp32 tensor (see :func:`linear_cross_entropy_sum`).
    """
    head = llama.lm_head
    weight = head.weight
    if isinstance(weight, DTensor):  # tensor parallel: this rank's vocabulary rows (no LoRA, parallel/tp.py)
        return vocab_parallel_loss_sum(hidden, weight, targets, chunk_tokens, llama.cfg.final_logit_softcap,
                                       backward_twice)
    lora = None
    fp32_matmul = isinstance(head, Fp32MatmulLinear)
    if isinstance(head, LoRALinear):
        a = head.lora_A.weight
        # (B, T, r): the adapters' first product, by autograd
        u = F.linear(head.dropout(hidden).to(a.dtype), a)
        lora = (u, head.lora_B.weight, head.scaling)
        fp32_matmul = head.fp32_matmul
    if weight.dtype != hidden.dtype or type(weight).__name__ == "NF4Tensor":
        # a frozen bf16 / NF4 base, as LoRALinear.base and torchao's linear do
        weight = weight.to(hidden.dtype)
    fp32_matmul = fp32_matmul and hidden.dtype == torch.bfloat16
    return linear_cross_entropy_sum(hidden, weight, targets, chunk_tokens, llama.cfg.final_logit_softcap,
                                    lora, fp32_matmul, backward_twice)


def linear_cross_entropy_sum(hidden: Tensor, weight: Tensor, targets: Tensor, chunk_tokens: int,
                             softcap: float = 0.0, lora: tuple[Tensor, Tensor, float] | None = None,
                             fp32_matmul: bool = False, backward_twice: bool = False) -> Tensor:
    """``token_loss_sum(softcap(hidden · weightᵀ [+ LoRA]), targets)``, computed ``chunk_tokens`` scored
    tokens at a time.

    Equal to the plain loss up to summation order (fp32: loss and gradients within 1e-6 relative, tested).
    Only the positions whose target is not ``IGNORE_INDEX`` are projected (their rows gathered first); the
    others get a zero gradient, as in the plain loss. With gradients enabled and any input requiring one, the
    gradients are computed here, in the forward, and the backward scales them (once: ``retain_graph`` is
    refused). Frozen inputs (``requires_grad=False``, e.g. a frozen or LoRA-base weight) get no gradient and
    cost no product. The scored rows are found on the CPU only (:data:`GATHER_SCORED_ROWS_ON`); on a GPU every
    row is projected and the ignored ones masked, so the loss reads nothing from the device.

    Args:
        hidden: (..., D) float, the compute dtype (fp32 or bf16); weight: (V, D), the same dtype. targets:
        (...) int64 ids in [0, V), or ``IGNORE_INDEX``. chunk_tokens: scored tokens per chunk, >= 1; the peak
        is about ``chunk_tokens × V`` fp32 values (two such
            with a soft-cap; bf16 adds a bf16 copy) plus the fp32 weight gradient ``V × D``.
        softcap: Gemma's ``final_logit_softcapping`` c: logits ``c · tanh(z / c)`` (in the compute dtype); 0 =
        none. lora: ``(u, B, scaling)``: the LoRA term ``scaling · u · Bᵀ`` added to the logits
        (:class:`LoRALinear`'s
            ``delta``), with u = (..., r) = ``dropout(hidden) · Aᵀ`` computed by the caller, B (V, r), both in
            the adapters' dtype.
        fp32_matmul: bf16 operands multiplied in fp32 and rounded to bf16 (``parallel.cpu_bf16_matmul``, the
            CPU kernel of :mod:`shardlm.model.cpu_matmul`); the weight is upcast once per call.
        backward_twice: allow a second backward with the same incoming gradient (a pipeline's zero-bubble
            schedules split the backward into an input and a weight part): the gradients are kept until then.

    Returns a 0-dim fp32 tensor: the sum in nats over the scored targets.

    Raises:
        ValueError: ``chunk_tokens`` < 1, or shapes that do not fit.
    """
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    if hidden.shape[-1] != weight.shape[1] or hidden.shape[:-1] != targets.shape:
        raise ValueError(f"hidden {tuple(hidden.shape)}, weight {tuple(weight.shape)} and targets "
                         f"{tuple(targets.shape)} do not fit: (..., D), (V, D), (...)")
    u, b, scaling = lora if lora is not None else (None, None, 0.0)
    h = hidden.reshape(-1, hidden.shape[-1])
    u = None if u is None else u.reshape(-1, u.shape[-1])
    inputs = (h, weight, u, b)
    if torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in inputs):
        return _LinearCrossEntropy.apply(h, weight, u, b, targets.reshape(-1), chunk_tokens, softcap, scaling,
                                         fp32_matmul, backward_twice)
    return _chunked(h, weight, u, b, targets.reshape(-1), chunk_tokens, softcap, scaling, fp32_matmul,
                    (False, False, False, False))[0]


#: device types on which only the scored rows are projected (found with a host read, free on the CPU);
#: elsewhere every row is projected and the ignored ones masked, so that the loss never synchronises with
#: the device
GATHER_SCORED_ROWS_ON = ("cpu",)


def _scored_rows(targets: Tensor) -> Tensor | None:
    """Indices (n,) int64 of the scored targets, or None when every row is projected: every target is scored,
    or ``targets`` is on an accelerator, where finding the rows would read the device from the host (a
    synchronisation per micro-batch, against the lean step); there the ignored rows are projected and
    masked instead."""
    if targets.device.type not in GATHER_SCORED_ROWS_ON:
        return None
    valid = targets != IGNORE_INDEX
    if bool(valid.all()):
        return None
    return valid.nonzero().squeeze(1)


def _chunked(
    h: Tensor,
    w: Tensor,
    u: Tensor | None,
    b: Tensor | None,
    targets: Tensor,
    chunk: int,
    softcap: float,
    scaling: float,
    fp32_matmul: bool,
    need: tuple[bool, bool, bool, bool],
) -> tuple[Any, ...]:
    """The loss sum and, where ``need`` says (for h, w, u, b), the unscaled gradients (see the
    module docstring).

    Returns ``(loss, rows, dh, dw, du, db)``: ``rows`` the scored rows (None: all), ``dh``/``du`` gradients of
    those rows only (n, D) / (n, r), ``dw`` (V, D) and ``db`` (V, r) fp32; None where not needed.
    """
    dtype = h.dtype
    rows = _scored_rows(targets)
    if rows is not None:  # only the scored rows are projected
        h, targets = h.index_select(0, rows), targets.index_select(0, rows)
        u = None if u is None else u.index_select(0, rows)
    n = h.shape[0]
    w_mm = w.float() if fp32_matmul else w  # the CPU fp32 kernel: the weight upcast once
    need_h, need_w, need_u, need_b = need
    dh = torch.empty_like(h) if need_h else None
    dw = torch.zeros(w.shape, dtype=torch.float32, device=w.device) if need_w else None
    du = torch.empty_like(u) if need_u else None
    db = torch.zeros(b.shape, dtype=torch.float32, device=b.device) if need_b else None
    # summed in fp64 (as nll_loss on CPU), returned fp32
    loss = torch.zeros((), dtype=torch.float64, device=h.device)
    for start in range(0, n, chunk):
        h_c, t_c = h[start:start + chunk], targets[start:start + chunk]
        z = (F.linear(h_c.float(), w_mm).to(dtype) if fp32_matmul else F.linear(h_c, w_mm))  # (c, V)
        if u is not None:  # LoRA: base + delta, the delta made in the adapters' dtype (LoRALinear.delta)
            z = z + (F.linear(u[start:start + chunk], b) * scaling).to(dtype)
        deriv = None
        if softcap:
            # in place (z is this chunk's own), in the compute dtype as the model's
            tanh = z.div_(softcap).tanh_()
            z = tanh * softcap
            if need_h or need_w or need_u or need_b:
                deriv = tanh.float().square_().neg_().add_(1.0)  # d(c · tanh(z / c)) / dz
            del tanh
        z = z.float()  # the fp32 softmax (a no-op in fp32)
        # see _scored_rows
        scored = None if rows is not None or h.device.type in GATHER_SCORED_ROWS_ON else t_c != IGNORE_INDEX
        if scored is not None:
            t_c = t_c.clamp_min(0)  # an ignored row's target: any id, its loss and gradient masked below
        z_t = z.gather(1, t_c.unsqueeze(1)).squeeze(1)
        zmax = z.amax(1, keepdim=True)
        z.sub_(zmax).exp_()  # in place: one (c, V) fp32 buffer
        total = z.sum(1, keepdim=True)
        # logsumexp - z_t as (max - z_t) + log Σ exp(z - max): the difference first, so that a confident
        # prediction (both near the max, the loss small against them) loses no digits to rounding
        row_loss = (zmax.squeeze(1) - z_t) + total.log().squeeze(1)
        loss += (row_loss if scored is None else row_loss * scored).sum(dtype=torch.float64)
        if not (need_h or need_w or need_u or need_b):
            del z  # before the next chunk's logits exist
            continue
        g = z.div_(total)  # softmax
        g[torch.arange(g.shape[0], device=g.device), t_c] -= 1.0
        if scored is not None:
            g.mul_(scored.unsqueeze(1))  # an ignored row: no gradient, as in the plain loss
        if deriv is not None:
            g.mul_(deriv)
            del deriv
        if dtype != torch.float32:  # rounded to the compute dtype in place (the plain loss's cast back)
            g.copy_(g.to(dtype))
        g_mm = g if fp32_matmul else g.to(dtype)  # the CPU fp32 kernel multiplies the rounded values in fp32
        if need_h:
            dh[start:start + chunk] = g_mm @ w_mm
        if need_w and (g_mm.dtype == torch.float32 or g.device.type == "cpu"):
            # fp32 products of the (rounded) values, summed into the fp32 accumulator in place; on CPU a bf16
            # product added in would cost a (V, D) bf16 result and an fp32 copy of it per chunk
            dw.addmm_(g.t(), h_c.float())
        elif need_w:  # CUDA, bf16: the bf16 product (V, D), added in (cast inside the kernel)
            dw.add_(g_mm.t() @ h_c)
        if need_u or need_b:
            g_a = g_mm.to(b.dtype) * scaling
            if need_u:
                du[start:start + chunk] = g_a @ b
            if need_b:
                db.addmm_(g_a.t(), u[start:start + chunk].to(db.dtype))
            del g_a
        del z, g, g_mm  # before the next chunk's logits exist
    return loss.float(), rows, dh, dw, du, db


class _LinearCrossEntropy(torch.autograd.Function):
    """Autograd for :func:`linear_cross_entropy_sum`: gradients made in forward, scaled in backward."""

    @staticmethod
    def forward(ctx, h: Tensor, w: Tensor, u: Tensor | None, b: Tensor | None,  # noqa: ANN001 - autograd's ctx
                targets: Tensor, chunk: int, softcap: float, scaling: float, fp32_matmul: bool,
                backward_twice: bool = False) -> Tensor:
        need = tuple(x is not None and x.requires_grad for x in (h, w, u, b))
        loss, rows, dh, dw, du, db = _chunked(h, w, u, b, targets, chunk, softcap, scaling, fp32_matmul, need)
        ctx.grads = [dh, dw, du, db]
        ctx.twice, ctx.first = backward_twice, None  # (the first backward's incoming gradient and results)
        ctx.rows, ctx.n = rows, h.shape[0]
        ctx.dtypes = (h.dtype, w.dtype, None if u is None else u.dtype, None if b is None else b.dtype)
        return loss

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor | None, ...]:  # noqa: ANN001 - autograd's ctx
        if ctx.first is not None and torch.equal(grad, ctx.first[0]):
            # the second of a split backward (zero-bubble schedules: the input part, then the weight part):
            # the same results, copied (autograd may have kept the first ones as a parameter's .grad)
            return (*(None if g is None else g.clone() for g in ctx.first[1]), None, None, None, None, None,
                    None)
        if ctx.grads is None:
            raise RuntimeError("the chunked loss's backward ran twice (retain_graph): its gradients are made "
                               "in forward and handed out once; use train.loss_chunk_tokens = 0 for a double "
                               "backward")
        grads, ctx.grads = ctx.grads, None
        out: list[Tensor | None] = []
        for i, (g, dtype) in enumerate(zip(grads, ctx.dtypes)):
            grads[i] = None
            if g is None:
                out.append(None)
                continue
            g = g.mul_(grad).to(dtype)  # in place: no second weight-sized buffer
            if i in (0, 2) and ctx.rows is not None:  # per-row gradients: zero where nothing was scored
                full = g.new_zeros((ctx.n, g.shape[1]))
                g = full.index_copy_(0, ctx.rows, g)
            out.append(g)
            del g
        if ctx.twice:  # kept for a second backward (split into input and weight parts)
            ctx.first = (grad.detach().clone(), out)
        return (*out, None, None, None, None, None, None)
