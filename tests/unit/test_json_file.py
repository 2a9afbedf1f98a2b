"""``shardlm.json_file.read_json``: one message naming the file for each way reading a JSON file fails, in the
caller's error type, and the readers that use it (prepared data's meta.json, a checkpoint's manifest)."""

from __future__ import annotations

import pytest

from shardlm.checkpoint.manifest import read_manifest
from shardlm.data.meta import load_meta
from shardlm.errors import CheckpointError, DataError, ModelDirError
from shardlm.json_file import read_json


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
    with pytest.raises(CheckpointError, match=f"^{tmp_path}/manifest.json is not a shardlm-checkpoint manifest"):
        read_manifest(tmp_path)
    (tmp_path / "manifest.json").write_text('{"format": ')
    with pytest.raises(CheckpointError, match=f"^{tmp_path}/manifest.json: not valid JSON"):
        read_manifest(tmp_path)
