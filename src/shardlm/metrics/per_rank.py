"""Per-rank figures in a metrics record: a summary whose size does not grow with the world size.

A figure measured on every rank (shard bytes, peak memory, resident set size) is written as
``{"min": ..., "max": ..., "mean": ..., "max_rank": r}`` (Megatron-LM reduces its per-rank timers to min/max
the same way); the full list over ranks is written too, as ``<key>_per_rank``, only when asked for
(``train.log_per_rank``).
"""

from __future__ import annotations

from typing import Any


def summarize(values: list[float]) -> dict[str, float | int]:
    """Min, max, mean and the (lowest) rank holding the max of one figure's per-rank values (non-empty).

    Integral values (bytes) stay ints in min/max; the mean is a float.
    """
    top = max(values)
    as_int = all(float(v).is_integer() for v in values)
    return {"min": int(min(values)) if as_int else min(values), "max": int(top) if as_int else top,
            "mean": sum(values) / len(values), "max_rank": values.index(top)}


def per_rank_summaries(keys: list[str], slots: list[float], world_size: int, full: bool) -> dict[str, Any]:
    """Record entries for per-rank figures gathered rank-major: ``slots[r * len(keys) + j]`` is rank
    r's ``keys[j]``.

    Returns ``{key: summary}`` for each key, plus ``{key + "_per_rank": [values in rank order]}``
    when ``full``.
    """
    k = len(keys)
    out: dict[str, Any] = {}
    for j, key in enumerate(keys):
        values = [slots[r * k + j] for r in range(world_size)]
        ints = all(float(v).is_integer() for v in values)
        out[key] = summarize(values)
        if full:
            out[key + "_per_rank"] = [int(v) for v in values] if ints else values
    return out
