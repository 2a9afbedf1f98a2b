"""Progress on the console: a tqdm bar on a terminal, plain lines at a steady interval otherwise.

One rule for ``prepare``, training and ``eval``. When stderr is not a terminal (a log file under CI,
Slurm or ``nohup``), a redrawing bar would write ``\\r`` updates that join into lines of thousands of
characters; :class:`PlainProgress` instead prints one short line (position, rate, the postfix values,
elapsed time and ETA) every ``interval_s`` seconds and once at the end.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any, TextIO

from tqdm import tqdm

#: seconds between plain progress lines when the output is not a terminal (environment:
#: SHARDLM_PROGRESS_INTERVAL_S)
PLAIN_INTERVAL_S = float(os.environ.get("SHARDLM_PROGRESS_INTERVAL_S", "30"))


def format_seconds(seconds: float) -> str:
    """``H:MM:SS`` (or ``M:SS`` under an hour) for a duration in seconds."""
    seconds = int(max(seconds, 0))
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


class PlainProgress:
    """The part of tqdm's interface shardlm uses (``update``, ``set_postfix``, ``write``, ``close``, ``n``),
    printing plain lines to ``file``: ``desc 40/300 step (13%) | loss=4.105 | 2.1 step/s | 0:19 < 2:04``.
    """

    def __init__(self, total: int | None, desc: str, unit: str, initial: int = 0, disable: bool = False,
                 interval_s: float = PLAIN_INTERVAL_S, file: TextIO | None = None) -> None:
        self.total, self.desc, self.unit, self.n = total, desc, unit, initial
        self.disable, self.interval_s = disable, interval_s
        self.file = file or sys.stderr
        self._initial, self._start = initial, time.perf_counter()
        self._last_print, self._postfix = self._start, ""
        self._printed: tuple[int, str] | None = None  # (position, postfix) of the last line printed

    def set_postfix(self, **values: Any) -> None:
        """Remember ``key=value`` pairs to show on the next line."""
        self._postfix = ", ".join(f"{k}={v}" for k, v in values.items())

    def update(self, n: int = 1) -> None:
        """Advance by ``n``; print a line if ``interval_s`` has passed since the last one."""
        self.n += n
        if time.perf_counter() - self._last_print >= self.interval_s:
            self._print()

    def line(self) -> str:
        """The progress line for the current position."""
        elapsed = time.perf_counter() - self._start
        done = self.n - self._initial
        rate = done / elapsed if elapsed > 0 else 0.0
        where = f"{self.n}/{self.total} {self.unit}" if self.total else f"{self.n} {self.unit}"
        if self.total:
            where += f" ({100 * self.n / self.total:.0f}%)"
        parts = [f"{self.desc} {where}".strip()]
        if self._postfix:
            parts.append(self._postfix)
        parts.append(f"{rate:.3g} {self.unit}/s")
        eta = (self.total - self.n) / rate if self.total and rate > 0 else None
        parts.append(format_seconds(elapsed) + (f" < {format_seconds(eta)}" if eta is not None else ""))
        return " | ".join(parts)

    def _print(self) -> None:
        self._last_print = time.perf_counter()
        self._printed = (self.n, self._postfix)
        if not self.disable:
            print(self.line(), file=self.file, flush=True)

    def write(self, text: str) -> None:
        """Print a message line (tqdm.write's counterpart)."""
        if not self.disable:
            print(text, file=self.file, flush=True)

    def close(self) -> None:
        """Print the final line once (not again when the last line printed already showed it)."""
        if (self.n != self._initial or self.total) and self._printed != (self.n, self._postfix):
            self._print()
        self.disable = True


def progress(total: int | None, desc: str = "", unit: str = "it", initial: int = 0,
             disable: bool = False) -> tqdm | PlainProgress:
    """A tqdm bar when stderr is a terminal, else a :class:`PlainProgress` (same calls)."""
    if sys.stderr.isatty():
        return tqdm(total=total, desc=desc or None, unit=unit, initial=initial, disable=disable,
                    dynamic_ncols=True, mininterval=0.1)
    return PlainProgress(total, desc, unit, initial, disable)
