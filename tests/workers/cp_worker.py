"""Context-parallel attention against one-rank attention, in one torchrun launch.

Usage: ``torchrun --nproc_per_node=N tests/workers/cp_worker.py OUT.json`` (N = 2 or 4, see :func:`main`).
Every rank builds the same full q, k, v (seeded), computes one-rank attention under the dense reference mask
and its gradients, then its own CP share (:class:`shardlm.parallel.cp.ContextParallel`) and their gradients,
and records the largest differences on its tokens per case (``dsinks``: the attention sinks' gradient, summed
over the CP group, against one rank's, relative to its magnitude; ``vs_no_sinks``: how far the sinks move the
output). Rank 0 writes ``OUT.json``: ``{case: {"out": diff,
"dq": .., "dk": .., "dv": .., "masked": ..}}`` with each diff the maximum over ranks; ``vs_causal`` is how far
the case's attention is from plain causal attention (documents and windows must make a difference, so a case
cannot pass by ignoring them). Each case runs blockwise (``CASE``), in the fallback (``CASE/fallback``, the
path without a log-sum-exp kernel) and at 4 ranks blockwise at CP 4 too (``CASE@cp4``); ``saved_rows`` is the
longest sequence dimension of any tensor attention saved for its backward (counted by
``torch.autograd.graph.saved_tensors_hooks``), ``saved_bytes`` their sum, and ``t_pad`` the padded length.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from shardlm.model.attention import dense_mask
from shardlm.model.decoder import attention
from shardlm.parallel import exit_process
from shardlm.parallel.cp import ContextParallel, padded_length
from shardlm.parallel.cp_attention import lse_kernels

#: (name, sequence length, window, block-causal documents as run lengths or None, attention sinks)
CASES = [
    ("causal_odd", 13, 0, None, False),
    ("block_causal_odd", 13, 0, [4, 6, 3], False),
    ("sliding_window", 16, 5, None, False),
    ("sliding_block_causal_odd", 15, 4, [7, 8], False),
    # gpt-oss: a sink logit per head in each query's softmax over the whole sequence, once
    ("sinks_causal_odd", 13, 0, None, True),
    ("sinks_sliding_block_causal_odd", 15, 4, [7, 8], True),
]


def documents_of(runs: list[int] | None, batch: int, t: int) -> torch.Tensor | None:
    """(batch, t) int64 document ids from run lengths (row b shifts the boundaries by b, so rows differ)."""
    if runs is None:
        return None
    rows = []
    for b in range(batch):
        ids = torch.repeat_interleave(torch.arange(len(runs)), torch.tensor(runs))
        rows.append(torch.cat([ids[:1].expand(b), ids])[:t])
    return torch.stack(rows)


def run_case(cp: ContextParallel, t: int, window: int, runs: list[int] | None,
             with_sinks: bool) -> dict[str, float]:
    b, h, kvh, d = 2, 4, 2, 8
    gen = torch.Generator().manual_seed(t * 100 + window)
    q, k, v, w = (torch.randn(b, n, t, d, generator=gen, dtype=torch.float64).float()
                  for n in (h, kvh, kvh, h))
    sinks = torch.randn(h, generator=gen) if with_sinks else None
    w = w / t  # the upstream gradient of a mean over the tokens, as a loss gives it
    docs = documents_of(runs, b, t)
    ref_docs = docs if docs is not None else torch.zeros(b, t, dtype=torch.int64)
    mask = dense_mask(ref_docs, window)
    qf, kf, vf = (x.clone().requires_grad_() for x in (q, k, v))
    sf = sinks.clone().requires_grad_() if with_sinks else None
    ref = attention(qf, kf, vf, mask, sinks=sf)
    (ref * w).sum().backward()
    causal = attention(q, k, v, dense_mask(torch.zeros(b, t, dtype=torch.int64)))
    without_sinks = attention(q, k, v, mask)

    ql, kl, vl = (cp.shard(x, 0, dim=2).requires_grad_() for x in (q, k, v))
    sl = sinks.clone().requires_grad_() if with_sinks else None
    cp._additive.clear()
    cp_mask = cp.masks(t, docs, {window}, q.device)[window]
    saved: list[torch.Tensor] = []

    def pack(x: torch.Tensor) -> torch.Tensor:
        saved.append(x)
        return x

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        out = cp.attend(ql, kl, vl, cp_mask, sinks=sl)
    (out * cp.shard(w, 0, dim=2)).sum().backward()
    sink_diff = 0.0
    if with_sinks:  # each CP rank's part from its own queries; the group's sum is the sinks' gradient
        grad = sl.grad.clone()
        dist.all_reduce(grad, group=cp.group)
        sink_diff = (grad - sf.grad).abs().max().item() / sf.grad.abs().max().item()

    real = cp.local_indices(t) < t  # this rank's real (not padding) tokens
    idx = cp.local_indices(t)[real]

    def diff(mine: torch.Tensor, full: torch.Tensor) -> float:
        return (mine[:, :, real] - full[:, :, idx]).abs().max().item()

    return {"out": diff(out.detach(), ref.detach()), "dq": diff(ql.grad, qf.grad),
            "dk": diff(kl.grad, kf.grad), "dv": diff(vl.grad, vf.grad),
            "dsinks": sink_diff, "vs_no_sinks": (ref.detach() - without_sinks).abs().max().item(),
            # the magnitudes the differences are relative to: the one-rank reference's largest values
            **{f"{key}_scale": x.abs().max().item() for key, x in
               (("out", ref), ("dq", qf.grad), ("dk", kf.grad), ("dv", vf.grad))},
            "vs_causal": (ref.detach() - causal).abs().max().item(), "padding": int((~real).sum()),
            "dense_mask": cp_mask is not None, "t_pad": padded_length(t, cp.size),
            "saved_rows": max(x.shape[2] for x in saved if x.dim() >= 3),  # (b, h, seq, ...) as attention's
            "saved_bytes": sum(x.numel() * x.element_size() for x in {id(x): x for x in saved}.values())}


def main() -> None:
    """At 2 ranks: CP 2, blockwise and fallback. At 4 ranks also CP 4 (blockwise, ``CASE@cp4``), the CP 2
    cases in two groups of 2 ranks at once."""
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    pairs = [dist.new_group([r, r + 1]) for r in range(0, world, 2)]  # every rank creates every group
    cp2 = ContextParallel(pairs[dist.get_rank() // 2])
    results = {}
    blockwise = lse_kernels("cpu")
    assert blockwise is not None, "torch 2.13's CPU flash kernel with a log-sum-exp is missing"
    runs_of = [(cp2, blockwise, ""), (cp2, None, "/fallback")]
    if world == 4:
        runs_of.append((ContextParallel(dist.group.WORLD), blockwise, "@cp4"))
    for cp, kernels, suffix in runs_of:
        cp.kernels = kernels
        for name, t, window, runs, with_sinks in CASES:
            r = run_case(cp, t, window, runs, with_sinks)
            gathered = [None] * world
            dist.all_gather_object(gathered, r)
            results[name + suffix] = {key: max(g[key] for g in gathered) for key in r}
            results[name + suffix]["padding_total"] = sum(g["padding"] for g in gathered) // (
                world // cp.size
            )
            results[name + suffix]["cp"] = cp.size
    if dist.get_rank() == 0:
        Path(sys.argv[1]).write_text(json.dumps(results))
    dist.barrier()


if __name__ == "__main__":
    main()
    exit_process(0)
