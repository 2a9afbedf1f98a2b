"""Preemption: the signals on which the ranks finish the current step, save a checkpoint and stop, and what a
second signal does (:class:`Preemption`, a part of :class:`shardlm.checkpoint.dcp.Checkpointer`)."""

from __future__ import annotations

import os
import signal
from typing import Any

from shardlm.config import Config
from shardlm.parallel import DistInfo

#: signals on which the ranks finish the current step, save a checkpoint and exit with
#: :data:`shardlm.errors.STOPPED_EXIT_CODE`: SIGINT is Ctrl-C (torchrun forwards it to the ranks), Slurm sends
#: SIGTERM or SIGUSR1 before killing a job. A second such signal after a SIGINT (Ctrl-C twice; torchrun sends
#: SIGTERM on the second), or a SIGINT after any of them, stops the process at once: see
#: :meth:`Checkpointer._on_signal`
PREEMPTION_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)


class Preemption:
    """The signal handling of a :class:`~shardlm.checkpoint.dcp.Checkpointer` (which sets ``cfg``, ``info``,
    ``_signal`` and ``_old_handlers`` in its ``__init__``)."""

    cfg: Config
    info: DistInfo
    _signal: int | None
    _old_handlers: dict[int, Any]

    def install_signal_handlers(self) -> None:
        """Catch SIGINT/SIGTERM/SIGUSR1 (from here to :meth:`close`): record it, so the loop saves
        and stops."""
        if not self.cfg.checkpoint.enabled:
            return
        for sig in PREEMPTION_SIGNALS:
            try:
                self._old_handlers[sig] = signal.signal(sig, self._on_signal)
            except ValueError:  # not the main thread: leave the signal alone
                pass

    def _on_signal(self, signum: int, frame: Any) -> None:
        """Record the first stop signal; from then on the next one that should stop at once does, with
        no handler.

        After a SIGINT (Ctrl-C) every stop signal gets its default action (the process ends at once, even
        inside a collective: the default action needs no Python code to run); after SIGTERM/SIGUSR1 only
        SIGINT does, so a preemption signal sent twice (to torchrun and to the ranks) still saves. Rank 0 says
        what happens next.
        """
        first = self._signal is None
        self._signal = self._signal or signum
        for sig in PREEMPTION_SIGNALS if self._signal == signal.SIGINT else (signal.SIGINT,):
            signal.signal(sig, signal.SIG_DFL)
        if first and self.info.is_main:
            # os.write: print() could re-enter a stream the main thread is writing
            name = "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name
            os.write(2, f"\n{name}: finishing this step, then saving a checkpoint and stopping "
                        "(Ctrl-C again stops at once, without saving)\n".encode())

    def signal_received(self) -> bool:
        """Whether this rank received SIGINT/SIGTERM/SIGUSR1 (host state only: no collective). The trainer
        sums the flag over ranks inside the step's one all-reduce, so every rank stops after the same step."""
        return self.cfg.checkpoint.enabled and self._signal is not None

    def restore_signal_handlers(self) -> None:
        """Put back the handlers that were installed before :meth:`install_signal_handlers`."""
        for sig, handler in self._old_handlers.items():
            signal.signal(sig, handler)
        self._old_handlers = {}
