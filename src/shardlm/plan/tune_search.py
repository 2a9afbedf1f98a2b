"""``shardlm tune``'s search: the lightest checkpointing that fits, the staged search's base, the first round
of candidates (:func:`first_round`), the second (:func:`combine`), the pick, and what to say when nothing
fits. The search is described in :mod:`shardlm.plan.tune`.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import statistics
from dataclasses import dataclass
from typing import Any

from shardlm.config import Config, ConfigError
from shardlm.errors import TuneError
from shardlm.plan.memory import plan_memory
from shardlm.plan.tune_candidates import (
    AC_ORDER,
    SEARCHES,
    STAGED_DIMENSIONS,
    Candidate,
    Planner,
    ac_modes,
    apply,
    config_candidate,
    size,
    space,
)


def lightest_fitting(cand: Candidate, planner: Planner) -> Candidate:
    """``cand`` with the lightest activation checkpointing mode (:data:`AC_ORDER`; under tensor parallel those
    the planner models, :func:`ac_modes`) that fits with its other settings; ``cand`` with ``full`` when
    none fits."""
    for ac in ac_modes(cand.tp):
        variant = cand.with_value("ac", ac)
        if planner.fits(variant):
            return variant
    return cand.with_value("ac", AC_ORDER[-1])


def base_candidate(cfg: Config, planner: Planner) -> Candidate | None:
    """The staged search's starting point: the config's reshard, prefetch and batching with the lightest
    checkpointing that fits; when nothing does, the config's smaller micro-batches, then the same with
    resharding and no prefetch; when none of these fits at the config's ``parallel.cp``, the same at each
    other cp of :func:`space` in turn (a long sequence split over more ranks: fewer activations per rank);
    None when nothing fits."""
    own = config_candidate(cfg, planner.world_size)
    dims = space(cfg, planner.world_size)
    batching = [own.key("batching")] + [b for b in dims["batching"] if b[0] < own.micro_batch_size]
    starts = [own,
              dataclasses.replace(own, reshard_after_forward=True, forward_prefetch=0, backward_prefetch=0)]
    for cp in dims["cp"]:  # the config's first
        for start in starts:
            for value in batching:
                cand = start.with_value("cp", cp).with_value("batching", value)
                if cp != own.cp and not planner.allowed(cand.with_value("ac", ac_modes(cand.tp)[0])):
                    continue  # e.g. cp x the config's tp does not divide the ranks
                cand = lightest_fitting(cand, planner)
                if planner.fits(cand):
                    return cand
    return None


@dataclass
class Row:
    """One line of the table: a candidate, its prediction, and (when measured) its times."""

    cand: Candidate
    predicted_bytes: int
    fits: bool
    round: int = 1
    times: list[float] = dataclasses.field(default_factory=list)
    """Measured step times in seconds (slowest rank per step), over every repeat."""
    measured_peak_bytes: int = -1
    """Peak allocated bytes of the busiest rank (CUDA only; -1 elsewhere)."""
    confirmed: bool = False
    """Measured a second time as one of the fastest (its times pooled)."""
    skipped: bool = False
    """Fits but was not measured: the time budget (``--time-budget``) was spent."""

    @property
    def step_s(self) -> float | None:
        return statistics.median(self.times) if self.times else None

    def to_dict(self) -> dict[str, Any]:
        return {"cand": self.cand.to_dict(), "predicted_bytes": self.predicted_bytes, "fits": self.fits,
                "round": self.round, "times": self.times, "measured_peak_bytes": self.measured_peak_bytes,
                "confirmed": self.confirmed, "skipped": self.skipped}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Row:
        return cls(Candidate.from_dict(d["cand"]), d["predicted_bytes"], d["fits"], d["round"], d["times"],
                   d.get("measured_peak_bytes", -1), d.get("confirmed", False), d.get("skipped", False))


def first_round(cfg: Config, planner: Planner, search: str) -> list[Row]:
    """The candidates enumerated before anything is measured, fitting or not (the fitting ones are measured; a
    staged search adds its round-2 candidate after round 1, :func:`combine`).

    Raises:
        TuneError: no candidate fits (see :func:`no_fit_message`).
    """
    if search not in SEARCHES:
        raise ConfigError(f"--search must be one of {list(SEARCHES)}, got {search!r}")
    dims = space(cfg, planner.world_size)
    if search == "full":
        product = itertools.product(dims["reshard"], dims["prefetch"], dims["ac"], dims["batching"],
                                    dims["compile"], dims["grouping"], dims["tp"], dims["ep"], dims["cp"])
        cands = list(dict.fromkeys(Candidate(r, f, b, ac, m, s, c, g, t, e, k).normalized(cfg.model.n_layers)
                                   # the same settings once
                                   for r, (f, b), ac, (m, s), c, g, t, e, k in product))
        cands = [c for c in cands if planner.allowed(c)]
        rows = [Row(c, planner.bytes(c), planner.fits(c)) for c in cands]
        if not any(r.fits for r in rows):
            raise TuneError(no_fit_message(cfg, planner))
        return rows
    base = base_candidate(cfg, planner)
    if base is None:
        raise TuneError(no_fit_message(cfg, planner))
    own = config_candidate(cfg, planner.world_size)
    cands = [own] if own != base else []
    cands.append(base)
    for dim in STAGED_DIMENSIONS:
        for value in dims[dim]:
            changed = base.with_value(dim, value).normalized(cfg.model.n_layers)
            if not planner.allowed(changed.with_value("ac", ac_modes(changed.tp)[0])):
                continue  # e.g. tp = 1 from a tensor-parallel base whose micro-batch does not divide G / N
            cand = lightest_fitting(changed, planner)
            if cand not in cands:
                cands.append(cand)
    return [Row(c, planner.bytes(c), planner.fits(c)) for c in cands]


def combine(rows: list[Row], base: Candidate, planner: Planner) -> Candidate:
    """Round 2 of the staged search: for each of :data:`STAGED_DIMENSIONS`, the value of the fastest measured
    row among those that agree with the base in the other dimensions; these values combined (a value the
    planner cannot predict beside those before it, :meth:`Planner.allowed`, is left out), with the lightest
    checkpointing that fits."""
    best = base
    for dim in STAGED_DIMENSIONS:
        alike = [r for r in rows if r.times and all(r.cand.key(d) == base.key(d) for d in STAGED_DIMENSIONS
                                                    if d != dim)]
        if alike:
            value = min(alike, key=lambda r: r.step_s).cand.key(dim)
            if planner.allowed(best.with_value(dim, value).with_value("ac", "full")):
                best = best.with_value(dim, value)
    return lightest_fitting(best.normalized(planner.cfg.model.n_layers), planner)


def smallest_candidate(cfg: Config, planner: Planner) -> Candidate:
    """Full checkpointing, micro-batch 1, resharding, no prefetch, one block per group, no tp or ep, at the
    cp of :func:`space` whose predicted peak is the least (the config's cp on a tie)."""
    smallest = Candidate(True, 0, 0, "full", 1, "every_micro_batch", cp=cfg.parallel.cp)
    others = [smallest.with_value("cp", cp) for cp in space(cfg, planner.world_size)["cp"]]
    return min([smallest] + [c for c in others if planner.allowed(c)], key=planner.bytes)


def no_fit_message(cfg: Config, planner: Planner) -> str:
    """What to say when no candidate fits: what the smallest candidate needs (:func:`smallest_candidate`), and
    what would fit instead: more ranks (with the checkpointing, micro-batch and, when it differs from the
    config's, the cp they need), bf16 compute, CPU offload on a GPU."""
    n, budget = planner.world_size, planner.budget
    smallest = smallest_candidate(cfg, planner)
    at_cp = f" at parallel.cp={smallest.cp}" if smallest.cp > 1 else ""
    fixes: list[str] = []
    for m in (2 * n, 4 * n, 8 * n, 16 * n, 32 * n, 64 * n):
        wider = copy.deepcopy(cfg)
        g = cfg.train.global_batch_size
        wider.train.global_batch_size = -(-g // m) * m  # the next multiple of the new world size
        wide = Planner(wider, m, planner.device, budget)
        base = base_candidate(wider, wide)
        if base is not None:
            batch = "" if wider.train.global_batch_size == g else \
                f" --train.global_batch_size={wider.train.global_batch_size}"
            split = f"parallel.cp={base.cp}, " if base.cp != cfg.parallel.cp else ""
            fixes.append(f"more ranks: --world-size {m}{batch}, with {split}activation checkpointing "
                         f"'{base.activation_checkpoint}' and micro-batch {base.micro_batch_size} "
                         f"({size(wide.bytes(base))} per rank)")
            break
    small = apply(cfg, smallest)
    others = []
    if cfg.parallel.param_dtype == "float32":
        others.append(("bf16 compute: --parallel.param_dtype=bfloat16", {"param_dtype": "bfloat16"}))
    if planner.device != "cpu" and not cfg.parallel.cpu_offload:
        others.append(("CPU offload: --parallel.cpu_offload=true", {"cpu_offload": True}))
    for text, change in others:
        variant = copy.deepcopy(small)
        for key, value in change.items():
            setattr(variant.parallel, key, value)
        need = plan_memory(variant, n, planner.device).peak
        if need <= budget:
            fixes.append(f"{text} (with activation checkpointing 'full' and micro-batch 1{at_cp}: "
                         f"{size(need)} per rank)")
    what = "; ".join(fixes) if fixes else ("nothing up to 64x the ranks: a smaller model, a shorter "
                                           "train.seq_len, or more memory per rank")
    return (f"no candidate fits at world size {n}: even activation checkpointing 'full' with micro-batch 1"
            f"{at_cp} needs {size(planner.bytes(smallest))} per rank, {size(budget)} usable; what would fit: "
            f"{what}")


def pick(rows: list[Row]) -> Row | None:
    """The row with the shortest median step time (the most tokens/s: the global batch is fixed), among the
    confirmed finalists when there are any (measured twice, see ``confirm``), else among all measured rows."""
    measured = [r for r in rows if r.times and r.confirmed] or [r for r in rows if r.times]
    return min(measured, key=lambda r: r.step_s) if measured else None
