"""Asynchronous checkpoints (``checkpoint.async``) in one process: a background save onto a full 3 MB tmpfs
stops the run at the next step with the cause and path. The torchrun checks of asynchronous saves are in
tests/dist/test_async_checkpoint.py."""

from __future__ import annotations

import json

from conftest import assert_full_disk_error, tiny_overrides
from shardlm.cli.train import main as train_main


def test_background_save_onto_a_full_tmpfs(small_data, tiny_fs, capsys):
    """One process: a checkpoint is ~1.7 MB, so step-1 fits on the 3 MB file system and step-2 does not."""
    run, ckpts = tiny_fs / "run", tiny_fs / "run" / "checkpoints"
    overrides = tiny_overrides(small_data, run, {"train.steps": 6, "train.eval_interval": 0,
                                                 "checkpoint.interval": 1, "checkpoint.keep": 0,
                                                 "checkpoint.async": "true"})
    assert train_main(overrides) == 2
    assert_full_disk_error(capsys.readouterr().err, ckpts)
    logged = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert logged == [1, 2, 3] or logged == [1, 2], logged  # reported before step 4 at the latest
