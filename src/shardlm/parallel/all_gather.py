"""Parameter all-gather through point-to-point sends, for gloo (CPU).

FSDP2 all-gathers each group's flat shards before its forward (and, resharded, before its backward): every
rank ends with the W shards side by side in rank order. Gloo's ``all_gather_single`` stages the output
through buffers of its own; here each rank sends its shard to every other rank and receives theirs straight
into their slots of the output (one ``batch_isend_irecv`` of W - 1 sends and W - 1 receives: ``(W - 1) / W``
of the output in and the shard W - 1 times out, the least any all-gather moves without a relay). Measured here
(2 ranks, 2 cores shared with other work, fp32, 20.5 MB gathered, ``bench/bench_collectives.py``): 7.9-11.2 ms
and 2.7-3.2 ms of rank 0's CPU per call against gloo's 26.6-28.2 ms and 8.4 ms. Only bytes move, so the
result is bit-identical at any world size.

Installed on every FSDP group with ``FSDPModule.set_custom_all_gather`` (FSDP2's own hook for this, like the
reduce-scatter's in ``reduce_scatter.py``); NCCL keeps its native kernel.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.profiler import record_function

#: the profiler range around one point-to-point all-gather: its sends and receives count as an all-gather in
#: ``shardlm profile``'s overlap report, not as other communication
PROFILER_NAME = "shardlm::all_gather_point_to_point"


def resolve_all_gather(setting: str, device_type: str, shared_memory: bool = False) -> str:
    """``parallel.all_gather`` on a ``device_type`` (``"cpu"``, ``"cuda"``) device: ``auto`` is
    ``shared_memory`` on CPU (gloo) where ``shared_memory`` says segments can be made
    (:func:`shardlm.parallel.shared_memory.shared_memory_usable`), else ``point_to_point`` on CPU and
    ``native`` elsewhere."""
    if setting == "auto":
        if device_type != "cpu":
            return "native"
        return "shared_memory" if shared_memory else "point_to_point"
    return setting


class PointToPointAllGather:
    """An all-gather of a flat buffer as point-to-point sends and receives (see the module docstring).

    It has the two methods of FSDP2's ``AllGather`` interface (``allocate`` and the call), which FSDP2
    exports only from a private module.

    Called by FSDP2 with ``input_tensor`` (n,) (this rank's shard; FSDP2 makes it the view of its slot of the
    output) and ``output_tensor`` (W·n,) on the shard group ``group`` of W ranks. ``async_op`` goes to the
    backend's own ``all_gather_single`` (FSDP2 waits on the work it returns). A 1-byte float buffer
    (float8) travels as ``uint8``: gloo has no float8 type.
    """

    def allocate(self, size: Sequence[int | torch.SymInt], *, dtype: torch.dtype,
                 device: torch.device) -> torch.Tensor:
        """A plain uninitialised tensor of ``size`` (FSDP's default allocation)."""
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 async_op: bool = False) -> dist.Work | None:
        """``output_tensor`` (W·n,) = every rank's ``input_tensor`` (n,) in rank order."""
        if output_tensor.element_size() == 1 and output_tensor.is_floating_point():
            output_tensor, input_tensor = output_tensor.view(torch.uint8), input_tensor.view(torch.uint8)
        if async_op:
            return dist.all_gather_single(output_tensor, input_tensor, group=group, async_op=True)
        world, rank = group.size(), group.rank()
        slots = output_tensor.view(world, -1)
        with record_function(PROFILER_NAME):  # one all-gather to the profiler (shardlm/metrics/overlap.py)
            if slots[rank].data_ptr() != input_tensor.data_ptr():
                slots[rank].copy_(input_tensor)
            ops = [dist.P2POp(dist.isend, input_tensor, group=group, group_peer=(rank + i) % world)
                   for i in range(1, world)]
            ops += [dist.P2POp(dist.irecv, slots[(rank - i) % world], group=group,
                               group_peer=(rank - i) % world) for i in range(1, world)]
            for work in dist.batch_isend_irecv(ops) if ops else []:
                work.wait()
        return None


def use_point_to_point_all_gather(model: torch.nn.Module) -> None:
    """Every FSDP group of ``model`` all-gathers its parameters with :class:`PointToPointAllGather`."""
    comm = PointToPointAllGather()
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_custom_all_gather(comm)
