"""Sharded training checkpoints with ``torch.distributed.checkpoint`` (DCP): save, verify, resume, preempt.

Each rank writes only its own shards (``dcp.save``); the stored state is world-size independent:

- ``model`` and ``optimizer``: DCP state dicts from ``get_state_dict`` (DTensor shards are stored
  with their global shapes, so a checkpoint written at N ranks loads at any M);
- ``lr_scheduler``: ``LambdaLR.state_dict()`` (plain numbers; the schedule itself is rebuilt from the config);
- ``train.step``: the number of optimizer steps done. The data position is the step (the sampler is a
  pure function of the step), and training draws no random numbers (no dropout), so no per-rank RNG
  state exists; every item is the same on every rank (DCP keeps one copy of a replicated item).

A save goes to ``checkpoints/.tmp-step-<N>``; each rank computes the SHA-256 of the files it writes from
the bytes as it writes them (:class:`shardlm.checkpoint.fs_errors.RecordingFileSystemWriter`: no second
read); when every rank has written, the records are gathered, rank 0 writes ``manifest.json`` last and
renames the directory to ``step-<N>`` (see :mod:`shardlm.checkpoint.manifest`). With ``checkpoint.async``
the training loop only waits for the state to be staged (copied to host memory); DCP's ``async_save``
writes it on a thread, on a gloo process group of its own (:data:`CHECKPOINT_TIMEOUT`), and that thread then
does the same gathering, manifest and rename. At most one save is in flight; a failure is reported at the
next step on every rank (:meth:`Checkpointer.check_background`). Loading verifies the files against the manifest (split
over ranks), reads the metadata with an allow-list unpickler, checks every tensor's shape against
the model, and only then calls ``dcp.load``.

Runs never mix (:mod:`shardlm.checkpoint.run`): each manifest records the run id and the save's number
within the run; retention deletes only the current run's older saves, and ``--resume=auto`` tries the run
directory's run's checkpoints newest save first, passing over (and moving aside) one that fails
verification. At resume every changed setting is printed and either takes effect or is refused
(:mod:`shardlm.checkpoint.resume_config`). A save that cannot write names the real cause and path
(:mod:`shardlm.checkpoint.fs_errors`).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

from shardlm.checkpoint.fs_errors import (
    RecordingFileSystemWriter,
    copy_file_hashed,
    describe,
    probe_free_space,
    with_path,
)
from shardlm.checkpoint.manifest import (
    TMP_PREFIX,
    check_files,
    file_record,
    fsync_dir,
    read_manifest,
    sha256_file,
    write_manifest,
)
from shardlm.checkpoint.resume_config import REFUSED, Change, config_changes, data_problems
from shardlm.checkpoint.run import new_run_id, remove_directory, run_checkpoints, run_dir_run_id
from shardlm.checkpoint.safe_load import SafeFileSystemReader, SafeLoadPlanner, read_metadata
from shardlm.checkpoint.staging import HostStager
from shardlm.config import Config
from shardlm.data.tokenizer_files import TOKENIZER_FILES
from shardlm.errors import CheckpointError, ConfigError, RankFailed, UnsafeCheckpointError
from shardlm.parallel import DistInfo, run_on_main

#: signals on which the ranks finish the current step, save a checkpoint and exit with
#: :data:`shardlm.errors.STOPPED_EXIT_CODE`: SIGINT is Ctrl-C (torchrun forwards it to the ranks), Slurm sends
#: SIGTERM or SIGUSR1 before killing a job. A second such signal after a SIGINT (Ctrl-C twice; torchrun sends SIGTERM
#: on the second), or a SIGINT after any of them, stops the process at once: see :meth:`Checkpointer._on_signal`
PREEMPTION_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)
#: timeout of the background save's process group (``checkpoint.async``): a long write never trips it, unlike the
#: training one (``parallel.timeout_s``)
CHECKPOINT_TIMEOUT = timedelta(hours=4)


def resume_mode(cfg: Config) -> str:
    """``checkpoint.resume``, or ``auto`` when it is empty and torchrun restarted the job.

    torchrun sets ``TORCHELASTIC_RESTART_COUNT`` (> 0 after a restart, https://pytorch.org/docs/stable/elastic/run.html).
    """
    if cfg.checkpoint.resume:
        return cfg.checkpoint.resume
    return "auto" if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0) > 0 else ""


def frozen_any(model: nn.Module) -> bool:
    """Whether some parameter of ``model`` is frozen (LoRA, ``train.trainable``): checkpoints then hold only the
    trainable parameters and refer to the base for the rest."""
    return any(not p.requires_grad for p in model.parameters())


def training_state(model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any, step: int) -> dict[str, Any]:
    """The nested state dict that DCP saves and loads in place (see the module docstring).

    When parameters are frozen, ``model`` holds the trainable ones only (the adapters under LoRA): the frozen
    ones equal the base (``model.init_from`` or the seeded initialisation), which the manifest names.
    """
    model_sd, optim_sd = get_state_dict(model, optimizer)
    if frozen_any(model):
        trainable = {name for name, p in model.named_parameters() if p.requires_grad}
        model_sd = {k: v for k, v in model_sd.items() if k in trainable}
    return {"model": model_sd, "optimizer": optim_sd, "lr_scheduler": scheduler.state_dict(),
            "train": {"step": torch.tensor(step, dtype=torch.int64)}}


def flat_tensors(state: dict[str, Any], prefix: str = "") -> dict[str, torch.Tensor]:
    """Tensors of a nested state dict under DCP's flattened keys (``model.lm_head.weight``, ``optimizer.state...``)."""
    out: dict[str, torch.Tensor] = {}
    items = state.items() if isinstance(state, dict) else enumerate(state)
    for key, value in items:
        name = f"{prefix}{key}"
        if isinstance(value, torch.Tensor):
            out[name] = value
        elif isinstance(value, (dict, list, tuple)):
            out.update(flat_tensors(value, name + "."))
    return out


def local_bytes(state: dict[str, Any]) -> int:
    """Bytes of this rank's part of a state dict's tensors (DTensors: the local shard)."""
    total = 0
    for t in flat_tensors(state).values():
        local = t.to_local() if hasattr(t, "to_local") else t
        total += local.numel() * local.element_size()
    return total


def check_shapes(path: Path, metadata: Metadata, state: dict[str, Any]) -> None:
    """Compare every tensor of ``state`` (global shapes for DTensors) with the checkpoint's metadata.

    Raises:
        CheckpointError: naming the first tensor missing from the checkpoint or of another shape (both
            shapes), or the first model tensor in the checkpoint that this model lacks.
    """
    stored = metadata.state_dict_metadata
    ours = flat_tensors(state)
    for name, tensor in ours.items():
        entry = stored.get(name)
        if not isinstance(entry, TensorStorageMetadata):
            raise CheckpointError(f"checkpoint {path} has no tensor {name}: it was written for another model")
        if tuple(entry.size) != tuple(tensor.shape):
            raise CheckpointError(
                f"checkpoint {path} does not fit this model: tensor {name} has shape {tuple(entry.size)} in the "
                f"checkpoint but {tuple(tensor.shape)} in the model")
    for name, entry in stored.items():
        if name.startswith("model.") and isinstance(entry, TensorStorageMetadata) and name not in ours:
            raise CheckpointError(f"checkpoint {path} has tensor {name} {tuple(entry.size)}, which this model lacks")


def verify_checkpoint(path: Path, rank: int = 0, world_size: int = 1) -> tuple[dict[str, Any], Metadata]:
    """Check a checkpoint against its manifest and read its metadata safely; return both.

    Files are split over ranks (rank r hashes files r, r + N, ...); with a process group of more than
    one rank the problems are all-gathered, so every rank raises the same error (no rank hangs).

    Raises:
        CheckpointError: not a checkpoint, a file missing, truncated or corrupted, or metadata that
            would build objects outside the allow-list (refused without running them).
    """
    manifest = read_manifest(path)
    names = sorted(manifest["files"])
    problems = check_files(path, manifest, names[rank::world_size])
    if world_size > 1:
        gathered: list[list[str]] = [[] for _ in range(world_size)]
        dist.all_gather_object(gathered, problems)
        problems = [p for ps in gathered for p in ps]
    if problems:
        raise CheckpointError(f"checkpoint {path} is damaged: " + "; ".join(problems))
    try:
        metadata = read_metadata(path / ".metadata")
    except (UnsafeCheckpointError, OSError) as e:
        raise CheckpointError(f"checkpoint {path}: {e}") from None
    return manifest, metadata


@dataclass
class _SaveJob:
    """One save under way: where it writes, its writer (errors, checksums), what the manifest needs."""

    step: int
    final: Path
    tmp: Path
    writer: RecordingFileSystemWriter
    base: dict[str, Any] | None
    tokenizer_records: dict[str, dict[str, Any]]
    needed_bytes: int  # this rank's state bytes: a file system with less free space counts as full
    start: float  # time.perf_counter() when the save began
    blocked_s: float | None = None  # async: seconds the training loop was held (staging)


@dataclass
class _InFlight:
    """The background save in flight and what its thread and the training thread share (under ``cond``).

    ``step``: the step the training loop last began; ``contributed``: the step this rank reported to the ranks'
    agreement (set once the write is done); ``outcome``: (the step to report at, the error message or None).
    """

    job: _SaveJob
    thread: threading.Thread | None = None
    cond: threading.Condition = field(default_factory=threading.Condition)
    step: int = 0
    contributed: int | None = None
    outcome: tuple[int, str | None] | None = None


class Checkpointer:
    """Saves and loads the training state of one run under ``<run dir>/checkpoints/``; catches preemption.

    Every method that takes the model is a collective: all ranks call it in the same order.
    """

    def __init__(self, cfg: Config, info: DistInfo, run_dir: Path, tokenizer_path: Path | None = None,
                 special_ids: dict[str, int | None] | None = None, data_meta: dict[str, Any] | None = None) -> None:
        self.cfg, self.info, self.run_dir = cfg, info, run_dir
        self.root = run_dir / "checkpoints"
        self.tokenizer_path = tokenizer_path
        self.special_ids = special_ids or {}
        self.data_meta = data_meta  # the prepared data's meta.json: recorded, and compared at resume
        self.changes: list[Change] = []  # settings that differ from the resumed checkpoint's
        self.resume = resume_mode(cfg)
        self.last_save: dict[str, Any] | None = None
        self.last_load: dict[str, Any] | None = None
        self.run_id: str | None = None  # set by load(): a new id, or the resumed run's (see checkpoint/run.py)
        self.skipped: list[dict[str, str]] = []  # damaged checkpoints that --resume=auto passed over
        self._save_seq = 0  # the highest save number of this run seen so far
        self._signal: int | None = None
        self._old_handlers: dict[int, Any] = {}
        self._base: dict[str, Any] | None = None
        self.last_started: dict[str, Any] | None = None  # async: the save last started (step, blocked_s, path)
        self._group: Any = None  # async: the background save's gloo process group (created at the first save)
        self._in_flight: _InFlight | None = None
        self._stager: HostStager | None = None  # async: the host copy's buffers, kept from one save to the next

    # ---- preemption ---------------------------------------------------------------------
    def install_signal_handlers(self) -> None:
        """Catch SIGINT/SIGTERM/SIGUSR1 (from here to :meth:`close`): record it, so the loop saves and stops."""
        if not self.cfg.checkpoint.enabled:
            return
        for sig in PREEMPTION_SIGNALS:
            try:
                self._old_handlers[sig] = signal.signal(sig, self._on_signal)
            except ValueError:  # not the main thread: leave the signal alone
                pass

    def _on_signal(self, signum: int, frame: Any) -> None:
        """Record the first stop signal; from then on the next one that should stop at once does, with no handler.

        After a SIGINT (Ctrl-C) every stop signal gets its default action (the process ends at once, even inside a
        collective: the default action needs no Python code to run); after SIGTERM/SIGUSR1 only SIGINT does, so a
        preemption signal sent twice (to torchrun and to the ranks) still saves. Rank 0 says what happens next.
        """
        first = self._signal is None
        self._signal = self._signal or signum
        for sig in PREEMPTION_SIGNALS if self._signal == signal.SIGINT else (signal.SIGINT,):
            signal.signal(sig, signal.SIG_DFL)
        if first and self.info.is_main:  # os.write: print() could re-enter a stream the main thread is writing
            name = "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name
            os.write(2, f"\n{name}: finishing this step, then saving a checkpoint and stopping "
                        "(Ctrl-C again stops at once, without saving)\n".encode())

    def signal_received(self) -> bool:
        """Whether this rank received SIGINT/SIGTERM/SIGUSR1 (host state only: no collective). The trainer sums the
        flag over ranks inside the step's one all-reduce, so every rank stops after the same step."""
        return self.cfg.checkpoint.enabled and self._signal is not None

    def close(self) -> None:
        """Wait for a background save still in flight (raising its failure), then restore the signal handlers that
        were installed before.

        Raises:
            CheckpointError: the background save failed (see :meth:`wait`).
        """
        try:
            self.wait()
        finally:
            for sig, handler in self._old_handlers.items():
                signal.signal(sig, handler)
            self._old_handlers = {}

    # ---- save -------------------------------------------------------------------------
    def should_save(self, step: int, last: bool) -> bool:
        """Whether to save after ``step``: every ``checkpoint.interval`` steps and at the last step."""
        interval = self.cfg.checkpoint.interval
        return self.cfg.checkpoint.enabled and (last or (interval > 0 and step % interval == 0))

    def save(self, model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any, step: int) -> Path:
        """Write ``checkpoints/step-<step>`` atomically (see the module docstring); return its path.

        With ``checkpoint.async`` the state is staged (copied to host memory) and this returns while a background
        thread writes it; the directory becomes ``step-<step>`` when that write and the manifest are done. A save
        still in flight is waited for first (at most one at a time).

        Raises:
            CheckpointError: on every rank, when a file cannot be written (a full disk, a quota, a read-only
                file system, no permission): one line naming the cause and the path, e.g. ``saving checkpoint
                .../step-4 failed: No space left on device: .../.tmp-step-4/__1_0.distcp (rank 1); the newest
                complete checkpoint is still .../step-2``. The unfinished ``.tmp-`` directory is removed. Also
                raised for the previous background save, when it failed.
        """
        self.wait()  # at most one save in flight
        tmp, final = self.root / f"{TMP_PREFIX}step-{step}", self.root / f"step-{step}"
        start = time.perf_counter()

        def prepare() -> dict[str, dict[str, Any]]:
            self.root.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir()
            records = {}
            if self.tokenizer_path is not None and self.tokenizer_path.is_file():
                for name in TOKENIZER_FILES:  # the tokenizer and its config (special tokens, chat template)
                    if (self.tokenizer_path.parent / name).is_file():
                        records[name] = copy_file_hashed(self.tokenizer_path.parent / name, tmp / name)
            return records

        tokenizer_records = self._on_main(prepare, final, tmp) or {}
        base = self.base_reference() if frozen_any(model) else None
        state = training_state(model, optimizer, scheduler, step)
        # remembers the OSError that torch.save's zip writer hides, and hashes each file as it is written
        writer = RecordingFileSystemWriter(tmp)
        job = _SaveJob(step, final, tmp, writer, base, tokenizer_records, local_bytes(state), start)
        if not self.cfg.checkpoint.async_:
            try:
                dcp.save(state, storage_writer=writer)  # each rank its shards; rank 0 .metadata
            except CheckpointException as e:  # derives from BaseException; raised on every rank
                self._dcp_save_failed(job, e)
            self._complete(job, self._gather({**writer.records, **tokenizer_records}, None), None)
            return final
        if self._group is None:  # a collective: every rank saves at the same step
            self._group = dist.new_group(backend="gloo", timeout=CHECKPOINT_TIMEOUT)
        if self._stager is None:
            self._stager = HostStager()
        # stage: a host copy of this rank's state, into buffers reused from save to save (checkpoint/staging.py);
        # the write runs on a DCP thread, on the checkpoint's own process group
        future = dcp.async_save(state, storage_writer=writer, process_group=self._group,
                                async_checkpointer_type=AsyncCheckpointerType.THREAD, async_stager=self._stager)
        del state
        job.blocked_s = time.perf_counter() - start
        flight = _InFlight(job)
        flight.thread = threading.Thread(target=self._finish_in_background, args=(flight, future),
                                         name=f"shardlm-checkpoint-{step}", daemon=True)
        self._in_flight = flight
        flight.thread.start()
        self.last_started = {"step": step, "blocked_s": job.blocked_s, "path": str(final)}
        return final

    def save_line(self, path: Path) -> str:
        """What the trainer prints after :meth:`save` returned ``path``."""
        if self.cfg.checkpoint.async_:
            return (f"checkpoint {path}: writing in the background (training blocked "
                    f"{self.last_started['blocked_s']:.2f} s)")
        return f"checkpoint {path} ({self.last_save['seconds']:.2f} s)"

    # ---- the background save ----------------------------------------------------------
    def check_background(self, step: int) -> None:
        """Called by the training loop before each step (no collective): report a failed background save.

        Every rank raises at the same step: when the write is done, the ranks' background threads agree on the
        outcome and on the step to report it at (one past the latest step any rank had begun; a rank that has
        begun a later step waits here for that agreement, which is short).

        Raises:
            CheckpointError: the background save failed (cause and path; see :meth:`save`).
        """
        flight = self._in_flight
        if flight is None:
            return
        with flight.cond:
            flight.step = step
            if flight.contributed is not None and step > flight.contributed:
                while flight.outcome is None:
                    flight.cond.wait()
            outcome = flight.outcome
        if outcome is not None and step >= outcome[0]:
            self.wait()

    def wait(self) -> None:
        """Wait for the background save in flight, if any (every rank calls it at the same point).

        Raises:
            CheckpointError: it failed (cause and path; the previous checkpoint stays the newest complete one).
        """
        flight, self._in_flight = self._in_flight, None
        if flight is None:
            return
        if flight.thread is not None:
            flight.thread.join()
        message = flight.outcome[1] if flight.outcome is not None else "the background save thread died"
        if message is not None:
            raise CheckpointError(message)

    def _finish_in_background(self, flight: _InFlight, future: Any) -> None:
        """The background thread of an async save: wait for DCP's write, agree with the other ranks on the outcome
        (on the checkpoint's process group), then rank 0 writes the manifest and renames the directory."""
        job = flight.job
        message: str | None = None
        cause: str | None = None  # this rank's real cause (a recorded OSError, a full file system)
        failed: str | None = None  # DCP's own message, on one line
        try:
            future.result()
        except BaseException as e:  # noqa: BLE001 - CheckpointException derives from BaseException
            failed = " ".join(str(e).split()) or type(e).__name__
            local = job.writer.errors[0] if job.writer.errors else probe_free_space(job.tmp.parent, job.needed_bytes)
            cause = describe(local) if local is not None else None
        try:
            with flight.cond:
                flight.contributed = flight.step
            mine = {"step": flight.contributed, "failed": failed, "cause": cause,
                    "files": {**job.writer.records, **job.tokenizer_records}}
            shares = [mine]
            if self.info.world_size > 1:
                shares = [None] * self.info.world_size
                dist.all_gather_object(shares, mine, group=self._group)
            report_at = 1 + max(s["step"] for s in shares)
            dcp_errors = [s["failed"] for s in shares if s["failed"]]
            if dcp_errors:
                message = self._failure(job.final, self._first_cause([s["cause"] for s in shares], dcp_errors[0]))
                if self.info.is_main:
                    shutil.rmtree(job.tmp, ignore_errors=True)
            else:
                files = {k: v for s in shares for k, v in s["files"].items()}
                try:
                    self._complete(job, files, self._group)
                except (CheckpointError, RankFailed) as e:
                    message = str(e)
        except BaseException as e:  # noqa: BLE001 - reported by the training thread
            report_at, message = flight.step + 1, f"saving checkpoint {job.final} failed: {type(e).__name__}: {e}"
        with flight.cond:
            flight.outcome = (report_at, message)
            flight.cond.notify_all()

    # ---- shared by both kinds of save ------------------------------------------------------
    def _gather(self, mine: dict[str, dict[str, Any]], group: Any) -> dict[str, dict[str, Any]]:
        """Every rank's file records, merged (an all-gather on ``group``)."""
        shares: list[dict[str, Any]] = [mine]
        if self.info.world_size > 1:
            shares = [{} for _ in range(self.info.world_size)]
            dist.all_gather_object(shares, mine, group=group)
        return {k: v for share in shares for k, v in share.items()}

    def _complete(self, job: _SaveJob, files: dict[str, dict[str, Any]], group: Any) -> None:
        """Rank 0 writes the manifest (the checksums computed while writing), renames ``.tmp-step-<N>`` to
        ``step-<N>`` and applies retention; then ``last_save`` is set on every rank."""

        def finish() -> None:
            for name in sorted(os.listdir(job.tmp)):  # a file not written through the hashing writer: read it
                if name not in files:
                    files[name] = file_record(job.tmp / name)
            seq = 1 + max([self._save_seq, *(e.save_seq for e in run_checkpoints(self.root, self.run_id))])
            write_manifest(job.tmp, {
                "step": job.step, "world_size": self.info.world_size, "time_unix": time.time(),
                "run_id": self.run_id, "save_seq": seq, "special_ids": self.special_ids,
                "config": self.cfg.to_dict(), "data": self.data_meta, "base": job.base,
            }, files)
            if job.final.exists():  # the same step saved again (e.g. a run resumed from an earlier step): replace it
                remove_directory(job.final)
            os.replace(job.tmp, job.final)
            fsync_dir(self.root)
            self._save_seq = seq
            self._prune(job.final)

        self._on_main(finish, job.final, job.tmp, group)
        self.last_save = {"step": job.step, "seconds": time.perf_counter() - job.start,
                          "blocked_s": job.blocked_s if job.blocked_s is not None else time.perf_counter() - job.start,
                          "bytes": sum(f["bytes"] for f in files.values()), "path": str(job.final)}

    def _failure(self, final: Path, cause: str) -> str:
        """The one-line message of a failed save: cause, path, and the checkpoint ``--resume=auto`` would pick."""
        newest = run_checkpoints(self.root, self.run_id)
        still = (f"the newest complete checkpoint is still {newest[0].path}" if newest
                 else "no complete checkpoint of this run exists yet")
        return f"saving checkpoint {final} failed: {cause}; {still}"

    def _on_main(self, fn: Callable[[], Any], final: Path, tmp: Path, group: Any = None) -> Any:
        """:func:`run_on_main` for a save's rank-0 file work: an ``OSError`` becomes a :class:`CheckpointError`
        naming its cause and path, and the unfinished ``tmp`` directory is removed."""

        def guarded() -> Any:
            try:
                return fn()
            except OSError as e:
                shutil.rmtree(tmp, ignore_errors=True)
                cause = describe(e if e.filename else with_path(e, tmp))
                raise CheckpointError(self._failure(final, cause)) from None

        return run_on_main(guarded, self.info, group)

    def _first_cause(self, causes: list[str | None], fallback: str) -> str:
        """The first rank's cause (naming the rank when there are several), else ``fallback``."""
        found = [(rank, c) for rank, c in enumerate(causes) if c is not None]
        if not found:
            return fallback
        rank, cause = found[0]
        return cause + (f" (rank {rank})" if self.info.world_size > 1 else "")

    def _dcp_save_failed(self, job: _SaveJob, error: CheckpointException) -> None:
        """After ``dcp.save`` failed on some rank (every rank is here): raise one :class:`CheckpointError`
        naming the first rank's real cause (its recorded ``OSError``, else a full file system found by
        :func:`probe_free_space`, else DCP's own message) on every rank, and remove ``tmp`` (rank 0)."""
        local = job.writer.errors[0] if job.writer.errors else probe_free_space(job.tmp.parent, job.needed_bytes)
        causes: list[str | None] = [describe(local) if local is not None else None]
        if self.info.world_size > 1:
            causes = [None] * self.info.world_size
            dist.all_gather_object(causes, describe(local) if local is not None else None)
        cause = self._first_cause(causes, " ".join(str(error).split()))  # else DCP's message, on one line
        if self.info.is_main:
            shutil.rmtree(job.tmp, ignore_errors=True)
        raise CheckpointError(self._failure(job.final, cause)) from None

    def _prune(self, just_written: Path) -> None:
        """Delete unfinished saves, then this run's checkpoints beyond the newest ``checkpoint.keep`` (rank 0).

        Only checkpoints of this run (``run_id``) are candidates, ordered by save (see checkpoint/run.py):
        another run's checkpoints are never deleted, and neither is ``just_written`` (the newest complete
        one) whatever ``keep`` says. Each is renamed to a temporary name before it is deleted, so a kill
        here never leaves a half-deleted checkpoint that looks complete.
        """
        for p in self.root.iterdir():
            if p.name.startswith(TMP_PREFIX):
                shutil.rmtree(p, ignore_errors=True)
        keep = self.cfg.checkpoint.keep
        if keep > 0:
            for entry in run_checkpoints(self.root, self.run_id)[keep:]:
                if entry.path != just_written:
                    remove_directory(entry.path)

    # ---- the base of a checkpoint of trainable parameters only ------------------------------
    def base_reference(self) -> dict[str, Any]:
        """What the frozen parameters are: ``{"init_from", "weights_sha256"}`` for a pretrained base (SHA-256 over
        its safetensors files, computed once), else ``{"seed", "model"}`` (the seeded initialisation's shape), plus
        the LoRA settings (which fix the adapters' shapes and how the base is stored)."""
        if self._base is None:
            cfg = self.cfg
            if cfg.model.init_from:
                files = sorted(Path(cfg.model.init_from).glob("*.safetensors"))
                base: dict[str, Any] = {"init_from": cfg.model.init_from,
                                        "weights_sha256": [sha256_file(f) for f in files]}
            else:
                base = {"seed": cfg.train.seed, "model": cfg.to_dict()["model"]}
            lora = cfg.to_dict()["lora"]
            lora.pop("merge_into", None)  # only what the export merges into: no part of the base
            base["lora"] = lora if cfg.lora.enabled else None
            base["trainable"], base["frozen"] = cfg.train.trainable, cfg.train.frozen
            self._base = base
        return self._base

    def trainable_changed(self) -> None:
        """Forget the cached :meth:`base_reference`: ``train.trainable`` / ``train.frozen`` changed during the run
        (``Trainer.set_trainable``), so the next save records the new ones; the run id, save numbering, data
        identity and special ids stay the run's."""
        self._base = None

    def check_base(self, path: Path, stored: dict[str, Any] | None) -> None:
        """Refuse to resume a checkpoint of trainable parameters onto another base (every rank raises).

        Raises:
            CheckpointError: the checkpoint holds all parameters but this run freezes some (or the reverse), or its
                base (pretrained weights, seed and shape, LoRA or freezing settings) differs from this run's.
        """
        if stored is None:
            raise CheckpointError(f"checkpoint {path} holds every parameter, but this run freezes some (LoRA or "
                                  "train.trainable): start from its exported model with model.init_from instead")
        ours = self.base_reference()
        for key in sorted(set(stored) | set(ours)):
            if stored.get(key) != ours.get(key):
                what = {"weights_sha256": "the base model's weights", "init_from": "the base model directory",
                        "seed": "train.seed (the base's initialisation)", "model": "the base model's shape",
                        "lora": "the [lora] settings", "trainable": "train.trainable", "frozen": "train.frozen"}
                raise CheckpointError(
                    f"checkpoint {path} holds adapters / trainable parameters for another base: "
                    f"{what.get(key, key)} differs (checkpoint: {str(stored.get(key))[:120]}; this run: "
                    f"{str(ours.get(key))[:120]})")

    # ---- load ---------------------------------------------------------------------------
    def _resume_plan(self) -> tuple[str, list[str]]:
        """(run id, checkpoints to try, best first) for this job; rank 0 reads the disk.

        Fresh start: a new run id, nothing to try. ``auto``: the run directory's run
        (:func:`shardlm.checkpoint.run.run_dir_run_id`) and its complete checkpoints, newest save first
        (a new id when there is none at all). A path: that checkpoint and its run id.
        """
        if not self.resume:
            return new_run_id(), []
        if self.resume == "auto":
            run_id = run_dir_run_id(self.run_dir)
            return run_id or new_run_id(), [str(e.path) for e in run_checkpoints(self.root, run_id)]
        try:
            run_id = read_manifest(self.resume).get("run_id")
        except CheckpointError:  # verify_checkpoint below reports it on every rank
            run_id = None
        return run_id or new_run_id(), [self.resume]

    def _skip_damaged(self, path: Path, error: CheckpointError) -> None:
        """``--resume=auto`` passes over a damaged checkpoint: say so and move it aside (rank 0) for inspection.

        It becomes ``step-<N>.damaged`` (``.damaged-2``... if taken): never picked again, never pruned.
        """
        self.skipped.append({"path": str(path), "reason": str(error)})
        if not self.info.is_main:
            return
        target, n = path.with_name(path.name + ".damaged"), 1
        while target.exists():
            n += 1
            target = path.with_name(f"{path.name}.damaged-{n}")
        os.replace(path, target)
        print(f"warning: skipping damaged checkpoint {path}: {error}; resuming from an earlier one. "
              f"The damaged one is kept for inspection as {target}", file=sys.stderr, flush=True)

    def _compare_config(self, path: Path, manifest: dict[str, Any], metadata: Metadata, state: dict[str, Any]) -> None:
        """Print every setting that differs from the checkpoint's (rank 0); refuse the ones that cannot change.

        See :mod:`shardlm.checkpoint.resume_config` for the rule of each field.

        Raises:
            CheckpointError: a tensor does not fit the model (:func:`check_shapes`), naming the refused fields.
            ConfigError: a refused field changed, or the prepared data differs; names each field and why.
        """
        self.changes = config_changes(manifest.get("config") or {}, self.cfg.to_dict())
        if self.changes and self.info.is_main:
            many = len(self.changes) > 1
            print(f"resume from {path}: {len(self.changes)} setting{'s' if many else ''} "
                  f"differ{'' if many else 's'} from the checkpoint's (old -> new):\n"
                  + "\n".join("  " + c.line() for c in self.changes), flush=True)
        refused = [f"{c.key} changed {json.dumps(c.old)} -> {json.dumps(c.new)} ({c.why})"
                   for c in self.changes if c.rule == REFUSED]
        try:
            check_shapes(path, metadata, state)
        except CheckpointError as e:
            raise CheckpointError("; ".join([str(e), *refused])) from None
        tokenizer = None
        if self.tokenizer_path is not None and self.tokenizer_path.is_file():
            tokenizer = sha256_file(self.tokenizer_path)
        refused += data_problems(manifest, self.data_meta, tokenizer)
        if refused:
            raise ConfigError(f"cannot resume from {path}: " + "; ".join(refused)
                              + ". Resume with the checkpoint's values, or start a new run")

    def load(self, model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any) -> int:
        """Resume as configured: load model, optimizer, LR scheduler; return the step (0 when starting fresh).

        Sets ``self.run_id``: a new id on a fresh start, the resumed checkpoint's run otherwise. ``auto``
        tries the run directory's run's checkpoints newest save first; one that fails verification is
        skipped with a warning and moved aside (:meth:`_skip_damaged`). The trainer then rewinds its metrics
        sinks to the returned step (:meth:`shardlm.metrics.logger.MetricsLogger.rewind`).

        Raises:
            CheckpointError: see :func:`verify_checkpoint` and :func:`check_shapes`; every rank raises it.
        """
        plan = [run_on_main(self._resume_plan, self.info)]
        if self.info.world_size > 1:
            dist.broadcast_object_list(plan, src=0)
        self.run_id, candidates = plan[0]
        path, manifest, metadata, step = None, None, None, 0
        start = time.perf_counter()
        for candidate in map(Path, candidates):
            try:
                manifest, metadata = verify_checkpoint(candidate, self.info.rank, self.info.world_size)
            except CheckpointError as e:
                if self.resume != "auto":  # an explicit --resume=PATH fails as it is
                    raise
                self._skip_damaged(candidate, e)
                continue
            path = candidate
            break
        if candidates and path is None:
            raise CheckpointError(f"--resume=auto: no intact checkpoint of run {self.run_id} in {self.root}: "
                                  + "; ".join(s["reason"] for s in self.skipped))
        if manifest is not None:
            self._save_seq = int(manifest.get("save_seq", 0) or 0)
        if path is not None:
            partial = frozen_any(model)
            if partial or manifest.get("base") is not None:  # trainable parameters only: the same base?
                self.check_base(path, manifest.get("base"))
            state = training_state(model, optimizer, scheduler, 0)
            self._compare_config(path, manifest, metadata, state)
            try:
                dcp.load(state, storage_reader=SafeFileSystemReader(path), planner=SafeLoadPlanner())
            except CheckpointException as e:  # derives from BaseException
                raise CheckpointError(f"loading checkpoint {path} failed: {e}") from None
            set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"],
                           options=StateDictOptions(strict=not partial))
            scheduler.load_state_dict(state["lr_scheduler"])
            step = int(state["train"]["step"].item())
            self.last_load = {"step": step, "seconds": time.perf_counter() - start, "path": str(path)}
        if path is not None and self.info.is_main:
            print(f"resumed run {self.run_id} from {path} at step {step} ({self.last_load['seconds']:.2f} s)",
                  flush=True)
        return step


__all__ = ["Checkpointer", "CheckpointError", "check_shapes", "resume_mode", "training_state",
           "verify_checkpoint"]
