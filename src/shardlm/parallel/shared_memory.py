"""FSDP's all-gather and reduce-scatter through shared memory, for CPU ranks on one host (gloo).

Gloo moves every byte through a TCP socket, so on one machine a collective costs two copies through the
kernel and the latency of loopback TCP. Here the ranks of a group map one file in ``/dev/shm`` (a
*segment*, created by the group's first rank, unlinked as soon as every rank has mapped it or mapping
failed, so a process that dies after the first collectives leaves nothing behind) and a collective is: each
rank writes its part into its slot, one tiny gloo all-reduce as the barrier, each rank reads what it needs.

- all-gather: rank r writes its shard (n,) to slot r; after the barrier every rank copies the W slots, in
  rank order, to its output (W·n,). Only bytes move: bit-identical to gloo's all-gather.
- reduce-scatter: rank r writes its whole input (W·n,) to slot r; after the barrier rank r sums chunk r of
  the W slots in rank order, as :class:`~shardlm.parallel.reduce_scatter.AllToAllReduceScatter` does (so
  the two are bit-identical at any world size, and equal gloo's own at 2 ranks).

A segment has two halves used in turn: a rank that has passed the barrier of call k has finished reading
call k - 1, so call k + 1 may overwrite the half call k - 1 used; one barrier per call suffices. Measured
here (2 ranks, 2 cores, fp32, 20.5 MB, ``bench/bench_collectives.py``, mean wall time of a call): all-gather
4.0-5.4 ms against point-to-point sends' 6.6-9.6 ms (gloo's own 14.8-16.9), reduce-scatter 6.8 ms against the
all-to-all's 14.7-15.8 ms (gloo's own 24.2-25.6).

The segment of a group holds two halves of the largest call so far (a reduce-scatter's half is W times its
input): 2 · W · G bytes of host memory for a largest FSDP group of G bytes (the reduce dtype's), shared by
the group's ranks, outside the allocator (so outside the planner's and the measured per-rank peaks). Used
only when every rank of the job is on one host (torchrun's ``LOCAL_WORLD_SIZE`` equals ``WORLD_SIZE``) and
``/dev/shm`` has room (:func:`shared_memory_usable`).
"""

from __future__ import annotations

import mmap
import os
import uuid
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.profiler import record_function

from shardlm.errors import ConfigError
from shardlm.parallel.dist import local_world_size
from shardlm.parallel.reduce_scatter import sum_in_rank_order

#: where segments live (a tmpfs on Linux)
SHM_DIR = "/dev/shm"
#: the profiler ranges of the two collectives (``shardlm profile``'s overlap report classifies them)
ALL_GATHER_NAME = "shardlm::all_gather_shared_memory"
REDUCE_SCATTER_NAME = "shardlm::reduce_scatter_shared_memory"
_NAME_BYTES = 4096  # PATH_MAX: the segment's path, sent from the first rank


def single_host() -> bool:
    """Whether every rank of the job runs on this host: torchrun's ``LOCAL_WORLD_SIZE`` equals
    ``WORLD_SIZE`` (:func:`~shardlm.parallel.dist.local_world_size`; the Ray launcher sets both)."""
    return local_world_size() == int(os.environ.get("WORLD_SIZE", "1"))


def shared_memory_usable(need_bytes: int) -> bool:
    """Whether segments can be made here: one host (:func:`single_host`) and ``/dev/shm`` a directory with
    at least ``need_bytes`` free (Docker's default ``/dev/shm`` is 64 MB)."""
    if not single_host() or not os.path.isdir(SHM_DIR):
        return False
    try:
        st = os.statvfs(SHM_DIR)
    except OSError:
        return False
    return st.f_bavail * st.f_frsize >= need_bytes


def shared_memory_fits(n_params: int, world_size: int) -> bool:
    """Whether a run of ``n_params`` parameters over ``world_size`` ranks can take the shared-memory
    collectives (``auto``'s test): :func:`shared_memory_usable` with room for two halves of a reduce-scatter
    of the whole model in fp32, 2 · W · 4 · P bytes (an upper bound: the largest FSDP group is at most the
    model). 1 rank needs none."""
    return world_size > 1 and shared_memory_usable(2 * world_size * 4 * n_params)


def check_shared_memory(all_gather: str, reduce_scatter: str, device_type: str) -> None:
    """Refuse ``parallel.all_gather`` / ``parallel.reduce_scatter`` set to ``"shared_memory"`` where segments
    cannot serve: a ``device_type`` other than ``"cpu"`` (the barrier is a gloo all-reduce of a CPU tensor),
    or ranks on more than one host (:func:`single_host`: the other hosts' ranks cannot open the file, and this
    host's would wait at the barrier until the timeout). ``auto`` never takes them there.

    Raises:
        ConfigError: either setting is ``"shared_memory"`` on such a job, named with the cause.
    """
    if "shared_memory" not in (all_gather, reduce_scatter):
        return
    names = "parallel.all_gather / parallel.reduce_scatter = \"shared_memory\""
    if device_type != "cpu":
        raise ConfigError(f"{names} is for CPU ranks (gloo); this job runs on {device_type}: use \"auto\"")
    if not single_host():
        raise ConfigError(
            f"{names} needs every rank on one host, but LOCAL_WORLD_SIZE = {local_world_size()} of "
            f"WORLD_SIZE = {os.environ.get('WORLD_SIZE')}: use \"auto\" (point_to_point / all_to_all there)")


def shared_memory_agreed(n_params: int, world_size: int) -> bool:
    """:func:`shared_memory_fits` as every rank of the job sees it: true only where it holds on every rank.

    Each rank reads ``/dev/shm``'s free room at its own moment (another job's segments come and go), and
    ranks that chose different collectives would wait on each other's barriers or mix up bytes. A collective
    (a one-element MIN all-reduce over the default group, which must take CPU tensors: gloo) when a process
    group is initialised: every rank calls this once per model build, whatever its ``n_params`` (a pipeline
    stage counts its own), so nothing here may depend on them to decide whether to call it. Else this rank's
    answer. :func:`shared_memory_chosen` reads the answer back without a collective."""
    fits = shared_memory_fits(n_params, world_size)
    if world_size > 1 and dist.is_initialized():
        flag = torch.tensor([int(fits)])
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        fits = bool(flag.item())
    _CHOSEN[0] = fits
    return fits


#: the last answer of :func:`shared_memory_agreed` in this process
_CHOSEN = [False]


def shared_memory_chosen() -> bool:
    """What the last :func:`shared_memory_agreed` in this process decided (False before any): the collectives
    the model was built with, for the start-up summary. No collective: a pipeline stage's summary counts
    other parameters than the build did, and ranks must not disagree on whether to call one."""
    return _CHOSEN[0]


class _Segment:
    """One group's shared bytes: two halves used in turn, grown (collectively) when a call needs more."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group
        self.half_bytes = 0
        self.map: mmap.mmap | None = None
        self.turn = 0
        self.flag = torch.zeros(1)

    def half(self, nbytes: int) -> torch.Tensor:
        """The next half as ``nbytes`` uint8 (every rank of the group calls this in the same order with the
        same size, as FSDP's collectives are)."""
        if nbytes > self.half_bytes:
            self._grow(nbytes)
        assert self.map is not None
        offset = self.turn * self.half_bytes
        self.turn ^= 1
        return torch.frombuffer(self.map, dtype=torch.uint8, count=nbytes, offset=offset)

    def barrier(self) -> None:
        """Every rank of the group has written its slot (a one-element all-reduce: gloo's barrier is
        slower)."""
        dist.all_reduce(self.flag, group=self.group)

    def _grow(self, nbytes: int) -> None:
        """Replace the segment by one of two ``nbytes`` halves: the group's first rank creates the file and
        gives it its room, sends its name (empty when that failed: every rank raises), every rank maps it,
        the first rank unlinks it."""
        rank, size = self.group.rank(), 2 * nbytes
        name = torch.zeros(_NAME_BYTES, dtype=torch.uint8)
        error = "it failed on the group's first rank"
        if rank == 0:
            path = os.path.join(SHM_DIR, f"shardlm-{os.getpid()}-{uuid.uuid4().hex[:16]}")
            try:
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
                try:
                    os.posix_fallocate(fd, 0, size)  # the room now: a full /dev/shm fails here, not by SIGBUS
                finally:
                    os.close(fd)
                name[:len(path)] = torch.frombuffer(bytearray(path.encode()), dtype=torch.uint8)
            except OSError as exc:
                error = str(exc)
                if os.path.exists(path):
                    os.unlink(path)
        dist.broadcast(name, group=self.group, group_src=0)
        path = name.numpy().tobytes().rstrip(b"\0").decode()  # through numpy: no host read to count
        if not path:
            raise ConfigError(
                f"could not make a {size / 2**20:.1f} MiB shared-memory segment in {SHM_DIR} for FSDP's "
                f"collectives ({error}); give {SHM_DIR} more room "
                "(docker: --shm-size) or set parallel.all_gather = \"point_to_point\" and "
                "parallel.reduce_scatter = \"all_to_all\"")
        try:
            with open(path, "r+b") as f:
                new = mmap.mmap(f.fileno(), size)
            self.barrier()  # every rank has mapped it
        finally:
            if rank == 0:  # mapped everywhere, or failed: nothing is left in /dev/shm either way
                os.unlink(path)
        self.map, self.half_bytes, self.turn = new, nbytes, 0


class _Segments:
    """A segment per process group, made on first use."""

    def __init__(self) -> None:
        self._by_group: dict[int, _Segment] = {}

    def __call__(self, group: dist.ProcessGroup) -> _Segment:
        key = id(group)
        if key not in self._by_group:
            self._by_group[key] = _Segment(group)
        return self._by_group[key]


class SharedMemoryAllGather:
    """An all-gather of a flat buffer through a shared segment (see the module docstring).

    The two methods of FSDP2's ``AllGather`` interface (``allocate`` and the call). Called by FSDP2 with
    ``input_tensor`` (n,) (this rank's shard) and ``output_tensor`` (W·n,) of any dtype on the group ``group``
    of W ranks; ``async_op`` goes to the backend's own ``all_gather_single``.
    """

    def __init__(self, segments: _Segments) -> None:
        self.segments = segments

    def allocate(self, size: Sequence[int | torch.SymInt], *, dtype: torch.dtype,
                 device: torch.device) -> torch.Tensor:
        """A plain uninitialised tensor of ``size`` (FSDP's default allocation)."""
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 async_op: bool = False) -> dist.Work | None:
        """``output_tensor`` (W·n,) = every rank's ``input_tensor`` (n,) in rank order."""
        if async_op:
            return dist.all_gather_single(output_tensor, input_tensor, group=group, async_op=True)
        world, rank = group.size(), group.rank()
        out = output_tensor.view(torch.uint8)
        if world == 1:  # a group of one (e.g. experts split over every rank): the shard is the output
            if out.data_ptr() != input_tensor.data_ptr():
                out.copy_(input_tensor.view(torch.uint8))
            return None
        with record_function(ALL_GATHER_NAME):
            segment = self.segments(group)
            slots = segment.half(out.numel()).view(world, -1)
            slots[rank].copy_(input_tensor.view(torch.uint8))
            segment.barrier()
            out.copy_(slots.view(-1))
        return None


class SharedMemoryReduceScatter:
    """A reduce-scatter of a flat buffer through a shared segment (see the module docstring).

    The two methods of FSDP2's ``ReduceScatter`` interface. FSDP2 allocates the input (W·n,), copies the
    gradients into it, allocates the output (n,) and calls: :meth:`allocate` hands out this rank's slot of
    the segment's next half as that input, so FSDP's copy-in writes straight into shared memory (no copy of
    ours, and pages that stay mapped); the output is a plain tensor. Called with ``input_tensor`` (W·n,) and
    ``output_tensor`` (n,) of the reduce dtype on the group ``group`` of W ranks; ``op`` SUM or AVG (the sum
    divided by W). An input that is not the slot handed out is copied into it first. Other ops and
    ``async_op`` go to the backend's own ``reduce_scatter_tensor``.
    """

    def __init__(self, segments: _Segments) -> None:
        self.segments = segments
        self.group: dist.ProcessGroup | None = None  # this FSDP group's shard group, from the first call
        self._slots: torch.Tensor | None = None  # the half handed out by allocate, (W, W·n) of its dtype

    def allocate(self, size: Sequence[int | torch.SymInt], *, dtype: torch.dtype,
                 device: torch.device) -> torch.Tensor:
        """The reduce-scatter's input: this rank's slot of the next half (W·n,); the output (asked for next,
        while a slot is out): a plain uninitialised tensor."""
        if self.group is None or self._slots is not None or device.type != "cpu" or len(size) != 1:
            return torch.empty(*size, dtype=dtype, device=device)
        world, numel = self.group.size(), int(size[0])
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        half = self.segments(self.group).half(world * nbytes)
        self._slots = half.view(dtype).view(world, numel)
        return self._slots[self.group.rank()]

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 op: dist.ReduceOp, async_op: bool = False) -> dist.Work | None:
        """``output_tensor`` = this rank's chunk of ``input_tensor`` summed (or averaged) over ``group``."""
        slots, self._slots = self._slots, None
        if self.group is not None and group is not self.group:
            raise RuntimeError("one SharedMemoryReduceScatter serves one FSDP group's shard group")
        self.group = group
        if async_op or op not in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):
            return dist.reduce_scatter_tensor(output_tensor, input_tensor, op=op, group=group,
                                              async_op=async_op)
        world, rank = group.size(), group.rank()
        with record_function(REDUCE_SCATTER_NAME):
            segment = self.segments(group)
            if slots is None or slots.shape[1] != input_tensor.numel() or slots.dtype != input_tensor.dtype:
                nbytes = input_tensor.numel() * input_tensor.element_size()
                slots = segment.half(world * nbytes).view(input_tensor.dtype).view(world, -1)
            if slots[rank].data_ptr() != input_tensor.data_ptr():
                slots[rank].copy_(input_tensor)
            segment.barrier()
            # (W, n): chunk ``rank`` of every rank's input
            sum_in_rank_order(output_tensor, slots.view(world, world, -1)[:, rank], op)
        return None


def use_shared_memory(model: torch.nn.Module, all_gather: bool, reduce_scatter: bool) -> None:
    """Every FSDP group of ``model`` all-gathers (``all_gather``) and/or reduce-scatters
    (``reduce_scatter``) through shared segments, one per process group, shared by the two."""
    segments = _Segments()
    gather = SharedMemoryAllGather(segments)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            if all_gather:
                module.set_custom_all_gather(gather)
            if reduce_scatter:  # one each: it hands out its group's slots between allocate and the call
                module.set_custom_reduce_scatter(SharedMemoryReduceScatter(segments))
