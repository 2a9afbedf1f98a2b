"""One transformer block's forward and backward against the kernels it cannot avoid: how far a step is from
the floor of this machine's matrix multiply and attention kernels (issue 43).

Usage: ``OMP_NUM_THREADS=1 python bench/bench_block.py [--dim 256 --heads 16 --ffn 768 --seq 256 --rows 4]``
(defaults: torchtitan's Llama 3 debug shape with one rank's micro-batch, as ``bench/bench_peer.py``).

Rows, each called ``--repeat`` times after warm-up in each of ``--rounds`` alternating rounds; the table gives
the fastest call (on a shared machine noise only adds time) and the median:

- *block, eager* and *block, compiled*: :class:`shardlm.model.decoder.Block` (fp32, one thread), forward
  then backward with a fixed output gradient; compiled with ``torch.compile`` as ``parallel.compile`` does.
- *its matrix multiplies and SDPA alone*: for every ``nn.Linear`` of the block, the forward multiply and the
  two of the backward (input and weight gradients) on tensors of the same shapes, and causal SDPA forward and
  backward on (rows, heads, seq, head_dim): the work no implementation of the block can skip. The difference
  to the compiled block is what is left for element-wise fusion and framework overhead.
- *GEMM rate*: the block's multiplies in GFLOP/s against one square 2048^3 multiply, a proxy for the core's
  peak.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from shardlm.model.config import ModelConfig  # noqa: E402
from shardlm.model.decoder import Block  # noqa: E402


def call_ms(fn: Callable[[], object], repeat: int) -> list[float]:
    """The wall times of ``repeat`` calls of ``fn`` in milliseconds, after two warm-up calls."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--ffn", type=int, default=768)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--rows", type=int, default=4, help="sequences in the micro-batch")
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    torch.manual_seed(0)
    cfg = ModelConfig(dim=args.dim, n_layers=1, n_heads=args.heads, ffn_hidden=args.ffn,
                      max_seq_len=args.seq)
    block = Block(cfg)
    b, t, hd = args.rows, args.seq, cfg.head_dim
    x = torch.randn(b, t, args.dim, requires_grad=True)
    grad_out = torch.randn(b, t, args.dim)
    angles = torch.randn(t, hd)
    cos, sin = angles.cos(), angles.sin()
    compiled = torch.compile(block)

    # the block's multiplies on tensors of their shapes: (tokens, in) @ (in, out) forward, and backward the
    # input gradient (tokens, out) @ (out, in) and the weight gradient (out, tokens) @ (tokens, in)
    tokens = b * t
    linears = [m for m in block.modules() if isinstance(m, torch.nn.Linear)]
    operands = [(torch.randn(tokens, m.in_features), m.weight.detach().clone(),
                 torch.randn(tokens, m.out_features)) for m in linears]
    gemm_flops = sum(3 * 2 * tokens * m.in_features * m.out_features for m in linears)
    q, k, v = (torch.randn(b, args.heads, t, hd, requires_grad=True) for _ in range(3))
    grad_attn = torch.randn(b, args.heads, t, hd)

    def multiplies() -> None:
        for a, w, dy in operands:
            a @ w.t()
            dy @ w
            dy.t() @ a

    def sdpa() -> None:
        F.scaled_dot_product_attention(q, k, v, is_causal=True).backward(grad_attn)

    square = torch.randn(2048, 2048)
    rows = {
        "block, eager": lambda: block(x, cos, sin).backward(grad_out),
        "block, compiled (`parallel.compile`)": lambda: compiled(x, cos, sin).backward(grad_out),
        "its matrix multiplies alone": multiplies,
        "its causal SDPA alone (forward + backward)": sdpa,
        "one 2048^3 multiply": lambda: square @ square,
    }
    times: dict[str, list[float]] = {name: [] for name in rows}
    for _ in range(args.rounds):
        for name, fn in rows.items():
            times[name] += call_ms(fn, args.repeat)
    ms = {name: min(values) for name, values in times.items()}  # the machine's noise only adds time
    floor = ms["its matrix multiplies alone"] + ms["its causal SDPA alone (forward + backward)"]
    print(f"block: dim {args.dim}, {args.heads} heads of {hd}, FFN {args.ffn}, {b} x {t} tokens, fp32, "
          f"{torch.get_num_threads()} thread(s); {args.rounds} rounds of {args.repeat} calls each\n")
    print("| row | fastest call ms | median ms | fastest vs multiplies + SDPA |\n|---|---:|---:|---:|")
    for name in list(rows)[:4]:
        print(f"| {name} | {ms[name]:.1f} | {statistics.median(times[name]):.1f} | {ms[name] / floor:.2f}x |")
    peak = 2 * 2048 ** 3 / (ms["one 2048^3 multiply"] / 1e3) / 1e9
    rate = gemm_flops / (ms["its matrix multiplies alone"] / 1e3) / 1e9
    print(f"\nthe block's multiplies: {gemm_flops / 1e9:.2f} GFLOP at {rate:.0f} GFLOP/s; "
          f"a 2048^3 multiply: {peak:.0f} GFLOP/s ({rate / peak:.0%})")


if __name__ == "__main__":
    main()
