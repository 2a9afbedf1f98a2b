"""Every error type shardlm reports to the user, in one place (no torch import here).

The CLI (:mod:`shardlm.cli.errors`) maps these to one ``error: ...`` line and an exit code: input errors
(config, data, checkpoints, model directories) exit 2, a non-finite loss 3, a lost node 4; a run stopped by a
signal after saving a checkpoint exits 5 (:data:`STOPPED_EXIT_CODE`).
"""

from __future__ import annotations

from typing import Any


class ConfigError(ValueError):
    """A configuration key or value is invalid; the message names the dotted key."""


class DataError(ValueError):
    """Bad input to the data package: missing path, malformed file, empty corpus, ...

    The message always names the cause (path, line number or field) so that a user
    can fix the input without reading a traceback.
    """


class CheckpointError(ValueError):
    """A checkpoint is missing, incomplete, corrupt, unsafe, or does not fit this model."""


class UnsafeCheckpointError(ValueError):
    """A checkpoint file asked to build an object outside the allow-list (it could run code); nothing
    was run."""


class ModelDirError(ValueError):
    """A model directory (or GGUF file) is missing, not a supported model, or inconsistent with
    its weights."""


class TuneError(ValueError):
    """``shardlm tune`` cannot choose: no candidate fits the memory, or the measuring launch failed.

    ``rows``: the candidates measured before a launch failed (:class:`shardlm.plan.tune_search.Row`),
    empty otherwise.
    """

    def __init__(self, message: str, rows: list | None = None) -> None:
        super().__init__(message)
        self.rows = rows or []


class NonFiniteError(RuntimeError):
    """The loss or the gradient norm became NaN or infinite; the step was not applied or logged."""


class RankFailed(RuntimeError):
    """Raised on every other rank when rank 0 failed inside ``run_on_main``; rank 0 reports the cause."""


class NodeLost(RuntimeError):
    """A collective failed because ranks stopped (their process or node died); the message names them.

    Attributes:
        lost: the lost ranks' ``shardlm.parallel.faults.RankHost`` entries, by rank.
        report_here: True on one surviving rank per node (the lowest), which prints the message.
    """

    def __init__(self, message: str, lost: list[Any], report_here: bool) -> None:
        super().__init__(message)
        self.lost = lost
        self.report_here = report_here


#: exit code of a rank that stopped because another node was lost (:class:`NodeLost`)
NODE_LOST_EXIT_CODE = 4
#: exit code of a run stopped early by a signal (Ctrl-C, SIGTERM, SIGUSR1) after it saved a checkpoint to
#: resume from; a second Ctrl-C stops at once instead (exit 130, or killed by the signal)
STOPPED_EXIT_CODE = 5

#: errors caused by the user's input or data: reported as one line, exit code 2
USER_ERRORS: tuple[type[BaseException], ...] = (ConfigError, DataError, ModelDirError, CheckpointError,
                                                UnsafeCheckpointError, TuneError)
