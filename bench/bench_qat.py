"""Quantisation-aware fine-tuning against quantising afterwards: does ``train.qat`` keep the quantised model's
validation loss closer to the unquantised fine-tune's?

Usage (a script, not a test; one process on the CPU, a few minutes)::

    OMP_NUM_THREADS=1 python bench/bench_qat.py                      # int8 dynamic activations + int4 weights
    OMP_NUM_THREADS=1 python bench/bench_qat.py --scheme int4_weight_only --pretrain-steps 300

1. Pre-train a small model (4 layers, dim 128, vocab 512) on three Shakespeare plays: the base.
2. Fine-tune the base twice on the same batches, the same settings: once plain, once with ``train.qat``.
3. Validation loss (nats/token, the same held-out windows, transformers' forward, causal attention) of: the
   plain fine-tune (the unquantised reference); the plain fine-tune quantised afterwards with the scheme
   (post-training quantisation, written as shardlm's quantised export writes it); the QAT fine-tune's
   ``final-quantized`` (what a user deploys); and the QAT fine-tune's unquantised weights.

The figures go to stdout and ``<out>/results.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

import torch  # noqa: E402

from shardlm.config import load_config  # noqa: E402
from shardlm.convert.quantized_out import save_quantized_dir  # noqa: E402
from shardlm.data import eval_windows, read_documents  # noqa: E402
from shardlm.model.qat import QAT_SCHEMES  # noqa: E402
from shardlm.parallel import init_distributed  # noqa: E402
from shardlm.train.trainer import Trainer  # noqa: E402

MODEL = {"model.dim": 128, "model.n_layers": 4, "model.n_heads": 4, "model.n_kv_heads": 2,
         "model.ffn_hidden": 384, "model.vocab_size": 512, "model.max_seq_len": 64,
         "model.attention": '"causal"'}


def overrides(data: Path, run: Path, steps: int, lr: float, extra: dict | None = None) -> list[str]:
    corpus = data.parent / "plays.txt"
    base = {**MODEL, "data.dir": json.dumps(str(data)), "data.corpus": json.dumps(str(corpus)),
            "data.tokenizer_vocab_size": 512, "data.val_fraction": 0.1, "train.seq_len": 64,
            "train.global_batch_size": 16, "train.micro_batch_size": 16, "train.steps": steps,
            "train.warmup_steps": max(1, steps // 10), "train.lr": lr, "train.min_lr": lr / 10,
            "train.eval_interval": 0, "train.log_interval": steps, "parallel.mode": '"single"',
            "checkpoint.enabled": "false", "run.dir": json.dumps(str(run)), "run.overwrite": "true",
            **(extra or {})}
    return [f"--{k}={v}" for k, v in base.items()]


def train(args: list[str]) -> Trainer:
    cfg = load_config(None, args)
    trainer = Trainer(cfg, init_distributed(cfg.parallel))
    trainer.train()
    return trainer


@torch.no_grad()
def val_loss(model_dir: Path, trainer: Trainer, eval_tokens: int) -> float:
    """Mean next-token loss of the transformers model in ``model_dir`` over the run's validation windows."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir)).eval()
    total, count = 0.0, 0
    seq = trainer.cfg.train.seq_len
    for ids in eval_windows(len(trainer.val_data), eval_tokens, seq, 0, 1, 16):
        batch = torch.as_tensor(trainer.val_data.get(ids)[:, :seq + 1], dtype=torch.long)
        logits = model(batch[:, :-1]).logits.float()
        total += torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten(),
                                                   reduction="sum").item()
        count += batch[:, 1:].numel()
    return total / count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--scheme", default="int8_dynamic_activation_int4_weight",
                        choices=sorted(QAT_SCHEMES))
    parser.add_argument("--group-size", type=int, default=32, help="train.qat_group_size (0: per row)")
    parser.add_argument("--pretrain-steps", type=int, default=200)
    parser.add_argument("--finetune-steps", type=int, default=100)
    parser.add_argument("--eval-tokens", type=int, default=32768)
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    out = Path(args.out or tempfile.mkdtemp(prefix="bench_qat_"))
    data = out / "data" / "small"
    (out / "data").mkdir(parents=True, exist_ok=True)  # the first run prepares it, the others reuse it
    (out / "data" / "plays.txt").write_text("\n\n".join(read_documents("shakespeare")[:3]))
    train(overrides(data, out / "base", args.pretrain_steps, 3e-3))
    tune = {"model.init_from": json.dumps(str(out / "base" / "final")), "train.seed": 1}
    # the fine-tunes read the base's tokenizer (model.init_from's): data prepared with it, shared by both
    tuned = out / "data" / "tune"
    plain = train(overrides(tuned, out / "plain", args.finetune_steps, 1e-3, tune))
    train(overrides(tuned, out / "qat", args.finetune_steps, 1e-3,
                    {**tune, "train.qat": json.dumps(args.scheme), "train.qat_group_size": args.group_size}))
    excluded = json.loads((out / "qat" / "final-quantized" / "qat.json").read_text())["not_quantized"]
    save_quantized_dir(out / "plain" / "final", out / "plain" / "final-ptq", args.scheme, excluded,
                       args.group_size)
    losses = {name: val_loss(out / path, plain, args.eval_tokens) for name, path in {
        "base (pre-trained)": "base/final",
        "plain fine-tune (unquantised reference)": "plain/final",
        "plain fine-tune, quantised afterwards (PTQ)": "plain/final-ptq",
        "QAT fine-tune, quantised (final-quantized)": "qat/final-quantized",
        "QAT fine-tune, unquantised weights": "qat/final",
    }.items()}
    reference = losses["plain fine-tune (unquantised reference)"]
    print(f"\nscheme {args.scheme}, group size {args.group_size}; pre-train {args.pretrain_steps} steps, "
          f"fine-tune {args.finetune_steps} steps; validation loss over {args.eval_tokens} tokens "
          "(nats/token)")
    for name, value in losses.items():
        print(f"  {name:45s} {value:.4f}  ({value - reference:+.4f} vs the reference)")
    ptq = losses["plain fine-tune, quantised afterwards (PTQ)"] - reference
    qat = losses["QAT fine-tune, quantised (final-quantized)"] - reference
    verdict = "closer" if abs(qat) < abs(ptq) else "not closer"
    print(f"quantisation gap: PTQ {ptq:+.4f}, QAT {qat:+.4f} -> QAT {verdict}")
    (out / "results.json").write_text(json.dumps({"scheme": args.scheme, "group_size": args.group_size,
                                                  "losses": losses,
                                                  "gap_ptq": ptq, "gap_qat": qat}, indent=2) + "\n")
    print(f"results in {out / 'results.json'}")


if __name__ == "__main__":
    main()
