"""Sharded training checkpoints with ``torch.distributed.checkpoint`` (DCP): save, verify, resume, preempt.

Each rank writes only its own shards (``dcp.save``); the stored state is world-size independent:

- ``model`` and ``optimizer``: DCP state dicts from ``get_state_dict`` (DTensor shards are stored
  with their global shapes, so a checkpoint written at N ranks loads at any M);
- ``lr_scheduler``: ``LambdaLR.state_dict()`` (plain numbers; the schedule itself is rebuilt from the config);
- ``train.step``: the number of optimizer steps done. The data position is the step (the sampler is a
  pure function of the step), and training draws no random numbers (no dropout), so no per-rank RNG
  state exists; every item is the same on every rank (DCP keeps one copy of a replicated item);
- beside DCP's files, only where the objective keeps state between steps (online RL inside a generation
  cycle; nothing otherwise): ``rank-<r>.state.safetensors``, each rank's own (:mod:`~shardlm.checkpoint.
  rank_state`), in the manifest with the rest; such a checkpoint resumes only at the world size that wrote it.

A save goes to ``checkpoints/.tmp-step-<N>``; each rank computes the SHA-256 of the files it writes from the
bytes as it writes them (:class:`shardlm.checkpoint.fs_errors.RecordingFileSystemWriter`: no second read);
when every rank has written, the records are gathered, rank 0 writes ``manifest.json`` last and renames the
directory to ``step-<N>`` (see :mod:`shardlm.checkpoint.manifest`). With ``checkpoint.async`` the training
loop only waits for the state to be staged (copied to host memory); DCP's ``async_save`` writes it on a
thread, on a gloo process group of its own (:data:`CHECKPOINT_TIMEOUT`), and that thread then does the same
gathering, manifest and rename. At most one save is in flight; a failure is reported at the next step on every
rank (:meth:`Checkpointer.check_background`). Loading verifies the files against the manifest (split over
ranks), reads the metadata with an allow-list unpickler, checks every tensor's shape against the model, and
only then calls ``dcp.load``.

Runs never mix (:mod:`shardlm.checkpoint.run`): each manifest records the run id and the save's number
within the run; retention deletes only the current run's older saves, and ``--resume=auto`` tries the run
directory's run's checkpoints newest save first, passing over (and moving aside) one that fails
verification. At resume every changed setting is printed and either takes effect or is refused
(:mod:`shardlm.checkpoint.resume_config`). A save that cannot write names the real cause and path
(:mod:`shardlm.checkpoint.fs_errors`).

:class:`Checkpointer` (here) holds a run's checkpoint state and is built from three parts, one concern and
file each: :mod:`~shardlm.checkpoint.preemption` (the stop signals), :mod:`~shardlm.checkpoint.saving`
(synchronous and background saves, manifest, retention) and :mod:`~shardlm.checkpoint.resume` (which
checkpoint to resume, the checks before loading, the load); :mod:`~shardlm.checkpoint.state` is what a
checkpoint holds and its verification.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from shardlm.checkpoint.preemption import PREEMPTION_SIGNALS, Preemption
from shardlm.checkpoint.rank_state import RankState
from shardlm.checkpoint.resume import Resuming, resume_mode
from shardlm.checkpoint.resume_config import Change
from shardlm.checkpoint.saving import CHECKPOINT_TIMEOUT, InFlight, Saving
from shardlm.checkpoint.staging import HostStager
from shardlm.checkpoint.state import (
    check_shapes,
    flat_tensors,
    frozen_any,
    local_bytes,
    training_state,
    verify_checkpoint,
)
from shardlm.config import Config
from shardlm.errors import CheckpointError
from shardlm.parallel import DistInfo

__all__ = ["CHECKPOINT_TIMEOUT", "PREEMPTION_SIGNALS", "CheckpointError", "Checkpointer", "check_shapes",
           "flat_tensors", "frozen_any", "local_bytes", "resume_mode", "training_state", "verify_checkpoint"]


class Checkpointer(Preemption, Saving, Resuming):
    """Saves and loads the training state of one run under ``<run dir>/checkpoints/``; catches preemption.

    Every method that takes the model is a collective: all ranks call it in the same order.
    """

    def __init__(
        self,
        cfg: Config,
        info: DistInfo,
        run_dir: Path,
        tokenizer_path: Path | None = None,
        special_ids: dict[str, int | None] | None = None,
        data_meta: dict[str, Any] | None = None,
    ) -> None:
        self.cfg, self.info, self.run_dir = cfg, info, run_dir
        self.root = run_dir / "checkpoints"
        self.tokenizer_path = tokenizer_path
        self.special_ids = special_ids or {}
        self.data_meta = data_meta  # the prepared data's meta.json: recorded, and compared at resume
        self.changes: list[Change] = []  # settings that differ from the resumed checkpoint's
        self.resume = resume_mode(cfg)
        self.last_save: dict[str, Any] | None = None
        self.last_load: dict[str, Any] | None = None
        #: this rank's state besides DCP's in the resumed checkpoint (checkpoint/rank_state.py), set by load()
        self.rank_state: RankState | None = None
        # set by load(): a new id, or the resumed run's (see checkpoint/run.py)
        self.run_id: str | None = None
        self.skipped: list[dict[str, str]] = []  # damaged checkpoints that --resume=auto passed over
        self._save_seq = 0  # the highest save number of this run seen so far
        self._signal: int | None = None
        self._old_handlers: dict[int, Any] = {}
        self._base: dict[str, Any] | None = None
        # async: the save last started (step, blocked_s, path)
        self.last_started: dict[str, Any] | None = None
        self._group: Any = None  # async: the background save's gloo process group (created at the first save)
        self._in_flight: InFlight | None = None
        # async: the host copy's buffers, kept from one save to the next
        self._stager: HostStager | None = None

    def close(self) -> None:
        """Wait for a background save still in flight (raising its failure), then restore the signal handlers
        that were installed before.

        Raises:
            CheckpointError: the background save failed (see :meth:`wait`).
        """
        try:
            self.wait()
        finally:
            self.restore_signal_handlers()
