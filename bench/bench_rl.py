"""The RL rollout's speed: shardlm's sampler (:func:`shardlm.rl.rollout.rollout`, KV cache, per-completion
streams) against ``transformers``' ``generate`` on the same model and prompts, and, under FSDP2 at N ranks,
the whole model gathered once for the generation against FSDP's all-gather before every decode step.

Usage (a script, not a test)::

    python bench/bench_rl.py                       # one process: shardlm vs transformers, then 2 ranks
    python bench/bench_rl.py --prompts 8 --generations 4 --new 64 --world 2

A random model of the given shape (fp32) is exported to a Hugging Face directory and loaded by transformers
(``AutoModelForCausalLM``, its default SDPA attention); both sample ``--prompts`` x ``--generations``
completions of exactly ``--new`` tokens (no stop id, so both generate the same number of tokens) with the same
temperature / top-k / top-p, all rows in one batch, left-padded prompts. Tokens/s = generated tokens / wall
seconds (median of ``--repeat`` runs after one warm-up). The log-prob row: the trainer's scoring of the
rollout (:func:`shardlm.rl.logps.score_rollout`, full forwards) and its max |decode - full forward|. The
exact rollout (:func:`shardlm.rl.exact.exact_rollout`, ``rl.rollout = "exact"``) samples the same rows in
micro-batches of ``--micro`` rows, one full forward per token, and its max |sampler - training forward|.

The ranks part (torchrun, gloo, ``OMP_NUM_THREADS`` = 1 per rank): each rank samples its own prompts from the
FSDP-sharded model (``shardlm.parallel.fsdp.apply_fsdp``), once inside ``gathered`` (one all-gather per group,
then none) and once without (FSDP all-gathers every group before each decode step; all ranks decode the same
number of steps here since no stop id ends a row early).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def model_config(args: argparse.Namespace):
    from shardlm.model.config import ModelConfig

    return ModelConfig(dim=args.dim, n_layers=args.layers, n_heads=args.heads, n_kv_heads=args.heads // 2,
                       vocab_size=args.vocab, max_seq_len=args.max_seq)


def prompts_of(args: argparse.Namespace) -> list[list[int]]:
    import torch

    gen = torch.Generator().manual_seed(0)
    lengths = torch.randint(args.prompt_len // 2, args.prompt_len + 1, (args.prompts,), generator=gen)
    lengths = lengths.tolist()
    return [torch.randint(3, args.vocab, (k,), generator=gen).tolist() for k in lengths]


def timed(fn, repeat: int) -> tuple[float, object]:
    """Median wall seconds of ``repeat`` calls after one warm-up, and the last result."""
    fn()
    times, out = [], None
    for _ in range(repeat):
        start = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), out


def single(args: argparse.Namespace) -> list[tuple[str, float, str]]:
    import torch
    from transformers import AutoModelForCausalLM

    from shardlm.convert.hf_out import save_model_dir
    from shardlm.model.decoder import CausalLM
    from shardlm.rl.exact import exact_rollout
    from shardlm.rl.logps import logprob_diff_max, score_rollout, token_logps, trainer_batch
    from shardlm.rl.rollout import rollout

    torch.set_num_threads(1)
    cfg = model_config(args)
    model = CausalLM(cfg)
    model.init_weights(0)
    model.eval()
    prompts = prompts_of(args)
    n_tokens = args.prompts * args.generations * args.new
    kw = dict(max_completion_length=args.new, stop_ids=[], seed=0, step=0, temperature=args.temperature,
              top_p=args.top_p, top_k=args.top_k)
    ours_s, ro = timed(lambda: rollout(model, prompts, list(range(len(prompts))), args.generations, **kw),
                       args.repeat)
    rows = list(range(ro.completion_ids.shape[0]))
    score_s, scored = timed(lambda: score_rollout(model, ro, [rows], args.temperature), args.repeat)
    diff = logprob_diff_max(ro.logps, scored, ro.completion_mask)
    with tempfile.TemporaryDirectory() as tmp:
        save_model_dir(model.state_dict(), cfg, Path(tmp) / "m")
        hf = AutoModelForCausalLM.from_pretrained(Path(tmp) / "m", dtype=torch.float32).eval()
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])

    def hf_generate():
        with torch.no_grad():
            return hf.generate(input_ids=ids, attention_mask=mask, do_sample=True,
                               temperature=args.temperature, top_p=args.top_p, top_k=args.top_k or None,
                               max_new_tokens=args.new, min_new_tokens=args.new,
                               num_return_sequences=args.generations, pad_token_id=0, eos_token_id=None)

    hf_s, out = timed(hf_generate, args.repeat)
    assert out.shape[1] - width == args.new
    n_rows = len(rows)
    micro = [list(range(a, min(a + args.micro, n_rows))) for a in range(0, n_rows, args.micro)]
    exact_s, ex = timed(lambda: exact_rollout(model, prompts, list(range(len(prompts))), args.generations,
                                              micro, **kw), args.repeat)
    exact_diff = 0.0
    with torch.no_grad():
        for part in micro:  # the training step's forward of each micro-batch against the sampler's log-probs
            batch = trainer_batch(ex, part, window=args.new)
            exact_diff = max(exact_diff, logprob_diff_max(ex.logps[batch.rows],
                                                          token_logps(model, batch, args.temperature)[0],
                                                          batch.completion_mask))
    return [("shardlm rollout (KV cache)", n_tokens / ours_s, f"{ours_s:.3f} s"),
            (f"shardlm exact rollout (micro-batches of {args.micro})", n_tokens / exact_s,
             f"{exact_s:.3f} s, max |sampler - training forward| logp {exact_diff:.2e}"),
            ("transformers generate", n_tokens / hf_s, f"{hf_s:.3f} s"),
            ("shardlm scoring (full forward)", n_tokens / score_s,
             f"{score_s:.3f} s, max |decode - full| logp {diff:.2e}")]


def worker(spec_path: str) -> None:
    """One torchrun launch: rank r samples its prompts gathered once and with per-step all-gathers."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh

    from shardlm.model.decoder import CausalLM
    from shardlm.model.generate import SamplingConfig
    from shardlm.parallel import exit_process
    from shardlm.parallel.fsdp import apply_fsdp
    from shardlm.rl.rollout import rollout, sample_rows, stream_uniforms

    args = argparse.Namespace(**json.loads(Path(spec_path).read_text()))
    torch.distributed.init_process_group("gloo")
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    with torch.device("meta"):
        model = CausalLM(model_config(args))
    apply_fsdp(model, init_device_mesh("cpu", (world,)))
    model.to_empty(device="cpu")
    model.init_weights(0)
    model.eval()
    prompts = prompts_of(args)[rank::world]
    ids = list(range(rank, args.prompts, world))
    kw = dict(max_completion_length=args.new, stop_ids=[], seed=0, step=0, temperature=args.temperature,
              top_p=args.top_p, top_k=args.top_k)
    sampling = SamplingConfig(args.temperature, args.top_k, args.top_p, 0)
    rows = [(i, g) for i in range(len(prompts)) for g in range(args.generations)]
    u = torch.stack([stream_uniforms(0, 0, ids[i], g, args.new) for i, g in rows])

    def per_step():  # no gathered(): FSDP's hooks all-gather every group at each decode step
        return sample_rows(model, [prompts[i] for i, _ in rows], u, sampling, args.new, set(), 0)

    def barrier_timed(fn):
        torch.distributed.barrier()
        return fn()

    once_s, ro = timed(lambda: barrier_timed(lambda: rollout(model, prompts, ids, args.generations, **kw)),
                       args.repeat)
    step_s, (tokens, *_) = timed(lambda: barrier_timed(per_step), args.repeat)
    same = torch.equal(tokens, ro.completion_ids)
    results = [None] * world
    torch.distributed.all_gather_object(results, {"once": once_s, "per_step": step_s, "same": same,
                                                  "tokens": len(rows) * args.new})
    if rank == 0:
        Path(spec_path).with_suffix(".out.json").write_text(json.dumps(results))
    torch.distributed.barrier()
    exit_process(0)


def ranks(args: argparse.Namespace) -> list[tuple[str, float, str]]:
    with tempfile.TemporaryDirectory() as tmp:
        spec = Path(tmp) / "spec.json"
        spec.write_text(json.dumps(vars(args)))
        env = {**os.environ, "OMP_NUM_THREADS": "1",
               "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
        subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                        f"--nproc_per_node={args.world}", __file__, "--worker", str(spec)], env=env,
                       check=True, timeout=1800)
        results = json.loads(spec.with_suffix(".out.json").read_text())
    tokens = sum(r["tokens"] for r in results)
    once, step = max(r["once"] for r in results), max(r["per_step"] for r in results)
    same = all(r["same"] for r in results)
    return [(f"FSDP {args.world} ranks, gathered once", tokens / once, f"{once:.3f} s (slowest rank)"),
            (f"FSDP {args.world} ranks, all-gather per step", tokens / step,
             f"{step:.3f} s (slowest rank), same tokens: {same}")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--max-seq", type=int, default=256)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=24)
    parser.add_argument("--generations", type=int, default=4)
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--top-p", type=float, default=0.95)
    parser.add_argument("--top-k", type=int, default=50)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--micro", type=int, default=8, help="rows per micro-batch of the exact rollout")
    parser.add_argument("--world", type=int, default=2, help="ranks of the FSDP part (0: skip it)")
    args = parser.parse_args()
    if args.worker:
        worker(args.worker)
        return
    rows = single(args) + (ranks(args) if args.world > 0 else [])
    print(f"model dim {args.dim}, {args.layers} layers, vocab {args.vocab}, fp32; {args.prompts} prompts x "
          f"{args.generations} completions x {args.new} new tokens, one thread per process")
    print(f"{'sampler':<42} {'tokens/s':>10}  detail")
    for name, rate, detail in rows:
        print(f"{name:<42} {rate:>10.1f}  {detail}")


if __name__ == "__main__":
    main()
