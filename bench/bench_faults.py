"""Reliability bench: SIGKILL a training job at random moments, resume it with ``--resume=auto``, check it
is exact.

Usage (a script, not a test; it launches torchrun itself, twice per trial)::

    python bench/bench_faults.py                  # 20 trials, 2 ranks, tiny config (~10 min on 2 idle cores)
    python bench/bench_faults.py --trials 4 --seed 1 --keep-dirs /tmp/faults

Each trial trains the tiny config (dim 64, 2 layers, ~140k parameters; 12 steps of a global batch of 8
sequences of 32 tokens, a checkpoint every 2 steps, ``checkpoint.keep = 2``) at 2 ranks and kills one
rank with SIGKILL at a random moment; trials cycle through four kinds of moment:

- ``any time``: the bench kills a random rank after a random delay counted from the moment that rank's
  trainer is built, uniform over the time the uninterrupted run's ranks spent from there to their end
  (it may land in a step, a save, retention or the final export); if the run ends first (the machine
  got faster), the delay is drawn again over a range 0.6x as long, up to 6 times;
- ``writing shards``: a rank kills itself after a random number of writes into its shard file of a
  random save (the file is half-written);
- ``manifest``: rank 0 kills itself after writing a random save's ``manifest.json``, before the rename
  that completes the save;
- ``retention``: rank 0 kills itself while deleting a random one of the old checkpoints that retention
  removes (renamed aside, not yet deleted).

Then the job is launched again with ``--resume=auto`` and must end as the uninterrupted reference run does.
A trial is exact when: the resume succeeds; it starts at the newest complete checkpoint the killed
attempt left (no step lost beyond it); the global batches of steps 1..N (steps up to the checkpoint from
the killed attempt, the rest from the resume) hold exactly the reference's sample ids (none skipped or
repeated); ``metrics.jsonl`` has each step once with the reference's losses; and ``final/model.safetensors``
is bit-identical to the reference's.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

STEPS, INTERVAL, KEEP, WORLD = 12, 2, 2, 2
KINDS = ("any time", "writing shards", "manifest", "retention")
TINY = {
    "model.dim": 64, "model.n_layers": 2, "model.n_heads": 4, "model.n_kv_heads": 2, "model.ffn_hidden": 128,
    "model.vocab_size": 512, "model.max_seq_len": 64, "train.seq_len": 32, "train.global_batch_size": 8,
    "train.micro_batch_size": 4, "train.steps": STEPS, "train.warmup_steps": 3, "train.lr": 3e-3,
    "train.min_lr": 3e-4, "train.eval_interval": 0, "train.log_interval": 1,
    "checkpoint.interval": INTERVAL, "checkpoint.keep": KEEP,
}


# ---- the worker (one per rank, under torchrun) ------------------------------------------------------------
def worker(spec_path: str) -> None:
    """Train as the spec says, logging each step's sample ids; kill this rank where the spec's
    ``kill`` says."""
    import torch.distributed as dist

    from shardlm.checkpoint import fs_errors
    from shardlm.checkpoint import saving as saving_module  # the save path: its manifest and retention
    from shardlm.config import load_config
    from shardlm.parallel import exit_process, init_distributed
    from shardlm.train.trainer import Trainer

    spec = json.loads(Path(spec_path).read_text())
    rank = int(os.environ["RANK"])
    out = Path(spec["out"])
    (out / f"pid{rank}").write_text(str(os.getpid()))
    started = time.time()
    log = open(out / f"rank{rank}.jsonl", "a", encoding="utf-8")  # noqa: SIM115 - open until the process ends

    def note(record: dict) -> None:
        log.write(json.dumps(record) + "\n")
        log.flush()  # in the OS's hands: survives SIGKILL

    def die() -> None:
        note({"killed": True})
        os.kill(os.getpid(), signal.SIGKILL)

    cfg = load_config(None, spec["overrides"])
    trainer = Trainer(cfg, init_distributed(cfg.parallel), keep_history=True)  # sample_ids per step
    note({"start": True, "time": started})
    note({"start_step": trainer.step, "run_id": trainer.run_id, "time": time.time()})
    kill = spec.get("kill") or {}
    mine = kill.get("rank") == rank
    train_step, save = trainer.train_step, trainer.checkpointer.save

    def step() -> dict:
        record = train_step()
        note({"step": trainer.step, "ids": trainer.sample_ids[trainer.step - 1]})
        return record

    def saving(model, optimizer, scheduler, at: int):  # noqa: ANN001, ANN202 - Checkpointer.save's signature
        state["saving"], state["writes"] = at, 0
        path = save(model, optimizer, scheduler, at)
        note({"saved": at, "writes": state["writes"]})
        return path

    state = {"saving": None, "writes": 0}
    trainer.train_step, trainer.checkpointer.save = step, saving
    write = fs_errors._RecordingFile.write

    def counting_write(self, data):  # noqa: ANN001, ANN202 - writes into this rank's shard file, per save
        state["writes"] += 1
        if mine and kill["kind"] == "writing shards" and state["saving"] == kill["step"] \
                and state["writes"] > kill["writes"]:
            die()
        return write(self, data)

    fs_errors._RecordingFile.write = counting_write
    if mine and kill["kind"] == "manifest":
        write_manifest = saving_module.write_manifest

        def killing_manifest(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            path = write_manifest(*args, **kwargs)
            if state["saving"] == kill["step"]:
                die()
            return path

        saving_module.write_manifest = killing_manifest
    elif mine and kill["kind"] == "retention":
        remove, removed = saving_module.remove_directory, [0]

        def killing_remove(path: Path) -> None:
            removed[0] += 1
            if removed[0] < kill["nth"]:
                return remove(path)
            os.replace(path, path.with_name(f".tmp-deleting-{path.name}"))  # as remove_directory does first
            die()

        saving_module.remove_directory = killing_remove
    trainer.train()
    note({"done": True, "time": time.time()})
    log.close()
    dist.barrier()
    exit_process(0)


# ---- the driver -------------------------------------------------------------------------------------------
def launch(spec: dict, out: Path, env: dict, kill_after_s: float | None = None, kill_rank: int = 0,
           timeout_s: float = 600) -> tuple[int, float]:
    """Run one torchrun launch of the worker; optionally SIGKILL rank ``kill_rank`` after ``kill_after_s``.

    Returns (exit code, seconds from start to exit).
    """
    out.mkdir(parents=True, exist_ok=True)
    for p in out.glob("pid*"):
        p.unlink()
    (out / "spec.json").write_text(json.dumps(spec))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={WORLD}",
           str(Path(__file__).resolve()), "--worker", str(out / "spec.json")]
    start = time.perf_counter()
    with open(out / "launch.log", "a") as logf:
        proc = subprocess.Popen(cmd, env=env, stdout=logf, stderr=subprocess.STDOUT)
        if kill_after_s is not None:
            pid_file, rank_log = out / f"pid{kill_rank}", out / f"rank{kill_rank}.jsonl"
            while proc.poll() is None and not any("start_step" in r for r in read_log(rank_log)):
                # the delay counts from the moment the rank's trainer is built (start-up excluded)
                time.sleep(0.01)
            deadline = time.perf_counter() + kill_after_s
            while proc.poll() is None and time.perf_counter() < deadline:
                time.sleep(0.01)
            if proc.poll() is None and pid_file.is_file():
                try:
                    os.kill(int(pid_file.read_text()), signal.SIGKILL)
                except (ProcessLookupError, ValueError):
                    pass
        code = proc.wait(timeout=timeout_s)
    return code, time.perf_counter() - start


def read_log(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def complete_steps(run: Path) -> list[int]:
    """Steps of the complete checkpoints (``step-<N>`` with a manifest) in ``run/checkpoints``."""
    root = run / "checkpoints"
    if not root.is_dir():
        return []
    return sorted(int(m.group(1)) for p in root.iterdir()
                  if (m := re.fullmatch(r"step-(\d+)", p.name)) and (p / "manifest.json").is_file())


def batches(logs: list[list[dict]], upto: int | None = None, after: int = 0) -> dict[int, list[int]]:
    """{step: sorted sample ids of the global batch} from the ranks' logs, for after < step <= upto."""
    out: dict[int, list[int]] = {}
    for log in logs:
        for rec in log:
            if "step" in rec and rec["step"] > after and (upto is None or rec["step"] <= upto):
                out.setdefault(rec["step"], []).extend(rec["ids"])
    return {s: sorted(ids) for s, ids in out.items()}


def metrics(run: Path) -> list[tuple[int, float]]:
    lines = (run / "metrics.jsonl").read_text().splitlines()
    return [(r["step"], r["loss"]) for r in map(json.loads, lines) if "loss" in r]


def same_final(a: Path, b: Path) -> bool:
    import torch
    from safetensors.torch import load_file

    p, q = (
        load_file(str(a / "final" / "model.safetensors")),
        load_file(str(b / "final" / "model.safetensors")),
    )
    return p.keys() == q.keys() and all(torch.equal(p[k], q[k]) for k in p)


def prepare(work: Path) -> Path:
    from shardlm.data import prepare_corpus, read_documents

    corpus = work / "plays.txt"
    corpus.write_text("\n\n".join(read_documents("shakespeare")[:3]))
    prepare_corpus(str(corpus), str(work / "data"), None, 512, 0.1)
    return work / "data"


def overrides(data: Path, run: Path, **extra: object) -> list[str]:
    values = {**TINY, "data.dir": json.dumps(str(data)), "run.dir": json.dumps(str(run)), **extra}
    return [f"--{k}={v}" for k, v in values.items()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0, help="seed of the kill moments")
    parser.add_argument("--keep-dirs", help="work in this directory and keep it (default: a temporary one)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker)
        return
    work = Path(args.keep_dirs or tempfile.mkdtemp(prefix="bench-faults-"))
    work.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT / "src"))
    rng = random.Random(args.seed)
    data = prepare(work)

    ref_dir = work / "ref"
    code, ref_s = launch({"out": str(ref_dir / "log"), "overrides": overrides(data, ref_dir / "run",
                                                                             **{"run.overwrite": "true"})},
                         ref_dir / "log", env)
    if code != 0:
        sys.exit(f"the reference run failed (exit {code}): see {ref_dir / 'log' / 'launch.log'}")
    ref_run = ref_dir / "run"
    ref_batches = batches([read_log(ref_dir / "log" / f"rank{r}.jsonl") for r in range(WORLD)])
    ref_metrics = metrics(ref_run)
    ref_logs = [read_log(ref_dir / "log" / f"rank{r}.jsonl") for r in range(WORLD)]
    # a rank's start, trainer built, end of training
    times = [rec["time"] for rec in ref_logs[0] if "time" in rec]
    built_s, worker_s = times[1] - times[0], times[-1] - times[0]
    # per shard file and save
    writes = min(rec["writes"] for log in ref_logs for rec in log if "writes" in rec)
    print(f"reference: {STEPS} steps at {WORLD} ranks, checkpoint every {INTERVAL} (keep {KEEP}), "
          f"{ref_s:.1f} s (a rank lives {worker_s:.1f} s, trains from {built_s:.1f} s; {writes}+ writes per "
          "shard file and save)",
          flush=True)

    rows, exact = [], 0
    saves = list(range(INTERVAL, STEPS + 1, INTERVAL))
    for trial in range(1, args.trials + 1):
        kind = KINDS[(trial - 1) % len(KINDS)]
        tdir = work / f"trial-{trial:02d}"
        run, log1, log2 = tdir / "run", tdir / "attempt1", tdir / "attempt2"
        kill: dict = {"kind": kind}
        delay = None
        if kind == "any time":
            kill["rank"] = rng.randrange(WORLD)
            delay = rng.uniform(0, worker_s - built_s)
            moment = f"{delay:.2f} s after the trainer was built"
        elif kind == "writing shards":
            kill.update(rank=rng.randrange(WORLD), step=rng.choice(saves), writes=rng.randrange(0, writes))
            moment = f"save of step {kill['step']}, after {kill['writes']} writes"
        elif kind == "manifest":
            kill.update(rank=0, step=rng.choice(saves))
            moment = f"save of step {kill['step']}, manifest written"
        else:  # the n-th deletion: of step-(n·INTERVAL), by the save of step (n + KEEP)·INTERVAL
            kill.update(rank=0, nth=rng.randrange(1, STEPS // INTERVAL - KEEP + 1))
            moment = (f"deleting step-{kill['nth'] * INTERVAL} after the save of step "
                      f"{(kill['nth'] + KEEP) * INTERVAL}")
        spec1 = {"out": str(log1), "overrides": overrides(data, run, **{"run.overwrite": "true"}),
                 "kill": None if delay is not None else kill}
        code1, _ = launch(spec1, log1, env, kill_after_s=delay, kill_rank=kill["rank"])
        span = worker_s - built_s
        for _ in range(6):  # "any time": the run may end before the delay on a machine that got faster: again
            if code1 != 0 or delay is None:
                break
            shutil.rmtree(tdir)
            span *= 0.6
            delay = rng.uniform(0, span)
            moment = f"{delay:.2f} s after the trainer was built (drawn again)"
            code1, _ = launch(spec1, log1, env, kill_after_s=delay, kill_rank=kill["rank"])
        logs1 = [read_log(log1 / f"rank{r}.jsonl") for r in range(WORLD)]
        killed = code1 != 0
        trained = max([rec["step"] for log in logs1 for rec in log if "step" in rec], default=0)
        on_disk = max(complete_steps(run), default=0)
        saved = max([rec["saved"] for log in logs1 for rec in log if "saved" in rec], default=0)
        code2, _ = launch({"out": str(log2),
                           "overrides": overrides(data, run, **{"checkpoint.resume": '"auto"'})},
                          log2, env)
        logs2 = [read_log(log2 / f"rank{r}.jsonl") for r in range(WORLD)]
        start = next((rec["start_step"] for rec in logs2[0] if "start_step" in rec), None)
        problems = []
        if code2 != 0:
            problems.append(f"resume failed (exit {code2})")
        if start != on_disk or start < saved:
            problems.append(f"resumed at {start}, newest complete checkpoint {on_disk}, last save returned "
                            f"{saved}")
        if code2 == 0:
            merged = {**batches(logs1, upto=start), **batches(logs2, after=start)}
            if merged != ref_batches:
                problems.append("sample ids differ from the reference")
            if metrics(run) != ref_metrics:
                problems.append("metrics.jsonl differs from the reference")
            if not same_final(run, ref_run):
                problems.append("final parameters differ")
        ok = not problems and killed
        exact += ok
        rows.append((trial, kind, moment, kill["rank"], "yes" if killed else "no (finished first)", trained,
                     on_disk, start, trained - (start or 0),
                     "exact" if ok else "; ".join(problems) or "not killed"))
        print(f"trial {trial:2d}: {rows[-1][-1]}", flush=True)
        if not args.keep_dirs:
            shutil.rmtree(tdir, ignore_errors=True)

    header = ("trial", "kill moment", "when", "rank", "killed", "last step", "newest ckpt", "resumed at",
              "steps redone", "result")
    table = [header, *[tuple(str(c) for c in r) for r in rows]]
    widths = [max(len(r[i]) for r in table) for i in range(len(header))]
    print()
    print("| " + " | ".join(h.ljust(w) for h, w in zip(header, widths)) + " |")
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for r in table[1:]:
        print("| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |")
    print(f"\n{exact}/{len(rows)} exact (killed, resumed at the newest complete checkpoint, same samples, "
          "same losses, bit-identical final parameters)")
    if not args.keep_dirs:
        shutil.rmtree(work, ignore_errors=True)
    sys.exit(0 if exact == len(rows) else 1)


if __name__ == "__main__":
    main()
