"""Every command in README.md and docs/**/*.md is checked against the real parsers and config keys
(tests/docs_commands.py): subcommands, flags, ``--section.key`` overrides anywhere in a page, ``--config``
files, the ``docs-test`` marker before each command block; the README's links resolve. A renamed config key
fails the check, naming the key."""

from __future__ import annotations

import dataclasses
import textwrap
from pathlib import Path

import pytest

import docs_commands
import docs_pages
from conftest import ROOT
from shardlm.config import reference as config_reference


def test_every_command_in_the_docs_is_valid():
    problems = docs_commands.check_docs(ROOT)
    assert not problems, "commands in the docs that shardlm would refuse:\n" + "\n".join(problems)
    readme = docs_pages.read_page(ROOT, "README.md")
    commands = [c for b in readme.blocks if b.lang in docs_pages.SHELL
                for c in docs_pages.split_commands(b.text, b.line + 1)[0]]
    checked = [c for c in commands if docs_commands.shardlm_start(c.words)]
    assert len(checked) >= 3, "the README's shardlm commands were not found: the check would see nothing"


def test_the_readme_links_resolve():
    problems = docs_pages.readme_link_problems(ROOT)
    assert not problems, "\n".join(problems)


def write_page(root: Path, text: str) -> None:
    (root / "configs").mkdir(parents=True, exist_ok=True)
    (root / "configs" / "a.toml").write_text("[train]\nsteps = 2\n")
    (root / "docs").mkdir(exist_ok=True)
    (root / "README.md").write_text("# r\n")
    (root / "docs" / "page.md").write_text(textwrap.dedent(text))


FIXTURE = '''\
# A page

<!-- docs-test: run -->
```bash
shardlm train --nproc-per-node 2 --config configs/a.toml --resume=auto --data.pack=true
OMP_NUM_THREADS=1 srun --nodes=2 torchrun --nnodes=2 --nproc_per_node=4 --rdzv-backend=c10d \\
    --rdzv-endpoint=$HEAD:29500 -m shardlm.train --config configs/a.toml --train.steps=5 2>&1 | tee log.txt
python -m shardlm.data --config configs/a.toml --workers 2 && shardlm plan configs/a.toml --world-size 8 \\
    --parallel.tp=2
cat > mine.toml <<'EOF'
[data]
pack = true
EOF
shardlm tune configs/a.toml --world-size 2 --out t.toml && shardlm train --config mine.toml --config t.toml
shardlm generate --model runs/a/final --prompt 'ROMEO\\n' --help
```

Set `data.pack = true`, or `--checkpoint.async=true`; `model.safetensors` is a file.

```bash
shardlm trian --config configs/a.toml
```

<!-- docs-test: skip -->
```bash
shardlm generate --model m --tempreature 0.5
shardlm generate --model m --train.steps=1
torchrun --standalone --nproc_per_node=2 -m shardlm.train --config configs/a.toml --train.step=5
shardlm prepare --config configs/nope.toml --train.steps 50
```

Prose: `--lora.rnk=4` and `data.packing = true`.

<!-- docs-test: sometimes -->
```toml
[train]
step = 5
```

<!-- docs-test: run -->

```bash
echo the marker is not directly before this block
```
'''


def test_the_check_finds_each_kind_of_mistake_and_passes_the_rest(tmp_path):
    write_page(tmp_path, FIXTURE)
    problems = docs_commands.check_docs(tmp_path)
    p = "docs/page.md"
    # argparse's wording of the choices differs between Python versions
    typo = [n for n, problem in enumerate(problems) if "trian" in problem]
    assert typo == [4], problems
    assert problems[4].startswith(f"{p}:21: shardlm: argument command: invalid choice: 'trian' (choose from ")
    assert problems[4].endswith(" (in: shardlm trian --config configs/a.toml)")
    assert problems[:4] + problems[5:] == [
        f"{p}:40: a docs-test marker not directly followed by a ``` block",
        f"{p}:32: unknown config key lora.rnk",
        f"{p}:32: unknown config key data.packing",
        f"{p}:20: a ```bash block with a shardlm/torchrun command needs '<!-- docs-test: run -->' or "
        "'<!-- docs-test: skip REASON -->' on the line before it",
        f"{p}:25: '<!-- docs-test: skip -->' needs a reason (why it is not run)",
        f"{p}:26: shardlm generate: unknown argument --tempreature (in: shardlm generate --model m "
        "--tempreature 0.5)",
        f"{p}:26: shardlm generate: unknown argument 0.5 (in: shardlm generate --model m --tempreature 0.5)",
        f"{p}:27: shardlm generate: unknown argument --train.steps=1 (in: shardlm generate --model m "
        "--train.steps=1)",
        f"{p}:28: torchrun --nproc_per_node=N -m shardlm.train: unknown config key train.step (in: torchrun "
        "--standalone --nproc_per_node=2 -m shardlm.train --config configs/a.toml --train.step=5)",
        f"{p}:29: shardlm prepare: --train.steps needs =VALUE (overrides are --section.key=value) (in: "
        "shardlm prepare --config configs/nope.toml --train.steps 50)",
        f"{p}:29: shardlm prepare: unknown argument 50 (in: shardlm prepare --config configs/nope.toml "
        "--train.steps 50)",
        f"{p}:29: config file configs/nope.toml does not exist (not in the repository, nor written earlier "
        "on the page) (in: shardlm prepare --config configs/nope.toml --train.steps 50)",
        f"{p}:35: a docs-test marker before a ```toml block (only ```bash blocks are run or checked as "
        "commands)",
        f"{p}:35: unknown config key train.step"]


def renamed_keys(monkeypatch: pytest.MonkeyPatch, section: str, key: str) -> set[str]:
    """The config's keys after renaming field ``key`` of ``[section]``'s dataclass to ``key + "_renamed"``
    (a new dataclass, as a refactor would leave it; the real one untouched)."""
    real = config_reference.sections()
    fields = [(f.name if f.name != key else f"{key}_renamed", f.type,
               dataclasses.field(default=f.default, default_factory=f.default_factory))  # new Field objects
              for f in dataclasses.fields(real[section])]
    monkeypatch.setattr(config_reference, "sections",
                        lambda: {**real, section: dataclasses.make_dataclass(section, fields)})
    keys = config_reference.config_keys()
    assert f"{section}.{key}_renamed" in keys and f"{section}.{key}" not in keys
    assert key in {f.name for f in dataclasses.fields(real[section])}
    return keys


def test_a_renamed_config_key_fails_the_check_naming_it(tmp_path, monkeypatch):
    """The keys come from the config dataclasses: rename ``DataConfig.pack`` (as a refactor would) and a
    page that names ``data.pack`` fails, naming the page, the line and the key."""
    write_page(tmp_path, "Packing: `data.pack = true`.\n\n<!-- docs-test: run -->\n```bash\n"
                         "shardlm prepare --config configs/a.toml --data.pack=true\n```\n")
    assert docs_commands.check_docs(tmp_path) == []
    checker = docs_commands.Checker(tmp_path, keys=renamed_keys(monkeypatch, "data", "pack"))
    assert docs_commands.check_docs(tmp_path, checker) == [
        "docs/page.md:1: unknown config key data.pack",
        "docs/page.md:5: shardlm prepare: unknown config key data.pack (in: shardlm prepare --config "
        "configs/a.toml --data.pack=true)"]


def test_renaming_a_key_the_real_pages_name_fails_the_real_check(monkeypatch):
    """The same on README.md and docs/: the first ``--section.key`` of the README (a key it documents),
    renamed in its dataclass, makes the check of the real pages fail at each place that names it."""
    readme = (ROOT / "README.md").read_text()
    first = docs_commands.DASHED_KEY.search(readme)
    assert first, "the README names no --section.key"
    section, key = first["section"], first["key"]
    keys = renamed_keys(monkeypatch, section, key)
    problems = docs_commands.check_docs(ROOT, docs_commands.Checker(ROOT, keys=keys))
    named = [p for p in problems if f"unknown config key {section}.{key}" in p]
    assert any(p.startswith("README.md:") for p in named), problems
    assert len(named) >= readme.count(f"--{section}.{key}"), named


def test_a_python_script_that_is_not_there_is_named(tmp_path):
    write_page(tmp_path, "<!-- docs-test: skip slow -->\n```bash\npython configs/a.toml.py --x 1 && "
                         "OMP_NUM_THREADS=1 python3 bench/gone.py --y\npython -c 'print(1)'\n```\n")
    (tmp_path / "configs" / "a.toml.py").write_text("")
    assert docs_commands.check_docs(tmp_path) == [
        "docs/page.md:3: bench/gone.py does not exist (in: python3 bench/gone.py --y)"]


def test_inline_commands_name_real_subcommands_and_options(tmp_path):
    write_page(tmp_path, "Use `shardlm export SOURCE OUT_DIR --format hf`, `shardlm train --resume=auto`, "
                         "`torchrun --max-restarts=1 -m shardlm.train --x`, `shardlm --help`.\n"
                         "Not `shardlm exprt`, `shardlm tune --budget 60`, `torchrun --max-restart=1`.\n")
    assert docs_commands.check_docs(tmp_path) == [
        "docs/page.md:2: shardlm has no subcommand exprt (in: `shardlm exprt`)",
        "docs/page.md:2: shardlm tune has no option --budget (in: `shardlm tune --budget 60`)",
        "docs/page.md:2: torchrun has no option --max-restart (in: `torchrun --max-restart=1`)"]


def test_split_commands_follows_the_shell():
    commands, heredocs, written = docs_pages.split_commands(
        "A=1 shardlm x --y 'a b' # comment\nshardlm p \\\n  --q=1 > out.txt 2>&1; echo ok\n"
        "cat > c.toml <<EOF\n[train]\nsteps = 1\nEOF\ntee -a t.log && cp -r configs/a.toml my.toml", 10)
    assert [(c.words, c.line) for c in commands] == [
        (["shardlm", "x", "--y", "a b"], 10), (["shardlm", "p", "--q=1"], 11), (["echo", "ok"], 11),
        (["cat"], 13), (["tee", "-a", "t.log"], 17), (["cp", "-r", "configs/a.toml", "my.toml"], 17)]
    assert heredocs == [("c.toml", "[train]\nsteps = 1", 13)]
    assert written == ["out.txt", "c.toml", "t.log", "my.toml"]
    with pytest.raises(ValueError, match="^12: cannot split"):
        docs_pages.split_commands("ok\n\nshardlm 'x", 10)


def test_the_readme_link_check_finds_a_missing_file_and_anchor(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "data.md").write_text("# Data\n\n## HSDP / TP\n\n```bash\n# not a heading\n```\n")
    (tmp_path / "README.md").write_text("[a](docs/data.md#hsdp--tp) [b](docs/data.md#not-a-heading)\n"
                                        "[c](docs/gone.md) [d](https://x.org/y) [e](#top)\n# Top\n")
    assert docs_pages.readme_link_problems(tmp_path) == [
        "README.md:1: link to docs/data.md#not-a-heading: no heading with the anchor #not-a-heading in "
        "docs/data.md",
        "README.md:2: link to docs/gone.md: docs/gone.md does not exist"]


def test_a_failing_run_block_is_named_by_page_and_line_with_its_output(tmp_path):
    """The runner of tests/dist/test_docs_run.py: blocks run in order in one directory, ``-e`` stops a block
    at its first failing command, ``pipefail`` sees a failure inside a pipe, a hang is killed at the
    timeout."""
    run = "<!-- docs-test: run -->\n```bash\n"
    write_page(tmp_path, f"{run}echo one > f.txt\n```\n\n{run}cat f.txt\nfalse\necho not reached\n```\n\n"
                         f"{run}false | cat\n```\n\n{run}sleep 30\n```\n")
    blocks = docs_pages.run_blocks(tmp_path, "docs/page.md")
    assert [b.line for b in blocks] == [2, 7, 14, 19]
    env = docs_pages.docs_env(ROOT)
    runs = [docs_pages.run_block(b, tmp_path, env, timeout=2) for b in blocks]
    assert [r.returncode for r in runs] == [0, 1, 1, None]
    assert runs[0].failure() is None and runs[1].output == "one\n"
    assert runs[1].failure().startswith("docs/page.md:7: the block failed (exit 1) after ")
    assert runs[1].failure().endswith("; its output ends:\none\n")
    assert runs[3].failure().startswith("docs/page.md:19: the block timed out after 2 s")
    assert runs[3].seconds < 10
