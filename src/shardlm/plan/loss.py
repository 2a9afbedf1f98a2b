"""The loss's allocations, in order: the plain loss on whole logits, or the chunked one
(``train.loss_chunk_tokens``).

Letters as in :mod:`shardlm.plan.activations`: N tokens of the micro-batch (all scored: an upper bound), V the
vocabulary, D ``dim``, c the bytes of the compute dtype, k the chunk (``min(loss_chunk_tokens, N)``). Derived
from ``shardlm/train/loss.py`` op by op and checked against PyTorch's allocator (``bench/bench_loss.py``).

Plain (``token_loss_sum(lm_head(h))``): the logits (c·N·V; when c = 2 an fp32 copy too, freed after the loss),
their log-softmax (4·N·V, saved); the logits are freed once the loss is made (nothing holds them: log-softmax
saves its output); with a soft-cap the tanh output (c·N·V) is saved too. Backward: ``nll_loss``'s gradient and
log-softmax's (4·N·V each, the high point: 3 × 4·N·V in fp32), then the logits' gradient (4·N·V, cast to
c·N·V), then the output weight's gradient (c·V·D) and the hidden state's (c·N·D).

Chunked: the hidden state's gradient (c·N·D) and an fp32 weight-gradient accumulator (4·V·D, when the weight
trains) exist from the forward on; per chunk one fp32 (k, V) buffer holds the logits, then in place the
softmax and the gradient (:func:`chunk_peak_bytes` for the other dtypes). Backward scales them in place; a
bf16 weight gradient is a cast of the accumulator.

Online RL's head (:func:`shardlm.rl.logps.token_logps`) is not a cross-entropy: :func:`rl_head_events`.
"""

from __future__ import annotations

#: an allocation (+bytes) or a free (-bytes), and what it is: ``temporaries``, ``grads`` (the output weight's
#: gradient), ``hidden_grad`` (the gradient of the final hidden state, freed by the caller later) or
#: ``prefetch`` (0 bytes: FSDP2's backward prefetch of the last block's group is issued here)
Event = tuple[str, int, str]


def chunk_peak_bytes(chunk: int, vocab: int, dim: int, c: int, softcap: bool, fp32_matmul: bool,
                     weight_grad: bool, cuda: bool = False) -> int:
    """Bytes of one chunk's buffers at their high point (``shardlm/train/loss.py::_chunked``, and the
    vocabulary-parallel ``shardlm/train/vocab_parallel_loss.py::_chunks`` on a rank's V / tp rows).

    fp32: the (k, V) logits, turned in place into the softmax and the gradient (two with a soft-cap: tanh and
    its derivative), and beside the gradient the chunk's hidden-state gradient product ``g @ w`` (k, D) before
    it is copied into the (N, D) gradient: 4·k·V + 4·k·D. bf16: the bf16 logits and their fp32 copy (6·k·V),
    then the fp32 gradient and its bf16 cast with either the (k, D) product or (on CUDA with the native
    kernel) the bf16 (V, D) weight-gradient product added into the accumulator; a soft-cap adds its derivative
    (10·k·V at the high point). Measured (tests/unit/test_loss.py, fp32, V = 512, D = 256, chunks of 128):
    without the (k, D) product the planned peak was 10.9 % under the allocator's, with it 0.2 %.
    """
    kv, kd = chunk * vocab, chunk * dim
    if c == 4:
        return max(8 * kv if softcap else 0, 4 * kv + 4 * kd)
    product = 2 * vocab * dim if cuda and weight_grad and not fp32_matmul else 0
    return max(10 * kv if softcap else 0, 6 * kv + max(product, c * kd))


def loss_events(tokens: int, vocab: int, dim: int, c: int, chunk: int, softcap: bool = False,
                fp32_matmul: bool = False, weight_grad: bool = True,
                cuda: bool = False) -> tuple[list[Event], list[Event]]:
    """The loss's allocations as ``(forward events, backward events)``; bytes > 0 allocate, < 0 free.

    Args:
        tokens: N, tokens of one micro-batch (all scored); vocab: V; dim: D; c: bytes of the compute dtype.
        chunk: ``train.loss_chunk_tokens`` (0 = plain); softcap: a final logit soft-cap is set;
        fp32_matmul: bf16 multiplied in fp32 (``parallel.cpu_bf16_matmul`` on CPU); weight_grad: the output
            weight trains; cuda: on a GPU (see :func:`chunk_peak_bytes`).

    The backward ends with the weight's gradient (``grads``, c·V·D) and the hidden state's (``hidden_grad``,
    c·N·D) alive; everything else is freed.
    """
    nv, vd, nd = tokens * vocab, vocab * dim, tokens * dim
    fwd: list[Event] = []
    bwd: list[Event] = []
    if chunk == 0:
        logits = c * nv
        fwd.append(("temporaries", logits, "logits"))
        if softcap:  # ÷ cap (the projection freed), tanh (saved; the quotient freed), × cap: the logits
            fwd += [("temporaries", logits, "logits"), ("temporaries", -logits, "logits"),
                    ("temporaries", logits, "logits"), ("temporaries", -logits, "logits"),
                    ("temporaries", logits, "logits")]
        if c != 4:
            fwd.append(("temporaries", 4 * nv, "loss"))  # the fp32 copy
        fwd.append(("temporaries", 4 * nv, "loss"))  # log-softmax output, saved
        if c != 4:
            fwd.append(("temporaries", -4 * nv, "loss"))
        fwd.append(("temporaries", -logits, "loss"))  # nothing holds the logits any more
        bwd += [("temporaries", 4 * nv, "loss backward"), ("temporaries", 4 * nv, "loss backward"),
                # nll and log-softmax gradients; nll's and the saved freed
                ("temporaries", -8 * nv, "loss backward")]
        grad_logits = 4 * nv
        if c != 4:
            bwd += [("temporaries", c * nv, "loss backward"), ("temporaries", -4 * nv, "loss backward")]
            grad_logits = c * nv
        if softcap:
            # × cap, tanh and ÷ cap backward, each out of place, its input then freed; the saved tanh too
            bwd += [("temporaries", c * nv, "loss backward"), ("temporaries", -grad_logits, "loss backward"),
                    ("temporaries", c * nv, "loss backward"), ("temporaries", -2 * c * nv, "loss backward"),
                    ("temporaries", c * nv, "loss backward"), ("temporaries", -c * nv, "loss backward")]
            grad_logits = c * nv
        if weight_grad:
            bwd.append(("grads", c * vd, "output backward"))
        bwd += [("hidden_grad", c * nd, "output backward"), ("temporaries", -grad_logits, "output backward")]
        return fwd, bwd
    k = min(chunk, tokens)
    if fp32_matmul and c != 4:
        fwd.append(("temporaries", 4 * vd, "loss"))  # the weight upcast once
    fwd.append(("hidden_grad", c * nd, "loss"))
    if weight_grad:
        fwd.append(("temporaries", 4 * vd, "loss"))  # the fp32 accumulator
    peak = chunk_peak_bytes(k, vocab, dim, c, softcap, fp32_matmul, weight_grad, cuda)
    fwd += [("temporaries", peak, "loss chunk"), ("temporaries", -peak, "loss chunk")]
    if fp32_matmul and c != 4:
        fwd.append(("temporaries", -4 * vd, "loss"))
    if weight_grad and c == 4:  # scaled in place: the accumulator becomes the gradient
        bwd += [("temporaries", -4 * vd, "output backward"), ("grads", 4 * vd, "output backward")]
    elif weight_grad:  # cast to the compute dtype, then the accumulator is freed
        bwd += [("grads", c * vd, "output backward"), ("temporaries", -4 * vd, "output backward")]
    return fwd, bwd


def vocab_parallel_loss_events(tokens: int, vocab: int, dim: int, c: int, chunk: int, tp: int,
                               gathered: int = 0, **kw: bool) -> tuple[list[Event], list[Event]]:
    """:func:`loss_events` of one tensor-parallel rank (``parallel.tp`` = ``tp``; ``tp`` = 1: the plain call):
    the vocabulary-parallel loss (``shardlm/train/vocab_parallel_loss.py``) on the rank's V / tp rows of the
    output projection over every token, chunked (the whole micro-batch one chunk when ``chunk`` is 0), its
    forward inside the all-gather of the sequence-parallel hidden states into ``gathered`` tokens (default
    ``tokens``; c·gathered·D bytes, freed once the loss is made). ``kw``: :func:`loss_events`' flags."""
    if tp == 1:
        return loss_events(tokens, vocab, dim, c, chunk, **kw)
    fwd, bwd = loss_events(tokens, vocab // tp, dim, c, chunk or tokens, **kw)
    hidden = c * (gathered or tokens) * dim
    gather = ("temporaries", hidden, "loss: hidden states all-gathered")
    return [gather, *fwd, ("temporaries", -hidden, "loss")], bwd


def loss_peak_bytes(tokens: int, vocab: int, dim: int, c: int, chunk: int, softcap: bool = False,
                    fp32_matmul: bool = False, weight_grad: bool = True, cuda: bool = False) -> int:
    """The high point, in bytes, of one micro-batch's loss forward and backward over what existed before it
    (the hidden states and the weight), the gradients it leaves included (see :func:`loss_events`)."""
    fwd, bwd = loss_events(tokens, vocab, dim, c, chunk, softcap, fp32_matmul, weight_grad, cuda)
    alive, peak = 0, 0
    for _, nbytes, _ in fwd + bwd:
        alive += nbytes
        peak = max(peak, alive)
    return peak


#: FSDP2's pre-backward of the output's group runs on the gradient of the model's output, here the head's
#: log-probs (``MaskedScatterBackward0``), before the head's backward: its prefetch of the last block's group
#: is alive at the head's high point (measured, 2 ranks)
PREFETCH: Event = ("prefetch", 0, "RL head backward")


def rl_head_events(tokens: int, vocab: int, dim: int, c: int, chunk: int, softcap: bool = False,
                   weight_grad: bool = True) -> tuple[list[Event], list[Event]]:
    """Online RL's head (:func:`shardlm.rl.logps.token_logps`, its chunks ``_chunk_logps``) as
    ``(forward events, backward events)``, as :func:`loss_events` gives the token loss's.

    Letters as in the module docstring: n = ``tokens`` scored tokens of the micro-batch, k the chunk, kV the
    chunk's logit count; all bytes. A chunk computes the logits (c·kV; a soft-cap saves its tanh, c·kV, and
    makes a second c·kV), z = logits.float() / temperature (4·kV, fp32; a bf16 chunk's fp32 copy, 4·kV, is
    freed once divided), logsumexp(z) (one 4·kV temporary, freed; saves z), softmax(z) (4·kV) and
    softmax · z (4·kV, freed once summed) for the entropy. Forward high point: c·kV (2·c·kV with a soft-cap)
    + 12·kV. The softmax is held by the entropy's graph, freed with the entropies when the objective's loss
    returns (only their detached copy reaches the loss), so the backward starts with z (4·kV) and the tanh
    (c·kV) saved, and (under FSDP) with the last block's prefetched all-gather (:data:`PREFETCH`).
    Its high point is LogsumexpBackward0: gather's gradient (a zeroed 4·kV, made first) and
    logsumexp's grad · exp(z − lse) (three 4·kV: the difference, its exp, the product): 16·kV over the saved.
    Then z is freed and the two gradients summed in place (4·kV), divided by the temperature (4·kV, out of
    place), cast to c·kV when c < 4, through the soft-cap's backward as in :func:`loss_events`, and the
    output's backward leaves the weight's gradient (``grads``, c·V·D) and the hidden state's (``hidden_grad``,
    c·n·D).

    ``0 < chunk < n``: every chunk checkpointed: the forward keeps nothing of a chunk (its high point is a
    transient), the backward remakes each chunk's logits and z (high point c·kV + 8·kV, 2·c·kV + 8·kV with a
    soft-cap: the recompute stops before the entropy's product), last chunk first, then as above; after the
    first chunk back the weight's and hidden state's gradients exist and each later chunk adds a c·V·D and
    a c·n·D (``SliceBackward0``'s zero-padded gradient) into them.

    Measured (tests/unit/test_rollout_plan.py against PyTorch's CPU allocator, 3 rows of 100 scored tokens in
    120, V = 4,000, D = 32, temperature 0.7): fp32 and bf16, one chunk and chunks of 128, with and without a
    soft-cap, the planned high point +0.05 % to +0.27 % over the measured. Not modelled:
    ``parallel.cpu_bf16_matmul``'s fp32 weight copy, and tensor parallel (token_logps runs without it).
    """
    n = max(tokens, 1)
    checkpointed = 0 < chunk < n
    k = min(chunk, n) if checkpointed else n
    saved_per = 4 + (c if softcap else 0)  # bytes per logit the backward starts with: z, the tanh
    high_per = (2 * c if softcap else c) + 12  # the forward's high point, per logit

    def backward(kv: int, first: bool) -> list[Event]:
        """One chunk's backward from its saved tensors to its gradients (its saved ones freed)."""
        steps = [16 * kv, -16 * kv, 4 * kv, -4 * kv]  # logsumexp's high point; z freed; ÷ temperature
        grad = 4 * kv
        if c != 4:
            steps += [c * kv, -4 * kv]
            grad = c * kv
        if softcap:  # × cap, tanh and ÷ cap backward, each out of place; the saved tanh freed
            steps += [c * kv, -grad, c * kv, -2 * c * kv, c * kv, -c * kv]
            grad = c * kv
        out: list[Event] = [("temporaries", b, "RL head backward") for b in steps]
        if first:
            out += [("grads", c * vocab * dim, "output backward")] if weight_grad else []
            out.append(("hidden_grad", c * n * dim, "output backward"))
        else:  # added into the existing gradients
            add = (c * vocab * dim if weight_grad else 0) + c * n * dim
            out += [("temporaries", add, "output backward"), ("temporaries", -add, "output backward")]
        return out + [("temporaries", -grad, "output backward")]

    high = high_per * k * vocab
    if not checkpointed:
        saved = saved_per * n * vocab
        return [("temporaries", high, "RL head"), ("temporaries", saved - high, "RL head")], [
            PREFETCH, *backward(n * vocab, True)]
    fwd: list[Event] = [("temporaries", high, "RL head chunk"), ("temporaries", -high, "RL head chunk")]
    last = n - (n - 1) // k * k  # the last chunk's tokens: the first back
    bwd: list[Event] = [PREFETCH]
    for kv, first in [(last * vocab, True)] + ([(k * vocab, False)] if n > k else []):
        remade = (high_per - 4) * kv  # the recompute stops before the entropy's product: 4·kV less
        bwd += [("temporaries", remade, "RL head recompute"),
                ("temporaries", saved_per * kv - remade, "RL head recompute"), *backward(kv, first)]
    return fwd, bwd
