"""One place that turns expected errors into one clear message and a non-zero exit code."""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Callable

from shardlm.errors import NODE_LOST_EXIT_CODE, USER_ERRORS, NodeLost, NonFiniteError, RankFailed

#: seconds a rank other than 0 waits before printing its error, plus this much per local rank. Most errors are
#: raised on every rank alike; rank 0 prints its copy at once and exits, and torchrun (which checks its
#: workers every 0.1 s) then stops the other ranks while they wait, so the message appears once. A rank that
#: outlives the wait failed alone (or on another node) and prints its own message.
PEER_REPORT_DELAY_S = 3.0
PEER_REPORT_STAGGER_S = 0.5


def _report(message: str, rank: int) -> None:
    """Print ``error: message`` on stderr: at once on rank 0, after the peer delay on other ranks."""
    if rank != 0:
        # torchrun stops the other workers with SIGTERM; take it with the default action (exit), even if the
        # trainer had installed its preemption handler, which would otherwise finish a step that cannot come
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        local_rank = int(os.environ.get("LOCAL_RANK", rank))
        time.sleep(PEER_REPORT_DELAY_S + PEER_REPORT_STAGGER_S * local_rank)
    print(f"error: {message}", file=sys.stderr, flush=True)


def run_cli(fn: Callable[[], int | None]) -> int:
    """Call ``fn``; map user errors to ``error: ...`` on stderr and exit code 2, other failures to 1.

    A file-system error (an ``OSError`` naming a path: no permission, a parent that is a file, a full
    disk) is reported as ``error: <reason>: <path>`` with exit code 2. A non-finite loss exits with
    code 3; a rank that stopped because another node was lost (:class:`shardlm.errors.NodeLost`)
    exits with code 4 and prints one message per surviving node. Ctrl-C exits with code 130 and one line
    (outside torchrun, whose launcher prints it).
    Otherwise rank 0 prints at once and other ranks print only if they are still running after
    :data:`PEER_REPORT_DELAY_S` (see there), so an error that every rank raises is printed once, and an
    error raised on one rank other than 0 is still printed.
    """
    rank = int(os.environ.get("RANK", "0"))
    shutdown: Callable[[], None] | None = None
    try:
        # here, not at the top: ``shardlm --help`` imports no torch; in the try: a Ctrl-C while torch imports
        # (before ``shardlm train`` starts its ranks) is one line too
        from shardlm.parallel.dist import shutdown

        return fn() or 0
    except USER_ERRORS as e:
        _report(str(e), rank)
        return 2
    except RankFailed as e:  # rank 0 failed and prints its own error; say so here only if rank 0 is far away
        _report(str(e), rank)
        return 2
    except NodeLost as e:  # another node died: one message per surviving node
        if e.report_here:
            print(f"error: {e}", file=sys.stderr, flush=True)
        return NODE_LOST_EXIT_CODE
    except NonFiniteError as e:
        _report(str(e), rank)
        return 3
    except OSError as e:
        if e.filename is None:  # not about a file (e.g. a socket): a failure to show whole
            raise
        # a path (str, or bytes from some libraries) that cannot be read or written
        _report(f"{e.strerror or type(e).__name__}: {os.fsdecode(e.filename)}", rank)
        return 2
    except KeyboardInterrupt as e:  # a command may say what is kept in e.args[0]
        if "TORCHELASTIC_RUN_ID" not in os.environ:  # under torchrun the launcher (cli/launch.py) says it
            kept = f": {e.args[0]}" if e.args else ""
            print(f"error: stopped by Ctrl-C{kept}", file=sys.stderr, flush=True)
        return 130
    finally:
        if shutdown is not None:
            shutdown()
