"""Saving a checkpoint: synchronously or in the background (``checkpoint.async``), the ranks' file records
gathered into the manifest, the rename to ``step-<N>``, failures named with their cause and path, retention
(:class:`Saving`, a part of :class:`shardlm.checkpoint.dcp.Checkpointer`; see that module's docstring)."""

from __future__ import annotations

import os
import shutil
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
    file_record,
    fsync_dir,
    write_manifest,
)
from shardlm.checkpoint.rank_state import RankState, write_rank_state
from shardlm.checkpoint.run import remove_directory, run_checkpoints
from shardlm.checkpoint.staging import HostStager
from shardlm.checkpoint.state import frozen_any, local_bytes, training_state
from shardlm.data.tokenizer_files import TOKENIZER_FILES
from shardlm.errors import CheckpointError, RankFailed
from shardlm.parallel import run_on_main

#: timeout of the background save's process group (``checkpoint.async``): a long write never trips it, unlike
#: the training one (``parallel.timeout_s``)
CHECKPOINT_TIMEOUT = timedelta(hours=4)


@dataclass
class _SaveJob:
    """One save under way: where it writes, its writer (errors, checksums), what the manifest needs."""

    step: int
    final: Path
    tmp: Path
    writer: RecordingFileSystemWriter
    base: dict[str, Any] | None
    own_records: dict[str, dict[str, Any]]  # files written besides DCP's: the tokenizer's, this rank's state
    needed_bytes: int  # this rank's state bytes: a file system with less free space counts as full
    start: float  # time.perf_counter() when the save began
    blocked_s: float | None = None  # async: seconds the training loop was held (staging)


@dataclass
class InFlight:
    """The background save in flight and what its thread and the training thread share (under ``cond``).

    ``step``: the step the training loop last began; ``contributed``: the step this rank reported to the
    ranks' agreement (set once the write is done); ``outcome``: (the step to report at, the error message
    or None).
    """

    job: _SaveJob
    thread: threading.Thread | None = None
    cond: threading.Condition = field(default_factory=threading.Condition)
    step: int = 0
    contributed: int | None = None
    outcome: tuple[int, str | None] | None = None


class Saving:
    """The saving half of a :class:`~shardlm.checkpoint.dcp.Checkpointer`, whose ``__init__`` sets the state
    it uses (the run's ``cfg``, ``info``, ``root``, run id and save numbering, the background save's group
    and stager)."""

    def should_save(self, step: int, last: bool) -> bool:
        """Whether to save after ``step``: every ``checkpoint.interval`` steps and at the last step."""
        interval = self.cfg.checkpoint.interval
        return self.cfg.checkpoint.enabled and (last or (interval > 0 and step % interval == 0))

    def save(self, model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any, step: int,
             rank_state: RankState | None = None) -> Path:
        """Write ``checkpoints/step-<step>`` atomically (see the module docstring); return its path.

        ``rank_state``: this rank's state besides DCP's (:mod:`shardlm.checkpoint.rank_state`; the objective's
        buffer inside an online-RL generation cycle), written into the same directory before DCP's files and
        recorded in the manifest; given on every rank or on none.

        With ``checkpoint.async`` the state is staged (copied to host memory) and this returns while a
        background thread writes it; the directory becomes ``step-<step>`` when that write and the manifest
        are done. A save still in flight is waited for first (at most one at a time).

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

        own_records = self._on_main(prepare, final, tmp) or {}  # every rank waits for the directory
        if rank_state is not None:
            own_records.update(self._write_rank_state(tmp, final, step, rank_state))
        base = self.base_reference() if frozen_any(model) else None
        state = training_state(model, optimizer, scheduler, step)
        # remembers the OSError that torch.save's zip writer hides, and hashes each file as it is written
        writer = RecordingFileSystemWriter(tmp)
        job = _SaveJob(step, final, tmp, writer, base, own_records, local_bytes(state), start)
        if not self.cfg.checkpoint.async_:
            try:
                dcp.save(state, storage_writer=writer)  # each rank its shards; rank 0 .metadata
            except CheckpointException as e:  # derives from BaseException; raised on every rank
                self._dcp_save_failed(job, e)
            self._complete(job, self._gather({**writer.records, **own_records}, None), None)
            return final
        if self._group is None:  # a collective: every rank saves at the same step
            self._group = dist.new_group(backend="gloo", timeout=CHECKPOINT_TIMEOUT)
        if self._stager is None:
            self._stager = HostStager()
        # stage: a host copy of this rank's state, into buffers reused from save to save
        # (checkpoint/staging.py); the write runs on a DCP thread, on the checkpoint's own process group
        future = dcp.async_save(state, storage_writer=writer, process_group=self._group,
                                async_checkpointer_type=AsyncCheckpointerType.THREAD,
                                async_stager=self._stager)
        del state
        job.blocked_s = time.perf_counter() - start
        flight = InFlight(job)
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
            CheckpointError: it failed (cause and path; the previous checkpoint stays the newest
            complete one).
        """
        flight, self._in_flight = self._in_flight, None
        if flight is None:
            return
        if flight.thread is not None:
            flight.thread.join()
        message = flight.outcome[1] if flight.outcome is not None else "the background save thread died"
        if message is not None:
            raise CheckpointError(message)

    def _finish_in_background(self, flight: InFlight, future: Any) -> None:
        """The background thread of an async save: wait for DCP's write, agree with the other ranks on the
        outcome (on the checkpoint's process group), then rank 0 writes the manifest and renames
        the directory."""
        job = flight.job
        message: str | None = None
        cause: str | None = None  # this rank's real cause (a recorded OSError, a full file system)
        failed: str | None = None  # DCP's own message, on one line
        try:
            future.result()
        except BaseException as e:  # noqa: BLE001 - CheckpointException derives from BaseException
            failed = " ".join(str(e).split()) or type(e).__name__
            local = (
                job.writer.errors[0]
                if job.writer.errors
                else probe_free_space(job.tmp.parent, job.needed_bytes)
            )
            cause = describe(local) if local is not None else None
        try:
            with flight.cond:
                flight.contributed = flight.step
            mine = {"step": flight.contributed, "failed": failed, "cause": cause,
                    "files": {**job.writer.records, **job.own_records}}
            shares = [mine]
            if self.info.world_size > 1:
                shares = [None] * self.info.world_size
                dist.all_gather_object(shares, mine, group=self._group)
            report_at = 1 + max(s["step"] for s in shares)
            dcp_errors = [s["failed"] for s in shares if s["failed"]]
            if dcp_errors:
                message = self._failure(job.final,
                                        self._first_cause([s["cause"] for s in shares], dcp_errors[0]))
                if self.info.is_main:
                    shutil.rmtree(job.tmp, ignore_errors=True)
            else:
                files = {k: v for s in shares for k, v in s["files"].items()}
                try:
                    self._complete(job, files, self._group)
                except (CheckpointError, RankFailed) as e:
                    message = str(e)
        except BaseException as e:  # noqa: BLE001 - reported by the training thread
            report_at, message = (
                flight.step + 1,
                f"saving checkpoint {job.final} failed: {type(e).__name__}: {e}",
            )
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
            if job.final.exists():
                # the same step saved again (e.g. a run resumed from an earlier step): replace it
                remove_directory(job.final)
            os.replace(job.tmp, job.final)
            fsync_dir(self.root)
            self._save_seq = seq
            self._prune(job.final)

        self._on_main(finish, job.final, job.tmp, group)
        self.last_save = {
            "step": job.step,
            "seconds": time.perf_counter() - job.start,
            "blocked_s": job.blocked_s if job.blocked_s is not None else time.perf_counter() - job.start,
            "bytes": sum(f["bytes"] for f in files.values()),
            "path": str(job.final),
        }

    def _failure(self, final: Path, cause: str) -> str:
        """The one-line message of a failed save: cause, path, and the checkpoint ``--resume=auto``
        would pick."""
        newest = run_checkpoints(self.root, self.run_id)
        still = (f"the newest complete checkpoint is still {newest[0].path}" if newest
                 else "no complete checkpoint of this run exists yet")
        return f"saving checkpoint {final} failed: {cause}; {still}"

    def _on_main(self, fn: Callable[[], Any], final: Path, tmp: Path, group: Any = None) -> Any:
        """:func:`run_on_main` for a save's rank-0 file work: an ``OSError`` becomes a
        :class:`CheckpointError` naming its cause and path, and the unfinished ``tmp`` directory
        is removed."""

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

    def _write_rank_state(self, tmp: Path, final: Path, step: int, state: RankState) -> dict[str, Any]:
        """Write this rank's ``state`` into ``tmp`` and return its manifest record; every rank learns whether
        every rank could (one all-gather), so a failure raises on all of them before DCP's collectives.

        Raises:
            CheckpointError: on every rank, naming the first rank's cause and path; ``tmp`` is removed.
        """
        records, error = {}, None
        try:
            records = write_rank_state(tmp, self.info.rank, self.info.world_size, step, state)
        except OSError as e:
            error = describe(e if e.filename else with_path(e, tmp))
        errors = [error]
        if self.info.world_size > 1:
            errors = [None] * self.info.world_size
            dist.all_gather_object(errors, error)
        if any(errors):
            if self.info.is_main:
                shutil.rmtree(tmp, ignore_errors=True)
            raise CheckpointError(self._failure(final, self._first_cause(errors, "")))
        return records

    def _dcp_save_failed(self, job: _SaveJob, error: CheckpointException) -> None:
        """After ``dcp.save`` failed on some rank (every rank is here): raise one :class:`CheckpointError`
        naming the first rank's real cause (its recorded ``OSError``, else a full file system found by
        :func:`probe_free_space`, else DCP's own message) on every rank, and remove ``tmp`` (rank 0)."""
        local = job.writer.errors[0] if job.writer.errors else probe_free_space(job.tmp.parent,
                                                                                job.needed_bytes)
        causes: list[str | None] = [describe(local) if local is not None else None]
        if self.info.world_size > 1:
            causes = [None] * self.info.world_size
            dist.all_gather_object(causes, describe(local) if local is not None else None)
        cause = self._first_cause(causes, " ".join(str(error).split()))  # else DCP's message, on one line
        if self.info.is_main:
            shutil.rmtree(job.tmp, ignore_errors=True)
        raise CheckpointError(self._failure(job.final, cause)) from None

    def _prune(self, just_written: Path) -> None:
        """Delete unfinished saves, then this run's checkpoints beyond the newest ``checkpoint.keep``
        (rank 0).

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
