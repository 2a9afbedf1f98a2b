"""Packed vs padded fine-tuning, and block-causal vs causal pre-training, on the SmolLM2-135M shape.

Usage (a script, not a test; it launches torchrun itself, one launch per row so that peak RSS is the row's)::

    python bench/bench_packing.py                       # 2 ranks, seq 1024, 30 layers, 3 steps (1 warm-up)
    python bench/bench_packing.py --layers 4 --steps 3  # a shorter model for a shared machine
    python bench/bench_packing.py --set parallel.activation_checkpoint=full   # less memory per rank

The corpus is generated deterministically: ``--examples`` chat examples whose lengths in words are log-normal
(sigma 0.8, capped at 0.9 ``seq_len``) with a mean chosen so that the mean example is about a quarter of
``seq_len`` tokens (the measured mean is printed), words drawn in order from the embedded Shakespeare text,
the response a uniform 30-70% of the words; an 8k byte-level BPE is trained on the plays. Pre-training uses
the same texts as documents of a token stream. The model is SmolLM2-135M's shape (dim 576, 9/3 heads, ffn
1536, vocab 49152, tied; ``--layers`` of its 30 blocks) from a random init, fp32, FSDP at ``--world`` ranks,
global batch 4, micro-batch 2.

Unpacked examples are padded to the longest of each micro-batch (``data.pad_multiple``, default 8; pass
``--set data.pad_multiple=0`` for the full ``seq_len + 1`` rows); packed rows run block-causal attention per
document (the CPU default) and, as a reference row, under the dense mask (``model.attention_backend =
"sdpa"``).

Per row: the median step time after the first step, response (target) tokens trained per step (the split's
targets per sample times the global batch) and per second, fill ratio (tokens of examples / tokens of the
samples), peak RSS per rank (``ru_maxrss``; a coarse measure on CPU: glibc keeps freed memory).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
MODEL = {"model.family": '"llama"', "model.dim": 576, "model.n_heads": 9, "model.n_kv_heads": 3,
         "model.ffn_hidden": 1536, "model.vocab_size": 49152, "model.tie_embeddings": "true",
         "model.rope_theta": 100000.0}
RUNS = {
    "fine-tuning padded (one example per sample)": {"data.format": '"instruct"'},
    "fine-tuning packed (block-causal)": {"data.format": '"instruct"', "data.pack": "true",
                                          "model.attention": '"block_causal"'},  # per-document on CPU
    "fine-tuning packed (block-causal, dense mask)": {"data.format": '"instruct"', "data.pack": "true",
                                                      "model.attention": '"block_causal"',
                                                      "model.attention_backend": '"sdpa"'},
    "pre-training causal": {"data.format": '"text"', "model.attention": '"causal"'},  # not the default "auto"
    "pre-training block-causal (sdpa)": {"data.format": '"text"', "model.attention": '"block_causal"'},
}


def worker(spec_path: str) -> None:
    """One torchrun launch, one row: rank 0 writes its result next to the spec."""
    import resource

    import torch

    from shardlm.config import load_config
    from shardlm.data.packing import PackedExamples
    from shardlm.parallel import all_gather_ints, exit_process, init_distributed
    from shardlm.train.trainer import Trainer

    spec = json.loads(Path(spec_path).read_text())
    cfg = load_config(None, spec["overrides"])
    trainer = Trainer(cfg, init_distributed(cfg.parallel))
    times = [trainer.train_step()["step_time_s"] for _ in range(cfg.train.steps)]
    data = trainer.train_data
    # target tokens of an average global batch: the whole split's targets per sample, times the batch
    per_step = data.num_targets(list(range(len(data)))) / len(data) * cfg.train.global_batch_size
    if isinstance(data, PackedExamples):
        fill = data.fill
    elif cfg.data.format == "instruct":
        # one example per sample: its tokens (at most seq_len + 1) of the sample
        lengths = np.minimum(np.diff(data.offsets), cfg.train.seq_len + 1)
        fill = float(lengths.mean()) / (cfg.train.seq_len + 1)
    else:
        fill = 1.0
    rss = all_gather_ints(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, trainer.info.device)
    if trainer.info.rank == 0:
        step_s = statistics.median(times[1:]) if len(times) > 1 else times[0]
        Path(spec["out"]).write_text(json.dumps({"step_s": step_s, "targets_per_step": per_step, "fill": fill,
                                                 "rss": rss, "samples": len(data)}))
    torch.distributed.barrier()
    exit_process(0)


def write_corpora(tmp: Path, n: int, seq_len: int, seed: int = 0) -> tuple[Path, Path, Path]:
    """The chat corpus (JSONL prompt/response), the same texts as pre-training documents, and an 8k BPE."""
    from shardlm.data import read_documents
    from shardlm.data.tokenizer import train_tokenizer

    plays = read_documents("shakespeare")
    tok = train_tokenizer(plays, 8192)
    tok.save(str(tmp / "tokenizer.json"))
    words = " ".join(plays).split()
    per_word = len(tok.encode(" ".join(words[:20000])).ids) / 20000  # tokens per word of this text
    sigma = 0.8
    mean_words = seq_len / 4 / per_word
    rng = np.random.default_rng(seed)
    counts = rng.lognormal(np.log(mean_words) - sigma ** 2 / 2, sigma, size=n)
    counts = np.clip(counts, 4, 0.9 * seq_len / per_word).astype(int)  # the tail capped below seq_len tokens
    pos = 0
    with (tmp / "chat.jsonl").open("w") as chat, (tmp / "docs.jsonl").open("w") as docs:
        for c in counts:
            if pos + c > len(words):
                pos = 0
            text = words[pos:pos + c]
            pos += c
            cut = max(1, int(c * rng.uniform(0.3, 0.7)))
            chat.write(json.dumps({"prompt": " ".join(text[:cut]), "response": " ".join(text[cut:])}) + "\n")
            docs.write(json.dumps({"text": " ".join(text)}) + "\n")
    return tmp / "chat.jsonl", tmp / "docs.jsonl", tmp / "tokenizer.json"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--world", type=int, default=2, help="ranks (torchrun --nproc_per_node)")
    parser.add_argument("--steps", type=int, default=3, help="steps per row, the first one untimed")
    parser.add_argument("--seq", type=int, default=1024, help="train.seq_len")
    parser.add_argument("--layers", type=int, default=30,
                        help="blocks of the SmolLM2-135M shape (30 = the model)")
    parser.add_argument("--examples", type=int, default=600, help="chat examples (documents) generated")
    parser.add_argument("--runs", default=",".join(RUNS), help="comma-separated row names (default: all)")
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="another config override for every row, e.g. parallel.activation_checkpoint=full",
    )
    args = parser.parse_args()
    chosen = [r.strip() for r in args.runs.split(",")]
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        chat, docs, tokenizer = write_corpora(tmp, args.examples, args.seq)
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")}
        for name in chosen:
            extra = RUNS[name]
            text = extra["data.format"] == '"text"'
            overrides = {**MODEL, "model.n_layers": args.layers, "model.max_seq_len": args.seq,
                         "train.seq_len": args.seq, "train.global_batch_size": 4, "train.micro_batch_size": 2,
                         "train.steps": args.steps, "train.eval_interval": 0, "train.warmup_steps": 1,
                         "checkpoint.enabled": "false", "data.val_fraction": 0.05,
                         "data.corpus": f'"{docs if text else chat}"', "data.tokenizer": f'"{tokenizer}"',
                         "data.dir": f'"{tmp / ("text" if text else "chat")}"', "run.dir": f'"{tmp / "run"}"',
                         "run.overwrite": "true", **extra, **dict(kv.split("=", 1) for kv in args.set)}
            spec = tmp / "spec.json"
            spec.write_text(json.dumps({"overrides": [f"--{k}={v}" for k, v in overrides.items()],
                                        "out": str(tmp / "out.json")}))
            subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                            f"--nproc_per_node={args.world}", __file__, "--worker", str(spec)], env=env,
                           check=True)
            results[name] = json.loads((tmp / "out.json").read_text())
        from shardlm.data.instruct import InstructionExamples

        if (tmp / "chat").is_dir():
            ex = InstructionExamples(str(tmp / "chat"), "train", args.seq)
            lengths = np.diff(ex.offsets)
            print(f"chat corpus: {len(lengths)} train examples, mean {lengths.mean():.0f} tokens "
                  f"({100 * lengths.mean() / args.seq:.0f}% of seq_len {args.seq}), median "
                  f"{np.median(lengths):.0f}, max {lengths.max()}")
    print(f"SmolLM2-135M shape, {args.layers} layers, {args.world} ranks (FSDP, fp32, CPU), seq_len "
          f"{args.seq}, global batch 4 samples, {args.steps} steps (first untimed)")
    print("| run | samples | fill | target tokens / step | step time (s) | target tokens / s | peak RSS per "
          "rank (MiB) |")
    print("|---|---|---|---|---|---|---|")
    for name, r in results.items():
        print(f"| {name} | {r['samples']} | {100 * r['fill']:.1f}% | {r['targets_per_step']:.0f} | "
              f"{r['step_s']:.2f} | {r['targets_per_step'] / r['step_s']:.0f} | "
              f"{' / '.join(f'{b / 2**20:.0f}' for b in r['rss'])} |")
    pad, pack = (results.get(k) for k in list(RUNS)[:2])
    if pad and pack:
        ratio = (pack["targets_per_step"] / pack["step_s"]) / (pad["targets_per_step"] / pad["step_s"])
        print(f"packed / padded response tokens per second: {ratio:.2f}x")
    causal, block = (results.get(k) for k in list(RUNS)[3:])
    if causal and block:
        print(f"block-causal / causal pre-training step time: {block['step_s'] / causal['step_s']:.3f}")


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--worker":
        worker(sys.argv[2])
    else:
        main()
