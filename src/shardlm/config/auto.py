"""Settings whose default is ``"auto"``: chosen once at start-up (by the planner under ``shardlm train``,
:mod:`shardlm.plan.defaults`), recorded resolved in the run's ``config.json`` and checkpoints, and kept on
resume. A value the user sets always wins.

Until something chooses, an ``"auto"`` field reads as its *fixed* default (:data:`FIXED`, the value it had
before it could be chosen): what the Python API's ``Trainer(cfg)`` runs without a chooser, and what a
planner call on an unresolved config assumes.
"""

from __future__ import annotations

import copy
from typing import Any

AUTO = "auto"

#: dotted key -> the fixed default an unresolved ``"auto"`` stands for
FIXED: dict[str, Any] = {
    "parallel.reshard_after_forward": True,
    "parallel.blocks_per_group": 1,
    "parallel.activation_checkpoint": "none",
    "train.loss_chunk_tokens": 256,
}


def get(cfg: Any, key: str) -> Any:
    """The value of dotted ``key`` in ``cfg`` (a :class:`~shardlm.config.Config`)."""
    section, name = key.split(".")
    return getattr(getattr(cfg, section), name)


def put(cfg: Any, key: str, value: Any) -> None:
    """Set dotted ``key`` of ``cfg`` to ``value`` (in place)."""
    section, name = key.split(".")
    setattr(getattr(cfg, section), name, value)


def unresolved(cfg: Any) -> list[str]:
    """The keys of :data:`FIXED` that ``cfg`` leaves ``"auto"``, in order."""
    return [key for key in FIXED if get(cfg, key) == AUTO]


def with_fixed_defaults(cfg: Any) -> Any:
    """``cfg`` itself when nothing is ``"auto"``, else a copy with every ``"auto"`` field at its fixed
    default (:data:`FIXED`): for readers that need a concrete value before (or without) a choice."""
    keys = unresolved(cfg)
    if not keys:
        return cfg
    out = copy.deepcopy(cfg)
    for key in keys:
        put(out, key, FIXED[key])
    return out
