"""README.md and docs/**/*.md as the documentation tests read them: pages in the site's order, their fenced
blocks with the ``docs-test`` marker on the line before, the simple commands of a shell block, the README's
links, and the runner of ``<!-- docs-test: run -->`` blocks (tests/dist/test_docs_run.py).

The convention: the line directly before a ```bash block that holds a shardlm or torchrun command is
``<!-- docs-test: run -->`` (the block is run as written) or ``<!-- docs-test: skip REASON -->`` (not run;
REASON says why); tests/docs_commands.py checks every block statically either way.
"""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

MARKER = re.compile(r"^<!--\s*docs-test:\s*(?P<verb>\S+)\s*(?P<reason>.*?)\s*-->$")
FENCE = re.compile(r"^(?P<indent>\s*)(?P<fence>`{3,}|~{3,})\s*(?P<lang>[\w+-]*)")
SHELL = {"bash", "sh", "shell"}
CONTROL = {"&&", "||", ";", "|", "&", "|&", "(", ")", ";;", "{", "}"}
REDIRECT = {">", ">>", "<", ">&", "&>", "<<<", ">|"}


@dataclass
class Block:
    """A fenced code block of a page: its language, text, 1-based line of the opening fence, and the
    ``docs-test`` marker on the line before (verb ``run``/``skip``/other, reason; None: no marker)."""

    page: str
    line: int
    lang: str
    text: str
    marker: str | None = None
    reason: str = ""


@dataclass
class Command:
    """One simple command of a shell block: its words (after ``VAR=value`` prefixes and redirections are
    taken off) and the 1-based line of the page it starts on."""

    words: list[str]
    line: int


@dataclass
class Page:
    """A page's blocks and the problems found in it (``"page:line: what"``)."""

    path: str
    text: str
    blocks: list[Block] = field(default_factory=list)
    orphan_markers: list[int] = field(default_factory=list)


def page_order(root: Path) -> list[str]:
    """README.md, then the pages of mkdocs.yml's nav in order, then any other docs/**/*.md (sorted), as
    paths relative to ``root``."""
    nav = []
    mkdocs = root / "mkdocs.yml"
    if mkdocs.is_file():
        text = mkdocs.read_text()
        nav_part = text[text.index("\nnav:") :] if "\nnav:" in text else ""
        nav = ["docs/" + m for m in re.findall(r":\s*([\w./-]+\.md)\s*$", nav_part, flags=re.M)]
    found = sorted(p.relative_to(root).as_posix() for p in (root / "docs").rglob("*.md"))
    pages = (["README.md"] if (root / "README.md").is_file() else []) + [p for p in nav if p in found]
    return pages + [p for p in found if p not in pages]


def read_page(root: Path, name: str) -> Page:
    """The fenced blocks of page ``name`` with their markers; a marker line not directly followed by a
    fence is recorded in ``orphan_markers``."""
    lines = (root / name).read_text().splitlines()
    page = Page(name, "\n".join(lines))
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            if MARKER.match(lines[i].strip()) and not (i + 1 < len(lines) and FENCE.match(lines[i + 1])):
                page.orphan_markers.append(i + 1)
            i += 1
            continue
        fence, indent = m.group("fence"), len(m.group("indent"))
        body, j = [], i + 1
        while j < len(lines) and not lines[j].strip().startswith(fence):
            body.append(lines[j][indent:] if lines[j][:indent].isspace() else lines[j].lstrip())
            j += 1
        marker = MARKER.match(lines[i - 1].strip()) if i > 0 else None
        page.blocks.append(Block(name, i + 1, m.group("lang").lower(), "\n".join(body),
                                 marker.group("verb") if marker else None,
                                 marker.group("reason") if marker else ""))
        i = j + 1
    return page


def split_commands(text: str, first_line: int) -> tuple[list[Command], list[tuple[str, str, int]], list[str]]:
    """The simple commands of a shell block whose first line is line ``first_line`` of its page, its
    here-documents as ``(target file, body, line)`` and the
    files it writes (``> FILE``, ``tee FILE``, ``cp SRC FILE``).

    Lines joined at a trailing backslash; comments dropped; split at ``&&``, ``||``, ``;``, ``|``;
    leading ``VAR=value`` words and redirections taken off.

    Raises:
        ValueError: a line shlex cannot split (an unbalanced quote), naming the line.
    """
    lines = text.split("\n")
    commands, heredocs, written = [], [], []
    i = 0
    while i < len(lines):
        start = i
        logical = lines[i]
        while logical.endswith("\\") and i + 1 < len(lines):
            i += 1
            logical = logical[:-1] + " " + lines[i]
        i += 1
        here = re.search(r"<<-?\s*(['\"]?)(\w+)\1", logical)
        if here:
            body = []
            while i < len(lines) and lines[i].strip() != here.group(2):
                body.append(lines[i])
                i += 1
            i += 1
            logical = logical[:here.start()] + logical[here.end():]
            target = re.search(r"(?:>|\btee)\s+(['\"]?)([^\s'\"|;&]+)\1", logical)
            heredocs.append((target.group(2) if target else "", "\n".join(body), first_line + start))
        lexer = shlex.shlex(logical, posix=True, punctuation_chars=True)
        lexer.whitespace_split = True
        try:
            words = list(lexer)
        except ValueError as e:
            line = first_line + start
            raise ValueError(f"{line}: cannot split {logical!r} as the shell would: {e}") from None
        current: list[str] = []
        for word in [*words, ";"]:
            if word not in CONTROL:
                current.append(word)
                continue
            current, files = _without_redirections(current)
            written += files
            if current:
                commands.append(Command(current, first_line + start))
            current = []
    for cmd in commands:
        files = [w for w in cmd.words[1:] if not w.startswith("-")]
        if cmd.words[0] == "tee":
            written += files
        elif cmd.words[0] in ("cp", "mv") and len(files) == 2:  # cp configs/x.toml my.toml
            written.append(files[1])
    return commands, heredocs, written


def _without_redirections(words: list[str]) -> tuple[list[str], list[str]]:
    """``words`` without redirections (``> f``, ``2>&1``...) and leading ``VAR=value`` assignments, and the
    files written by ``>``/``>>``."""
    out, written, skip = [], [], False
    for k, word in enumerate(words):
        if skip:
            skip = False
            if words[k - 1] in (">", ">>", ">|"):
                written.append(word)
            continue
        if word in REDIRECT:
            skip = True
            if out and out[-1].isdigit():
                out.pop()
            continue
        out.append(word)
    while out and re.match(r"^[A-Za-z_]\w*=", out[0]):
        out.pop(0)
    return out, written


def run_blocks(root: Path, name: str) -> list[Block]:
    """The ``<!-- docs-test: run -->`` shell blocks of page ``name``, in page order."""
    return [b for b in read_page(root, name).blocks if b.marker == "run" and b.lang in SHELL]


def anchors(text: str) -> set[str]:
    """The heading anchors of a Markdown text as GitHub and the site (mkdocs.yml's toc slugify) make them:
    lower case, punctuation dropped, every space a hyphen, ``-1``, ``-2`` on repeats; code blocks skipped."""
    from pymdownx.slugs import slugify

    slug = slugify(case="lower")
    out: set[str] = set()
    fence = None
    for line in text.split("\n"):
        m = FENCE.match(line)
        if m and (fence is None or m.group("fence").startswith(fence)):
            fence = None if fence else m.group("fence")[:3]
            continue
        heading = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if fence is None and heading:
            plain = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.group(1)).replace("`", "")
            base = slug(plain, "-")
            name, n = base, 0
            while name in out:
                n += 1
                name = f"{base}-{n}"
            out.add(name)
    return out


def readme_link_problems(root: Path) -> list[str]:
    """README.md's relative links whose file (or the heading anchor in a Markdown target) does not exist:
    the site's strict build checks docs/, not the README."""
    text = (root / "README.md").read_text()
    out = []
    for n, line in enumerate(text.split("\n"), 1):
        for target in re.findall(r"\]\(([^)\s]+)\)", line):
            if re.match(r"^[a-z]+:", target):
                continue  # http:, https:, mailto:
            path, _, anchor = target.partition("#")
            file = (root / path) if path else root / "README.md"
            if not file.exists():
                out.append(f"README.md:{n}: link to {target}: {path} does not exist")
            elif anchor and file.suffix == ".md" and anchor not in anchors(file.read_text()):
                out.append(f"README.md:{n}: link to {target}: no heading with the anchor #{anchor} in "
                           f"{path or 'README.md'}")
    return out


@dataclass
class BlockRun:
    """What running a ``run`` block did: exit code (None: killed at the timeout), wall seconds, output."""

    block: Block
    returncode: int | None
    seconds: float
    output: str

    def failure(self, tail: int = 3000) -> str | None:
        """``"page:line: ..."`` with the end of the output when the block failed; None when it passed."""
        if self.returncode == 0:
            return None
        what = f"timed out after {self.seconds:.0f} s" if self.returncode is None else \
            f"failed (exit {self.returncode}) after {self.seconds:.1f} s"
        where = f"{self.block.page}:{self.block.line}"
        return f"{where}: the block {what}; its output ends:\n{self.output[-tail:]}"


def docs_env(root: Path) -> dict[str, str]:
    """The environment a documented command runs in: one thread per process, this tree's ``src`` first on
    the path (the ``shardlm`` command beside this Python then runs this tree's code)."""
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONPATH"] = str(root / "src")
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    return env


def run_block(block: Block, cwd: Path, env: dict[str, str], timeout: float) -> BlockRun:
    """Run ``block`` exactly as written with ``bash -e -o pipefail`` in ``cwd``; past ``timeout`` seconds
    its whole process group is killed. Whatever it started that is still running at its end is ended."""
    start = time.perf_counter()
    proc = subprocess.Popen(["bash", "-e", "-o", "pipefail", "-c", block.text], cwd=cwd, env=env, text=True,
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=timeout)
        code: int | None = proc.returncode
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        code = None
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    return BlockRun(block, code, time.perf_counter() - start, output)
