"""The documentation's quick commands run exactly as written: every ``<!-- docs-test: run -->`` block of
README.md and docs/ (read by tests/docs_pages.py), page by page in the site's order, in one scratch directory
holding copies of configs/ and examples/ (so a page's later blocks see what its earlier ones wrote, and the
repository stays clean), with ``bash -e -o pipefail``, OMP_NUM_THREADS=1 and this tree's ``src``. A failing
block is named by page and line, with the end of its output."""

from __future__ import annotations

import shutil

import pytest

import docs_pages
from conftest import ROOT

pytestmark = pytest.mark.dist

#: the most one block may take: a hang guard (the convention is under about a minute each on an idle
#: 2-core machine; 2-3 times that when the cores are shared)
BLOCK_TIMEOUT_S = 300


def test_every_run_block_of_the_docs_runs_as_written(tmp_path):
    pages = [(name, blocks) for name in docs_pages.page_order(ROOT)
             if (blocks := docs_pages.run_blocks(ROOT, name))]
    assert pages, "no <!-- docs-test: run --> block in README.md or docs/: nothing would be run"
    work = tmp_path / "work"
    work.mkdir()
    for folder in ("configs", "examples"):
        shutil.copytree(ROOT / folder, work / folder)
    env = docs_pages.docs_env(ROOT)
    runs = [docs_pages.run_block(block, work, env, BLOCK_TIMEOUT_S) for _, blocks in pages for block in blocks]
    print("docs run blocks, wall s: " + ", ".join(f"{r.block.page}:{r.block.line} {r.seconds:.1f}" for r in runs)
          + f"; total {sum(r.seconds for r in runs):.0f}")
    failures = [f for r in runs if (f := r.failure())]
    assert not failures, "documented commands that failed:\n\n" + "\n\n".join(failures)
