"""One command that answers what a first GPU must: speed, MFU and memory against the plan, numerics,
export, resume.

Usage::

    python bench/gpu_check.py                 # on one GPU (H100/H200): at most ~8 minutes, one table
    python bench/gpu_check.py --device cpu    # tiny shapes on the CPU (what CI runs: the script itself works)
    python bench/gpu_check.py --out gpu_check.json   # also write the rows as JSON

One process, world size 1 (the process group is started here: ``nccl`` for CUDA tensors, with ``gloo`` beside
it for the CPU reference run; ``gloo`` alone with ``--device cpu``). Data are seeded random token ids written
in the prepared-data layout (speed, memory and numerics do not depend on them), so nothing is downloaded or
tokenised. Checks, each one row (``FAIL`` rows make the exit status 1):

a. speed: the Llama 3.2 1B-shaped ``configs/llama3.2-1b.toml`` (``--device cpu``: a tiny stand-in) in bf16
   with ``compile`` and selective activation checkpointing, ``--steps`` steps (30): tokens/s, MFU against the
   datasheet peak (the measured peak on CPU), and ``max_memory_allocated`` over the steps after the first
   against the planner's prediction for the same config (fails when the measurement exceeds the prediction by
   more than 10%, or MFU is not in (0, 1)).
b. numerics: the tiny config (``configs/shakespeare-tiny.toml``'s shape) in fp32 with TF32 off, 10 steps on
   the device and the same 10 steps on the CPU: losses within 1e-4. (A TF32 run beside it is printed,
   not judged.)
c. export: a checkpoint of the tiny run written on the device, ``shardlm export`` to a Hugging Face directory,
   cast to bf16 (``shardlm export DIR --dtype bfloat16``), loaded by ``transformers`` and by shardlm on the
   device, both computing in fp32 on the same bf16 weights: logits within 1e-3.
d. resume: 4 steps with a checkpoint after step 2, then a new trainer resumed from it runs steps 3-4 on the
   device: losses and parameters bitwise equal to the uninterrupted run (deterministic algorithms on, so that
   a difference can only come from the checkpoint).
e. block-causal attention (``model.attention = "block_causal"``), one row per backend: a packed row of three
   examples against each alone (fp32, TF32 off), forward and backward: ``sdpa`` (dense mask; CUDA's
   memory-efficient kernel) and ``flex`` compiled (the CUDA default; on CPU eager and forward only).
f-h. tensor parallel 2 (and async TP with compile) and context parallel 2 against one process, the MoE grouped
   matmul (``torch._grouped_mm``) against the loop: ``bench/gpu_check_parallel.py``. A row that needs more
   GPUs than the machine has is skipped with the reason (so on one GPU: TP and CP skipped, the grouped matmul
   run; with ``--device cpu`` TP 2 runs on gloo and the CUDA-only rows are skipped).
i. float8 (``train.float8``: tensorwise, rowwise, MXFP8) against bf16 on the speed check's config, the same
   ``--steps`` steps: step time, tokens/s, memory, and the loss curve above torchao's 20 dB SQNR:
   ``bench/gpu_check_float8.py`` (a recipe the GPU lacks is skipped; all three on a CPU).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "bench"))  # gpu_check_parallel beside this script
# cuBLAS is deterministic only with a fixed workspace (set before the first CUDA matmul); check d needs it
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import numpy as np  # noqa: E402
import torch  # noqa: E402
from gpu_check_float8 import check_float8  # noqa: E402
from gpu_check_parallel import check_context_parallel, check_grouped_mm, check_tensor_parallel  # noqa: E402

from shardlm.config import Config, ParallelConfig, load_config  # noqa: E402
from shardlm.parallel.dist import DistInfo, exit_process, init_distributed  # noqa: E402

LOSS_TOL = 1e-4
LOGITS_TOL = 1e-3
MEMORY_OVER_PLAN = 0.10
TINY = ["--model.dim=192", "--model.n_layers=4", "--model.n_heads=6", "--model.n_kv_heads=2",
        "--model.ffn_hidden=512", "--model.vocab_size=4096", "--model.max_seq_len=256",
        "--model.tie_embeddings=true", "--train.seq_len=128", "--train.global_batch_size=32",
        "--train.micro_batch_size=16", "--train.lr=2e-3", "--train.min_lr=2e-4", "--train.warmup_steps=3",
        "--train.eval_interval=0", "--train.log_interval=1"]
#: --device cpu: smaller still (the CPU stand-in for the 1B config, with its settings: bf16, compile,
#: selective AC; and for checks b-d), so that CI runs the whole script in a few minutes
SPEED_CPU = ["--model.dim=64", "--model.n_layers=2", "--model.n_heads=4", "--model.n_kv_heads=2",
             "--model.ffn_hidden=128", "--model.vocab_size=512", "--model.max_seq_len=64",
             "--train.seq_len=64", "--train.global_batch_size=8", "--train.micro_batch_size=4"]
TINY_CPU = [*SPEED_CPU, "--model.tie_embeddings=true", "--train.lr=2e-3", "--train.min_lr=2e-4",
            "--train.warmup_steps=3", "--train.eval_interval=0", "--train.log_interval=1"]


def tiny(device: torch.device) -> list[str]:
    """Overrides of the tiny model of checks b-d on ``device`` (their vocabulary: :func:`tiny_vocab`)."""
    return TINY if device.type == "cuda" else TINY_CPU


def tiny_vocab(device: torch.device) -> int:
    return 4096 if device.type == "cuda" else 512


def write_random_data(out: Path, vocab: int, tokens: int, seed: int = 0) -> Path:
    """A prepared-data directory (``train.bin``, ``val.bin``, ``meta.json``, ``tokenizer.json``) of seeded
    random ids.

    The tokenizer is a word-level one over the names ``t0 .. t<vocab-1>`` (HF ``tokenizers``), so an exported
    model directory is complete.
    """
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit

    out.mkdir(parents=True, exist_ok=True)
    dtype = np.uint16 if vocab <= 65536 else np.uint32
    ids = np.random.default_rng(seed).integers(0, vocab, size=tokens, dtype=np.int64).astype(dtype)
    n_val = tokens // 10
    ids[:-n_val].tofile(out / "train.bin")
    ids[-n_val:].tofile(out / "val.bin")
    tok = Tokenizer(WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    tok.pre_tokenizer = WhitespaceSplit()
    tok.save(str(out / "tokenizer.json"))
    meta = {"dtype": np.dtype(dtype).name, "vocab_size": vocab, "tokenizer_vocab_size": vocab,
            "train_tokens": int(tokens - n_val), "val_tokens": int(n_val), "corpus": "random",
            "special_ids": {"bos": None, "eos": None, "eod": None}, "unigram_entropy_nats": math.log(vocab),
            "seed": seed, "identity": {"external": f"bench/gpu_check.py: seeded random ids, seed {seed}"}}
    (out / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    return out


def trainer_for(cfg: Config, device: torch.device, backend: str):
    from shardlm.train.trainer import Trainer

    return Trainer(cfg, DistInfo(0, 0, 1, device, backend), keep_history=True)  # every record, for the checks


def config(base: str | None, overrides: list[str], device: torch.device, data: Path, run: Path) -> Config:
    return load_config(base,
                       [*overrides, f'--data.dir="{data}"', f'--run.dir="{run}"', "--run.overwrite=true",
                              f"--parallel.device={device.type}"])


def speed_setup(device: torch.device, work: Path, steps: int) -> tuple[str | None, list[str], Path]:
    """The speed check's config file (None: the CPU stand-in), its overrides, and its random data (written
    once under ``work``)."""
    base = str(ROOT / "configs" / "llama3.2-1b.toml") if device.type == "cuda" else None
    extra = [] if device.type == "cuda" else [
        "--parallel.param_dtype=bfloat16", "--parallel.reduce_dtype=float32",
        "--parallel.activation_checkpoint=selective", *SPEED_CPU]
    probe = load_config(base, extra)
    t = probe.train
    tokens = (steps + 2) * t.global_batch_size * (t.seq_len + 1) + t.seq_len * 64
    data = work / "data-speed"
    if not (data / "meta.json").is_file():
        write_random_data(data, probe.model.vocab_size, tokens)
    return base, extra, data


def speed_runs(device: torch.device, backend: str, work: Path, steps: int):
    """``run(overrides, run_dir)`` for check i: ``steps`` records of the speed check's config with
    ``overrides``; ``max_memory_allocated`` over the steps after the first in the last record."""
    def run(overrides: list[str], run_dir: Path) -> list[dict]:
        base, extra, data = speed_setup(device, work, steps)
        cfg = config(base, [*extra, "--parallel.compile=true", "--checkpoint.enabled=false", *overrides],
                     device, data, run_dir)
        trainer = trainer_for(cfg, device, backend)
        records = [trainer.train_step()]
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        records += [trainer.train_step() for _ in range(steps - 1)]
        records[-1]["max_allocated_bytes"] = torch.cuda.max_memory_allocated(device)
        del trainer
        torch.cuda.empty_cache()
        return records
    return run


def check_speed(device: torch.device, backend: str, work: Path, steps: int) -> dict:
    """(a) bf16 + compile + selective AC: tokens/s, MFU, peak allocated memory against the planner."""
    from shardlm.plan import plan_memory
    from shardlm.plan.devices import device_for_cuda_name

    base, extra, data = speed_setup(device, work, steps)
    cfg = config(base, [*extra, "--parallel.compile=true", "--checkpoint.enabled=false"], device, data,
                 work / "run-speed")
    trainer = trainer_for(cfg, device, backend)
    records = [trainer.train_step()]  # includes compilation
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    for _ in range(steps - 1):
        records.append(trainer.train_step())
    timed = records[1:]
    step_s = sorted(r["step_time_s"] for r in timed)[len(timed) // 2]
    tokens_per_s = cfg.train.global_batch_size * cfg.train.seq_len / step_s
    mfu = (
        trainer.flops_per_token
        * cfg.train.global_batch_size
        * cfg.train.seq_len
        / (step_s * trainer.peak.flops)
    )
    row = {
        "check": "a. speed",
        "config": f"{base and Path(base).name or 'tiny stand-in'}, bf16, compile, selective AC",
        "first_step_s": records[0]["step_time_s"],
        "median_step_s": step_s,
        "tokens_per_s": tokens_per_s,
        "mfu": mfu,
        "peak": f"{trainer.peak.flops / 1e12:.1f} TFLOP/s ({trainer.peak.precision}, {trainer.peak.source})",
    }
    ok = 0 < mfu < 1
    if device.type == "cuda":
        known = device_for_cuda_name(torch.cuda.get_device_name(device))
        predicted = plan_memory(cfg, 1, known.name if known else "h100").peak
        measured = torch.cuda.max_memory_allocated(device)
        row.update(max_allocated_bytes=measured, planned_bytes=predicted,
                   memory_vs_plan=measured / predicted - 1,
                   max_reserved_bytes=torch.cuda.max_memory_reserved(device))
        ok = ok and measured <= predicted * (1 + MEMORY_OVER_PLAN)
        row["result"] = (
            f"{tokens_per_s:,.0f} tokens/s, MFU {mfu:.1%} of {row['peak']}; max allocated "
            f"{measured / 2**30:.2f} GiB vs plan {predicted / 2**30:.2f} GiB "
            f"({measured / predicted - 1:+.1%})"
        )
    else:
        row["result"] = (
            f"{tokens_per_s:,.0f} tokens/s, MFU {mfu:.1%} of {row['peak']}; memory vs plan: not on CPU "
            "(no allocator statistics)"
        )
    row["pass"] = bool(ok)
    return row


def losses_of(cfg: Config, device: torch.device, backend: str, steps: int) -> list[float]:
    trainer = trainer_for(cfg, device, backend)
    return [trainer.train_step()["loss"] for _ in range(steps)]


def check_numerics(device: torch.device, backend: str, work: Path, data: Path) -> list[dict]:
    """(b) the tiny config in fp32 (TF32 off) on the device against the CPU: 10 steps, losses within 1e-4."""
    cpu = torch.device("cpu")
    common = [*tiny(device), "--checkpoint.enabled=false", "--parallel.tf32=false"]
    ref = losses_of(config(None, common, cpu, data, work / "run-cpu"), cpu, backend, 10)
    got = losses_of(config(None, common, device, data, work / "run-dev-fp32"), device, backend, 10)
    diff = max(abs(a - b) for a, b in zip(got, ref))
    rows = [
        {
            "check": "b. fp32 device vs CPU",
            "max_loss_diff": diff,
            "losses_device": got,
            "losses_cpu": ref,
            "result": f"10 steps, max loss diff {diff:.2e} (limit {LOSS_TOL:.0e}); loss {got[0]:.4f} -> "
                      f"{got[-1]:.4f}",
            "pass": diff <= LOSS_TOL,
        }
    ]
    if device.type == "cuda":
        tf32 = losses_of(config(None, [*tiny(device), "--checkpoint.enabled=false"], device, data,
                                work / "run-dev-tf32"),
                         device, backend, 10)
        d = max(abs(a - b) for a, b in zip(tf32, ref))
        rows.append({"check": "b'. TF32 device vs CPU (information)", "max_loss_diff": d,
                     "result": f"10 steps, max loss diff {d:.2e} (not judged)", "pass": True})
    return rows


def check_block_causal(device: torch.device) -> list[dict]:
    """(e) block-causal attention on the device, fp32 with TF32 off: a packed row of three examples (Mistral's
    sliding window of 32, shorter than two of them) against each example alone from position 0, per backend
    that trains there (``sdpa``; ``flex`` compiled on CUDA; on CPU ``flex`` is forward only): logits within
    1e-5, gradients of the summed loss within 1e-4 (relative, all parameters). Then the same for gpt-oss
    (attention sinks, unit-size so that they take a real share of each softmax: under ``flex`` joined to the
    kernel's log-sum-exp, whose gradient the compiled backward must carry)."""
    from shardlm.model.config import ModelConfig
    from shardlm.model.decoder import CausalLM

    gen = torch.Generator().manual_seed(0)
    examples = [torch.randint(0, 512, (n,), generator=gen) for n in (40, 70, 30)]
    tokens = torch.cat([*examples, torch.zeros(20, dtype=torch.long)])[None].to(device)
    documents = torch.cat([torch.full((len(e),), d) for d, e in enumerate([*examples, range(20)])])[None].to(
        device
    )
    targets = torch.cat(
        [torch.cat([e[1:], torch.tensor([-100])]) for e in examples] + [torch.full((20,), -100)]
    )
    saved = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")  # TF32 off: fp32 against fp32
    rows = []
    try:
        for family, backend in (("mistral", "sdpa"), ("mistral", "flex"), ("gpt_oss", "sdpa"),
                                ("gpt_oss", "flex")):
            train = backend == "sdpa" or device.type == "cuda"
            experts = dict(n_experts=4, sliding_window_pattern=2) if family == "gpt_oss" else {}
            cfg = ModelConfig(family=family, dim=128, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=256,
                              vocab_size=512, max_seq_len=256, sliding_window=32, attention="block_causal",
                              attention_backend=backend, **experts)
            model = CausalLM(cfg).to(device)
            model.init_weights(0)
            with torch.no_grad():
                for name, p in model.named_parameters():
                    if name.endswith("sinks"):
                        p.copy_(torch.randn(p.shape, generator=gen).to(device))
            with torch.set_grad_enabled(train):
                logits = model(tokens, documents=documents)[0]
                alone = [model(e[None].to(device))[0] for e in examples]
            starts = np.cumsum([0] + [len(e) for e in examples])
            diff = max((logits[a:b] - ref).abs().max().item() for a, b, ref in zip(starts[:-1], starts[1:],
                                                                                   alone))
            grad = float("nan")
            if train:
                loss = torch.nn.functional.cross_entropy(logits, targets.to(device), reduction="sum")
                packed = torch.autograd.grad(loss, list(model.parameters()))
                total = sum(torch.nn.functional.cross_entropy(ref[:-1], e[1:].to(device), reduction="sum")
                            for ref, e in zip(alone, examples))
                one_by_one = torch.autograd.grad(total, list(model.parameters()))
                grad = (torch.cat([(a - b).flatten() for a, b in zip(packed, one_by_one)]).norm()
                        / torch.cat([b.flatten() for b in one_by_one]).norm()).item()
            ok = diff <= 1e-5 and (not train or grad <= 1e-4)
            rows.append(
                {
                    "check": f"e. block-causal {backend}{', gpt-oss sinks' if family == 'gpt_oss' else ''}: "
                             "packed row = each example alone",
                    "max_logits_diff": diff,
                    "grad_rel_diff": grad,
                    "result": f"logits {diff:.1e} (limit 1e-5), gradients "
                    + (f"{grad:.1e} (limit 1e-4)" if train else "not run (no flex backward on CPU)"),
                    "pass": ok,
                }
            )
    finally:
        torch.set_float32_matmul_precision(saved)
    return rows


def check_resume_and_export(device: torch.device, backend: str, work: Path, data: Path) -> list[dict]:
    """(d) save after step 2 and resume on the device, bitwise; (c) export that checkpoint and
        compare logits."""
    from shardlm.convert.hf_in import load_model_dir

    run = work / "run-resume"
    opts = [*tiny(device), "--train.steps=4", "--checkpoint.interval=2", "--checkpoint.keep=0"]
    # deterministic kernels (e.g. attention backward without atomics), so that a difference means
    # the checkpoint
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        first = trainer_for(config(None, opts, device, data, run), device, backend)
        straight = first.train()
        ckpt = run / "checkpoints" / "step-2"
        resumed = trainer_for(config(None, [*opts, f'--checkpoint.resume="{ckpt}"'], device, data,
                                     work / "run-resumed"), device, backend)
        assert resumed.step == 2, resumed.step
        after = resumed.train()
    finally:
        torch.use_deterministic_algorithms(False)
    a = {r["step"]: r["loss"] for r in straight if "loss" in r}
    b = {r["step"]: r["loss"] for r in after if "loss" in r}
    pa = {k: v.float() for k, v in first.model.state_dict().items()}
    pb = {k: v.float() for k, v in resumed.model.state_dict().items()}
    same_params = all(torch.equal(_full(pa[k]), _full(pb[k])) for k in pa)
    rows = [{"check": "d. checkpoint + resume", "losses_straight": a, "losses_resumed": b,
             "result": f"steps 3-4 losses {'equal' if a[3] == b[3] and a[4] == b[4] else 'DIFFER'} "
                       f"({a[3]:.6f}, {a[4]:.6f} vs {b[3]:.6f}, {b[4]:.6f}); final parameters "
                       f"{'bitwise equal' if same_params else 'differ'}",
             "pass": a[3] == b[3] and a[4] == b[4] and same_params}]

    hf32, hf16 = work / "export-fp32", work / "export-bf16"
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", "")}
    for args in ([str(ckpt), str(hf32)], [str(hf32), str(hf16), "--dtype", "bfloat16"]):
        subprocess.run([sys.executable, "-m", "shardlm", "export", *args], check=True, env=env,
                       capture_output=True)
    import transformers

    previous = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False  # both sides in full fp32
    try:
        hf = (
            transformers.AutoModelForCausalLM.from_pretrained(str(hf16), dtype=torch.float32)
            .to(device)
            .eval()
        )
        ours = load_model_dir(hf16, device).float().eval()
        tokens = torch.randint(0, tiny_vocab(device), (2, 64), generator=torch.Generator().manual_seed(3)).to(
            device
        )
        with torch.no_grad():
            diff = (hf(tokens).logits.float() - ours(tokens).float()).abs().max().item()
    finally:
        torch.backends.cuda.matmul.allow_tf32 = previous
    rows.insert(0, {"check": "c. export -> transformers", "max_logits_diff": diff,
                    "result": f"bf16 weights, fp32 compute, 2 x 64 tokens: max logits diff {diff:.2e} "
                              f"(limit {LOGITS_TOL:.0e})", "pass": diff <= LOGITS_TOL})
    return rows


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--steps", type=int, default=30, help="steps of the speed check (default 30)")
    ap.add_argument("--out", help="also write the rows as JSON to this file")
    args = ap.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("error: --device cuda but no CUDA device is visible (use --device cpu for the CPU run)",
              file=sys.stderr)
        return 2
    started = time.perf_counter()
    pcfg = ParallelConfig(device=args.device,
                          backend="cuda:nccl,cpu:gloo" if args.device == "cuda" else "gloo")
    info = init_distributed(pcfg)
    device = info.device
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="shardlm-gpu-check-") as tmp:
        work = Path(tmp)
        tiny_data = write_random_data(work / "data-tiny", tiny_vocab(device),
                                      400_000 if device.type == "cuda" else 20_000)
        checks = {
            "a. speed": lambda: [check_speed(device, info.backend, work, args.steps)],
            "b. fp32 device vs CPU": lambda: check_numerics(device, info.backend, work, tiny_data),
            "c/d. export, resume": lambda: check_resume_and_export(device, info.backend, work, tiny_data),
            "e. block-causal attention": lambda: check_block_causal(device),
            "f. tensor parallel": lambda: check_tensor_parallel(device, work, tiny_data, tiny(device)),
            "g. MoE grouped matmul": lambda: check_grouped_mm(device),
            "h. context parallel": lambda: check_context_parallel(device, work, tiny_data, tiny(device)),
            "i. float8": lambda: check_float8(device, args.steps, speed_runs(device, info.backend, work,
                                                                             args.steps), work),
        }
        for label, check in checks.items():
            t0 = time.perf_counter()
            try:
                new = check()
            except Exception as e:  # noqa: BLE001 - one failed check is one FAIL row; the others still run
                traceback.print_exc()
                new = [{"check": label, "result": f"{type(e).__name__}: {e}"[:300], "pass": False}]
            for r in new:
                r["seconds"] = time.perf_counter() - t0
            rows += new
    total = time.perf_counter() - started
    print(f"\nshardlm gpu_check on {name} (torch {torch.__version__}, backend {info.backend}), {total:.0f} s")
    print("| check | result | s | status |\n|---|---|---|---|")
    for r in rows:
        status = "skipped" if r.get("skipped") else "ok" if r["pass"] else "FAIL"
        print(f"| {r['check']} | {r['result']} | {r['seconds']:.0f} | {status} |")
    if args.out:
        Path(args.out).write_text(json.dumps({"device": name, "torch": torch.__version__, "seconds": total,
                                              "rows": rows}, indent=2, default=str) + "\n")
    return 0 if all(r["pass"] for r in rows) else 1


if __name__ == "__main__":
    exit_process(main())
