"""The tests' own layout: single-process tests in tests/unit, torchrun tests (marked ``dist``) in tests/dist,
the scripts torchrun runs in tests/workers, and the guards that keep it so (tests/conftest.py refuses a
misplaced test at collection; tests/single_process.py refuses a launch or a process group of several ranks
from tests/unit)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch.distributed

import single_process
from conftest import TESTS, WORKERS, misplaced

UNIT, DIST = TESTS / "unit", TESTS / "dist"


def files_in(folder: Path) -> list[Path]:
    return sorted(folder.glob("test_*.py"))


def is_dist(node: ast.FunctionDef, tree: ast.Module) -> bool:
    """Whether a test function is marked ``dist``: by a decorator or by the module's ``pytestmark``."""
    module = [ast.unparse(n.value) for n in tree.body if isinstance(n, ast.Assign)
              and any(isinstance(t, ast.Name) and t.id == "pytestmark" for t in n.targets)]
    return any("mark.dist" in m for m in module) or any(
        "mark.dist" in ast.unparse(d) for d in node.decorator_list
    )


def functions_of(path: Path) -> list[tuple[str, bool]]:
    """(name, marked dist) of every top-level test function of a test file."""
    tree = ast.parse(path.read_text())
    return [(n.name, is_dist(n, tree)) for n in tree.body
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name.startswith("test_")]


def imported_modules(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module.split(".")[0])
    return out


def test_every_test_is_in_the_folder_of_its_kind():
    """tests/ holds no test or worker file itself; tests/unit no ``dist`` test, tests/dist only ``dist``
    tests; tests/workers only ``*_worker.py`` scripts; a file name is used once (pytest imports modules
    by it)."""
    assert not files_in(TESTS) and not sorted(TESTS.glob("*_worker.py"))
    unit, dist = files_in(UNIT), files_in(DIST)
    assert len(unit) > 20 and len(dist) > 20
    wrong = [f"{p.name}::{name}" for p in unit for name, marked in functions_of(p) if marked]
    wrong += [f"{p.name}::{name}" for p in dist for name, marked in functions_of(p) if not marked]
    assert not wrong, f"tests in the folder of the other kind: {wrong}"
    assert all(functions_of(p) for p in unit + dist), "a test file without tests"
    workers = sorted(p.name for p in WORKERS.glob("*.py"))
    assert workers and all(name.endswith("_worker.py") for name in workers), workers
    names = [p.stem for p in unit + dist]
    assert len(names) == len(set(names)), sorted(n for n in names if names.count(n) > 1)


def test_unit_tests_import_no_torchrun_helper_dist_module_or_worker():
    """A single-process test imports neither conftest's launch helpers nor a module of tests/dist or a worker
    (the launches themselves are refused while it runs: see the tests below)."""
    dist_modules = {p.stem for p in files_in(DIST)} | {p.stem for p in WORKERS.glob("*.py")}
    launchers = {"torchrun", "run_scenarios"}
    found = []
    for p in files_in(UNIT):
        tree = ast.parse(p.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module == "conftest":
                found += [f"{p.name}: conftest.{a.name}" for a in node.names if a.name in launchers]
        found += [f"{p.name}: {m}" for m in imported_modules(p) & dist_modules]
    assert not found, found


def test_the_collection_check_names_a_misplaced_test():
    def item(folder: str, dist: bool) -> SimpleNamespace:
        path = TESTS / folder / "test_x.py" if folder else TESTS / "test_x.py"
        return SimpleNamespace(
            path=path,
            nodeid=f"{folder}/test_x.py::t",
            get_closest_marker=lambda name, dist=dist: object() if dist and name == "dist" else None,
        )

    assert misplaced([item("unit", False), item("dist", True)]) == []
    assert misplaced([item("unit", True), item("dist", False), item("workers", False), item("", True)]) == [
        "unit/test_x.py::t: marked dist, so it belongs in tests/dist",
        "dist/test_x.py::t: not marked dist, so it belongs in tests/unit",
        "workers/test_x.py::t: not marked dist, so it belongs in tests/unit",
        "/test_x.py::t: marked dist, so it belongs in tests/dist"]


def test_a_unit_test_cannot_launch_torchrun_or_a_worker():
    for argv in ([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "x.py"],
                 ["torchrun", "--standalone", "x.py"],
                 [sys.executable, str(WORKERS / "dist_worker.py"), "spec.json"]):
        with pytest.raises(RuntimeError, match="a test in tests/unit launches .*: launches belong in "
                                               "tests/dist"):
            subprocess.run(argv, capture_output=True, timeout=30)
    proc = subprocess.run([sys.executable, "-c", "print(6 * 7)"], capture_output=True, text=True, timeout=30)
    assert proc.stdout.strip() == "42"  # any other subprocess runs


def test_a_unit_test_cannot_start_a_process_group_of_several_ranks():
    store = torch.distributed.HashStore()
    with pytest.raises(RuntimeError, match="starts a process group of 2 ranks: that is a dist test"):
        torch.distributed.init_process_group("gloo", store=store, rank=0, world_size=2)
    assert not torch.distributed.is_initialized()
    assert single_process.launch_in("python -m torch.distributed.run x.py") == "torch.distributed.run"
    assert single_process.launch_in([b"python", Path("a/b_worker.py")]) == "_worker.py"
    assert single_process.launch_in(["python", "-m", "shardlm", "--help"]) is None


def collect(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                           *args], capture_output=True, text=True, timeout=120, cwd=TESTS.parent)


def test_a_run_with_the_smollm2_tests_on_a_nearly_full_disk_is_refused_at_collection(tiny_fs):
    """Too little free space where pytest writes (a 3 MB tmpfs as --basetemp's disk): collecting the SmolLM2
    tests stops with one message naming the space needed and free, exit 4 (a usage error), before any test
    runs (with two pytest-xdist workers: the message once as a collection error, exit 1); the same collection
    with the default base directory passes, and so does a selection without the SmolLM2 tests on the tiny
    disk."""
    smol = "tests/dist/test_pretrained_finetune.py"
    proc = collect(f"--basetemp={tiny_fs / 'base'}", smol)
    assert proc.returncode == 4, proc.stdout + proc.stderr
    text = proc.stdout + proc.stderr
    assert f"the tests need about 8 GB free under {tiny_fs}" in text and "GB is free" in text
    # the README's two pytest-xdist workers: the same message once, no test run, a failing exit
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "2", "-p", "no:cacheprovider",
                           f"--basetemp={tiny_fs / 'base'}", smol],
                          capture_output=True, text=True, timeout=300, cwd=TESTS.parent)
    text = proc.stdout + proc.stderr
    assert proc.returncode == 1 and text.count("ERROR collecting test session") == 1, text
    assert f"the tests need about 8 GB free under {tiny_fs}" in text, text
    assert "1 error in" in text and "passed" not in text and "INTERNALERROR" not in text, text
    assert collect(smol).returncode == 0
    assert collect(f"--basetemp={tiny_fs / 'base'}", "tests/unit/test_json_file.py").returncode == 0
