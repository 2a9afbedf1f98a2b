"""What fits when a config does not: ``shardlm plan``'s search over combinations of memory-saving settings.

The search varies, together: activation checkpointing (``none``, ``selective``, ``full``; under tensor
parallel ``none`` and ``full``, the modes the planner models there), the micro-batch size (every divisor of
the config's, the global batch kept: more gradient accumulation), ``reshard_after_forward``, CPU offload, bf16
parameters (with fp32 reduction), gradient sync on every micro-batch, FSDP instead of DDP or one process, and
the world size (the config's times 1, 2, 4, ... 64, as far as the global batch divides and an HSDP mesh with
both ``dp_replicate`` and ``dp_shard`` set allows). Each combination's peak comes from
:func:`shardlm.plan.memory.plan_memory`, its step time from :func:`shardlm.plan.time.plan_time` (FLOPs at the
dense peak, communication at the bus bandwidth, overlapped: a lower bound) plus, with CPU offload, an estimate
of the host work that does not overlap (:func:`offload_seconds`).

Of the combinations that fit, it keeps for each world size the fastest (and, at the smallest world size where
anything fits, the few fastest, none of them another one's changes plus more; ties go to fewer changes), and
drops a larger world size unless its step is :data:`MIN_GAIN` faster than every smaller one's: the list runs
from the fewest GPUs to the fastest step. Peaks decrease monotonically with stronger checkpointing, a
smaller micro-batch, resharding, offload and gradient sync on every micro-batch, so a combination that saves
less than one that does not fit (with the same dtype, mode and world size) is not planned.
"""

from __future__ import annotations

import copy
import itertools
from dataclasses import dataclass

from shardlm.config import Config, ConfigError, gradient_accumulation_steps, validate
from shardlm.config.auto import with_fixed_defaults
from shardlm.plan.activations import TP_AC_MODES
from shardlm.plan.devices import Device, get_device
from shardlm.plan.memory import plan_memory
from shardlm.plan.param_groups import param_groups
from shardlm.plan.time import flops_per_token, plan_time

GIB = 1024**3
HOST_LINK_BW = 50e9
"""Host <-> device bytes/s per GPU used for CPU offload: PCIe Gen5 x16 (64 GB/s per direction on paper, ~50
sustained), an assumption for H100/H200/B200 nodes, stated in every offload cost line."""
HOST_MEMORY_BW = 25e9
"""Host memory bytes/s per GPU for the offloaded AdamW step: a node's ~200 GB/s of DDR5 shared by 8 GPUs (an
assumption)."""
ADAMW_HOST_BYTES = 28
"""Bytes AdamW streams per parameter on the host: fp32 parameter, gradient, two moments read (16), parameter
and moments written (12)."""
WORLD_FACTORS = (1, 2, 4, 8, 16, 32, 64)
"""World sizes tried, as multiples of the config's."""
MIN_GAIN = 0.1
"""A larger world size is listed only when its step is at least this fraction faster than every
smaller one's."""

AC_ORDER = {"none": 0, "selective": 1, "every_n": 1, "full": 2}
"""How much each activation-checkpointing mode saves, for the pruning order (``every_n`` and ``selective``
are not compared with each other)."""


@dataclass(frozen=True)
class Choice:
    """One combination of settings: the values the search varies, at one world size."""

    world_size: int
    """Ranks N."""
    mode: str
    """``parallel.mode``."""
    ac: str
    """``parallel.activation_checkpoint``."""
    micro_batch: int
    """``train.micro_batch_size`` (the global batch is the config's)."""
    reshard: bool
    """``parallel.reshard_after_forward`` (FSDP)."""
    offload: bool
    """``parallel.cpu_offload`` (FSDP on a GPU)."""
    param_dtype: str
    """``parallel.param_dtype``; ``bfloat16`` where the config has ``float32`` comes with fp32 reduction."""
    grad_sync: str
    """``parallel.grad_sync``."""

    def saves_at_least(self, other: Choice) -> bool:
        """Whether this combination saves at least as much memory as ``other`` in every varied setting (same
        world size, mode and dtype; the order of the module docstring)."""
        if (self.world_size, self.mode, self.param_dtype) != (
            other.world_size,
            other.mode,
            other.param_dtype,
        ):
            return False
        if self.ac != other.ac and (
            AC_ORDER[self.ac] <= AC_ORDER[other.ac] or "every_n" in (self.ac, other.ac)
        ):
            return False
        return (self.micro_batch <= other.micro_batch and self.reshard >= other.reshard
                and self.offload >= other.offload
                and (self.grad_sync == other.grad_sync or self.grad_sync == "every_micro_batch"))


@dataclass
class Fit:
    """A combination that fits: its flags, predicted peak (bytes), step time (s) and one-line cost."""

    choice: Choice
    """The settings."""
    flags: list[str]
    """What to add to the ``shardlm plan`` (or training) command line: ``--world-size N`` and overrides."""
    peak: int
    """Predicted per-rank peak, bytes."""
    step_s: float
    """Predicted step time, seconds (a lower bound, :func:`step_seconds`)."""
    cost: str
    """One line: step time against the config's, GPUs, and the price of each change."""


def variant(cfg: Config, c: Choice) -> Config:
    """``cfg`` with the settings of ``c`` (a copy; bf16 parameters come with fp32 reduction).

    Raises:
        ConfigError: the combination is not a valid config (e.g. an FSDP-only setting under DDP).
    """
    out = copy.deepcopy(cfg)
    p = out.parallel
    p.mode, p.activation_checkpoint, p.grad_sync = c.mode, c.ac, c.grad_sync
    out.train.micro_batch_size = c.micro_batch
    if c.mode == "fsdp":
        p.reshard_after_forward, p.cpu_offload = c.reshard, c.offload
        if c.param_dtype != p.param_dtype:
            p.param_dtype, p.reduce_dtype = c.param_dtype, "float32"
    validate(out)
    return out


def flags(cfg: Config, c: Choice) -> list[str]:
    """The command-line flags that turn ``cfg`` at its world size into ``c``: ``--world-size N`` and the
    ``--section.key=value`` overrides that differ (appended to the original command, they replace
    its values)."""
    p = cfg.parallel
    out = [f"--world-size {c.world_size}"]
    if c.mode != p.mode:
        out.append(f"--parallel.mode={c.mode}")
    if c.ac != p.activation_checkpoint:
        out.append(f"--parallel.activation_checkpoint={c.ac}")
    if c.micro_batch != cfg.train.micro_batch_size:
        out.append(f"--train.micro_batch_size={c.micro_batch}")
    if c.mode == "fsdp" and c.reshard != p.reshard_after_forward:
        out.append(f"--parallel.reshard_after_forward={str(c.reshard).lower()}")
    if c.offload != p.cpu_offload:
        out.append(f"--parallel.cpu_offload={str(c.offload).lower()}")
    if c.param_dtype != p.param_dtype:
        out.append(f"--parallel.param_dtype={c.param_dtype} --parallel.reduce_dtype=float32")
    if c.grad_sync != p.grad_sync:
        out.append(f"--parallel.grad_sync={c.grad_sync}")
    return out


def offload_seconds(cfg: Config, world_size: int) -> float:
    """Seconds per step CPU offload adds, an estimate that assumes none of it overlaps compute.

    Host to device: each all-gather first copies the fp32 shard up, k·(1 + r) times per step (k micro-batches,
    r = 1 when resharded after forward); device to host: the fp32 gradient shard after each reduce-scatter (k
    or 1 times); both at :data:`HOST_LINK_BW`. The AdamW step on the host streams :data:`ADAMW_HOST_BYTES` per
    trainable local parameter at :data:`HOST_MEMORY_BW`. 0 without offload.
    """
    if not (cfg.parallel.cpu_offload and cfg.parallel.mode == "fsdp"):
        return 0.0
    cp, tp = cfg.parallel.cp, cfg.parallel.tp  # N / (cp·tp) data-parallel ranks; FSDP shards over N / tp
    k = gradient_accumulation_steps(cfg, world_size // (cp * tp))
    groups, _, _ = param_groups(cfg, world_size // tp, tp=tp)
    stored = sum(g.stored_shard_bytes for g in groups)
    trainable = sum(g.grad_shard_numel for g in groups)
    gathers = k * (2 if cfg.parallel.reshard_after_forward else 1)
    syncs = k if cfg.parallel.grad_sync != "last_micro_batch" else 1
    return (
        gathers * stored + syncs * 4 * trainable
    ) / HOST_LINK_BW + ADAMW_HOST_BYTES * trainable / HOST_MEMORY_BW


def step_seconds(cfg: Config, world_size: int, device: Device, params: int) -> float:
    """Predicted step time (s): compute and communication overlapped (lower bounds) plus
    :func:`offload_seconds`."""
    return plan_time(cfg, world_size, device, params).overlapped_s + offload_seconds(cfg, world_size)


def cost_line(cfg: Config, world_size: int, c: Choice, var: Config, step_s: float, base_s: float,
              device: Device) -> str:
    """One line saying what ``c`` costs against the config: step time, GPUs, and each change's price."""
    p = cfg.parallel
    parts = []
    if c.ac != p.activation_checkpoint:
        extra = flops_per_token(var, c.ac) / flops_per_token(cfg, p.activation_checkpoint) - 1
        if c.ac == "full":
            parts.append(f"~{extra:.0%} more compute for full AC (each block's forward runs twice)")
        elif c.ac == "selective":
            parts.append("selective AC recomputes the element-wise ops (few FLOPs, some time)"
                         + (f"; {-extra:.0%} less compute than full AC" if extra < 0 else ""))
        else:
            parts.append(f"no recompute ({-extra:.0%} less compute)")
    if c.micro_batch != cfg.train.micro_batch_size:
        k = gradient_accumulation_steps(var, c.world_size // (var.parallel.cp * var.parallel.tp))
        parts.append(
            f"micro-batch {c.micro_batch}"
            + (
                f" x {k} accumulation steps (same global batch; "
                "smaller matmuls run further below peak; one all-gather round per micro-batch)"
                if k > 1
                else " (smaller matmuls run further below peak)"
            )
        )
    if c.mode == "fsdp" and c.reshard != p.reshard_after_forward:
        parts.append(
            "blocks all-gathered again for backward (+1 all-gather per micro-batch)"
            if c.reshard
            else "blocks kept unsharded between forward and backward (one all-gather fewer per micro-batch)"
        )
    if c.offload and not p.cpu_offload:
        parts.append(f"CPU offload ~{offload_seconds(var, c.world_size):.1f} s/step of host copies and host "
                     f"AdamW (at {HOST_LINK_BW / 1e9:.0f} GB/s PCIe, {HOST_MEMORY_BW / 1e9:.0f} GB/s host "
                     "memory per GPU)")
    if c.param_dtype != p.param_dtype:
        now = plan_time(cfg, world_size, device, 0)
        parts.append(f"bf16 compute ({device.peak_flops('bf16') / now.peak_flops:.0f}x the {now.precision} "
                     "peak), weights rounded to bf16 in the matmuls")
    if c.grad_sync != p.grad_sync:
        parts.append("a reduce-scatter on every micro-batch")
    if c.mode != p.mode:
        parts.append("FSDP shards parameters, gradients and AdamW state")
    if c.world_size != world_size:
        parts.append(f"{c.world_size / world_size:g}x the GPUs")
    head = (f"step >= {step_s:.3g} s ({step_s / base_s:.2f}x the config's {base_s:.3g} s) on {c.world_size} "
            "GPUs")
    return head + (": " + "; ".join(parts) if parts else "")


def choices(cfg: Config, world_size: int, device: str) -> list[Choice]:
    """Every combination the search considers (module docstring), the config's world size first."""
    p = cfg.parallel
    modes = [p.mode] + (["fsdp"] if p.mode != "fsdp" else [])
    acs = ["none", "selective", "full"] + (
        [p.activation_checkpoint] if p.activation_checkpoint == "every_n" else []
    )
    if p.tp > 1:  # the modes the planner models under tensor parallel
        acs = [a for a in acs if a in TP_AC_MODES]
    mbs = [b for b in range(cfg.train.micro_batch_size, 0, -1) if cfg.train.micro_batch_size % b == 0]
    dtypes = [p.param_dtype] + (["bfloat16"] if p.param_dtype != "bfloat16" else [])
    syncs = [p.grad_sync] + (["every_micro_batch"] if p.grad_sync == "last_micro_batch" else [])
    reshard_now = p.reshard_after_forward if isinstance(p.reshard_after_forward, bool) else True
    out = []
    for factor in WORLD_FACTORS:
        n = world_size * factor
        for mode, ac, b, dtype, sync in itertools.product(modes, acs, mbs, dtypes, syncs):
            if mode == "single" and n != 1:
                continue
            fsdp = mode == "fsdp"
            if not fsdp and dtype != p.param_dtype:
                continue
            for reshard, offload in itertools.product([True, False] if fsdp else [reshard_now],
                                                      [False, True] if fsdp and device != "cpu" else [False]):
                out.append(Choice(n, mode, ac, b, reshard, offload, dtype, sync))
    return out


def search(cfg: Config, world_size: int, device_name: str, budget: float, first_few: int = 3,
           limit: int = 6) -> list[Fit]:
    """Combinations of settings under which ``cfg`` fits in ``budget`` bytes per rank (module docstring).

    Args:
        cfg: the config that does not fit at ``world_size``.
        world_size: its world size.
        device_name: a key of :data:`shardlm.plan.devices.DEVICES`.
        budget: usable bytes per device (memory less the headroom).
        first_few: how many to keep at the smallest world size where something fits.
        limit: the most returned.

    Returns:
        At most ``limit`` :class:`Fit`, by world size, each faster than all before it (the first few at the
        smallest world size by step time); empty when nothing tried fits.
    """
    cfg = with_fixed_defaults(cfg)  # "auto" settings not chosen yet: their fixed defaults
    device = get_device(device_name)
    params = param_groups(cfg, 1)[1]
    base_s = step_seconds(cfg, world_size, device, params)
    timed: dict[int, list[tuple[float, Choice, Config]]] = {}
    for c in choices(cfg, world_size, device_name):
        try:
            var = variant(cfg, c)
            t = step_seconds(var, c.world_size, device, params)
        except ConfigError:  # not a valid config, or the global batch does not divide at this world size
            continue
        timed.setdefault(c.world_size, []).append((t, c, var))
    peaks: dict[Choice, int | None] = {}

    def peak_of(c: Choice, var: Config) -> int | None:
        if c not in peaks:
            try:
                peaks[c] = plan_memory(var, c.world_size, device_name).peak
            except ConfigError:
                peaks[c] = None
        return peaks[c]

    fits: list[Fit] = []
    for n in sorted(timed):
        failed: list[Choice] = []
        for _t, c, var in timed[n]:
            # the most saving of each dtype and mode first: when it fails, all of them do
            if all(
                c.saves_at_least(o)
                for _, o, _ in timed[n]
                if (o.mode, o.param_dtype) == (c.mode, c.param_dtype)
            ):
                peak = peak_of(c, var)
                if peak is None or peak > budget:
                    failed.append(c)
        found: list[Fit] = []
        want = first_few if not fits else 1
        for t, c, var in sorted(timed[n], key=lambda x: (x[0], len(flags(cfg, x[1])))):
            if fits and t > (1 - MIN_GAIN) * min(f.step_s for f in fits):
                break  # not clearly faster than with fewer GPUs
            mine = flags(cfg, c)
            if any(f.saves_at_least(c) for f in failed) or any(
                set(f.flags) <= set(mine) or (t <= 1.01 * f.step_s and len(f.flags) <= len(mine))
                for f in found
            ):
                continue  # cannot fit, or no better than a fit already found
            peak = peak_of(c, var)
            if peak is None or peak > budget:
                failed.append(c)
                continue
            found.append(Fit(c, mine, peak, t, cost_line(cfg, world_size, c, var, t, base_s, device)))
            if len(found) >= want:
                break
        fits.extend(found)
        if len(fits) >= limit:
            break
    return fits[:limit]


def format_fits(fits: list[Fit]) -> list[str]:
    """The lines ``shardlm plan`` prints for :func:`search`'s result."""
    if not fits:
        return ["  nothing tried fits (activation checkpointing, micro-batch, resharding, CPU offload, bf16, "
                f"up to {WORLD_FACTORS[-1]}x the GPUs)"]
    lines = ["  fits with (fewest GPUs first, each faster than those before; add the flags to this command):"]
    for f in fits:
        lines.append(f"    {' '.join(f.flags)}")
        lines.append(f"        peak {f.peak / GIB:.1f} GiB; {f.cost}")
    return lines
