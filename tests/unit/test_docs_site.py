"""The documentation site (mkdocs.yml, MkDocs with the Material theme) builds with ``--strict`` and no
warning: every page of docs/ is in the nav and every page the nav names exists, every link and anchor
resolves. The site is written to a temporary directory, never into the repository."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from conftest import ROOT


def mkdocs_build(config: Path, site: Path) -> tuple[int, list[str], str]:
    """``mkdocs build --strict`` of ``config`` into ``site``: (exit code, its WARNING and ERROR lines, its
    whole output). Not ``--quiet``: that hides the warnings from the strict count too."""
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(config), "-d",
                           str(site)], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    output = proc.stdout + proc.stderr
    return proc.returncode, [line for line in output.splitlines() if line.startswith(("WARNING", "ERROR"))], \
        output


def test_the_site_builds_strict_without_a_warning(tmp_path):
    code, warnings, output = mkdocs_build(ROOT / "mkdocs.yml", tmp_path / "site")
    assert code == 0 and not warnings, f"mkdocs build --strict failed:\n{output[-4000:]}"
    for page in ("index.html", "reference/config/index.html", "reference/cli/index.html"):
        assert (tmp_path / "site" / page).is_file(), page
    assert "data.pack" in (tmp_path / "site" / "reference" / "config" / "index.html").read_text()
    assert not (ROOT / "site").exists()


def test_a_broken_link_a_missing_anchor_or_page_fails_the_build(tmp_path):
    """The repository's mkdocs.yml settings (its nav replaced by two pages): a link to a missing page, a
    missing anchor, and a page outside the nav each fail the strict build, named."""
    config = (ROOT / "mkdocs.yml").read_text()
    (tmp_path / "mkdocs.yml").write_text(config[:config.index("\nnav:")] + "\nnav:\n  - index.md\n"
                                         "  - other.md\n")
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "other.md").write_text("# Other\n\n## HSDP / TP\n")
    (docs / "index.md").write_text("# Home\n\n[fine](other.md#hsdp--tp) [a](gone.md) [b](other.md#nowhere) "
                                   "[c](#nope)\n")
    (docs / "extra.md").write_text("# Not in the nav\n")
    code, warnings, output = mkdocs_build(tmp_path / "mkdocs.yml", tmp_path / "site")
    assert code != 0, output
    text = "\n".join(warnings)
    assert "'gone.md'" in text and "'other.md#nowhere'" in text and "'#nope'" in text, text
    assert 'not included in the "nav"' in text and "- extra.md" in output, output
    # a GitHub-style anchor (every space a hyphen: mkdocs.yml's slugify) resolves
    assert "hsdp--tp" not in text and len(warnings) == 4, text
