"""``shardlm tune``'s candidates: the tuned settings (:class:`Candidate`), their values (:func:`space`), the
config's own (:func:`config_candidate`), each one's predicted peak (:class:`Planner`) and the memory they must
fit (:func:`memory_budget`). The dimensions and the search are described in :mod:`shardlm.plan.tune`.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shardlm.config import Config, ConfigError, gradient_accumulation_steps, validate
from shardlm.config.auto import with_fixed_defaults
from shardlm.config.layout import check_ep, check_tp
from shardlm.parallel.ac import find_cxx_compiler
from shardlm.parallel.dist import dp_mesh_shape
from shardlm.plan.activations import TP_AC_MODES
from shardlm.plan.devices import GIB, MIB, device_for_cuda_name, get_device
from shardlm.plan.memory import plan_memory
from shardlm.plan.param_groups import param_groups

#: activation checkpointing modes, lightest (least recomputation) first: a staged search's candidates take the
#: first that fits
AC_ORDER = ("none", "selective", "every_n", "full")
PREFETCH_DEPTHS = (0, 1, 2)
SEARCHES = ("staged", "full")
DIMENSIONS = ("reshard", "prefetch", "ac", "batching", "compile", "grouping", "tp", "ep", "cp")
#: what the staged search varies; the checkpointing follows: the lightest mode that fits
STAGED_DIMENSIONS = ("reshard", "prefetch", "batching", "compile", "grouping", "tp", "ep", "cp")


def ac_modes(tp: int) -> tuple[str, ...]:
    """The checkpointing modes a candidate of tensor-parallel degree ``tp`` may take, lightest first: those
    the planner can predict (:data:`TP_AC_MODES` under tensor parallel, all of :data:`AC_ORDER` without)."""
    return AC_ORDER if tp == 1 else tuple(m for m in AC_ORDER if m in TP_AC_MODES)

@dataclass(frozen=True)
class Candidate:
    """One setting of the tuned fields."""

    reshard_after_forward: bool
    forward_prefetch: int
    backward_prefetch: int
    activation_checkpoint: str
    micro_batch_size: int
    grad_sync: str
    compile: bool = False
    blocks_per_group: int = 1
    tp: int = 1
    """Tensor-parallel degree (``parallel.tp``); the data-parallel ranks are N / tp."""
    ep: int = 1
    """Expert-parallel degree (``parallel.ep``, mixtures of experts only)."""
    cp: int = 1
    """Context-parallel degree (``parallel.cp``): each sequence split over cp ranks, N / (cp·tp) of them
    data-parallel."""

    def key(self, dimension: str) -> Any:
        """This candidate's value in ``dimension`` (one of :data:`DIMENSIONS`)."""
        return {"reshard": self.reshard_after_forward,
                "prefetch": (self.forward_prefetch, self.backward_prefetch), "ac": self.activation_checkpoint,
                "batching": (self.micro_batch_size, self.grad_sync), "compile": self.compile,
                "grouping": self.blocks_per_group, "tp": self.tp, "ep": self.ep, "cp": self.cp}[dimension]

    def with_value(self, dimension: str, value: Any) -> Candidate:
        """A copy with ``dimension`` set to ``value`` (as :meth:`key` returns it)."""
        if dimension == "reshard":
            return dataclasses.replace(self, reshard_after_forward=value)
        if dimension == "prefetch":
            return dataclasses.replace(self, forward_prefetch=value[0], backward_prefetch=value[1])
        if dimension == "ac":
            return dataclasses.replace(self, activation_checkpoint=value)
        if dimension == "compile":
            return dataclasses.replace(self, compile=value)
        if dimension == "grouping":
            return dataclasses.replace(self, blocks_per_group=value)
        if dimension in ("tp", "ep", "cp"):
            return dataclasses.replace(self, **{dimension: value})
        return dataclasses.replace(self, micro_batch_size=value[0], grad_sync=value[1])

    def normalized(self, n_layers: int) -> Candidate:
        """The same settings with each prefetch depth at most the number of other block groups (a deeper
        prefetch all-gathers nothing more: with all blocks in one group there is nothing to prefetch)."""
        others = -(-n_layers // self.blocks_per_group) - 1
        return dataclasses.replace(self, forward_prefetch=min(self.forward_prefetch, others),
                                   backward_prefetch=min(self.backward_prefetch, others))

    def overrides(self) -> dict[str, Any]:
        """The dotted config keys this candidate sets, with their values."""
        return {
            "parallel.reshard_after_forward": self.reshard_after_forward,
            "parallel.forward_prefetch": self.forward_prefetch,
            "parallel.backward_prefetch": self.backward_prefetch,
            "parallel.activation_checkpoint": self.activation_checkpoint,
            "parallel.grad_sync": self.grad_sync,
            "train.micro_batch_size": self.micro_batch_size,
            "parallel.compile": self.compile,
            "parallel.blocks_per_group": self.blocks_per_group,
            "parallel.tp": self.tp,
            "parallel.ep": self.ep,
            "parallel.cp": self.cp,
        }

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Candidate:
        return cls(**d)


def size(nbytes: float) -> str:
    """``nbytes`` for a message: GiB with two decimals from 1 GiB on, MiB with one below."""
    return f"{nbytes / GIB:.2f} GiB" if nbytes >= GIB else f"{nbytes / MIB:.1f} MiB"


def toml_value(value: Any) -> str:
    """``value`` as a TOML value (bool, int, float or string)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    return json.dumps(str(value))  # a TOML basic string


def dotted(cand: Candidate) -> str:
    """The candidate as command-line overrides: ``--parallel.reshard_after_forward=false ...``."""
    return " ".join(f"--{k}={toml_value(v)}" for k, v in cand.overrides().items())


def apply(cfg: Config, cand: Candidate) -> Config:
    """A copy of ``cfg`` with the candidate's settings."""
    out = copy.deepcopy(cfg)
    for key, value in cand.overrides().items():
        section, name = key.split(".")
        setattr(getattr(out, section), name, value)
    return out


def local_batch(cfg: Config, world_size: int, tp: int = 1, cp: int | None = None) -> int:
    """Sequences per data-parallel rank per step, G / (N / (cp·tp)): the ``cp`` ranks of a context-parallel
    group and the ``tp`` ranks of a tensor-parallel group take the same sequences
    (:func:`shardlm.config.gradient_accumulation_steps`' data-parallel world size). ``cp``: a candidate's
    context-parallel degree, the config's ``parallel.cp`` when None.

    Raises:
        ConfigError: ``cp`` does not divide N, or N / cp (the data-parallel ranks at tp 1, so that the batch
            divides at every tp) does not divide the global batch.
    """
    g = cfg.train.global_batch_size
    cp = cfg.parallel.cp if cp is None else cp
    if world_size < 1:
        raise ConfigError(f"--world-size must be >= 1, got {world_size}")
    if world_size % cp:
        raise ConfigError(f"parallel.cp={cp} must divide the world size {world_size}")
    dp = world_size // cp
    if g % dp:
        shared = f" / parallel.cp={cp} = {dp} (the ranks of a CP group share a sequence)" if cp > 1 else ""
        raise ConfigError(f"train.global_batch_size={g} must be divisible by the world size "
                          f"{world_size}{shared}")
    return g * tp // dp


def layout_allowed(cfg: Config, world_size: int, tp: int, ep: int, cp: int | None = None) -> bool:
    """Whether a run of ``cfg`` at ``world_size`` ranks (one node: the machine ``shardlm tune`` measures on)
    accepts ``parallel.tp = tp``, ``parallel.ep = ep`` and ``parallel.cp = cp`` (the config's when None): the
    trainer's own checks, which refuse a tp that does not divide the query or key/value heads, the FFN width,
    the vocabulary, the sequence or the ranks of the node, tp with LoRA, a mixture of experts or preference
    tuning (:func:`shardlm.config.validate`, :func:`shardlm.config.layout.check_tp`,
    :func:`shardlm.parallel.dist.dp_mesh_shape`), an ep that does not divide the experts or the ranks, or ep
    without experts, outside FSDP or with HSDP (:func:`shardlm.config.layout.check_ep`), and a cp that does
    not divide the ranks, is longer than ``train.seq_len``, or comes with preference tuning (``validate``).
    Under context parallel (cp > 1) a tp is one whose ``cp × tp`` divides the ranks and the tokens of a CP
    rank (sequence parallel splits them); the N / (cp·tp) data-parallel ranks must divide the global batch
    (:func:`shardlm.config.gradient_accumulation_steps` at micro-batch 1)."""
    out = copy.deepcopy(cfg)
    out.parallel.tp, out.parallel.ep = tp, ep
    out.parallel.cp = cfg.parallel.cp if cp is None else cp
    try:
        validate(out)
        check_tp(out.model, tp, out.train.seq_len, out.lora.enabled, out.parallel.cp)
        check_ep(out.model.n_experts, ep, world_size, out.parallel.mode, out.parallel.dp_replicate)
        dp_mesh_shape(out.parallel, world_size, world_size)
        out.train.micro_batch_size = 1
        gradient_accumulation_steps(out, world_size // (out.parallel.cp * tp))
    except ConfigError:
        return False
    return True


def degrees(cfg: Config, world_size: int, dimension: str) -> list[int]:
    """The values of ``dimension`` (``tp``, ``ep`` or ``cp``): the config's own, then every other divisor of
    the world size that :func:`layout_allowed` accepts with the config's values of the other two."""
    own = {"tp": cfg.parallel.tp, "ep": cfg.parallel.ep, "cp": cfg.parallel.cp}
    allowed = [d for d in range(1, world_size + 1) if world_size % d == 0 and d != own[dimension]
               and layout_allowed(cfg, world_size, **{**own, dimension: d})]
    return [own[dimension], *allowed]


def sync_policies(cfg: Config) -> list[str]:
    """The ``parallel.grad_sync`` values worth trying under accumulation (the third one only with HSDP)."""
    out = ["every_micro_batch", "last_micro_batch"]
    if cfg.parallel.dp_replicate != 1:
        out.append("reduce_scatter_every_all_reduce_last")
    return out


def space(cfg: Config, world_size: int) -> dict[str, list[Any]]:
    """The values of each dimension (see the module docstring), the config's own first where it is one
    of them."""
    cfg = with_fixed_defaults(cfg)  # an "auto" setting is searched from its fixed default
    p = cfg.parallel
    tp_values, cp_values = degrees(cfg, world_size, "tp"), degrees(cfg, world_size, "cp")
    # its divisors divide the batch at every tp and cp value (G·cp·tp / N)
    per_rank = local_batch(cfg, world_size, min(tp_values), min(cp_values))
    micro = sorted({per_rank >> j for j in range(4) if per_rank % (1 << j) == 0}
                   | ({cfg.train.micro_batch_size} if per_rank % cfg.train.micro_batch_size == 0 else set()),
                   reverse=True)
    batching: list[tuple[int, str]] = []
    for m in micro:
        if per_rank // m == 1:  # one micro-batch: the gradient sync policy changes nothing
            batching.append((m, p.grad_sync))
        else:
            batching += [(m, s) for s in sync_policies(cfg)]
    depth_cap = max(0, cfg.model.n_layers - 1)
    prefetch = [(d, d) for d in PREFETCH_DEPTHS if d <= depth_cap]
    if (p.forward_prefetch, p.backward_prefetch) not in prefetch:
        prefetch.append((p.forward_prefetch, p.backward_prefetch))
    compile_values = [p.compile, not p.compile] if find_cxx_compiler() else [p.compile]
    grouping = [p.blocks_per_group] + [k for k in sorted({1, min(2, cfg.model.n_layers), cfg.model.n_layers})
                                       if k != p.blocks_per_group]
    return {"reshard": [True, False], "prefetch": prefetch, "ac": list(AC_ORDER), "batching": batching,
            "compile": compile_values, "grouping": grouping, "tp": tp_values,
            "ep": degrees(cfg, world_size, "ep"), "cp": cp_values}


def config_candidate(cfg: Config, world_size: int) -> Candidate:
    """The config's own settings as a candidate (an N-way ``reshard_after_forward`` counts as true: the
    planner models true and false only; a micro-batch that does not divide G / N becomes the largest smaller
    one that does; a grad_sync that has no effect with one micro-batch is kept as it is; prefetch depths are
    cut to the other block groups, :meth:`Candidate.normalized`)."""
    cfg = with_fixed_defaults(cfg)  # an "auto" setting is searched from its fixed default
    p = cfg.parallel
    reshard = p.reshard_after_forward if isinstance(p.reshard_after_forward, bool) else True
    per_rank = local_batch(cfg, world_size, p.tp)
    micro = max(m for m in range(1, min(per_rank, cfg.train.micro_batch_size) + 1) if per_rank % m == 0)
    return Candidate(reshard, p.forward_prefetch, p.backward_prefetch, p.activation_checkpoint, micro,
                     p.grad_sync, p.compile, p.blocks_per_group, p.tp, p.ep,
                     p.cp).normalized(cfg.model.n_layers)


def block_bytes(cfg: Config, world_size: int) -> int:
    """Bytes of the largest block group's unsharded parameters in the compute dtype (what one prefetch holds;
    under tensor parallel this rank's pieces, FSDP-sharded over the N / tp data-parallel ranks)."""
    cfg = with_fixed_defaults(cfg)  # an "auto" setting is searched from its fixed default
    param_bytes = 2 if cfg.parallel.param_dtype == "bfloat16" else 4
    tp = cfg.parallel.tp
    groups, _, _ = param_groups(cfg, world_size // tp, param_bytes, tp)
    blocks = [g for g in groups if g.name.startswith("block")] or groups
    return max(round(g.numel * param_bytes * g.gather_factor) for g in blocks)


class Planner:
    """Predicted per-rank peak bytes of candidates of one config, cached (each prediction builds a
    meta model)."""

    def __init__(self, cfg: Config, world_size: int, device: str, budget: float) -> None:
        self.cfg, self.world_size, self.device, self.budget = cfg, world_size, device, budget
        self._cache: dict[Candidate, int] = {}
        # (blocks per group, tp, ep) -> the largest group's bytes (FSDP shards over N / tp at every cp)
        self._group: dict[tuple[int, int, int], int] = {}
        self._layout: dict[tuple[int, int, int], bool] = {}  # (tp, ep, cp) -> layout_allowed

    def bytes(self, cand: Candidate) -> int:
        """Predicted peak bytes per rank of ``cand``: the planner's, plus the explicit prefetch's blocks.

        Raises:
            ConfigError: the planner refuses the candidate (e.g. global batch not divisible).
        """
        if cand not in self._cache:
            cfg = apply(self.cfg, cand)
            plan = plan_memory(cfg, self.world_size, self.device)
            group = (cand.blocks_per_group, cand.tp, cand.ep)
            if group not in self._group:
                self._group[group] = block_bytes(cfg, self.world_size)
            cut = cand.normalized(cfg.model.n_layers)  # a depth holds at most the other groups
            depth = max(cut.forward_prefetch, cut.backward_prefetch)
            self._cache[cand] = plan.peak + depth * self._group[group]
        return self._cache[cand]

    def fits(self, cand: Candidate) -> bool:
        return self.bytes(cand) <= self.budget

    def allowed(self, cand: Candidate) -> bool:
        """Whether the planner predicts ``cand`` at all: a tp, ep and cp the trainer accepts together
        (:func:`layout_allowed`; the config's own always), a micro-batch that divides the batch of a
        data-parallel rank at that ``cp`` and ``tp`` (:func:`local_batch`), a checkpointing mode it models at
        that ``tp`` (:func:`ac_modes`)."""
        layout, p = (cand.tp, cand.ep, cand.cp), self.cfg.parallel
        if layout not in self._layout:  # the config's own: the planner's own errors say what is wrong with it
            self._layout[layout] = layout == (p.tp, p.ep, p.cp) or layout_allowed(self.cfg, self.world_size,
                                                                                  *layout)
        if not self._layout[layout]:
            return False
        per_rank = local_batch(self.cfg, self.world_size, cand.tp, cand.cp)
        return per_rank % cand.micro_batch_size == 0 and cand.activation_checkpoint in ac_modes(cand.tp)


# ---- memory budget ----------------------------------------------------------------------------
def available_host_memory() -> int:
    """Bytes of RAM available now (``MemAvailable`` of /proc/meminfo; free pages elsewhere)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


@dataclass(frozen=True)
class Budget:
    """Usable bytes per rank, the planner's device name, and how the figure was found (for the report)."""

    bytes: float
    device: str
    source: str


def memory_budget(device: str, world_size: int, headroom: float, memory_per_rank_gib: float | None,
                  cuda_name: str | None = None, cuda_total_bytes: int = 0) -> Budget:
    """The usable memory per rank.

    Args:
        device: ``cpu``, a name of :data:`shardlm.plan.devices.DEVICES`, or ``auto`` (the GPU described by
            ``cuda_name``/``cuda_total_bytes`` when given, else the CPU).
        world_size: ranks sharing the host's RAM on a CPU.
        headroom: fraction kept free (allocator fragmentation, the process itself).
        memory_per_rank_gib: overrides the device's memory per rank when given.

    Raises:
        ConfigError: unknown device name, or a headroom outside [0, 1).
    """
    if not 0 <= headroom < 1:
        raise ConfigError(f"--headroom must be in [0, 1), got {headroom}")
    if device == "auto":
        device = "cpu"
        if cuda_name is not None:  # the planner needs a GPU name (only offload depends on it): an unknown one
            known = device_for_cuda_name(cuda_name)  # counts as an H100, with its own memory size
            device = known.name if known is not None else "h100"
    dev = get_device(device)
    if memory_per_rank_gib is not None:
        if memory_per_rank_gib <= 0:
            raise ConfigError(f"--memory-per-rank must be positive (GiB), got {memory_per_rank_gib}")
        total, source = memory_per_rank_gib * GIB, "--memory-per-rank"
    elif device == "cpu":
        total = available_host_memory() / world_size
        source = f"RAM available now / {world_size} ranks"
    elif cuda_total_bytes:
        total, source = cuda_total_bytes, f"{cuda_name} memory"
    else:
        total, source = dev.memory_bytes, f"{dev.name} memory"
    return Budget(total * (1 - headroom), device,
                  f"{size(total)} per rank ({source}) less {headroom:.0%} headroom")


