"""One place that turns expected errors into one clear message and a non-zero exit code."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable

from shardlm.checkpoint import ModelDirError
from shardlm.checkpoint.manifest import CheckpointError
from shardlm.config import ConfigError
from shardlm.data import DataError

#: errors caused by the user's input or data: reported as one line, exit code 2
USER_ERRORS: tuple[type[BaseException], ...] = (ConfigError, DataError, ModelDirError, CheckpointError)


def run_cli(fn: Callable[[], int | None]) -> int:
    """Call ``fn``; map user errors to ``error: ...`` on stderr and exit code 2, other failures to 1.

    A rank that stopped because another node was lost (:class:`shardlm.parallel.faults.NodeLost`)
    exits with code 4. Only one rank prints a given message: rank 0, or any rank whose failure is its own (not
    :class:`shardlm.parallel.RankFailed`, which merely reports that rank 0 failed).
    """
    from shardlm.parallel import RankFailed, shutdown
    from shardlm.parallel.faults import NODE_LOST_EXIT_CODE, NodeLost
    from shardlm.train import NonFiniteError

    rank = int(os.environ.get("RANK", "0"))
    try:
        return fn() or 0
    except USER_ERRORS as e:
        if rank == 0:
            print(f"error: {e}", file=sys.stderr, flush=True)
        return 2
    except RankFailed:
        return 2
    except NodeLost as e:  # another node died: one message per surviving node
        if e.report_here:
            print(f"error: {e}", file=sys.stderr, flush=True)
        return NODE_LOST_EXIT_CODE
    except NonFiniteError as e:
        if rank == 0:
            print(f"error: {e}", file=sys.stderr, flush=True)
        return 3
    except KeyboardInterrupt:
        return 130
    finally:
        shutdown()
