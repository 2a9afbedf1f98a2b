"""The distillation loss: a divergence between the student's and the teacher's next-token distributions on
the response tokens, mixed with the student's cross-entropy, computed a chunk of tokens at a time from both
models' final hidden states, so that neither model's whole logits exist.

Per scored position (target != ``IGNORE_INDEX``), with s = log_softmax(z_student / T) and t =
log_softmax(z_teacher / T) over the vocabulary (fp32)::

    forward KL   KL(teacher ‖ student) = Σ_v e^t (t - s)                         (beta = 0)
    reverse KL   KL(student ‖ teacher) = Σ_v e^s (s - t)                         (beta = 1)
    JSD(β)       β · KL(teacher ‖ m) + (1 - β) · KL(student ‖ m),  m = β e^t + (1 - β) e^s,  0 < β < 1

the generalised Jensen-Shannon divergence of GKD (Agarwal et al., "On-Policy Distillation of Language Models:
Learning from Self-Generated Mistakes", ICLR 2024, eq. 1), with TRL's conventions (``GKDTrainer
.generalized_jsd_loss``, TRL 1.16): β weighs the teacher's side, the mixture is taken in log space, and the
temperature divides both models' logits with no T² factor. The mixed per-token loss is::

    loss = alpha · D(student, teacher) + (1 - alpha) · CE(student at temperature 1, target)

(``alpha`` the distillation weight, as torchtune's KD recipes' ``kd_ratio`` and DistillKit's ``alpha``).

**Top-k** (``top_k`` = k > 0): the teacher's k most likely tokens at temperature T, plus one tail bucket
holding the rest of the probability mass, make a (k + 1)-outcome distribution for each model: the teacher's
and the student's log-probabilities of those k tokens (each normalised over the whole vocabulary) and each
model's log-probability of all the other tokens together, ``log Σ_{v ∉ top-k} e^{s_v}`` (for the teacher the
same). The divergence above is taken over these k + 1 outcomes. This is TRL 1.16's sparse teacher form
(``trl.experimental.server_distillation``: teacher top-k log-probs and ``_add_tail_bucket``, default
``loss_add_tail=True``), which stores k values per position instead of the vocabulary; TRL computes the tail
as ``log(1 - Σ top-k)``, here it is the log-sum-exp of the other tokens (the same number, exact when the
top-k mass is near 1). Within a chunk the teacher's logits for the chunk are still made: the saving is in
what a teacher must keep or send per position, not in this chunk's peak.

**Chunks**: only the scored rows are projected (their hidden states gathered first: a host read of the
targets, a synchronisation per micro-batch on a GPU). For each chunk of ``chunk_tokens`` rows the student's
logits (with gradient) and the teacher's (without) are made, the chunk's loss and the gradient with respect
to the student's chunk logits are computed by autograd on that chunk alone, and turned into the gradients of
the student's hidden states and output weight (``dh = g · W``, ``dW += gᵀ · h``) before the chunk's logits
are freed, as the chunked cross-entropy of :mod:`shardlm.train.loss` does; the backward only scales them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from shardlm.data.instruct import IGNORE_INDEX

#: the divergences of ``distill.loss`` and the β of the generalised JSD each is
DIVERGENCES = ("forward_kl", "reverse_kl", "jsd")
#: the per-position sums the loss returns beside it (fp64), in this order
STAT_NAMES = ("divergence", "student_ce", "teacher_ce")


@dataclass(frozen=True)
class DistillSpec:
    """What the distillation loss computes (``[distill]`` resolved).

    ``beta``: the generalised JSD's β in [0, 1] (0 = forward KL, 1 = reverse KL); ``temperature`` T > 0;
    ``alpha`` in [0, 1], the weight of the divergence against the student's cross-entropy; ``top_k`` the
    teacher's top-k support (0 = the whole vocabulary)."""

    beta: float
    temperature: float = 1.0
    alpha: float = 1.0
    top_k: int = 0

    @classmethod
    def of(cls, loss: str, beta: float, temperature: float, alpha: float, top_k: int) -> DistillSpec:
        """The spec of a ``[distill]`` section: ``forward_kl`` is β = 0, ``reverse_kl`` β = 1, ``jsd`` its
        ``beta``.

        Raises:
            ValueError: an unknown loss name."""
        if loss not in DIVERGENCES:
            raise ValueError(f"distill.loss {loss!r}: expected one of {', '.join(DIVERGENCES)}")
        b = {"forward_kl": 0.0, "reverse_kl": 1.0}.get(loss, beta)
        return cls(b, temperature, alpha, top_k)


def _top_k_support(s: Tensor, t: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """(n, V) log-probs of student and teacher -> (n, k + 1) each: the teacher's top-k tokens and the tail
    bucket of every other token (see the module docstring)."""
    ids = t.topk(k, dim=1).indices
    rest = torch.ones_like(t, dtype=torch.bool).scatter_(1, ids, False)
    neg_inf = torch.tensor(-math.inf, dtype=t.dtype, device=t.device)

    def sparse(x: Tensor) -> Tensor:
        tail = torch.where(rest, x, neg_inf).logsumexp(1, keepdim=True)
        return torch.cat([x.gather(1, ids), tail], dim=1)

    return sparse(s), sparse(t)


def divergence_rows(student_logits: Tensor, teacher_logits: Tensor, beta: float, temperature: float = 1.0,
                    top_k: int = 0) -> Tensor:
    """The divergence of each row (see the module docstring for the formulas and sources).

    Args:
        student_logits, teacher_logits: (n, V) float logits of the same positions (upcast to fp32).
        beta: β in [0, 1]; temperature: T > 0; top_k: 0 = the whole vocabulary, else k in [1, V).

    Returns (n,) fp32 divergences in nats, differentiable in both inputs.
    """
    s = F.log_softmax(student_logits.float() / temperature, dim=-1)
    t = F.log_softmax(teacher_logits.float() / temperature, dim=-1)
    if top_k:
        s, t = _top_k_support(s, t, top_k)
    if beta == 0:
        return (t.exp() * (t - s)).sum(-1)
    if beta == 1:
        return (s.exp() * (s - t)).sum(-1)
    m = torch.logaddexp(s + math.log1p(-beta), t + math.log(beta))  # log((1 - β) e^s + β e^t)
    return beta * (t.exp() * (t - m)).sum(-1) + (1 - beta) * (s.exp() * (s - m)).sum(-1)


def _chunk_rows(zs: Tensor, zt: Tensor, targets: Tensor, spec: DistillSpec) -> tuple[Tensor, Tensor]:
    """A chunk's mixed loss sum (0-dim fp32, differentiable in ``zs``) and its stats (3,) fp64 (divergence,
    student CE, teacher CE), from (c, V) fp32 logits."""
    div = divergence_rows(zs, zt, spec.beta, spec.temperature, spec.top_k)
    ce = F.cross_entropy(zs, targets, reduction="none")
    with torch.no_grad():
        teacher_ce = F.cross_entropy(zt, targets, reduction="sum")
    loss = spec.alpha * div.sum() + (1 - spec.alpha) * ce.sum()
    stats = torch.stack([div.detach().sum(), ce.detach().sum(), teacher_ce]).double()
    return loss, stats


def distill_logits_sum(student_logits: Tensor, teacher_logits: Tensor, targets: Tensor,
                       spec: DistillSpec) -> tuple[Tensor, Tensor]:
    """The whole-logits form (the reference of the chunked one): the mixed loss summed over the scored rows.

    Args:
        student_logits, teacher_logits: (..., V) float; targets: (...) int64, ``IGNORE_INDEX`` where nothing
        is scored.

    Returns ``(loss, stats)``: a 0-dim fp32 sum in nats (differentiable in ``student_logits``) and
    (3,) fp64 sums of :data:`STAT_NAMES` over the scored rows.
    """
    v = student_logits.shape[-1]
    zs, zt, tg = student_logits.reshape(-1, v), teacher_logits.reshape(-1, v), targets.reshape(-1)
    rows = (tg != IGNORE_INDEX).nonzero().squeeze(1)
    return _chunk_rows(zs.index_select(0, rows).float(), zt.index_select(0, rows).float(),
                       tg.index_select(0, rows), spec)


@dataclass(frozen=True)
class Head:
    """A model's output projection as the chunked loss reads it: ``weight`` (V, D) in the hidden states'
    dtype, Gemma's final logit ``softcap`` (0 = none), and ``fp32_matmul`` (bf16 operands multiplied in fp32,
    :mod:`shardlm.model.cpu_matmul`)."""

    weight: Tensor
    softcap: float = 0.0
    fp32_matmul: bool = False

    def logits(self, h: Tensor) -> Tensor:
        """(c, D) hidden states -> (c, V) logits in the hidden states' dtype, soft-capped as the model's."""
        if self.fp32_matmul:
            z = F.linear(h.float(), self.weight.float()).to(h.dtype)
        else:
            z = F.linear(h, self.weight)
        return self.softcap * torch.tanh(z / self.softcap) if self.softcap else z


def distill_hidden_sum(student_hidden: Tensor, student_head: Head, teacher_hidden: Tensor, teacher_head: Head,
                       targets: Tensor, spec: DistillSpec, chunk_tokens: int) -> tuple[Tensor, Tensor]:
    """The mixed loss of the scored rows from both models' final hidden states, ``chunk_tokens`` rows at a
    time (see the module docstring); equal to :func:`distill_logits_sum` of the two models' logits up to
    summation order.

    Args:
        student_hidden: (..., D_s), the student's final norm output (compute dtype); student_head: its output
            projection (weight (V, D_s), may require a gradient). teacher_hidden: (..., D_t), teacher_head:
            (V, D_t), no gradient. targets: (...) int64. chunk_tokens: rows per chunk, >= 1; the peak is a few
            ``chunk_tokens × V`` fp32 buffers (both models' log-probs, the mixture) plus the fp32 gradient of
            the student's weight.

    Returns ``(loss, stats)``: 0-dim fp32 (the sum in nats over the scored rows; its backward gives the
    student's hidden states and weight their gradients, once: ``retain_graph`` is refused) and (3,) fp64
    sums of :data:`STAT_NAMES`.

    Raises:
        ValueError: ``chunk_tokens`` < 1, or shapes that do not fit.
    """
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    ws, wt = student_head.weight, teacher_head.weight
    if (student_hidden.shape[:-1] != targets.shape or teacher_hidden.shape[:-1] != targets.shape
            or student_hidden.shape[-1] != ws.shape[1] or teacher_hidden.shape[-1] != wt.shape[1]
            or ws.shape[0] != wt.shape[0]):
        raise ValueError(f"student hidden {tuple(student_hidden.shape)} and weight {tuple(ws.shape)}, "
                         f"teacher hidden {tuple(teacher_hidden.shape)} and weight {tuple(wt.shape)}, "
                         f"targets {tuple(targets.shape)} do not fit: (..., D_s), (V, D_s), (..., D_t), "
                         "(V, D_t), (...)")
    hs = student_hidden.reshape(-1, student_hidden.shape[-1])
    ht = teacher_hidden.reshape(-1, teacher_hidden.shape[-1]).detach()
    stats = torch.zeros(len(STAT_NAMES), dtype=torch.float64, device=hs.device)
    loss = _DistillChunks.apply(hs, ws, ht, targets.reshape(-1), student_head, teacher_head, spec,
                                chunk_tokens, stats)
    return loss, stats


def _chunks(hs: Tensor, ws: Tensor, ht: Tensor, targets: Tensor, s_head: Head, t_head: Head,
            spec: DistillSpec, chunk: int, stats: Tensor, need: tuple[bool, bool]) -> tuple[Any, ...]:
    """Loss (0-dim fp32), scored rows, and the gradients of the scored rows' hidden states (n, D_s) and of the
    student's weight (V, D_s) fp32 where ``need`` says; ``stats`` summed into in place."""
    rows = (targets != IGNORE_INDEX).nonzero().squeeze(1)
    hs, ht, targets = hs.index_select(0, rows), ht.index_select(0, rows), targets.index_select(0, rows)
    need_h, need_w = need
    dh = torch.empty_like(hs) if need_h else None
    dw = torch.zeros(ws.shape, dtype=torch.float32, device=ws.device) if need_w else None
    w_mm = ws.float() if s_head.fp32_matmul else ws
    loss = torch.zeros((), dtype=torch.float64, device=hs.device)
    for start in range(0, hs.shape[0], chunk):
        h_c = hs[start:start + chunk]
        with torch.no_grad():
            zt = t_head.logits(ht[start:start + chunk]).float()
            z = F.linear(h_c.float(), w_mm).to(h_c.dtype) if s_head.fp32_matmul else F.linear(h_c, ws)
        leaf = z.requires_grad_(need_h or need_w)
        with torch.enable_grad():
            zs = s_head.softcap * torch.tanh(leaf / s_head.softcap) if s_head.softcap else leaf
            loss_c, stats_c = _chunk_rows(zs.float(), zt, targets[start:start + chunk], spec)
            g = torch.autograd.grad(loss_c, leaf)[0] if leaf.requires_grad else None
        loss += loss_c.detach().double()
        stats += stats_c
        del zt, zs, leaf, z, loss_c
        if g is None:
            continue
        g_mm = g.float() if s_head.fp32_matmul else g
        if need_h:
            dh[start:start + chunk] = (g_mm @ w_mm).to(hs.dtype)
        if need_w:
            dw.addmm_(g.float().t(), h_c.float())
        del g, g_mm  # before the next chunk's logits exist
    return loss.float(), rows, dh, dw


class _DistillChunks(torch.autograd.Function):
    """Autograd for :func:`distill_hidden_sum`: gradients made in forward, scaled in backward."""

    @staticmethod
    def forward(ctx, hs: Tensor, ws: Tensor, ht: Tensor, targets: Tensor, s_head: Head,  # noqa: ANN001 - ctx
                t_head: Head, spec: DistillSpec, chunk: int, stats: Tensor) -> Tensor:
        need = (hs.requires_grad, ws.requires_grad)
        loss, rows, dh, dw = _chunks(hs, ws, ht, targets, s_head, t_head, spec, chunk, stats, need)
        ctx.grads, ctx.rows, ctx.n, ctx.dtypes = [dh, dw], rows, hs.shape[0], (hs.dtype, ws.dtype)
        return loss

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor | None, ...]:  # noqa: ANN001 - autograd's ctx
        if ctx.grads is None:
            raise RuntimeError("the chunked distillation loss's backward ran twice (retain_graph): its "
                               "gradients are made in forward and handed out once")
        (dh, dw), ctx.grads = ctx.grads, None
        if dh is not None:
            dh = dh.new_zeros((ctx.n, dh.shape[1])).index_copy_(0, ctx.rows, dh.mul_(grad.to(dh.dtype)))
        if dw is not None:
            dw = dw.mul_(grad).to(ctx.dtypes[1])
        return dh, dw, None, None, None, None, None, None, None
