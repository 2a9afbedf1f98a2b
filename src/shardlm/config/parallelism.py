"""The ``[parallel]`` section: how the model is distributed over ranks (one docstring per field)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass
class ParallelConfig:
    """How the model is distributed over ranks."""

    mode: Literal["fsdp", "ddp", "single"] = "fsdp"
    """``fsdp`` shards parameters, gradients and optimizer state; ``ddp`` replicates; ``single`` is one
    process, no wrapper."""
    backend: str = "auto"
    """Process-group backend: ``auto`` (nccl on CUDA, gloo on CPU), ``gloo``, ``nccl`` or
    ``cuda:nccl,cpu:gloo``."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Device to train on: ``auto`` picks CUDA when present."""
    timeout_s: int = 600
    """Collective timeout in seconds: a rank stuck in a collective fails after this long instead
    of hanging."""
    dp_replicate: int = 1
    """Replicas of the model (HSDP's replicate dimension, usually the number of nodes): gradients are
    reduce-scattered within a shard group, then all-reduced across replicas. 1 = plain FSDP (a 1-D mesh);
    -1 = world size / ``dp_shard`` (one replica per shard group, follows the node count)."""
    dp_shard: int = -1
    """Ranks per shard group (HSDP's shard dimension, usually the GPUs of a node); -1 = all remaining ranks,
    world size / ``dp_replicate``. ``dp_replicate × dp_shard × tp`` must equal the world size (divided
    by ``cp``)."""
    cp: int = 1
    """Context parallelism: the ranks each sequence is split over (``shardlm/parallel/cp.py``: each holds a
    head and a tail chunk, attention all-gathers keys and values). The ``cp`` ranks of a group take the same
    samples (one data-parallel rank): consecutive, or ``tp`` apart under tensor parallel (torchtitan's mesh
    order ``dp_replicate, dp_shard, cp, tp``); FSDP shards parameters over ``dp_shard × cp``. Composes with
    HSDP, DDP and ``tp``. Must divide the world size; 1 = no split."""
    tp: int = 1
    """Tensor-parallel degree: each block's q/k/v and gate/up projections split by columns (heads, FFN width),
    o and down by rows, the embedding and output projection by vocabulary rows, norms and residuals sharded
    along the sequence between the blocks (sequence parallel), the loss vocabulary-parallel
    (``shardlm/parallel/tp.py``). The innermost mesh dimension (consecutive ranks, within one node);
    ``dp_replicate × dp_shard × tp`` must equal the world size (per pipeline stage under ``pp``). Needs
    ``mode = "fsdp"``; composes with ``pp`` (each stage split over its ``tp`` ranks); 1 = off."""
    pp: int = 1
    """Pipeline-parallel stages (``shardlm/parallel/pp.py``): the blocks are cut into ``pp`` consecutive
    stages (``pp`` × 2 with the interleaved and V schedules), each held by the ranks of one ``pp`` coordinate,
    the outermost mesh dimension (torchtitan's order ``pp, dp_replicate, dp_shard, cp, tp``); activations and
    their gradients travel between neighbouring stages point to point, and every stage is FSDP-sharded over
    its own data-parallel ranks. The step's micro-batches (``train.micro_batch_size`` each) are the
    pipeline's. With ``tp`` > 1 each stage is also split over its ``tp`` ranks (every schedule) and a rank
    sends its sequence shard (``seq_len / tp`` tokens) to the next stage; ``shardlm plan`` does not model
    that layout yet. ``pp`` must divide the world size; 1 = no pipeline."""
    pp_schedule: Literal["gpipe", "1f1b", "interleaved_1f1b", "zbv", "dualpipev"] = "1f1b"
    """The pipeline schedule (``torch.distributed.pipelining``): ``gpipe`` (every micro-batch forward, then
    every backward), ``1f1b`` (one forward, one backward: at most ``pp`` micro-batches in flight),
    ``interleaved_1f1b`` (two stages per rank, looped: stage s on rank s mod ``pp``; a smaller bubble),
    ``zbv`` (zero-bubble V: two stages per rank in a V, backward split into input and weight parts) and
    ``dualpipev`` (DeepSeek's DualPipe in a V). All five run on CPU with gloo. Under ``zbv`` and ``dualpipev``
    a stage's blocks stay unsharded from a micro-batch's forward to its weight backward
    (``reshard_after_forward`` does not apply). ``1f1b``, the interleaved and the V schedules need at least as
    many micro-batches per step as ranks in the pipeline (``dualpipev``: as stages)."""
    pp_layers_per_stage: tuple[int, ...] = ()
    """Blocks per stage, first stage first (as many numbers as stages, summing to ``model.n_layers``); the
    first stage also holds the embedding and the last the final norm and output projection. Empty = an even
    split, which the stages must divide."""
    async_tp: bool = False
    """Asynchronous tensor parallel on CUDA: TorchInductor splits each TP all-gather / reduce-scatter and the
    matrix multiply beside it into micro-pipelined pieces over symmetric memory
    (``torch._inductor.config._micro_pipeline_tp``), hiding the collectives. Needs ``tp > 1``, ``compile =
    true`` and CUDA (refused on CPU)."""
    ep: int = 1
    """Expert parallelism (mixtures of experts, ``parallel/ep.py``): each of ``ep`` ranks holds ``n_experts /
    ep`` whole experts and tokens travel to them by all-to-all; the experts are FSDP-sharded over the other
    world size / ``ep`` ranks. 1 = none (the experts are FSDP-sharded like every other parameter)."""
    param_dtype: Literal["float32", "bfloat16"] = "float32"
    """FSDP compute dtype (``MixedPrecisionPolicy.param_dtype``): shards stay fp32, all-gathered weights
    are cast."""
    reduce_dtype: Literal["float32", "bfloat16"] = "float32"
    """FSDP gradient reduce-scatter dtype (``MixedPrecisionPolicy.reduce_dtype``); gradient shards are kept
    in fp32."""
    reshard_after_forward: bool | int | Literal["auto"] = "auto"
    """Blocks and embedding after forward: ``true`` free the full weights (all-gather again in backward),
    ``false`` keep them (no backward all-gather, more memory), or N (1 < N < world size, N divides it): keep
    an N-way shard (backward all-gathers within groups of N ranks). The root always keeps FSDP's default
    (not resharded). ``auto``: chosen at start-up (``shardlm train``: ``false`` when the planned step fits
    the memory per rank with it, else ``true``; shardlm/plan/defaults.py), kept on resume; ``true`` where
    nothing chooses (the Python API)."""
    forward_prefetch: int = 0
    """Explicit forward prefetch depth: block group i's pre-forward all-gathers groups i+1..i+k
    (``set_modules_to_forward_prefetch``; a group is one block unless ``blocks_per_group``); 0 leaves FSDP's
    implicit prefetch alone."""
    backward_prefetch: int = 0
    """Explicit backward prefetch depth: block group i's pre-backward all-gathers groups i-1..i-k
    (``set_modules_to_backward_prefetch``); 0 leaves FSDP's implicit one-group backward prefetch."""
    blocks_per_group: int | Literal["auto"] = "auto"
    """Transformer blocks per FSDP group (one ``fully_shard`` call): their parameters are all-gathered
    together and their gradients reduce-scattered together, the last group taking the remainder. 1 is
    torchtitan's grouping; more means fewer, larger collectives (less per-collective latency and hook
    overhead) and more memory held unsharded at once. Prefetch depths count groups. Results are bit-identical
    for every value. ``auto``: chosen at start-up (``shardlm train``: blocks grouped until a group holds
    about 64 MiB of parameters, where a collective's fixed cost stops mattering, while the planned step fits;
    shardlm/plan/defaults.py), kept on resume; 1 where nothing chooses."""
    async_all_gather: bool = False
    """Issue the next block's all-gather from the current block's forward pre-hook with
    ``unshard(async_op=True)``; FSDP waits on it just before that block runs."""
    reduce_scatter: Literal["auto", "native", "all_to_all", "shared_memory"] = "auto"
    """How FSDP reduce-scatters gradients: ``native`` is the backend's ``reduce_scatter_tensor`` (NCCL's
    kernel; gloo runs an all-reduce of the whole buffer), ``all_to_all`` one all-to-all of the chunks and a
    local sum in rank order (half gloo's traffic: 2.4x faster here; ``shardlm/parallel/reduce_scatter.py``),
    ``shared_memory`` (CPU ranks on one host) each rank's gradients written once into a ``/dev/shm`` segment
    the ranks share and its chunk summed from there in rank order (bit-identical to ``all_to_all``; 2.3x
    faster again at 20 MB; ``shardlm/parallel/shared_memory.py``). ``auto`` is ``shared_memory`` on CPU when
    every rank is on one host and ``/dev/shm`` has room for 2 x ranks x the model in fp32, else
    ``all_to_all`` on CPU, and ``native`` on CUDA."""
    all_gather: Literal["auto", "native", "point_to_point", "shared_memory"] = "auto"
    """How FSDP all-gathers parameters: ``native`` is the backend's ``all_gather_into_tensor`` (NCCL's kernel;
    gloo's stages the data through buffers of its own), ``point_to_point`` each rank's shard sent to every
    other rank and received straight into its slot (2.5x faster here at 20 MB; ``shardlm/parallel/
    all_gather.py``), ``shared_memory`` (CPU ranks on one host) each shard written once into a ``/dev/shm``
    segment the ranks share and read from there (1.2-2x faster again). All bit-identical. ``auto`` is
    ``shared_memory`` on CPU under the same test as ``reduce_scatter``'s, else ``point_to_point`` on CPU, and
    ``native`` on CUDA."""
    cpu_offload: bool = False
    """Keep parameter shards, gradient shards and optimizer state in CPU memory (``CPUOffloadPolicy``; pinned
    only when an accelerator exists); the optimizer step runs on the CPU."""
    activation_checkpoint: Literal["auto", "none", "full", "every_n", "selective"] = "auto"
    """Activation checkpointing of the blocks: ``full`` recomputes every block in backward, ``every_n`` every
    n-th block (``activation_checkpoint_n``), ``selective`` keeps matrix-multiply and attention outputs and
    recomputes the element-wise ops (torchtitan's "selective op"). Parameter names do not change. ``auto``:
    chosen at start-up (``shardlm train``: the least recomputation whose planned step fits the memory per
    rank: ``none``, else ``selective``, else ``full``; shardlm/plan/defaults.py), kept on resume; ``none``
    where nothing chooses."""
    activation_checkpoint_n: int = 2
    """For ``activation_checkpoint = "every_n"``: checkpoint blocks n, 2n, ... (1-based), i.e. every
    n-th block."""
    compile: bool = False
    """Compile each block with ``block.compile()`` (TorchInductor) before sharding; needs a C++ compiler
    (``$CXX``, else ``g++``)."""
    cpu_bf16_matmul: Literal["auto", "native", "fp32"] = "auto"
    """bf16 linear layers on a CPU device (``param_dtype = "bfloat16"``): ``native`` uses PyTorch's bf16 GEMM,
    ``fp32`` upcasts both bf16 operands, multiplies in fp32 and rounds the result to bf16 (same products, fp32
    accumulation; 2.3x faster forward + backward on CPUs without bf16 instructions), ``auto`` is ``fp32``
    unless the CPU has AVX512-BF16 or AMX. No effect on CUDA or with fp32 compute
    (``shardlm/model/cpu_matmul.py``)."""
    cpu_keep_freed_memory: bool = True
    """On a CPU device, memory freed by tensors stays in the process for the next ones instead of going
    back to the operating system (glibc's ``mallopt``: no separate mapping per large block, no trimming), as
    CUDA's caching allocator keeps freed blocks: the large blocks a step makes again every step (a
    49,152-id output projection's gradient is 113 MB) are then not faulted in again page by page: on a
    packed SmolLM2-shape step here 220,000 page faults per rank per step fall to a handful in most steps,
    the step 14% shorter, peak RSS up to 14% higher after 30 steps (holes the heap cannot return or fill).
    Same results. Skipped where
    ``GLIBC_TUNABLES`` or ``LD_PRELOAD`` already set the allocator, or the C library is not glibc
    (``shardlm/parallel/host_memory.py``). No effect on CUDA."""
    grad_sync: Literal["every_micro_batch", "last_micro_batch", "reduce_scatter_every_all_reduce_last"] = (
        "every_micro_batch")
    """Gradient reduction under accumulation: reduce-scatter after every micro-batch (the default: only
    gradient shards are kept between micro-batches, FSDP's memory saving holds; torchtitan's choice), on the
    last micro-batch only (least communication, but every rank holds unsharded full-model gradients
    meanwhile), or reduce-scatter every micro-batch with the cross-replica all-reduce on the last only (HSDP:
    differs from ``every_micro_batch`` only once a replicate mesh dimension exists). ``shardlm plan`` prints
    the memory and communication of both choices when there is gradient accumulation."""
    tf32: bool = True
    """On CUDA, fp32 matrix multiplies and convolutions use TF32 tensor cores
    (``torch.backends.cuda.matmul.allow_tf32``, ``torch.backends.cudnn.allow_tf32``): about 7x the fp32 rate
    on an H100, with a 10-bit mantissa in the products (fp32 accumulation). ``false`` keeps full fp32
    products. No effect on CPU or on bf16 compute; the planner's and MFU's peak follow it
    (shardlm/parallel/dist.py)."""
