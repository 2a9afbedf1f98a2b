"""The ``"auto"`` settings of a run resolved once at start-up (:mod:`shardlm.config.auto`): a resumed run
keeps the values its checkpoint recorded, a new one takes a chooser's (``shardlm train`` passes the
planner's, :func:`shardlm.plan.defaults.choose_defaults`), and without a chooser the fixed defaults. The
values are set in place in the config, so the run's ``config.json`` and checkpoints record them; the summary
prints each with its reason."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from shardlm.config import Config
from shardlm.config.auto import FIXED, put, unresolved


@dataclass(frozen=True)
class DefaultChoice:
    """One ``"auto"`` setting as the run resolved it."""

    key: str
    """Dotted config key, e.g. ``parallel.reshard_after_forward``."""
    value: Any
    """The value the run trains with."""
    why: str
    """The reason, for the summary (e.g. ``the planned step fits 3.1 GiB of 12.0 GiB per rank with it``)."""


#: a chooser: (config with the keys still "auto", those keys, the process's DistInfo: world size, device) ->
#: {key: (value, why)}, for any subset of the keys
Chooser = Callable[[Config, list[str], Any], dict[str, tuple[Any, str]]]


def resolve_defaults(cfg: Config, resumed: dict[str, Any] | None, chooser: Chooser | None = None,
                     info: Any = None) -> list[DefaultChoice]:
    """Resolve every ``"auto"`` field of ``cfg`` in place and return the choices, in the order of
    :data:`~shardlm.config.auto.FIXED`.

    Args:
        cfg: the run's config; fields the user set are left alone (and not returned).
        resumed: the checkpoint's config when resuming (its recorded, resolved values win), else None.
        chooser: decides the new run's values (may leave some out: they take their fixed default); called
            with ``info``, this process's :class:`~shardlm.parallel.dist.DistInfo`.
    """
    keys = unresolved(cfg)
    if not keys:
        return []
    out = []
    recorded = {}
    if resumed is not None:
        for key in keys:
            section, name = key.split(".")
            value = (resumed.get(section) or {}).get(name, FIXED[key])  # older checkpoints: the fixed default
            recorded[key] = value if value != "auto" else FIXED[key]
    chosen = {} if resumed is not None or chooser is None else chooser(cfg, keys, info)
    for key in keys:
        if key in recorded:
            value, why = recorded[key], "auto: the resumed checkpoint's"
        elif key in chosen:
            value, why = chosen[key]
        else:
            value, why = FIXED[key], "auto: the fixed default (no planner ran)"
        put(cfg, key, value)
        out.append(DefaultChoice(key, value, why))
    return out


def describe_defaults(choices: list[DefaultChoice]) -> list[str]:
    """One summary line per choice: ``key = value (why)``."""
    return [f"{c.key} = {str(c.value).lower() if isinstance(c.value, bool) else c.value} ({c.why})"
            for c in choices]
