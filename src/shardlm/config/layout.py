"""The checks of a parallel layout against the model and the sequence, torch-free so that the configuration
runs them (:func:`shardlm.config.validate`, before any data is prepared) as well as the planner, ``shardlm
tune`` and the model's build: whether tensor parallel (``parallel.tp``) splits every size it cuts evenly,
whether expert parallel (``parallel.ep``) can be built, and the context-parallel padding
(:func:`padded_length`, :mod:`shardlm.parallel.cp`) that decides the tokens a rank holds."""

from __future__ import annotations

from typing import TYPE_CHECKING

from shardlm.errors import ConfigError

if TYPE_CHECKING:
    from shardlm.config.sections import Config
    from shardlm.model.config import ModelConfig


def padded_length(seq_len: int, cp: int) -> int:
    """``seq_len`` rounded up to a multiple of ``2·cp`` (the load-balanced split's chunk count); ``seq_len``
    itself at ``cp = 1`` (no split)."""
    if cp == 1:
        return seq_len
    return -(-seq_len // (2 * cp)) * (2 * cp)


def check_tp(cfg: ModelConfig, tp: int, seq_len: int, lora: bool = False, cp: int = 1) -> None:
    """Refuse a model that a ``tp``-way split cannot cut evenly, naming the size that does not divide.

    Each rank holds n_heads / tp query heads, n_kv_heads / tp key/value heads (grouped-query attention keeps
    its groups whole only then), ffn_dim / tp of the FFN width, vocab_size / tp vocabulary rows, and 1 / tp of
    its tokens between blocks: of ``seq_len``, or under context parallelism (``cp`` > 1) of its CP share
    ``padded_length(seq_len, cp) / cp`` (:mod:`shardlm.parallel.cp`: sequence parallel splits a CP rank's head
    and tail chunks over its tensor-parallel group).

    Raises:
        ConfigError: one of those does not divide by ``tp``; LoRA with tensor parallel (its adapters are not
            split: not supported).
    """
    if tp == 1:
        return
    tokens = ("train.seq_len (sequence parallel splits the tokens)", seq_len) if cp == 1 else (
        f"the tokens per context-parallel rank (train.seq_len={seq_len} padded to a multiple of 2 × "
        f"parallel.cp, / parallel.cp={cp}; sequence parallel splits them)", padded_length(seq_len, cp) // cp)
    sizes = {"model.n_heads": cfg.n_heads, "the key/value heads (model.n_kv_heads)": cfg.kv_heads,
             "the FFN width (model.ffn_hidden)": cfg.ffn_dim, "model.vocab_size": cfg.vocab_size,
             tokens[0]: tokens[1]}
    for name, size in sizes.items():
        if size % tp:
            raise ConfigError(f"parallel.tp={tp} must divide {name} = {size}: each tensor-parallel rank "
                              "holds an equal part; pick a tp that divides it")
    if lora:
        raise ConfigError(f"parallel.tp={tp} with lora.enabled is not supported (the LoRA adapters are not "
                          "split over the tensor-parallel ranks); use parallel.tp=1 for LoRA")


def check_ep(n_experts: int, ep: int, world_size: int | None, mode: str, dp_replicate: int = 1) -> None:
    """Refuse an expert-parallel layout that cannot be built (one message naming the cause); ``world_size``
    None: before the ranks are known (the configuration's check), their part is left to the run's.

    Raises:
        ConfigError: ``ep`` > 1 without MoE layers, with ``parallel.mode`` other than fsdp, not dividing
            ``n_experts`` or the data-parallel ranks, or with HSDP (``dp_replicate`` other than 1: not built).
    """
    if ep == 1:
        return
    if ep < 1:
        raise ConfigError(f"parallel.ep must be >= 1, got {ep}")
    if not n_experts:
        raise ConfigError(f"parallel.ep={ep} needs a mixture of experts (model.n_experts > 0)")
    if mode != "fsdp":
        raise ConfigError(f"parallel.ep={ep} needs parallel.mode='fsdp' (got {mode!r}): the experts of an ep "
                          "rank are FSDP-sharded over the other data-parallel ranks; DDP would replicate "
                          "every expert")
    if n_experts % ep:
        raise ConfigError(f"parallel.ep={ep} must divide model.n_experts={n_experts} (each ep rank holds "
                          "n_experts / ep whole experts)")
    if world_size is not None and world_size % ep:
        raise ConfigError(f"parallel.ep={ep} must divide the data-parallel ranks ({world_size})")
    if dp_replicate != 1:
        raise ConfigError(f"parallel.ep={ep} with parallel.dp_replicate={dp_replicate} (HSDP) is not built")


def check_ranks(cfg: Config, world_size: int) -> None:
    """The checks of ``cfg``'s layout that need the number of ranks, for a run to make before it prepares
    any data (the rest are :func:`shardlm.config.validate`'s; the mesh's, ``parallel/dist.py``'s
    ``dp_mesh_shape``, run when the process group starts).

    Raises:
        ConfigError: ``parallel.mode = 'single'`` on more than one rank; an expert-parallel degree the ranks
            cannot take (:func:`check_ep`); a pipeline layout the ranks cannot take (:func:`check_pp`).
    """
    if cfg.parallel.mode == "single" and world_size > 1:
        raise ConfigError(f"parallel.mode='single' runs one process, but the world size is {world_size}")
    check_ep(cfg.model.n_experts, cfg.parallel.ep, world_size, cfg.parallel.mode, cfg.parallel.dp_replicate)
    p, t = cfg.parallel, cfg.train
    dp = world_size // max(1, p.pp * p.tp * p.cp)  # the ranks that read different samples
    per_step = dp * t.micro_batch_size
    check_pp(cfg, world_size, t.global_batch_size // per_step if per_step and not
             t.global_batch_size % per_step else None)


#: stages per pipeline rank of each ``parallel.pp_schedule``: the interleaved and V schedules hold two
VIRTUAL_STAGES = {"gpipe": 1, "1f1b": 1, "interleaved_1f1b": 2, "zbv": 2, "dualpipev": 2}


#: schedules that split a micro-batch's backward into an input and a weight part (zero bubble): a stage's
#: blocks stay unsharded from forward to the weight part (``reshard_after_forward`` does not apply)
SPLIT_BACKWARD_SCHEDULES = ("zbv", "dualpipev")


def pp_stage_layers(n_layers: int, stages: int, layers_per_stage: tuple[int, ...] = ()) -> list[range]:
    """The blocks of each pipeline stage, first stage first: ``layers_per_stage`` when given, else an even
    split (``parallel.pp_layers_per_stage``).

    Raises:
        ConfigError: an even split the stages do not divide; a ``layers_per_stage`` of another length than the
            stages, with a stage of no block, or not summing to ``n_layers``.
    """
    if not layers_per_stage:
        if n_layers % stages:
            raise ConfigError(f"{stages} pipeline stages do not divide model.n_layers={n_layers}: pick a "
                              "parallel.pp (or schedule) whose stages divide the blocks, or give "
                              "parallel.pp_layers_per_stage (blocks per stage, summing to n_layers)")
        layers_per_stage = (n_layers // stages,) * stages
    if len(layers_per_stage) != stages or min(layers_per_stage) < 1 or sum(layers_per_stage) != n_layers:
        raise ConfigError(f"parallel.pp_layers_per_stage={list(layers_per_stage)} must give {stages} "
                          f"stages of at least one block each, summing to model.n_layers={n_layers}")
    starts = [sum(layers_per_stage[:i]) for i in range(stages)]
    return [range(s, s + n) for s, n in zip(starts, layers_per_stage)]


def min_pp_microbatches(schedule: str, pp: int) -> int:
    """The fewest micro-batches per step ``schedule`` runs at ``pp`` pipeline ranks (PyTorch's own bounds:
    ``dualpipev`` one per stage, the other schedules but ``gpipe`` one per rank)."""
    if schedule == "gpipe":
        return 1
    return pp * VIRTUAL_STAGES[schedule] if schedule == "dualpipev" else pp


def check_pp(cfg: Config, world_size: int | None, micro_batches: int | None = None) -> None:
    """Refuse a pipeline-parallel layout that cannot be built (one message naming the cause); ``world_size``
    and ``micro_batches`` None: before the ranks are known (the configuration's check).

    Raises:
        ConfigError: ``parallel.pp`` < 1 or not dividing the world size; stages that do not divide the blocks
            (:func:`pp_stage_layers`); fewer micro-batches per step than the schedule needs
            (:func:`min_pp_microbatches`); with ``parallel.pp`` > 1, a setting not built with it: preference
            tuning, a mixture of experts, LoRA, tied embeddings, context or expert parallel, or a mode other
            than fsdp.

    Tensor parallel (``parallel.tp`` > 1) composes with every schedule: each stage's part is split over its
    ``tp`` ranks (:func:`shardlm.parallel.tp.apply_tp` skips what the stage does not hold), the hidden states
    travel between stages as each rank's sequence shard (seq_len / tp tokens), the last stage's loss is
    vocabulary-parallel, and the gradient norm is summed over the ``tp`` and then the ``pp`` groups; what
    ``tp`` must divide is :func:`check_tp`'s.
    """
    p, m = cfg.parallel, cfg.model
    if p.pp < 1:
        raise ConfigError(f"parallel.pp must be >= 1 (1 = no pipeline), got {p.pp}")
    if p.pp == 1:
        if p.pp_layers_per_stage:
            raise ConfigError("parallel.pp_layers_per_stage needs pipeline stages (parallel.pp > 1)")
        return
    refused = [
        (cfg.data.format == "preference", "preference tuning (data.format = 'preference')",
         "train it with FSDP (parallel.pp = 1)"),
        (bool(m.n_experts), f"a mixture of experts (model.n_experts={m.n_experts})",
         "its router losses are not carried through the stages yet; set parallel.pp = 1"),
        (cfg.lora.enabled, "LoRA (lora.enabled)", "set parallel.pp = 1"),
        (m.tie_embeddings, "tied embeddings (model.tie_embeddings)",
         "the embedding lives on the first stage and the output projection on the last; set parallel.pp = 1"),
        (p.cp > 1, f"context parallel (parallel.cp={p.cp})", "set parallel.cp = 1"),
        (p.ep > 1, f"expert parallel (parallel.ep={p.ep})", "set parallel.ep = 1"),
        (p.mode != "fsdp", f"parallel.mode={p.mode!r}", "use parallel.mode = 'fsdp' (each stage FSDP-sharded "
         "over its data-parallel ranks)"),
    ]
    for bad, what, fix in refused:
        if bad:
            raise ConfigError(f"pipeline parallel (parallel.pp={p.pp}) with {what} is not built: {fix}")
    pp_stage_layers(m.n_layers, p.pp * VIRTUAL_STAGES[p.pp_schedule], p.pp_layers_per_stage)
    if world_size is not None and world_size % p.pp:
        raise ConfigError(f"parallel.pp={p.pp} must divide the world size {world_size} (each stage is held "
                          "by world size / pp ranks)")
    need = min_pp_microbatches(p.pp_schedule, p.pp)
    if micro_batches is not None and micro_batches < need:
        raise ConfigError(
            f"parallel.pp_schedule={p.pp_schedule!r} at parallel.pp={p.pp} needs at least {need} "
            f"micro-batches per step, but the step has {micro_batches} (train.global_batch_size / "
            "(data-parallel ranks × train.micro_batch_size)): lower train.micro_batch_size, raise "
            "train.global_batch_size, or use pp_schedule = 'gpipe'")
