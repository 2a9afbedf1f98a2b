"""The commands of README.md and docs/**/*.md checked against the real parsers and config keys, for
tests/unit/test_docs_commands.py (the pages and blocks are read by tests/docs_pages.py).

A shell block's subcommands, flags, ``--section.key=value`` overrides, ``--config`` files and the scripts
``python x.py`` runs are checked, and its ``docs-test`` marker (``run`` or ``skip REASON``) is required when
it holds a shardlm or torchrun command; ``--section.key`` anywhere in a page, ``section.key = value`` and
``shardlm SUBCOMMAND --option`` in inline code, and the keys of ```toml blocks are checked too.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import re
import shlex
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from docs_pages import SHELL, Page, page_order, read_page, split_commands
from shardlm.cli import reference
from shardlm.config.reference import config_keys, sections

#: ``--section.key`` anywhere in a page's text (prose, tables, code)
DASHED_KEY = re.compile(r"(?<![\w.-])--(?P<section>[a-z_]+)\.(?P<key>[a-z_]+)\b")
#: an inline code span that starts like a command: ``shardlm tune --time-budget``, ``torchrun --nnodes=2``
INLINE_COMMAND = re.compile(r"`((?:shardlm|torchrun) [^`]*)`")
#: ``section.key = value`` (or ``section.key=value``) as a whole inline code span
INLINE_SETTING = re.compile(r"`(?P<section>[a-z_]+)\.(?P<key>[a-z_]+)\s*=[^`]*`")
PYTHON = re.compile(r"^(.*/)?python(3(\.\d+)?)?$")


class ParseError(Exception):
    """argparse's error message, raised instead of its exit."""


def _parse(parser: argparse.ArgumentParser, argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """``parser.parse_known_args(argv)`` with argparse's errors (of the parser or a subparser) raised as
    :class:`ParseError` and ``--help`` printing nothing.

    Raises:
        ParseError: what argparse would print after ``error:``.
    """

    def error(message: str) -> None:
        raise ParseError(message)

    stack = [parser]
    while stack:
        p = stack.pop()
        p.error = error  # type: ignore[method-assign]
        p.allow_abbrev = False  # a page spells each option in full
        stack += [sub for sub, _ in reference.subcommands(p).values()]
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        try:
            return parser.parse_known_args(argv)
        except SystemExit:  # --help
            return argparse.Namespace(help=True), []


def shardlm_start(words: list[str]) -> tuple[str, list[str]] | None:
    """Where a shardlm command starts in a simple command's words (after wrappers such as ``srun ...``,
    ``timeout 60``): ``("shardlm", args)``, ``("-m MODULE", args)`` for ``python -m shardlm...``, or
    ``("torchrun", args)``; None for any other command."""
    for k, word in enumerate(words):
        if word == "shardlm" or word.endswith("/shardlm"):
            return "shardlm", words[k + 1:]
        if word == "torchrun" or word.endswith("/torchrun"):
            return "torchrun", words[k + 1:]
        if PYTHON.match(word) and words[k + 1:k + 2] == ["-m"] and len(words) > k + 2:
            module = words[k + 2]
            if module == "torch.distributed.run":
                return "torchrun", words[k + 3:]
            if module == "shardlm" or module.startswith("shardlm."):
                return f"-m {module}", words[k + 3:]
    return None


@dataclass
class Checker:
    """Checks the commands of one repository (``root``) against this source tree's parsers and config."""

    root: Path
    keys: set[str] = field(default_factory=config_keys)
    #: the parsers of :func:`shardlm.cli.reference.programs` (built once: a few ms each)
    programs: dict[str, argparse.ArgumentParser] = field(default_factory=reference.programs)

    def key_problem(self, section: str, key: str) -> str | None:
        """Why ``section.key`` is no config key (None: it is one)."""
        if f"{section}.{key}" in self.keys:
            return None
        if section not in sections() and section != "data.sources":
            return f"unknown config section '{section}' in {section}.{key}"
        return f"unknown config key {section}.{key}"

    def check_page(self, page: Page) -> list[str]:
        """The problems of one page, each ``"page:line: what"``."""
        out = [f"{page.path}:{n}: a docs-test marker not directly followed by a ``` block" for n in
               page.orphan_markers]
        lines = page.text.split("\n")
        sections_named = set(sections())
        # shell and TOML blocks are checked as commands and tables below
        checked = {b.line + k for b in page.blocks if b.lang in SHELL | {"toml"}
                   for k in range(len(b.text.split("\n")) + 2)}
        for n, line in enumerate(lines, 1):
            if n in checked:
                continue
            for m in list(DASHED_KEY.finditer(line)) + list(INLINE_SETTING.finditer(line)):
                if m.group("section") in sections_named and (why := self.key_problem(m["section"], m["key"])):
                    out.append(f"{page.path}:{n}: {why}")
            for span in INLINE_COMMAND.findall(line):
                out += [f"{page.path}:{n}: {why} (in: `{span}`)"
                        for why in self.inline_problems(span.split())]
        written: set[str] = set()
        for block in page.blocks:
            where = f"{page.path}:{block.line}"
            if block.lang not in SHELL:
                if block.marker is not None:
                    out.append(f"{where}: a docs-test marker before a ```{block.lang or 'plain'} block (only "
                               "```bash blocks are run or checked as commands)")
                if block.lang == "toml":
                    out += [f"{where}: {p}" for p in self.toml_problems(block.text)]
                continue
            try:
                commands, heredocs, files = split_commands(block.text, block.line + 1)
            except ValueError as e:
                out.append(f"{page.path}:{e}")
                continue
            written |= set(files)  # what the block writes with > or tee (a config, say) counts from its start
            for target, body, line in heredocs:
                written.add(target)
                if target.endswith(".toml"):
                    out += [f"{page.path}:{line}: {p}" for p in self.toml_problems(body)]
            shardlm_commands = [(c, s) for c in commands if (s := shardlm_start(c.words))]
            for c in commands:  # ``python bench/x.py``, ``python examples/y.py``: the script exists
                runs_file = PYTHON.match(c.words[0]) and c.words[1:2] not in (["-m"], ["-c"])
                script = next((w for w in c.words[1:] if not w.startswith("-")), "") if runs_file else ""
                if script.endswith(".py") and script not in written and not (self.root / script).is_file():
                    out.append(f"{page.path}:{c.line}: {script} does not exist (in: {shlex.join(c.words)})")
            if shardlm_commands or block.marker is not None:
                if block.marker is None:
                    out.append(f"{where}: a ```bash block with a shardlm/torchrun command needs "
                               "'<!-- docs-test: run -->' or '<!-- docs-test: skip REASON -->' on the line "
                               "before it")
                elif block.marker not in ("run", "skip"):
                    out.append(f"{where}: unknown docs-test marker '{block.marker}' (run or skip REASON)")
                elif block.marker == "skip" and not block.reason:
                    out.append(f"{where}: '<!-- docs-test: skip -->' needs a reason (why it is not run)")
            for command, (kind, args) in shardlm_commands:
                for problem in self.command_problems(kind, args, written):
                    out.append(f"{page.path}:{command.line}: {problem} (in: {shlex.join(command.words)})")
                if kind == "shardlm" and args[:1] == ["tune"]:
                    with contextlib.suppress(ParseError):
                        parsed, _ = _parse(self.programs["shardlm tune"], args[1:])
                        written.add(parsed.out or f"{Path(parsed.config).stem}.tuned.toml")  # its default
        return out

    def inline_problems(self, words: list[str]) -> list[str]:
        """An inline mention such as ``shardlm export SOURCE OUT_DIR --format hf`` or ``torchrun
        --max-restarts=1``: its subcommand and each ``--option`` it names exist (values and placeholders are
        not checked; ``--section.key`` is checked as everywhere)."""
        if words[0] == "torchrun":
            from torch.distributed.run import get_args_parser

            options = set(get_args_parser()._option_string_actions)
            name, words = "torchrun", words[1:words.index("-m")] if "-m" in words else words[1:]
        else:
            subs = reference.subcommands(self.programs["shardlm"])
            if words[1].startswith("-"):
                name, words = "shardlm", words[1:]
                options = set(self.programs[name]._option_string_actions)
            elif words[1] not in subs:
                return [f"shardlm has no subcommand {words[1]}"]
            else:
                name = f"shardlm {words[1]}"
                options = set(self.programs[name]._option_string_actions)
                if words[1] == "train":  # passed on to the ranks
                    options |= set(self.programs["python -m shardlm.train"]._option_string_actions)
                words = words[2:]
        flags = [w.split("=", 1)[0] for w in words if w.startswith("--")]
        return [f"{name} has no option {f}" for f in flags if "." not in f and f not in options]

    def toml_problems(self, text: str) -> list[str]:
        """Unknown keys of a TOML text whose tables are config sections (a snippet that does not parse, or
        whose tables are no config sections, e.g. pyproject.toml, is not checked)."""
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError:
            return []
        if not set(data) & set(sections()):
            return []
        out = []
        for section, table in data.items():
            if not isinstance(table, dict):
                out.append(f"'{section}' is not a [section] table")
                continue
            for key, value in table.items():
                if (why := self.key_problem(section, key)):
                    out.append(why)
                elif section == "data" and key == "sources" and isinstance(value, list):
                    out += [why for item in value if isinstance(item, dict) for k in item
                            if (why := self.key_problem("data.sources", k))]
        return out

    def command_problems(self, kind: str, args: list[str], written: set[str]) -> list[str]:
        """What is wrong with one shardlm command line (``kind`` and ``args`` from :func:`shardlm_start`):
        an unknown subcommand or flag, a bad value of a flag (as argparse says), an override that is no
        config key or lacks ``=value``, a ``--config`` file that neither exists nor was written earlier on
        the page."""
        programs = self.programs
        values = [re.sub(r"\$\{?\w+\}?|\$\([^)]*\)", "1", a) for a in args]  # shell variables: any value
        dollar = {v for v, a in zip(values, args) if v != a}
        if kind == "torchrun":
            from torch.distributed.run import get_args_parser

            try:
                parsed, rest = _parse(get_args_parser(), values)
            except ParseError as e:
                return [f"torchrun: {e}"]
            if not getattr(parsed, "module", False) or not parsed.training_script.startswith("shardlm"):
                return []
            kind, values = f"-m {parsed.training_script}", parsed.training_script_args + rest
        if kind in ("-m shardlm", "-m shardlm.data"):
            values = (["prepare"] if kind == "-m shardlm.data" else []) + values
            kind = "shardlm"
        if kind == "shardlm":
            parser, name = programs["shardlm"], "shardlm"
        elif kind in ("-m shardlm.train", "-m shardlm.eval"):
            name = f"python {kind}"
            parser = programs[name]
        elif kind in ("-m shardlm.cli.reference", "-m shardlm.rl.tasks"):
            return []  # run as written by tests/dist/test_docs_run.py (the rl task: a docs-test run block)
        else:
            return [f"python {kind}: no such shardlm module to run"]
        try:
            parsed, rest = _parse(parser, values)
        except ParseError as e:
            return [f"{name}: {e}"]
        if getattr(parsed, "help", False):
            return []
        program = programs.get(f"shardlm {parsed.command}") if name == "shardlm" else parser
        configs = getattr(parsed, "config", None)
        configs = [configs] if isinstance(configs, str) else list(configs or [])
        if parsed.__dict__.get("fn") is not None and parsed.command == "train":
            try:
                launched, rest = _parse(programs["python -m shardlm.train"], rest)
            except ParseError as e:
                return [f"shardlm train: {e}"]
            configs += launched.config or []
        out = []
        takes = reference.takes_overrides(program)
        for item in rest:
            if not takes:
                out.append(f"{program.prog}: unknown argument {item}")
            elif not item.startswith("--") or "." not in item.split("=", 1)[0]:
                out.append(f"{program.prog}: unknown argument {item}")
            elif "=" not in item:
                out.append(f"{program.prog}: {item} needs =VALUE (overrides are --section.key=value)")
            else:
                section, _, key = item[2:].split("=", 1)[0].partition(".")
                if (why := self.key_problem(section, key)):
                    out.append(f"{program.prog}: {why}")
        for path in configs:
            if path not in dollar and path not in written and not (self.root / path).is_file():
                out.append(f"config file {path} does not exist (not in the repository, nor written earlier "
                           "on the page)")
        return out


def check_docs(root: Path, checker: Checker | None = None) -> list[str]:
    """Every problem of every page under ``root`` (README.md and docs/**/*.md), ``"page:line: what"``."""
    checker = checker or Checker(root)
    return [p for name in page_order(root) for p in checker.check_page(read_page(root, name))]
