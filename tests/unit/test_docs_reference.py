"""The generated references (docs/reference/config.md from the config dataclasses' field docstrings,
docs/reference/cli.md from the argparse parsers) are current, complete, and their staleness check names the
command that regenerates them."""

from __future__ import annotations

import dataclasses
import shutil

from conftest import ROOT
from shardlm.cli import reference
from shardlm.config import reference as config_reference
from shardlm.config.sections import TrainConfig


def test_the_committed_references_are_current():
    stale = reference.stale_files(ROOT)
    assert not stale, f"stale generated docs: {stale}; regenerate them with {reference.COMMAND}"


def test_the_check_names_a_stale_file_and_the_command(tmp_path, capsys):
    (tmp_path / "docs").mkdir()
    shutil.copytree(ROOT / "docs" / "reference", tmp_path / "docs" / "reference")
    assert reference.main(["--check", "--root", str(tmp_path)]) == 0
    cli = tmp_path / "docs" / "reference" / "cli.md"
    cli.write_text(cli.read_text().replace("--max-new-tokens", "--max-tokens"))  # an option renamed
    capsys.readouterr()
    assert reference.main(["--check", "--root", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert out == f"{cli} is stale: regenerate it with python -m shardlm.cli.reference\n"
    assert reference.main(["--root", str(tmp_path)]) == 0
    assert reference.main(["--check", "--root", str(tmp_path)]) == 0
    assert cli.read_text() == (ROOT / "docs" / "reference" / "cli.md").read_text()


@dataclasses.dataclass
class _Example:
    """A section."""

    steps: int = 3
    """How many.

    Second line."""
    plain: str = ""
    label = "not a field"
    """a string after a class attribute without annotation"""


def test_field_docs_reads_the_string_under_each_field():
    assert config_reference.field_docs(_Example) == {"steps": "How many. Second line."}
    docs = config_reference.field_docs(TrainConfig)
    assert docs["lr"] == "Peak learning rate, reached after warm-up."


def test_the_config_reference_has_every_key_with_type_default_and_meaning():
    text = config_reference.config_reference()
    keys = config_reference.config_keys()
    assert {"train.lr", "data.pack", "checkpoint.async", "parallel.dp_shard", "data.sources.weight"} <= keys
    assert "checkpoint.async_" not in keys and len(keys) > 100
    rows = {line.split(" | ")[0][3:-1]: line.split(" | ")[1:] for line in text.splitlines()
            if line.startswith("| `")}
    assert set(rows) == keys
    assert rows["train.lr"][:2] == ["`float`", "`0.0003`"] and "learning rate" in rows["train.lr"][2]
    assert rows["data.format"][:2] == ['`"text" or "instruct" or "preference" or "prompts"`',
                                   '`"text"`']
    assert rows["train.betas"][:2] == ["`[float, float]`", "`[0.9, 0.95]`"]
    assert rows["parallel.reshard_after_forward"][0] == '`bool or int or "auto"`'
    for section, cls in config_reference.sections().items():
        missing = [f.name for f in dataclasses.fields(cls) if f.name not in config_reference.field_docs(cls)]
        assert not missing, f"[{section}] fields without a docstring: {missing}"
        assert f"\n## [{section}]\n" in text


def test_the_cli_reference_has_every_command_and_option():
    text = reference.cli_reference()
    programs = reference.programs()
    assert {"shardlm train", "shardlm chat", "shardlm tune", "python -m shardlm.train"} <= set(programs)
    for name, parser in programs.items():
        assert f"\n## {name}\n" in text
        for action in parser._actions:
            for option in action.option_strings:
                assert option == "-h" or option == "--help" or f"`{option}`" in text, (name, option)
    assert reference.takes_overrides(programs["shardlm tune"])
    assert reference.takes_overrides(programs["python -m shardlm.train"])
    assert not reference.takes_overrides(programs["shardlm generate"])
