"""Peak memory and time of one training step's loss: plain (whole logits) vs chunked
(``train.loss_chunk_tokens``).

Usage: ``OMP_NUM_THREADS=1 python bench/bench_loss.py [--tokens 4096] [--chunk 256] [--rows 151936x576,...]``.

Each row runs in a fresh subprocess: fp32 (``--dtype``) hidden states (N, D) and output weight (V, D), both
requiring gradients, random targets; one step is the loss's forward and backward (``(loss / N).backward()``).
Memory is PyTorch's CPU allocator as its profiler records it (``torch.profiler.profile(profile_memory=True)``:
every allocation and free, in order); the peak is the largest sum of live bytes above those that existed
before the step (the inputs), so the weight's and the hidden state's gradients count. The planner's prediction
is :func:`shardlm.plan.loss.loss_peak_bytes`. Time: the steps run plain, chunked (``--repeat`` times), then
chunked and plain once more under the profiler; each loss's step time is the best of its ``--repeat`` + 1 wall
times (the profiler records a few hundred events: nothing against a step).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from shardlm.metrics.peak import allocator_bytes  # noqa: E402
from shardlm.plan.loss import loss_peak_bytes  # noqa: E402
from shardlm.train.loss import linear_cross_entropy_sum, token_loss_sum  # noqa: E402

ROWS = "151936x576,151936x1152,262144x576,262144x1152"


def step(h: torch.Tensor, w: torch.Tensor, targets: torch.Tensor, chunk: int, softcap: float = 0.0) -> None:
    """One loss forward and backward, as the trainer runs it (the loss scaled by 1 / target count)."""
    h.grad = w.grad = None
    if chunk:
        loss = linear_cross_entropy_sum(h, w, targets, chunk, softcap)
    else:
        logits = F.linear(h, w).unsqueeze(0)
        if softcap:  # as CausalLM.forward
            logits = torch.tanh(logits / softcap) * softcap
        loss = token_loss_sum(logits, targets.unsqueeze(0))
        del logits  # as model_loss_sum: nothing holds the logits during the backward
    (loss / targets.numel()).backward()


def peak_bytes(fn) -> int:  # noqa: ANN001
    """The high point of live CPU allocator bytes during ``fn()``, above those alive before it."""
    return allocator_bytes(fn)[1]


def measure_row(vocab: int, dim: int, tokens: int, chunk: int, repeat: int,
                dtype: torch.dtype = torch.float32, softcap: float = 0.0) -> dict:
    gen = torch.Generator().manual_seed(0)
    h = torch.randn(tokens, dim, generator=gen).to(dtype).requires_grad_()
    w = (torch.randn(vocab, dim, generator=gen) * dim ** -0.5).to(dtype).requires_grad_()
    targets = torch.randint(0, vocab, (tokens,), generator=gen)
    out = {"vocab": vocab, "dim": dim, "tokens": tokens, "chunk": chunk}
    losses = {"plain": 0, "chunked": chunk}
    times: dict[str, list[float]] = {"plain": [], "chunked": []}
    # plain, chunked, then chunked, plain under the profiler (its few hundred events cost nothing against a
    # step): the two losses take turns, so a change in the machine's load falls on both
    for name in ("plain", "chunked") * repeat + ("chunked", "plain"):
        profiled = len(times[name]) == repeat
        h.grad = w.grad = None
        start = time.perf_counter()
        if profiled:
            out[f"{name}_peak"] = peak_bytes(lambda c=losses[name]: step(h, w, targets, c, softcap))
        else:
            step(h, w, targets, losses[name], softcap)
        times[name].append(time.perf_counter() - start)
    for name, c in losses.items():
        out[f"{name}_s"] = min(times[name])
        out[f"{name}_times"] = times[name]
        out[f"{name}_planned"] = loss_peak_bytes(tokens, vocab, dim, dtype.itemsize, c, bool(softcap))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=4096,
                        help="tokens per micro-batch (default: %(default)s)")
    parser.add_argument("--chunk", type=int, default=256,
                        help="train.loss_chunk_tokens (default: %(default)s)")
    parser.add_argument("--rows", default=ROWS, help="VOCABxDIM,... (default: %(default)s)")
    parser.add_argument("--repeat", type=int, default=1,
                        help="unprofiled steps per loss before the profiled one; the best time is kept "
                             "(default: 1)")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                        help="of the hidden states and the weight (default: %(default)s)")
    parser.add_argument("--softcap", type=float, default=0.0,
                        help="final logit soft-cap, 0 = none (default: 0)")
    parser.add_argument("--json", help="also write the rows to this file")
    parser.add_argument("--row", help=argparse.SUPPRESS)  # VOCABxDIM: measure one row here, print its JSON
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.row:
        vocab, dim = (int(x) for x in args.row.split("x"))
        print(json.dumps(measure_row(vocab, dim, args.tokens, args.chunk, args.repeat,
                                     getattr(torch, args.dtype), args.softcap)))
        return
    gib = 2 ** 30
    print(f"loss of one micro-batch of {args.tokens} tokens, {args.dtype}"
          f"{f', soft-cap {args.softcap:g}' if args.softcap else ''}, forward + backward; chunk {args.chunk} "
          f"tokens; {torch.get_num_threads()} thread; peak = PyTorch CPU allocator (profiler), above the "
          "inputs")
    print("| vocab | hidden | plain peak (planned) | chunked peak (planned) | chunked / plain | plain step | "
          "chunked step |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    rows = []
    for row in args.rows.split(","):
        proc = subprocess.run([sys.executable, __file__, "--row", row, "--tokens", str(args.tokens),
                               "--chunk", str(args.chunk), "--repeat", str(args.repeat), "--dtype",
                               args.dtype, "--softcap", str(args.softcap)], capture_output=True, text=True)
        if proc.returncode:
            print(f"| {row}: failed ({proc.returncode}): {proc.stderr.strip().splitlines()[-1:]} |",
                  flush=True)
            continue
        r = json.loads(proc.stdout.strip().splitlines()[-1])
        rows.append(r)
        print(f"| {r['vocab']:,} | {r['dim']:,} | {r['plain_peak'] / gib:.2f} GiB "
              f"({r['plain_planned'] / gib:.2f}) | {r['chunked_peak'] / gib:.3f} GiB "
              f"({r['chunked_planned'] / gib:.3f}) | 1/{r['plain_peak'] / r['chunked_peak']:.1f} | "
              f"{r['plain_s']:.2f} s | {r['chunked_s']:.2f} s ({r['chunked_s'] / r['plain_s'] - 1:+.0%}) |",
              flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
