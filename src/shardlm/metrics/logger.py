"""``metrics.jsonl``: one JSON object per logged step, written by rank 0."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any


class MetricsLogger:
    """Appends records to ``<run dir>/metrics.jsonl`` (rank 0 only; other ranks hold a no-op logger).

    Each record is flushed at once, so the file is complete up to the last finished step even if
    the job is killed.
    """

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self._file = open(path, "a", encoding="utf-8") if path is not None else None

    def log(self, record: dict[str, Any]) -> None:
        """Write one record; floats that are not finite are refused (ValueError) rather than written."""
        for key, value in record.items():
            if isinstance(value, float) and not math.isfinite(value):
                raise ValueError(f"refusing to log non-finite {key}={value}")
        if self._file is not None:
            self._file.write(json.dumps(record) + "\n")
            self._file.flush()

    def close(self) -> None:
        """Close the file."""
        if self._file is not None:
            self._file.close()
            self._file = None


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """All records of a ``metrics.jsonl`` file, in order."""
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]
