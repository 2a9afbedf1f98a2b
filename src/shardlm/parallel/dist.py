"""Process-group start-up from torchrun's environment, and the one place that picks the device.

torchrun sets RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT for each process
(https://pytorch.org/docs/stable/elastic/run.html). Without them (plain ``python``), a one-process
group is created in memory, so the same code runs unchanged.
"""

from __future__ import annotations

import logging
import os
import sys
from dataclasses import dataclass
from datetime import timedelta
from typing import NoReturn

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from shardlm.config import ParallelConfig
from shardlm.errors import ConfigError, RankFailed
from shardlm.parallel.host_memory import keep_freed_memory
from shardlm.parallel.launcher_exit import stop_with_launcher

#: whether this process started a process group (see :func:`exit_process`)
_started_process_group = False


@dataclass(frozen=True)
class DistInfo:
    """Where this process sits: global rank, rank on its node, world size, device and backend."""

    rank: int
    local_rank: int
    world_size: int
    device: torch.device
    backend: str

    @property
    def is_main(self) -> bool:
        """True on global rank 0, the rank that writes files and prints."""
        return self.rank == 0


def pick_device(requested: str, local_rank: int, local_ranks: int = 1) -> torch.device:
    """``cuda:<local_rank>`` when CUDA is available (or requested), else ``cpu``.

    Args:
        requested: ``parallel.device``: ``auto``, ``cpu`` or ``cuda``.
        local_rank: this rank's index on its node (torchrun's ``LOCAL_RANK``).
        local_ranks: ranks on this node (torchrun's ``LOCAL_WORLD_SIZE``).

    Raises:
        ConfigError: ``cuda`` was requested but no CUDA device is visible; or more ranks run on this
            node than it has visible GPUs (two ranks would share one GPU: NCCL refuses or, worse,
            both ranks run at half speed with twice the memory), named with both counts.
    """
    if requested == "cpu":
        return torch.device("cpu")
    if torch.cuda.is_available():
        visible = torch.cuda.device_count()
        if max(local_ranks, local_rank + 1) > visible:
            raise ConfigError(
                f"{max(local_ranks, local_rank + 1)} ranks on this node but only {visible} visible GPU"
                f"{'s' if visible != 1 else ''} "
                f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}): start one rank "
                "per GPU (torchrun --nproc-per-node=<GPUs>), or --parallel.device=cpu")
        return torch.device("cuda", local_rank)
    if requested == "cuda":
        raise ConfigError("parallel.device='cuda' but no CUDA device is available")
    return torch.device("cpu")


def use_tf32(device: torch.device, pcfg: ParallelConfig) -> bool:
    """Whether fp32 matrix multiplies run as TF32 on ``device``: on CUDA unless ``parallel.tf32 = false``.

    TF32 applies only to fp32 compute (``param_dtype = "float32"``); it is never used on a CPU.
    """
    return device.type == "cuda" and pcfg.tf32


def compute_precision(device: torch.device, pcfg: ParallelConfig) -> str:
    """The precision the model's matrix multiplies run in: ``"bf16"``, ``"tf32"`` or ``"fp32"``.

    bf16 when ``param_dtype = "bfloat16"`` (FSDP all-gathers bf16 weights; on a CPU without bf16
    instructions the products may be computed in fp32 from the bf16 operands, still counted as bf16
    compute here); else TF32 on CUDA when :func:`use_tf32`; else fp32. The MFU peak and the planner's
    step time use it.
    """
    if pcfg.param_dtype == "bfloat16":
        return "bf16"
    return "tf32" if use_tf32(device, pcfg) else "fp32"


def set_matmul_precision(device: torch.device, pcfg: ParallelConfig) -> None:
    """Apply :func:`use_tf32` to PyTorch's CUDA matmul and cuDNN switches (CUDA only; a no-op on CPU)."""
    if device.type != "cuda":
        return
    tf32 = use_tf32(device, pcfg)
    torch.backends.cuda.matmul.allow_tf32 = tf32
    torch.backends.cudnn.allow_tf32 = tf32


def pin_host_batches(device: torch.device) -> bool:
    """Whether host batches are pinned (page-locked) before the copy to ``device``: on CUDA only.

    A ``non_blocking=True`` copy from pageable memory is synchronous; from pinned memory it runs
    asynchronously on the copy engine. On a CPU device there is no copy (and pinning needs an accelerator).
    """
    return device.type == "cuda"


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Copy a host tensor to ``device``: pinned and ``non_blocking`` on CUDA (:func:`pin_host_batches`),
    unchanged on CPU."""
    if pin_host_batches(device):
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


class HostScalar:
    """A 0-dim device value read on the host with as little waiting as possible: the copy starts at
    construction (on CUDA asynchronously, into pinned memory, followed by an event), and :meth:`item` waits
    for that copy only, so work queued in between (an optimizer step) keeps the device busy while the host
    waits. On a CPU device the value is there at once."""

    def __init__(self, value: torch.Tensor) -> None:
        self._host = value.detach().to("cpu", non_blocking=True)
        self._event = None
        if value.is_cuda:
            self._event = torch.cuda.Event()
            self._event.record()

    def item(self) -> float:
        """The value (the one host read; waits for the copy, not for what was queued after it)."""
        if self._event is not None:
            self._event.synchronize()
        return self._host.item()


def process_group_kwargs(device: torch.device, backend: str, timeout: timedelta) -> dict:
    """Keyword arguments of ``init_process_group`` that depend on the device.

    On CUDA ``device_id`` binds the process group to this rank's GPU, so NCCL creates its communicator
    at once (not lazily at the first collective) and can split it for sub-meshes (HSDP's shard and
    replicate groups) instead of building each from scratch.
    """
    kwargs: dict = {"backend": backend, "timeout": timeout}
    if device.type == "cuda":
        kwargs["device_id"] = device
    return kwargs


def pick_backend(device: torch.device, requested: str = "auto", cpu_collectives: bool = False) -> str:
    """The process-group backend for ``device``: nccl on CUDA, gloo on CPU.

    With ``cpu_collectives`` on CUDA (CPU offload: gradient-norm reductions run on CPU tensors) the
    result is ``"cuda:nccl,cpu:gloo"`` so each device type has its own backend. An explicit
    ``requested`` value other than ``auto`` is returned unchanged.
    """
    if requested != "auto":
        return requested
    if device.type == "cuda":
        return "cuda:nccl,cpu:gloo" if cpu_collectives else "nccl"
    return "gloo"


def check_async_tp_device(pcfg: ParallelConfig, device_type: str, what: str) -> None:
    """Refuse ``parallel.async_tp`` on a device other than CUDA (``device_type``: ``"cuda"``, ``"cpu"``...),
    at the start of training and in ``shardlm plan --device cpu``; ``what`` names the device in the message.

    Raises:
        ConfigError: ``pcfg.async_tp`` and ``device_type`` is not ``"cuda"``.
    """
    if pcfg.async_tp and device_type != "cuda":
        raise ConfigError("parallel.async_tp needs CUDA (TorchInductor's micro-pipelined TP runs on "
                          f"symmetric GPU memory), but {what} is {device_type}: set parallel.async_tp = "
                          "false")


def init_distributed(pcfg: ParallelConfig, cpu_collectives: bool = False) -> DistInfo:
    """Start (or join the already started) default process group and pick this rank's device.

    With ``pcfg.cpu_offload`` (or ``cpu_collectives``) a CUDA run also gets CPU collectives
    (``cuda:nccl,cpu:gloo``), which clipping offloaded gradient shards needs. The collective
    timeout is ``pcfg.timeout_s``: a rank blocked in a collective whose peer has died raises after
    that long instead of hanging. On CUDA the group is bound to this rank's GPU (``device_id``) and
    fp32 matmuls use TF32 unless ``parallel.tf32 = false`` (:func:`set_matmul_precision`); on a CPU,
    freed memory is kept in the process for reuse unless ``parallel.cpu_keep_freed_memory = false``
    (:mod:`shardlm.parallel.host_memory`).

    Raises:
        ConfigError: a CUDA device was requested but is missing, or this node runs more ranks than it has GPUs
            (:func:`pick_device`); the ``dp_replicate × dp_shard × tp`` mesh does not fit the world size or
            the ranks per node (:func:`dp_mesh_shape`); ``parallel.async_tp`` on a device other than CUDA; all
            checked before the process group starts.
    """
    global _started_process_group
    stop_with_launcher()  # a rank whose torchrun is killed stops (SIGTERM: a preemption), not left running
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    dp_mesh_shape(pcfg, world_size, local_world_size())  # bad mesh: one ConfigError, before any collective
    device = pick_device(pcfg.device, local_rank, local_world_size())
    check_async_tp_device(pcfg, device.type, "this rank's device")
    backend = pick_backend(device, pcfg.backend, cpu_collectives or pcfg.cpu_offload)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    set_matmul_precision(device, pcfg)
    keep_freed_memory(device, pcfg.cpu_keep_freed_memory)
    if not dist.is_initialized():
        _started_process_group = True
        kwargs = process_group_kwargs(device, backend, timedelta(seconds=pcfg.timeout_s))
        if "MASTER_ADDR" in os.environ:
            dist.init_process_group(**kwargs, **restart_rendezvous(world_size, kwargs["timeout"]))
        else:
            dist.init_process_group(**kwargs, store=dist.HashStore(), rank=0, world_size=1)
    return DistInfo(dist.get_rank(), local_rank, dist.get_world_size(), device, backend)


def restart_rendezvous(world_size: int, timeout: timedelta) -> dict:
    """Extra ``init_process_group`` arguments for a job that torchrun restarted (``--max-restarts``).

    torchrun's workers share the launcher's TCPStore, which outlives a restart, on the same
    ``MASTER_PORT``; the restarted workers' process group would read the dead workers' addresses left
    in it and fail ("Gloo connectFullMesh failed ... Connection refused", seen here every time; the
    same happens with NCCL, pytorch/pytorch#167288). So from the first restart on, the process group
    rendezvous runs under a ``PrefixStore`` of its own per attempt (``TORCHELASTIC_RESTART_COUNT``).
    Returns ``{}`` for a first attempt or outside torchrun (the default ``env://`` rendezvous).
    """
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if attempt == 0 or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return {}
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size,
                          is_master=False, timeout=timeout)
    return {"store": dist.PrefixStore(f"shardlm/attempt-{attempt}", store), "rank": int(os.environ["RANK"]),
            "world_size": world_size}


def local_world_size() -> int:
    """Ranks on this node: torchrun's ``LOCAL_WORLD_SIZE``, or the world size when not set (one node)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))


def dp_mesh_shape(pcfg: ParallelConfig, world_size: int, ranks_per_node: int) -> tuple[int, int]:
    """The data-parallel mesh shape ``(dp_replicate, dp_shard)`` for ``world_size`` ranks (``world_size / cp``
    data- parallel ranks under context parallelism, ``parallel.cp``; of one pipeline stage's ``world_size /
    pp`` ranks under pipeline parallelism, ``parallel.pp``, the outermost dimension).

    The data-parallel ranks are the world divided by the inner dimensions, ``parallel.cp`` and ``parallel.tp``
    (:func:`mesh_dims`); ``dp_shard = -1`` takes all remaining ones, ``dp_ranks // dp_replicate``
    (``dp_replicate = -1`` likewise ``dp_ranks // dp_shard``, so one config fits any node count). torchrun
    numbers ranks node by node and the inner dimensions are innermost (``tp`` the innermost, torchtitan's
    order), so shard group g with its context- and tensor-parallel peers holds the consecutive ranks
    ``[g·S·C·T, (g+1)·S·C·T)``: it stays inside one node (S·C·T divides the ranks of a node, the HSDP layout:
    all-gathers and reduce-scatters on the fast intra-node links, only the all-reduce across replicas between
    nodes) or spans whole nodes (S·C·T a multiple of them); plain FSDP (S·C·T = world size) may span any
    nodes. A tensor-parallel group (T consecutive ranks) must lie inside one node. Pure arithmetic, no
    collective.

    Raises:
        ConfigError: ``parallel.cp`` does not divide the world size; ``dp_replicate × dp_shard × tp`` differs
            from the (data-parallel) world size; ``tp`` larger than a node or not dividing its ranks; a shard
            group that would hold part of a node; HSDP (``dp_replicate > 1``) outside
            ``parallel.mode='fsdp'``.
    """
    r, s, tp = pcfg.dp_replicate, pcfg.dp_shard, pcfg.tp
    if world_size % pcfg.pp:
        raise ConfigError(f"parallel.pp={pcfg.pp} must divide the world size {world_size} (each pipeline "
                          "stage is held by world size / pp ranks)")
    world_size //= pcfg.pp  # pipeline stages outermost: the mesh below is one stage's ranks
    cp = pcfg.cp  # context parallel: cp ranks (tp apart) per data-parallel rank (parallel/cp.py)
    if world_size % cp:
        raise ConfigError(f"parallel.cp={cp} must divide the world size {world_size} (each sequence is split "
                          f"over {cp} ranks)")
    # under CP the mesh below covers world / cp ranks: the messages say so (not "the world size 1" at world 2)
    per_cp = f" / parallel.cp={cp} = {world_size // cp}" if cp > 1 else ""
    world, world_is = f"the world size {world_size}{per_cp}", f"the world size is {world_size}{per_cp}"
    node_ranks, world_size = ranks_per_node, world_size // cp
    if r == s == -1:
        raise ConfigError("parallel.dp_replicate and parallel.dp_shard cannot both be -1: set one of them")
    if world_size % tp:
        raise ConfigError(f"parallel.tp={tp} must divide {world} (dp_replicate × dp_shard × tp "
                          "must cover every rank exactly once)")
    if tp > node_ranks or node_ranks % tp:
        raise ConfigError(f"parallel.tp={tp} must divide the {node_ranks} ranks of a node: a tensor-parallel "
                          "group exchanges activations in every layer and must stay on one node's links")
    dp_ranks = world_size // tp
    ranks = f"the {dp_ranks} data-parallel ranks ({world} / parallel.tp={tp})" if tp > 1 else world
    if s == -1:
        if dp_ranks % r:
            raise ConfigError(f"parallel.dp_replicate={r} must divide {ranks} "
                              "(parallel.dp_shard=-1 takes the remaining ranks)")
        s = dp_ranks // r
    if r == -1:
        if dp_ranks % s:
            raise ConfigError(f"parallel.dp_shard={s} must divide {ranks} "
                              "(parallel.dp_replicate=-1 takes the remaining ranks)")
        r = dp_ranks // s
    if r * s * tp != world_size:
        product = f"{r} × {s} × {tp} = {r * s * tp}" if tp > 1 else f"{r} × {s} = {r * s}"
        names = "parallel.dp_replicate × parallel.dp_shard" + (" × parallel.tp" if tp > 1 else "")
        raise ConfigError(f"{names} = {product}, but {world_is}: the mesh must cover every rank exactly once")
    block = s * cp * tp  # consecutive ranks of one shard group and its context- and tensor-parallel peers
    if block != world_size * cp and node_ranks % block and block % node_ranks:
        inner = "".join(f" × parallel.{k}={v}" for k, v in (("cp", cp), ("tp", tp)) if v > 1)
        raise ConfigError(f"parallel.dp_shard={s}{inner} does not divide the {node_ranks} ranks of a node "
                          "(nor is it a multiple of them): a shard group would straddle nodes; pick a "
                          "divisor of the ranks per node (HSDP) or whole nodes")
    if r > 1 and pcfg.mode != "fsdp":
        raise ConfigError(f"parallel.dp_replicate={r} (HSDP) needs parallel.mode='fsdp', not {pcfg.mode!r}")
    return r, s


def mesh_dims(pcfg: ParallelConfig | None, world_size: int, ranks_per_node: int) -> list[tuple[str, int]]:
    """The device mesh's named dimensions, outermost first: ``pp`` (pipeline stages, when > 1),
    ``dp_replicate`` (HSDP only), ``dp_shard``
    (always, with ``parallel.cp`` folded in: FSDP shards parameters over ``dp_shard × cp``), then the inner,
    model-parallel one (``tp``, when > 1), torchtitan's order; sizes multiply to the world size. The CP groups
    are built beside it (:func:`shardlm.parallel.cp.build_context_parallel`: the ``cp`` ranks of one dp and tp
    coordinate).

    Raises:
        ConfigError: see :func:`dp_mesh_shape`.
    """
    if pcfg is None:
        return [("dp_shard", world_size)]
    r, s = dp_mesh_shape(pcfg, world_size, ranks_per_node)
    s *= pcfg.cp  # FSDP shards over dp_shard × cp: a CP group's ranks (tp apart) lie in one shard row
    dims = [("pp", pcfg.pp), ("dp_replicate", r), ("dp_shard", s), ("tp", pcfg.tp)]
    return [(name, size) for name, size in dims if size > 1 or name == "dp_shard"]


#: mesh dimensions over which the data (samples) differ; the others (``tp``) see the same samples
DATA_PARALLEL_DIMS = ("dp_replicate", "dp_shard")


def data_parallel_rank(info: DistInfo, pcfg: ParallelConfig | None) -> tuple[int, int]:
    """``(dp_rank, dp_size)``: this rank's index among the ranks that read different samples, and
    their number.

    The model-parallel dimensions (``cp``, then ``tp``) are innermost (:func:`mesh_dims`), so the ``cp × tp``
    consecutive ranks of one data-parallel coordinate read the same samples: ``dp_rank = rank // (cp × tp)``,
    ``dp_size = world_size // (cp × tp)``; a tensor-parallel group computes on the same tokens, a
    context-parallel group splits each sequence (``parallel.cp``). Under pipeline parallelism
    (``parallel.pp``, outermost) every stage's ranks read the same samples: the index is the one within the
    stage.
    """
    if pcfg is None:
        return info.rank, info.world_size
    inner, stage = pcfg.tp * pcfg.cp, info.world_size // pcfg.pp  # a stage's ranks: consecutive
    return (info.rank % stage) // inner, stage // inner


def build_mesh(info: DistInfo, pcfg: ParallelConfig | None = None) -> DeviceMesh:
    """The device mesh with :func:`mesh_dims`' named dimensions: 1-D ``("dp_shard",)``, ``("dp_replicate",
    "dp_shard")`` for HSDP, and ``"tp"`` innermost with tensor parallel.

    With ``dp_replicate = 1`` (or no ``pcfg``) there is no replicate dimension, so FSDP's placements stay
    ``Shard(0)`` and no one-rank all-reduce runs. With ``dp_replicate = R > 1`` row i of the ``R × S``
    data-parallel mesh holds one shard group (usually one node); ``fully_shard`` on it gives HSDP: placements
    ``(Replicate(), Shard(0))``, gradients reduce-scattered within the row, then all-reduced down each column
    (across replicas). FSDP takes :func:`dp_submesh`, tensor parallel ``mesh["tp"]``. With ``parallel.cp`` the
    shard dimension is ``dp_shard × cp`` (CP ranks join the shard group; the CP groups themselves come from
    :func:`shardlm.parallel.cp.build_context_parallel`).

    Raises:
        ConfigError: see :func:`dp_mesh_shape`.
    """
    dims = mesh_dims(pcfg, info.world_size, local_world_size())
    return init_device_mesh(info.device.type, tuple(size for _, size in dims),
                            mesh_dim_names=tuple(name for name, _ in dims))


def dp_submesh(mesh: DeviceMesh) -> DeviceMesh:
    """The data-parallel part of ``mesh`` (its ``dp_replicate`` / ``dp_shard`` dimensions), the mesh FSDP
    shards on; ``mesh`` itself when it has no other dimension."""
    names = tuple(n for n in mesh.mesh_dim_names if n in DATA_PARALLEL_DIMS)
    return mesh if names == tuple(mesh.mesh_dim_names) else mesh[names]


def all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    """Sum ``t`` in place over all ranks and return it (a no-op for one rank)."""
    if dist.get_world_size() > 1:
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def all_gather_ints(value: int, device: torch.device) -> list[int]:
    """Gather one integer from every rank, in rank order (one collective, one read to the host)."""
    t = torch.tensor([value], dtype=torch.int64, device=device)
    out = torch.zeros(dist.get_world_size(), dtype=torch.int64, device=device)
    dist.all_gather_single(out, t)
    return out.tolist()


def run_on_main(fn, info: DistInfo, group: dist.ProcessGroup | None = None):
    """Run ``fn()`` on rank 0 only; if it raises, every rank raises the same error (no rank hangs).

    Returns ``fn()``'s result on rank 0 and None elsewhere. ``group``: the process group that tells the other
    ranks (None: the default one; rank 0 must be its rank 0).

    Raises:
        RankFailed: on ranks other than 0 when rank 0 failed (rank 0 re-raises its own error).
    """
    result, error = None, None
    if info.is_main:
        try:
            result = fn()
        except Exception as e:  # noqa: BLE001 - re-raised below, after telling the other ranks
            error = e
    message = [f"{type(error).__name__}: {error}" if error is not None else None]
    if info.world_size > 1:
        dist.broadcast_object_list(message, src=0, group=group)
    if error is not None:
        raise error
    if message[0] is not None:
        raise RankFailed(f"rank 0 failed: {message[0]}")
    return result


def shutdown() -> None:
    """Destroy the default process group if one is running."""
    if dist.is_initialized():
        dist.destroy_process_group()


def exit_process(code: int) -> NoReturn:
    """End the process with exit status ``code``, after :func:`shutdown`.

    A process that used a gloo process group can abort in the interpreter's own teardown, after
    ``destroy_process_group`` and after all its work ("terminate called without an active exception",
    SIGABRT): C++ threads of process-group objects still referenced are destroyed unjoined. It was seen
    here in 6 of 32 two-rank benchmark launches and in a CI run, and torchrun would report such a
    run as failed (and restart it under ``--max-restarts``). So once a process group was started, the
    process flushes its output and leaves with ``os._exit``, skipping that teardown; every file shardlm
    writes is closed by then. Otherwise it exits normally.
    """
    shutdown()
    if not _started_process_group:
        sys.exit(code)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
