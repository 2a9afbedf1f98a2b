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
            cannot take (:func:`check_ep`).
    """
    if cfg.parallel.mode == "single" and world_size > 1:
        raise ConfigError(f"parallel.mode='single' runs one process, but the world size is {world_size}")
    check_ep(cfg.model.n_experts, cfg.parallel.ep, world_size, cfg.parallel.mode, cfg.parallel.dp_replicate)
