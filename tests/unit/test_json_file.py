"""``shardlm.json_file.read_json``: one message naming the file for each way reading a JSON file fails, in
the caller's error type (or in the caller's own words around the reason), and the readers that use it
(prepared data's meta.json, a checkpoint's manifest, a model directory's config.json, a run's config.json)."""

from __future__ import annotations

import pytest

from shardlm.checkpoint.manifest import read_manifest
from shardlm.cli.train import train_config
from shardlm.data.meta import load_meta
from shardlm.errors import CheckpointError, ConfigError, DataError, ModelDirError
from shardlm.json_file import read_json
from shardlm.metrics.report import load_run
from shardlm.model.hf_config import read_model_dir_config


def test_read_json_names_the_file_and_the_cause(tmp_path):
    good = tmp_path / "good.json"
    good.write_text('{"a": [1, 2]}')
    assert read_json(good, DataError) == {"a": [1, 2]}
    (tmp_path / "list.json").write_text("[1]")
    assert read_json(tmp_path / "list.json", DataError, expect=object) == [1]
    cases = {
        "missing.json": (None, r"missing\.json: cannot be read \(No such file or directory\)"),
        "bad.json": ('{"a": 1,}', r"bad\.json: not valid JSON \(Expecting property name"),
        "latin1.json": (b'{"a": "\xe9"}', r"latin1\.json: not valid JSON \('utf-8' codec can't decode"),
        "list.json": (None, r"list\.json: expected a JSON object$"),
    }
    for name, (content, message) in cases.items():
        path = tmp_path / name
        if isinstance(content, bytes):
            path.write_bytes(content)
        elif content is not None:
            path.write_text(content)
        with pytest.raises(ModelDirError, match=f"^{tmp_path}/{message}"):
            read_json(path, ModelDirError)
    with pytest.raises(DataError, match=r"expected a JSON int"):
        read_json(good, DataError, expect=int)


def test_its_readers_keep_their_error_types(tmp_path):
    (tmp_path / "meta.json").write_text("{not json")
    with pytest.raises(DataError, match=f"^{tmp_path}/meta.json: not valid JSON"):
        load_meta(str(tmp_path))
    (tmp_path / "manifest.json").write_text("[]")
    with pytest.raises(CheckpointError,
                       match=f"^{tmp_path}/manifest.json is not a shardlm-checkpoint manifest"):
        read_manifest(tmp_path)
    (tmp_path / "manifest.json").write_text('{"format": ')
    with pytest.raises(CheckpointError, match=f"^{tmp_path}/manifest.json: not valid JSON"):
        read_manifest(tmp_path)


def test_a_caller_s_message_frames_the_reason(tmp_path):
    bad = tmp_path / "index.json"
    bad.write_text("{")
    with pytest.raises(DataError, match=rf"^{tmp_path}/index\.json: not an index \(not valid JSON \(Expect"):
        read_json(bad, DataError, message="{path}: not an index ({reason})")
    with pytest.raises(DataError, match=r"^resume index\.json: Expecting property name enclosed in double"):
        read_json(bad, DataError, message="resume {path.name}: {cause}")
    with pytest.raises(DataError, match=r"^gone\.json is gone \(No such file or directory\); see --help$"):
        read_json(tmp_path / "gone.json", DataError, message="{path.name} is gone ({cause}); see --help")
    (tmp_path / "list.json").write_text("[]")
    with pytest.raises(DataError, match=r"^list\.json: expected a JSON object / expected a JSON object$"):
        read_json(tmp_path / "list.json", DataError, message="{path.name}: {reason} / {cause}")


def test_readers_of_model_directories_and_runs_name_the_file(tmp_path):
    """A model directory's config.json (init_from, import, export), a run directory's for ``shardlm report``
    and for ``--resume=auto`` without a config: their error type, the file named, the JSON decoder's cause."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": ')
    with pytest.raises(ModelDirError, match=f"^{model}/config.json: not valid JSON \\(Expecting value"):
        read_model_dir_config(model)
    (model / "config.json").write_text('["llama"]')
    with pytest.raises(ModelDirError, match=f"^{model}/config.json: expected a JSON object$"):
        read_model_dir_config(model)
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n')
    (run / "config.json").write_text('{"run": {"name": "x"}')
    with pytest.raises(ConfigError, match=f"^{run}/config.json: not valid JSON \\(Expecting ',' delimiter"):
        load_run(run)
    (run / "config.json").write_text('{"run": {"name": "x"}}')
    assert load_run(run).name == "x" and load_run(run).records[0]["loss"] == 2.0
    (run / "config.json").write_text("{")
    with pytest.raises(ConfigError, match=f"recorded in {run}/config.json, which cannot be read \\(Expecting "
                       "property name enclosed in double quotes: .*\\): pass --run.dir=DIR"):
        train_config(None, ["--checkpoint.resume=auto", f"--run.dir={run}"])
