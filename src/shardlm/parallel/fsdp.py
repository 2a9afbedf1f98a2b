"""Applying FSDP2 (``fully_shard``) to the model: the recipe, in one function; and :func:`gathered`, the whole
model unsharded for a block of forwards (decoding).

FSDP2 (https://pytorch.org/docs/stable/distributed.fsdp.fully_shard.html) turns each parameter
into a DTensor sharded on dim 0 (``Shard(0)``) over the mesh. Each ``fully_shard`` call makes one
communication group: its parameters are all-gathered together before the group's forward,
freed (resharded) after it, all-gathered again for backward, and their gradients are
reduce-scattered (averaged over ranks) when backward leaves the group.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard

from shardlm.model.decoder import CausalLM
from shardlm.parallel.all_gather import use_point_to_point_all_gather
from shardlm.parallel.options import add_async_all_gather, check_reshard_after_forward, set_prefetch
from shardlm.parallel.reduce_scatter import use_all_to_all_reduce_scatter
from shardlm.parallel.shared_memory import use_shared_memory


def apply_fsdp(model: CausalLM, mesh: DeviceMesh, mp_policy: MixedPrecisionPolicy | None = None,
               reshard_after_forward: bool | int = True, *, offload: OffloadPolicy | None = None,
               forward_prefetch: int = 0, backward_prefetch: int = 0, async_all_gather: bool = False,
               reduce_scatter: str = "native", all_gather: str = "native", blocks_per_group: int = 1,
               experts: list[nn.Module] = (), expert_mesh: DeviceMesh | None = None) -> CausalLM:
    """Shard ``model`` in torchtitan's grouping: embedding, each block, final norm + output, root.

    1. the token embedding is one group (unless tied: then it stays with the output projection);
    2. each transformer block is one group (or each run of ``blocks_per_group`` consecutive blocks, the last
       run taking the remainder), resharded after forward per ``reshard_after_forward`` (true, false, or an
       N-way shard; see ``ParallelConfig``);
    3. the final norm and the output projection form one group, kept unsharded after forward
       since backward needs them at once;
    4. the root takes whatever is left (with tied embeddings: the shared embedding/output weight,
       the final norm) and drives the lazy initialisation and the prefetch order; it keeps
       FSDP's default of not resharding after forward.

    Every group uses ``mp_policy`` (compute/reduce dtypes) and ``offload`` (CPU offload); then the
    block groups get ``forward_prefetch``/``backward_prefetch`` explicit prefetch depths (counted in
    groups), and with ``async_all_gather`` each group issues the next group's all-gather with
    ``unshard(async_op=True)``.
    With ``reduce_scatter = "all_to_all"`` (``shardlm/parallel/reduce_scatter.py``) every group
    reduce-scatters its gradients through one all-to-all; with ``all_gather = "point_to_point"``
    (``shardlm/parallel/all_gather.py``) it all-gathers its parameters by sends and receives; with
    ``"shared_memory"`` (either, ``shardlm/parallel/shared_memory.py``; CPU ranks on one host, the default
    there) through a ``/dev/shm`` segment its ranks share; ``"native"`` keeps the backend's.

    Expert parallelism (:func:`shardlm.parallel.ep.apply_ep` ran first): each module of ``experts`` becomes a
    group of its own over ``expert_mesh`` (the ``efsdp`` ranks that hold the same experts) before its block's;
    its gradients are divided by the world size rather than the group's size, since every rank's tokens reach
    an expert (summed, not averaged, in the collective: gloo has no pre-multiplied sum).

    Returns the same object, now also an ``FSDPModule``.

    Raises:
        ConfigError: an integer ``reshard_after_forward`` that does not fit the mesh size.
    """
    # the shard group is the last mesh dimension (all ranks, or one HSDP row)
    reshard_after_forward = check_reshard_after_forward(reshard_after_forward, mesh.size(mesh.ndim - 1))
    common = dict(mesh=mesh, mp_policy=mp_policy or MixedPrecisionPolicy(),
                  offload_policy=offload or OffloadPolicy())
    decoder = model.model
    # a pipeline stage (shardlm/parallel/pp.py) lacks the parts other stages hold: None
    if not model.cfg.tie_embeddings and decoder.embed_tokens is not None:
        fully_shard(decoder.embed_tokens, reshard_after_forward=reshard_after_forward, **common)
    world = mesh.size()
    for module in experts:
        fully_shard(module, mesh=expert_mesh, reshard_after_forward=bool(reshard_after_forward),
                    **{k: v for k, v in common.items() if k != "mesh"})
        module.set_gradient_divide_factor(float(world))
        # a one-rank group divides by the factor without a collective; forcing the sum there divided
        # twice (measured)
        module.set_force_sum_reduction_for_comms(expert_mesh.size() > 1)
    layers = [layer for layer in decoder.layers if layer is not None]
    block_groups = [layers[i:i + blocks_per_group] for i in range(0, len(layers), blocks_per_group)]
    for group in block_groups:
        # one module or a list: a list is one group (one all-gather, one reduce-scatter)
        fully_shard(group[0] if len(group) == 1 else group, reshard_after_forward=reshard_after_forward,
                    **common)
    if not model.cfg.tie_embeddings and decoder.norm is not None:
        fully_shard([decoder.norm, model.lm_head], reshard_after_forward=False, **common)
    fully_shard(model, **common)
    # a group's modules share one FSDP state: its first stands for it
    firsts = [group[0] for group in block_groups]
    set_prefetch(firsts, forward_prefetch, backward_prefetch)
    if async_all_gather:
        ends = [] if model.cfg.tie_embeddings else [decoder.embed_tokens, decoder.norm]
        groups = [m for m in ends[:1] if m is not None] + firsts
        add_async_all_gather(model, groups + [m for m in ends[1:] if m is not None])
    if reduce_scatter == "all_to_all":
        use_all_to_all_reduce_scatter(model)
    if all_gather == "point_to_point":
        use_point_to_point_all_gather(model)
    if "shared_memory" in (all_gather, reduce_scatter):
        use_shared_memory(model, all_gather == "shared_memory", reduce_scatter == "shared_memory")
    return model


#: ids of the models inside :func:`gathered` now (a nested call gathers nothing again)
_GATHERED: set[int] = set()


@contextlib.contextmanager
def gathered(model: nn.Module) -> Iterator[None]:
    """Inside the block every FSDP group of ``model`` is unsharded (all-gathered once, on entry) and stays so
    through any number of forwards; on exit every group is resharded (its gathered copy freed) and resharding
    after forward is as it was. A model without FSDP groups, or one already inside ``gathered``, is left as it
    is.

    For decoding (:mod:`shardlm.rl.rollout`): without it each forward of one new token would all-gather every
    block again, and every rank would have to run the same number of forwards. Inside, forwards run no
    collective, so ranks may run different numbers of them; entry and exit are each one all-gather (exit:
    none) per group, in the same order on every rank, so every rank must enter. Memory: the whole model in
    the compute dtype (``param_dtype``) on every rank while inside, besides the shards.

    Uses FSDP2's public ``unshard`` / ``reshard`` and, to keep the forwards from resharding, each group's
    ``post_forward_mesh_info`` (saved and restored: ``set_reshard_after_forward`` cannot restore an integer
    setting or the root's default), after the root's lazy initialisation (torch 2.13, the project's pin).
    """
    modules = [m for m in model.modules() if isinstance(m, FSDPModule)]
    if not modules or id(model) in _GATHERED:
        yield
        return
    if isinstance(model, FSDPModule):  # the root decides its own resharding on its first forward: now
        model._get_fsdp_state()._lazy_init()
    groups = [g for m in modules for g in m._get_fsdp_state()._fsdp_param_groups]
    saved = [g.post_forward_mesh_info for g in groups]
    _GATHERED.add(id(model))
    try:
        for g in groups:
            g.post_forward_mesh_info = None  # no reshard after a forward
        for m in modules:
            m.unshard()
        yield
    finally:
        for m in modules:
            m.reshard()
        for g, info in zip(groups, saved):
            g.post_forward_mesh_info = info
        _GATHERED.discard(id(model))
