"""A checkpoint's per-rank state (shardlm/checkpoint/rank_state.py), without a run: the safetensors file
round-trips tensors of every kind the RL buffer holds with its manifest record equal to the file's bytes;
a checkpoint without such files reads as None; one written at another world size is refused naming both,
the state and what to do; a file of another rank is refused; a write that fails names the file, and the
save turns it into one CheckpointError and removes the unfinished directory."""

from __future__ import annotations

import hashlib

import pytest
import torch

from shardlm.checkpoint.dcp import Checkpointer
from shardlm.checkpoint.rank_state import rank_state_file, read_rank_state, write_rank_state
from shardlm.config import load_config
from shardlm.errors import CheckpointError, ConfigError
from shardlm.parallel import DistInfo

HEADER = {"what": "the buffer of the generation cycle of steps 5 .. 8", "advice": "from a cycle's start"}


def state() -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    base = torch.arange(12, dtype=torch.float32).reshape(3, 4) / 7
    metrics = torch.tensor([0.1, float("nan")], dtype=torch.float64)
    return {"logps": base, "row": base[1], "mask": base > 0.5, "ids": torch.arange(5), "metrics": metrics,
            "empty": torch.zeros(0)}, HEADER


def test_round_trip_and_refusals(tmp_path):
    manifest = {"step": 6, "world_size": 2, "files": {}}
    assert read_rank_state(tmp_path, manifest, 0, 2) is None  # nothing saved: any world size resumes
    for rank in (0, 1):
        manifest["files"].update(write_rank_state(tmp_path, rank, 2, 6, state()))
    record = manifest["files"][rank_state_file(1)]
    data = (tmp_path / rank_state_file(1)).read_bytes()
    assert record == {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    tensors, header = read_rank_state(tmp_path, manifest, 1, 2)
    want = state()[0]
    assert tensors.keys() == want.keys()
    for name, tensor in want.items():  # dtypes, shapes and bits (NaN included)
        assert tensors[name].dtype == tensor.dtype and tensors[name].shape == tensor.shape, name
        assert torch.equal(tensors[name].view(-1).view(torch.uint8), tensor.reshape(-1).view(torch.uint8))
    assert header == {**HEADER, "rank": "1", "world_size": "2", "step": "6"}
    refused = (r"cannot resume from .* at 4 rank\(s\): it was saved after step 6 at 2 rank\(s\) with "
               r"per-rank state \(the buffer of the generation cycle of steps 5 \.\. 8\), which only that "
               r"layout can read: resume with 2 rank\(s\) \(the same layout\), or from a cycle's start")
    with pytest.raises(ConfigError, match=refused):
        read_rank_state(tmp_path, manifest, 3, 4)
    (tmp_path / rank_state_file(0)).replace(tmp_path / rank_state_file(1))  # rank 0's under rank 1's name
    with pytest.raises(CheckpointError, match="its header names rank 0, world size 2, step 6; the checkpoint "
                                              "is rank 1 of 2 after step 6"):
        read_rank_state(tmp_path, manifest, 1, 2)


def test_a_failed_write_is_one_checkpoint_error(tmp_path):
    missing = tmp_path / "gone"
    with pytest.raises(OSError, match="No such file or directory") as err:
        write_rank_state(missing, 0, 1, 3, state())
    assert err.value.filename == str(missing / rank_state_file(0))
    cfg = load_config(None, [f"--run.dir={tmp_path / 'run'}"])
    saving = Checkpointer(cfg, DistInfo(0, 0, 1, torch.device("cpu"), "gloo"), tmp_path / "run")
    tmp = tmp_path / "run" / "checkpoints" / ".tmp-step-3"
    failed = (r"saving checkpoint .*step-3 failed: No such file or directory: .*\.tmp-step-3/"
              r"rank-0\.state\.safetensors; no complete checkpoint of this run exists yet")
    with pytest.raises(CheckpointError, match=failed):
        saving._write_rank_state(tmp, tmp.with_name("step-3"), 3, state())
    assert not tmp.exists()
