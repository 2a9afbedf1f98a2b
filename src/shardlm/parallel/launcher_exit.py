"""A rank stops when its launcher dies.

torchrun starts each rank as a child process in a session of its own. When torchrun ends normally it stops its
ranks, but when it is killed outright (``kill -9``, the out-of-memory killer, a scheduler removing the job's
launcher) the ranks are left running on their own: they go on training and writing checkpoints into a run
directory that nobody watches, and a new launch of the same run would race them.

:func:`stop_with_launcher` asks Linux to send this process ``SIGTERM`` when its parent process ends
(``prctl(PR_SET_PDEATHSIG)``, see prctl(2)). Every rank of the node gets it at once, so a run with checkpoints
on treats it as a preemption (finish the step, save, stop: :mod:`shardlm.checkpoint.preemption`), and a run
without them ends at once.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

#: prctl(2)'s option number: the signal the calling process gets when its parent ends
PR_SET_PDEATHSIG = 1


def launched_by_torchrun() -> bool:
    """Whether this process is a rank that torchrun started (its agent sets ``TORCHELASTIC_RUN_ID``)."""
    return "TORCHELASTIC_RUN_ID" in os.environ


def stop_with_launcher(sig: int = signal.SIGTERM) -> bool:
    """Have this process receive ``sig`` when the process that started it ends, if that is torchrun.

    Only on Linux and only under torchrun (:func:`launched_by_torchrun`); elsewhere nothing changes. If the
    launcher ends while the request is made (this process is handed to another parent), the signal is sent
    now. Returns whether the request was made.
    """
    if not sys.platform.startswith("linux") or not launched_by_torchrun():
        return False
    launcher = os.getppid()
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
            return False
    except (OSError, AttributeError):  # no prctl in this C library
        return False
    if os.getppid() != launcher:  # it ended before the request took effect: no signal would come
        os.kill(os.getpid(), sig)
    return True
