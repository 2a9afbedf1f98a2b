"""Packed vs padded fine-tuning, and block-causal vs causal pre-training, on the SmolLM2-135M shape.

Usage (a script, not a test; it launches torchrun itself, one launch per row so that peak RSS is the row's)::

    python bench/bench_packing.py                       # 2 ranks, seq 1024, 30 layers, 3 steps (1 warm-up)
    python bench/bench_packing.py --layers 4 --steps 3  # a shorter model for a shared machine
    python bench/bench_packing.py --set parallel.activation_checkpoint=full   # less memory per rank
    python bench/bench_packing.py --rounds 3 --baseline ../old   # alternating, against another checkout

The corpus is generated deterministically: ``--examples`` chat examples whose lengths in words are log-normal
(sigma 0.8, capped at 0.9 ``seq_len``) with a mean chosen so that the mean example is about a quarter of
``seq_len`` tokens (the measured mean is printed), words drawn in order from the embedded Shakespeare text,
the response a uniform 30-70% of the words; an 8k byte-level BPE is trained on the plays. Pre-training uses
the same texts as documents of a token stream. The model is SmolLM2-135M's shape (dim 576, 9/3 heads, ffn
1536, vocab 49152, tied; ``--layers`` of its 30 blocks) from a random init, fp32, FSDP at ``--world`` ranks,
global batch 4, micro-batch 2.

The rows: unpacked examples (one per sample) padded to ``seq_len + 1`` (``data.pad_multiple = 0``) and to
the longest of each micro-batch (the default), and grouped by length 16 steps at a time
(``data.group_by_length_steps``: its steps train other batches, so it is compared by the targets trained over
the time taken, summed over the timed steps); packed rows under block-causal attention with the default
kernel (per document on CPU) and under the dense mask (``model.attention_backend = "sdpa"``); causal and
block-causal pre-training. ``--baseline PATH`` runs every chosen row on another checkout's ``src/`` too (its
own data preparation), alternating launch by launch, and prints this checkout's speed over it (a row whose
settings the other checkout lacks fails there: choose its rows with ``--baseline-runs``).

Per row: the median step time after the first step (one per launch; tokens/s from the median launch),
response (target) tokens trained per step (the split's targets per sample times the global batch) and per
second, fill ratio (tokens of examples / tokens of the samples), peak RSS per rank (``ru_maxrss``; a coarse
measure on CPU: glibc keeps freed memory), and the losses of each row's first launch (rows that differ only
in padding or in the attention kernel train the same examples).
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
    "fine-tuning unpacked (padded to seq_len)": {"data.format": '"instruct"', "data.pad_multiple": 0},
    "fine-tuning unpacked (default padding)": {"data.format": '"instruct"'},
    "fine-tuning unpacked (grouped by length)": {
        "data.format": '"instruct"', "data.group_by_length_steps": 16},
    "fine-tuning packed (default attention)": {  # block-causal; per document on CPU
        "data.format": '"instruct"', "data.pack": "true", "model.attention": '"block_causal"'},
    "fine-tuning packed (dense mask)": {
        "data.format": '"instruct"', "data.pack": "true", "model.attention": '"block_causal"',
        "model.attention_backend": '"sdpa"'},
    "pre-training causal": {"data.format": '"text"', "model.attention": '"causal"'},  # not the default "auto"
    "pre-training block-causal": {
        "data.format": '"text"', "model.attention": '"block_causal"'},
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
    records = [trainer.train_step() for _ in range(cfg.train.steps)]
    times = [r["step_time_s"] for r in records]
    data = trainer.train_data
    targets = [data.num_targets(trainer.sampler.step_ids(s)) for s in range(cfg.train.steps)]  # each step's
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
                                                 "targets": targets, "times": times,
                                                 "rss": rss, "samples": len(data),
                                                 "losses": [r["loss"] for r in records]}))
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
    parser.add_argument("--rounds", type=int, default=1,
                        help="launches per row, the rows alternating (round 1: every row, then round 2...)")
    parser.add_argument("--baseline", metavar="PATH",
                        help="another shardlm checkout (a git worktree of an older commit): every row also "
                             "runs on its src/, alternating with this one; the table gains its rows, ratios")
    parser.add_argument("--baseline-runs", help="the rows to run on --baseline too (default: all of --runs)")
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="another config override for every row, e.g. parallel.activation_checkpoint=full",
    )
    args = parser.parse_args()
    chosen = [r.strip() for r in args.runs.split(",")]
    trees = {"": ROOT}  # row suffix -> checkout
    if args.baseline:
        base = Path(args.baseline).resolve()
        commit = subprocess.run(["git", "-C", str(base), "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True, check=True).stdout.strip()
        trees[f" @ {commit}"] = base
    on_base = [r.strip() for r in (args.baseline_runs or args.runs).split(",")]
    unknown = sorted(set(chosen + on_base) - set(RUNS))
    if unknown:
        parser.error(f"unknown row(s) {unknown}; the rows are: {', '.join(RUNS)}")
    rows = [(name, suffix, tree, i) for name in chosen for i, (suffix, tree) in enumerate(trees.items())
            if not suffix or name in on_base]
    results: dict[str, list[dict]] = {name + suffix: [] for name, suffix, _, _ in rows}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        chat, docs, tokenizer = write_corpora(tmp, args.examples, args.seq)
        for _ in range(args.rounds):
            for name, suffix, tree, i in rows:  # each tree prepares its own data
                env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(tree / "src")}
                results[name + suffix].append(launch(name, args, tmp, tmp / f"tree{i}", chat, docs, tokenizer,
                                                     env))
        from shardlm.data.instruct import InstructionExamples

        if (tmp / "tree0" / "chat").is_dir():
            ex = InstructionExamples(str(tmp / "tree0" / "chat"), "train", args.seq)
            lengths = np.diff(ex.offsets)
            print(f"chat corpus: {len(lengths)} train examples, mean {lengths.mean():.0f} tokens "
                  f"({100 * lengths.mean() / args.seq:.0f}% of seq_len {args.seq}), median "
                  f"{np.median(lengths):.0f}, max {lengths.max()}")
    report(results, args)


def launch(name: str, args: argparse.Namespace, tmp: Path, data: Path, chat: Path, docs: Path,
           tokenizer: Path, env: dict) -> dict:
    """One torchrun launch of row ``name``, its prepared data under ``data``: rank 0's result (see
    :func:`worker`)."""
    extra = RUNS[name]
    text = extra["data.format"] == '"text"'
    overrides = {**MODEL, "model.n_layers": args.layers, "model.max_seq_len": args.seq,
                 "train.seq_len": args.seq, "train.global_batch_size": 4, "train.micro_batch_size": 2,
                 "train.steps": args.steps, "train.eval_interval": 0, "train.warmup_steps": 1,
                 "checkpoint.enabled": "false", "data.val_fraction": 0.05,
                 "data.corpus": f'"{docs if text else chat}"', "data.tokenizer": f'"{tokenizer}"',
                 "data.dir": f'"{data / ("text" if text else "chat")}"', "run.dir": f'"{tmp / "run"}"',
                 "run.overwrite": "true", **extra, **dict(kv.split("=", 1) for kv in args.set)}
    spec = tmp / "spec.json"
    spec.write_text(json.dumps({"overrides": [f"--{k}={v}" for k, v in overrides.items()],
                                "out": str(tmp / "out.json")}))
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                    f"--nproc_per_node={args.world}", __file__, "--worker", str(spec)], env=env, check=True)
    return json.loads((tmp / "out.json").read_text())


def report(results: dict[str, list[dict]], args: argparse.Namespace) -> None:
    """The table (step time per launch, tokens/s at the median launch), the losses of each row's first
    launch, and the ratios of the rows that compare one change."""
    print(f"SmolLM2-135M shape, {args.layers} layers, {args.world} ranks (FSDP, fp32, CPU), seq_len "
          f"{args.seq}, global batch 4 samples, {args.steps} steps (first untimed), {args.rounds} "
          "alternating round(s)")
    print("| run | samples | fill | target tokens / step | step time (s) per launch | target tokens / s | "
          "peak RSS per rank (MiB) |")
    print("|---|---|---|---|---|---|---|")
    speed = {}
    for name, launches in results.items():
        if not launches:
            continue
        r = launches[0]
        steps = [x["step_s"] for x in launches]
        speed[name] = r["targets_per_step"] / statistics.median(steps)
        print(f"| {name} | {r['samples']} | {100 * r['fill']:.1f}% | {r['targets_per_step']:.0f} | "
              f"{' / '.join(f'{t:.2f}' for t in steps)} | {speed[name]:.0f} | "
              f"{' / '.join(f'{b / 2**20:.0f}' for b in r['rss'])} |")
    print("losses per step (first launch of each row):")
    for name, launches in results.items():
        if launches:
            print(f"  {name}: {', '.join(f'{v:.6f}' for v in launches[0]['losses'])}")
    grouped, plain = "fine-tuning unpacked (grouped by length)", "fine-tuning unpacked (default padding)"
    if grouped in results and plain in results and results[grouped] and results[plain]:
        # a grouped step's batch is all short or all long: its tokens/s is the targets trained over the time
        # taken, summed over the timed steps of every launch (for both rows alike)
        def trained(name: str) -> float:
            runs = results[name]
            return sum(sum(r["targets"][1:]) for r in runs) / sum(sum(r["times"][1:]) for r in runs)
        print(f"grouped by length / plain order, target tokens trained per second over all timed steps: "
              f"{trained(grouped):.0f} / {trained(plain):.0f} = {trained(grouped) / trained(plain):.2f}x")
    names = [n for n in RUNS if n != grouped]
    # (faster, baseline, what, same batches): the losses compared only where the steps see the same examples
    pairs = ((names[1], names[0], "unpacked, padded to the micro-batch's longest / to seq_len", True),
             (names[2], names[1], "packed / unpacked", False),
             (names[2], names[3], "packed, attention per document / under the dense mask", True))
    for top, bottom, what, same in pairs:
        if top in speed and bottom in speed:
            diff = max(abs(x - y) for x, y in zip(results[top][0]["losses"], results[bottom][0]["losses"]))
            print(f"{what}, target tokens per second: {speed[top] / speed[bottom]:.2f}x"
                  + (f" (losses differ by at most {diff:.2e})" if same else ""))
    for name in speed:  # this checkout against the baseline's
        row, _, commit = name.partition(" @ ")
        if commit and row in speed:
            print(f"{row}: this checkout / {commit}, target tokens / s: {speed[row] / speed[name]:.2f}x")
    causal, block = (results.get(k) for k in names[4:])
    if causal and block:
        ratio = statistics.median(x["step_s"] for x in block) / statistics.median(x["step_s"] for x in causal)
        print(f"block-causal / causal pre-training step time: {ratio:.3f}")


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--worker":
        worker(sys.argv[2])
    else:
        main()
