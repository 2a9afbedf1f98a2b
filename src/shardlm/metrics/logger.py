"""``metrics.jsonl``: one JSON object per logged step, written by rank 0."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any, Protocol

from shardlm.metrics.tensorboard import TensorBoardWriter


class TrackerSink(Protocol):
    """What the logger needs of an experiment tracker (:class:`shardlm.metrics.trackers.Tracker`:
    W&B, MLflow)."""

    def log(self, record: dict[str, Any]) -> None: ...

    def rewind(self, step: int) -> None: ...

    def finish(self, outcome: str, model_dir: Path | None = None) -> None: ...


class MetricsLogger:
    """Appends records to ``<run dir>/metrics.jsonl`` (rank 0 only; other ranks hold a no-op logger).

    Each record is flushed at once, so the file is complete up to the last finished step even if
    the job is killed. With ``tensorboard`` (default) the records also go to TensorBoard event
    files in ``<run dir>/tensorboard/`` when that package is installed (see
    :class:`shardlm.metrics.tensorboard.TensorBoardWriter`). :meth:`rewind` takes every sink back to a
    step when a run resumes from a checkpoint. A new or emptied ``metrics.jsonl`` means a new run, so
    stale event files are then removed. ``trackers`` (W&B, MLflow: :mod:`shardlm.metrics.trackers`; rank 0
    only) receive every record too; :meth:`rewind` and :meth:`close` reach them.
    """

    def __init__(self, path: Path | None, tensorboard: bool = True,
                 trackers: list[TrackerSink] | None = None) -> None:
        self.path = path
        self.trackers = list(trackers or [])
        self.tensorboard: TensorBoardWriter | None = None
        if path is not None and tensorboard:
            fresh = not Path(path).exists() or Path(path).stat().st_size == 0
            self.tensorboard = TensorBoardWriter(Path(path).parent / "tensorboard", fresh=fresh)
        self._file = open(path, "a", encoding="utf-8") if path is not None else None

    def log(self, record: dict[str, Any]) -> None:
        """Write one record; floats that are not finite are refused (ValueError) rather than written.

        Raises:
            OSError: the file cannot be written (a full disk...), naming ``metrics.jsonl``'s path.
        """
        for key, value in record.items():
            if isinstance(value, float) and not math.isfinite(value):
                raise ValueError(f"refusing to log non-finite {key}={value}")
        if self._file is not None:
            try:
                self._file.write(json.dumps(record) + "\n")
                self._file.flush()
            except OSError as e:  # a failed write names no file (e.g. a full disk): name it
                raise OSError(e.errno, e.strerror or str(e), str(self.path)) from None
        if self.tensorboard is not None:
            self.tensorboard.log(record)
        for tracker in self.trackers:
            tracker.log(record)

    def rewind(self, step: int) -> None:
        """Drop everything logged after ``step`` from every sink (``metrics.jsonl``, TensorBoard
        events, trackers).

        Called once when a run resumes from the checkpoint of ``step``: the steps after it will be logged
        again, and each sink then holds each step once; a tracker whose backend cannot delete what it was
        sent records the rewind instead (MLflow; see :mod:`shardlm.metrics.trackers`). A no-op on ranks other
        than 0.
        """
        if self.path is None:
            return
        self._file.close()
        truncate_jsonl(self.path, step)
        self._file = open(self.path, "a", encoding="utf-8")
        if self.tensorboard is not None:
            self.tensorboard.rewind(step)
        for tracker in self.trackers:
            tracker.rewind(step)

    def close(self, outcome: str = "finished", model_dir: Path | None = None) -> None:
        """Close the file and the event file; end the tracker runs with ``outcome`` (``finished``,
        ``preempted``, ``failed``) and, when given, the final model directory's path. Closing again
        does nothing."""
        if self._file is not None:
            self._file.close()
            self._file = None
        if self.tensorboard is not None:
            self.tensorboard.close()
        for tracker in self.trackers:
            tracker.finish(outcome, model_dir)
        self.trackers = []


def truncate_jsonl(path: Path, step: int) -> int:
    """Drop the records of a ``metrics.jsonl`` past ``step`` (atomically: temp file, then rename); return how
    many were kept."""
    path = Path(path)
    if not path.is_file():
        return 0
    kept = [line for line in path.read_text(encoding="utf-8").splitlines()
            if line.strip() and json.loads(line).get("step", 0) <= step]
    tmp = path.with_suffix(".jsonl.tmp")
    tmp.write_text("".join(line + "\n" for line in kept), encoding="utf-8")
    os.replace(tmp, path)
    return len(kept)


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """All records of a ``metrics.jsonl`` file, in order."""
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]
