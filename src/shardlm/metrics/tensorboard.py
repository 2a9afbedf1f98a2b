"""TensorBoard event files beside ``metrics.jsonl``, written when the ``tensorboard`` package is installed.

Uses ``torch.utils.tensorboard.SummaryWriter``. Tags: ``train/loss``, ``val/loss``, ``train/lr``,
``train/grad_norm``, ``perf/tokens_per_s``, ``perf/tokens_per_s_per_rank``, ``perf/step_time_s``,
``perf/mfu``, ``memory/<key>_MiB/{min,max,mean}`` for each per-rank summary of bytes in a record
(``shard_bytes``, ``max_allocated_bytes``, ``rss_bytes``...), and ``memory/<key>_MiB/rank<r>`` for a full
per-rank list (``<key>_per_rank``, written with ``train.log_per_rank``); a preference run's TRL metrics as
``train/<name>`` (``train/rewards/chosen``, ``train/logps/rejected``, ``train/nll_loss``...). View with
``tensorboard --logdir runs/``.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

#: record key -> TensorBoard tag, for the scalar metrics of a training record
SCALAR_TAGS = {
    "loss": "train/loss", "val_loss": "val/loss", "lr": "train/lr", "grad_norm": "train/grad_norm",
    "tokens_per_s": "perf/tokens_per_s", "tokens_per_s_per_rank": "perf/tokens_per_s_per_rank",
    "step_time_s": "perf/step_time_s", "mfu": "perf/mfu",
}


#: a preference run's record keys (TRL's names) that go to ``train/<key>``: those with these prefixes,
#: and ``nll_loss``
PREFERENCE_PREFIXES = ("rewards/", "logps/", "logits/")


def summary_writer_class() -> type | None:
    """``torch.utils.tensorboard.SummaryWriter``, or None when tensorboard is not installed."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        return None
    return SummaryWriter


class TensorBoardWriter:
    """Writes training records as TensorBoard scalars into ``log_dir``; a no-op without tensorboard.

    ``fresh=True`` deletes event files left in ``log_dir`` by an earlier run (a run directory that is
    overwritten). :meth:`rewind` drops everything logged after a step (for a resumed run).
    """

    def __init__(self, log_dir: str | Path, fresh: bool = False) -> None:
        self.log_dir = Path(log_dir)
        self._cls = summary_writer_class()
        self._writer = None
        if self._cls is None:
            return
        if fresh and self.log_dir.is_dir():
            for f in self.log_dir.glob("events.out.tfevents.*"):
                f.unlink()
        self._writer = self._cls(log_dir=str(self.log_dir))

    @property
    def enabled(self) -> bool:
        """True when event files are being written."""
        return self._writer is not None

    def log(self, record: dict[str, Any]) -> None:
        """Add the record's scalars at ``record["step"]``; per-rank byte summaries in MiB (min, max, mean),
        full per-rank lists one tag per rank."""
        if self._writer is None or "step" not in record:
            return
        step = int(record["step"])
        for key, value in record.items():
            if key in SCALAR_TAGS and isinstance(value, (int, float)) and math.isfinite(value):
                self._writer.add_scalar(SCALAR_TAGS[key], value, step)
            elif (
                (key.startswith(PREFERENCE_PREFIXES) or key == "nll_loss")
                and isinstance(value, (int, float))
                and math.isfinite(value)
            ):
                self._writer.add_scalar(f"train/{key}", value, step)
            elif key.endswith("bytes") and isinstance(value, dict):
                for stat in ("min", "max", "mean"):
                    self._writer.add_scalar(f"memory/{key.removesuffix('_bytes')}_MiB/{stat}",
                                            value[stat] / 2**20, step)
            elif key.endswith("bytes_per_rank") and isinstance(value, list):
                for rank, v in enumerate(value):
                    name = key.removesuffix("_bytes_per_rank")
                    self._writer.add_scalar(f"memory/{name}_MiB/rank{rank}", v / 2**20, step)
        self._writer.flush()

    def rewind(self, step: int) -> None:
        """Rewrite the event files so that they hold only events up to ``step`` (a run resuming from it).

        TensorBoard's own ``purge_step`` only hides later events when the files are read; here they are
        removed: every event file is read back with tensorboard's ``EventFileLoader``, the events with a
        step <= ``step`` (and the file-version headers) are written to one new event file with
        tensorboard's ``EventFileWriter``, then the old files are deleted and writing continues.
        """
        if self._writer is None:
            return
        from tensorboard.backend.event_processing.event_file_loader import EventFileLoader
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        self._writer.close()
        old = sorted(self.log_dir.glob("events.out.tfevents.*"))
        kept = [event for f in old for event in EventFileLoader(str(f)).Load()
                if event.step <= step and not event.HasField("file_version")]
        writer = EventFileWriter(str(self.log_dir), filename_suffix=".rewound")
        for event in kept:
            writer.add_event(event)
        writer.close()
        for f in old:
            f.unlink()
        self._writer = self._cls(log_dir=str(self.log_dir))

    def close(self) -> None:
        """Flush and close the event file."""
        if self._writer is not None:
            self._writer.close()
            self._writer = None

