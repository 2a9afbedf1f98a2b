"""Configuration: dataclasses with a docstring per field, read from TOML with dotted CLI overrides.

Precedence is command line > TOML file > dataclass defaults, as in torchtitan. Every key is
checked: an unknown section or key, or a value of the wrong type, raises :class:`ConfigError`
naming the dotted key.
"""

from __future__ import annotations

import dataclasses
import json
import math
import tomllib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from shardlm.convert.hf_config import read_model_dir_config
from shardlm.errors import ConfigError
from shardlm.model.config import FAMILIES, ModelConfig


@dataclass
class DataSource:
    """One source of a mixture (``[[data.sources]]``)."""

    path: str = ""
    """The corpus: anything ``data.corpus`` accepts."""
    weight: float = 1.0
    """Share of the training samples drawn from this source, relative to the other sources' weights."""
    name: str = ""
    """Name in metrics and in the data directory; empty means ``source<i>``."""


@dataclass
class DataConfig:
    """Corpus, tokenizer and where the token ids are stored."""

    corpus: str = "shakespeare"
    """``shakespeare`` (the embedded default); a .txt/.md/.jsonl file (each also .gz/.zst) or .parquet; a datasets
    ``save_to_disk`` directory; ``hf:NAME[:SPLIT]`` (the local Hugging Face cache, offline); a directory of any of
    these (recursive) or a glob."""
    tokenizer: str = ""
    """Path to an existing ``tokenizer.json``; empty trains a byte-level BPE on a sample of the corpus."""
    tokenizer_vocab_size: int = 0
    """Vocabulary size of a trained tokenizer; 0 means ``model.vocab_size``."""
    tokenizer_sample_bytes: int = 100_000_000
    """Most text a trained tokenizer learns from, in bytes: a seeded sample of the corpus (``train.seed``)."""
    text_field: str = "text"
    """The field of a JSONL object, or the column of Parquet and datasets, that holds the text."""
    workers: int = 0
    """Encoding processes per rank; 0 means the cores this process may use, divided by the ranks of the node."""
    piece_bytes: int = 64 << 20
    """Input bytes per piece: the unit of work shared between ranks and kept when a preparation restarts."""
    val_fraction: float = 0.05
    """Fraction of the token stream (its tail) held out for validation."""
    dir: str = ""
    """Directory of the prepared token ids; empty means ``data/<config name>``."""
    format: Literal["text", "instruct", "preference"] = "text"
    """``text``: a corpus for language modelling; ``instruct``: a .jsonl of ``messages`` or ``prompt``/``response``
    examples, chat-formatted, loss on response tokens only (see shardlm/data/instruct.py); ``preference``: a .jsonl of
    ``prompt``/``chosen``/``rejected`` pairs for the ``[preference]`` objective (shardlm/data/preference.py)."""
    pack: bool = False
    """Pack several instruction examples into each sample of ``seq_len + 1`` tokens (best-fit decreasing, the rest
    padded; shardlm/data/packing.py), under ``model.attention = "block_causal"`` so that no example sees another.
    Only for ``format = "instruct"``: pre-training windows are already full (use block-causal attention there)."""
    sources: list[DataSource] = field(default_factory=list)
    """A mixture, instead of ``corpus``: ``[[data.sources]]`` tables with ``path`` and ``weight`` (and ``name``).
    Each global batch draws its samples from the sources in proportion to the weights; all sources share one
    tokenizer; each is prepared into ``<data.dir>/<name>``."""


@dataclass
class TrainConfig:
    """Optimisation. A step is one optimizer step over a global batch."""

    steps: int = 100
    """Number of optimizer steps."""
    seq_len: int = 256
    """Tokens per sample (each sample is a window of seq_len + 1 tokens)."""
    global_batch_size: int = 8
    """Sequences per optimizer step, summed over ranks and micro-batches."""
    micro_batch_size: int = 4
    """Sequences per forward/backward on one rank."""
    lr: float = 3e-4
    """Peak learning rate, reached after warm-up."""
    min_lr: float = 3e-5
    """Learning rate at the end of the cosine decay."""
    warmup_steps: int = 10
    """Steps of linear warm-up from 0 to ``lr``."""
    betas: tuple[float, float] = (0.9, 0.95)
    """AdamW (beta1, beta2)."""
    eps: float = 1e-8
    """AdamW epsilon."""
    weight_decay: float = 0.1
    """AdamW decoupled weight decay on weight matrices."""
    decay_norms_and_embeddings: bool = False
    """Also apply weight decay to norm weights and the token embedding."""
    grad_clip: float = 1.0
    """Maximum global gradient norm; 0 disables clipping (the norm is still logged)."""
    eval_interval: int = 50
    """Evaluate on the validation tokens every this many steps (and at the last step); 0 disables."""
    eval_tokens: int = 16384
    """Validation tokens used per evaluation (a fixed set, split over ranks)."""
    log_interval: int = 1
    """Write a metrics record every this many steps (and at the last step, and on evaluation and checkpoint steps).
    Only these steps read values to the host; a preemption signal is acted on at the next of them."""
    log_per_rank: bool = False
    """Also write each per-rank figure as a full list over ranks (``<key>_per_rank`` in metrics.jsonl, one
    TensorBoard tag per rank); otherwise only its summary (min, max, mean, rank of the max)."""
    log_moe_layers: bool = False
    """A mixture of experts: also write tokens per expert for each MoE layer (``tokens_per_expert_min/layer<i>``,
    ``_max/layer<i>``, i the block index); otherwise only over all layers and experts together."""
    seed: int = 0
    """Seed of the initialisation and the data order."""
    peak_flops: float = 0.0
    """Peak dense FLOP/s of one rank's device that MFU is measured against; 0 = automatic: the datasheet peak of
    a known GPU in the precision that runs (bf16, TF32 or fp32; shardlm/metrics/flops.py), or on a CPU (or an
    unknown GPU) a rate measured at start-up with large matrix products in that precision."""
    trainable: str = ""
    """Comma-separated name patterns of the parameters to train; every other parameter is frozen (no gradient,
    no optimizer state, no gradient communication). ``*`` matches any text, ``[a-b]`` any integer from a to b,
    and a pattern may match any dot-separated run of a name: ``model.layers.[0-11].*``, ``embed_tokens``,
    ``norm``. Empty: everything is trainable (see shardlm/model/freeze.py)."""
    frozen: str = ""
    """Comma-separated name patterns of parameters to freeze (as ``trainable``), applied after it."""
    loss_chunk_tokens: int = 256
    """Scored tokens per chunk of the fused output projection and cross-entropy (training and evaluation): each
    chunk's logits (this many × vocab fp32 values) are made, turned into its loss and gradients, and freed, so the
    whole logits never exist (``shardlm/train/loss.py``); same results as the plain loss up to summation order.
    0 = the plain loss (the whole logits, their fp32 log-softmax and gradients)."""


@dataclass
class ParallelConfig:
    """How the model is distributed over ranks."""

    mode: Literal["fsdp", "ddp", "single"] = "fsdp"
    """``fsdp`` shards parameters, gradients and optimizer state; ``ddp`` replicates; ``single`` is one process, no wrapper."""
    backend: str = "auto"
    """Process-group backend: ``auto`` (nccl on CUDA, gloo on CPU), ``gloo``, ``nccl`` or ``cuda:nccl,cpu:gloo``."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Device to train on: ``auto`` picks CUDA when present."""
    timeout_s: int = 600
    """Collective timeout in seconds: a rank stuck in a collective fails after this long instead of hanging."""
    dp_replicate: int = 1
    """Replicas of the model (HSDP's replicate dimension, usually the number of nodes): gradients are
    reduce-scattered within a shard group, then all-reduced across replicas. 1 = plain FSDP (a 1-D mesh);
    -1 = world size / ``dp_shard`` (one replica per shard group, follows the node count)."""
    dp_shard: int = -1
    """Ranks per shard group (HSDP's shard dimension, usually the GPUs of a node); -1 = all remaining ranks,
    world size / ``dp_replicate``. ``dp_replicate × dp_shard × tp`` must equal the world size (divided by ``cp``)."""
    cp: int = 1
    """Context parallelism: the ranks each sequence is split over (``shardlm/parallel/cp.py``: each holds a head and a
    tail chunk, attention all-gathers keys and values). The ``cp`` ranks of a group are consecutive and take the same
    samples (one data-parallel rank); FSDP shards parameters over ``dp_shard × cp`` (torchtitan's mesh order
    ``dp_replicate, dp_shard, cp``). Must divide the world size; 1 = no split."""
    tp: int = 1
    """Tensor-parallel degree: each block's q/k/v and gate/up projections split by columns (heads, FFN width), o and
    down by rows, the embedding and output projection by vocabulary rows, norms and residuals sharded along the
    sequence between the blocks (sequence parallel), the loss vocabulary-parallel (``shardlm/parallel/tp.py``).
    The innermost mesh dimension (consecutive ranks, within one node); ``dp_replicate × dp_shard × tp`` must equal
    the world size. Needs ``mode = "fsdp"``; 1 = off."""
    async_tp: bool = False
    """Asynchronous tensor parallel on CUDA: TorchInductor splits each TP all-gather / reduce-scatter and the matrix
    multiply beside it into micro-pipelined pieces over symmetric memory (``torch._inductor.config._micro_pipeline_tp``),
    hiding the collectives. Needs ``tp > 1``, ``compile = true`` and CUDA (refused on CPU)."""
    ep: int = 1
    """Expert parallelism (mixtures of experts, ``parallel/ep.py``): each of ``ep`` ranks holds ``n_experts / ep``
    whole experts and tokens travel to them by all-to-all; the experts are FSDP-sharded over the other
    world size / ``ep`` ranks. 1 = none (the experts are FSDP-sharded like every other parameter)."""
    param_dtype: Literal["float32", "bfloat16"] = "float32"
    """FSDP compute dtype (``MixedPrecisionPolicy.param_dtype``): shards stay fp32, all-gathered weights are cast."""
    reduce_dtype: Literal["float32", "bfloat16"] = "float32"
    """FSDP gradient reduce-scatter dtype (``MixedPrecisionPolicy.reduce_dtype``); gradient shards are kept in fp32."""
    reshard_after_forward: bool | int = True
    """Blocks and embedding after forward: ``true`` free the full weights (all-gather again in backward), ``false``
    keep them (no backward all-gather, more memory), or N (1 < N < world size, N divides it): keep an N-way shard
    (backward all-gathers within groups of N ranks). The root always keeps FSDP's default (not resharded)."""
    forward_prefetch: int = 0
    """Explicit forward prefetch depth: block group i's pre-forward all-gathers groups i+1..i+k
    (``set_modules_to_forward_prefetch``; a group is one block unless ``blocks_per_group``); 0 leaves FSDP's
    implicit prefetch alone."""
    backward_prefetch: int = 0
    """Explicit backward prefetch depth: block group i's pre-backward all-gathers groups i-1..i-k
    (``set_modules_to_backward_prefetch``); 0 leaves FSDP's implicit one-group backward prefetch."""
    blocks_per_group: int = 1
    """Transformer blocks per FSDP group (one ``fully_shard`` call): their parameters are all-gathered together
    and their gradients reduce-scattered together, the last group taking the remainder. 1 is torchtitan's
    grouping; more means fewer, larger collectives (less per-collective latency and hook overhead) and more
    memory held unsharded at once. Prefetch depths count groups. Results are bit-identical for every value."""
    async_all_gather: bool = False
    """Issue the next block's all-gather from the current block's forward pre-hook with ``unshard(async_op=True)``;
    FSDP waits on it just before that block runs."""
    reduce_scatter: Literal["auto", "native", "all_to_all"] = "auto"
    """How FSDP reduce-scatters gradients: ``native`` is the backend's ``reduce_scatter_tensor`` (NCCL's kernel; gloo
    runs an all-reduce of the whole buffer), ``all_to_all`` one all-to-all of the chunks and a local sum in rank
    order (half gloo's traffic: 2.4x faster here; ``shardlm/parallel/reduce_scatter.py``); ``auto`` is
    ``all_to_all`` on CPU (gloo) and ``native`` on CUDA."""
    cpu_offload: bool = False
    """Keep parameter shards, gradient shards and optimizer state in CPU memory (``CPUOffloadPolicy``; pinned only
    when an accelerator exists); the optimizer step runs on the CPU."""
    activation_checkpoint: Literal["none", "full", "every_n", "selective"] = "none"
    """Activation checkpointing of the blocks: ``full`` recomputes every block in backward, ``every_n`` every n-th
    block (``activation_checkpoint_n``), ``selective`` keeps matrix-multiply and attention outputs and recomputes
    the element-wise ops (torchtitan's "selective op"). Parameter names do not change."""
    activation_checkpoint_n: int = 2
    """For ``activation_checkpoint = "every_n"``: checkpoint blocks n, 2n, ... (1-based), i.e. every n-th block."""
    compile: bool = False
    """Compile each block with ``block.compile()`` (TorchInductor) before sharding; needs a C++ compiler
    (``$CXX``, else ``g++``)."""
    cpu_bf16_matmul: Literal["auto", "native", "fp32"] = "auto"
    """bf16 linear layers on a CPU device (``param_dtype = "bfloat16"``): ``native`` uses PyTorch's bf16 GEMM,
    ``fp32`` upcasts both bf16 operands, multiplies in fp32 and rounds the result to bf16 (same products, fp32
    accumulation; 2.3x faster forward + backward on CPUs without bf16 instructions), ``auto`` is ``fp32`` unless
    the CPU has AVX512-BF16 or AMX. No effect on CUDA or with fp32 compute (``shardlm/model/cpu_matmul.py``)."""
    grad_sync: Literal["every_micro_batch", "last_micro_batch", "reduce_scatter_every_all_reduce_last"] = (
        "every_micro_batch")
    """Gradient reduction under accumulation: reduce-scatter after every micro-batch (the default: only gradient
    shards are kept between micro-batches, FSDP's memory saving holds; torchtitan's choice), on the last
    micro-batch only (least communication, but every rank holds unsharded full-model gradients meanwhile), or
    reduce-scatter every micro-batch with the cross-replica all-reduce on the last only (HSDP: differs from
    ``every_micro_batch`` only once a replicate mesh dimension exists). ``shardlm plan`` prints the memory and
    communication of both choices when there is gradient accumulation."""
    tf32: bool = True
    """On CUDA, fp32 matrix multiplies and convolutions use TF32 tensor cores
    (``torch.backends.cuda.matmul.allow_tf32``, ``torch.backends.cudnn.allow_tf32``): about 7x the fp32 rate on
    an H100, with a 10-bit mantissa in the products (fp32 accumulation). ``false`` keeps full fp32 products.
    No effect on CPU or on bf16 compute; the planner's and MFU's peak follow it (shardlm/parallel/dist.py)."""


@dataclass
class RunConfig:
    """Where a run writes."""

    name: str = ""
    """Run name; empty means the config file's stem."""
    dir: str = ""
    """Run directory; empty means ``runs/<name>``."""
    overwrite: bool = False
    """On a fresh start (no ``checkpoint.resume``): allow a non-empty run directory and start a new run in it,
    removing the previous run's checkpoints, metrics, config and final model (each named on the console).
    Ignored when resuming."""
    export_single_file_bytes: int = 2**31
    """``final/`` of a model up to this many bytes is one ``model.safetensors`` (gathered to rank 0); a larger
    one is written by every rank: whole tensors into its own ``model-0000K-of-0000M.safetensors`` plus
    ``model.safetensors.index.json``, as Hugging Face shards large models. 0 always shards."""


@dataclass
class CheckpointConfig:
    """Sharded checkpoints (torch.distributed.checkpoint) under ``<run dir>/checkpoints/step-<N>/``."""

    enabled: bool = True
    """Write checkpoints (every ``interval`` steps, at the last step, and on SIGINT/SIGTERM/SIGUSR1: Ctrl-C or
    preemption then saves and exits 5; false: Ctrl-C stops at once)."""
    interval: int = 100
    """Save every this many steps (and at the last step); 0 saves only at the last step and on preemption."""
    keep: int = 3
    """Keep this run's newest this many complete checkpoints (by save order), deleting its older ones; never
    deletes another run's checkpoints or the one just written; 0 keeps all."""
    resume: str = ""
    """``""`` starts fresh (unless torchrun restarted the job: then ``auto``), ``auto`` resumes from the newest
    complete checkpoint of the run directory's run (``config.json``'s ``run_id``) if there is one, or a path to
    a ``step-<N>`` checkpoint directory. ``--resume=auto`` is the same; with it and no ``--config`` the run's settings
    come from the run directory's ``config.json`` (:func:`shardlm.cli.train.train_config`)."""
    async_: bool = False
    """``checkpoint.async`` in TOML and on the command line (``async`` is a Python keyword): stage the state to host
    memory (a copy of this rank's shards: ~12 bytes per parameter / world size with AdamW in fp32) and write it in
    the background with DCP's ``async_save`` on a gloo process group of its own (timeout
    :data:`shardlm.checkpoint.dcp.CHECKPOINT_TIMEOUT`) while training continues. At most one save is in flight (the
    next save and the end of the run wait for it); the checkpoint becomes ``step-<N>`` only when every rank has
    written and the manifest is there, and a failed background save stops the run at the next step with the cause
    and path. False: the training loop waits for each save."""


@dataclass
class MetricsConfig:
    """Experiment trackers that receive the metrics records besides ``metrics.jsonl`` and TensorBoard.

    Rank 0 logs; a tracker that fails prints one warning and training goes on (``shardlm/metrics/trackers.py``).
    """

    wandb: bool = False
    """Log to Weights & Biases (``pip install 'shardlm[wandb]'``): the config, every logged step, the final model path."""
    wandb_project: str = ""
    """W&B project; empty means ``WANDB_PROJECT`` or ``shardlm``."""
    wandb_entity: str = ""
    """W&B entity (user or team); empty means ``WANDB_ENTITY`` or the account's default."""
    wandb_name: str = ""
    """W&B run name; empty means ``WANDB_NAME`` or ``run.name``."""
    wandb_tags: tuple[str, ...] = ()
    """W&B run tags; empty means ``WANDB_TAGS`` (comma-separated) or none."""
    wandb_mode: Literal["", "online", "offline"] = ""
    """``online`` uploads as it goes; ``offline`` writes ``<run dir>/wandb/offline-run-*`` for ``wandb sync``; empty
    means ``WANDB_MODE`` or online."""
    wandb_rewind: bool = True
    """On resume, rewind the W&B run to the checkpoint's step (``resume_from``; a W&B preview feature) so the resumed
    steps replace those logged past it; false, or a server that refuses it, continues with ``resume="allow"``."""
    mlflow: bool = False
    """Log to MLflow (``pip install 'shardlm[mlflow]'``): the config as parameters and artefact, every logged step,
    the final model path, the report PNGs."""
    mlflow_tracking_uri: str = ""
    """MLflow tracking URI (``http://host:5000``, ``file:/path/mlruns``, ``sqlite:///mlflow.db``...); empty means
    ``MLFLOW_TRACKING_URI``, else MLflow's default in the working directory: ``sqlite:///mlflow.db``, or
    ``file:./mlruns`` without sqlalchemy/alembic (said in one line) or when it already holds experiments."""
    mlflow_experiment: str = ""
    """MLflow experiment name; empty means ``MLFLOW_EXPERIMENT_NAME`` or ``shardlm``."""
    mlflow_run_name: str = ""
    """MLflow run name; empty means ``run.name``."""


@dataclass
class LoRAConfig:
    """Low-rank adapters (LoRA) on the targeted linear layers; everything else is frozen (shardlm/model/lora.py).

    Checkpoints then hold the adapters and their optimizer state only, plus a reference to the base; the run's
    ``final/`` is the merged model and ``final-adapter/`` a PEFT-format adapter."""

    enabled: bool = False
    """Train adapters instead of the model's weights."""
    rank: int = 8
    """Rank r of the adapters A (r, in) and B (out, r); 1 <= r <= min(in, out) of every targeted layer."""
    alpha: float = 16.0
    """The update is scaled by alpha / r."""
    dropout: float = 0.0
    """Dropout on the adapters' input. Above 0 a run draws random numbers (seeded per step and rank): resume
    stays exact at the same world size, but runs at different world sizes no longer agree."""
    targets: str = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"
    """Comma-separated names of the linear layers that get adapters (last name component)."""
    base_dtype: Literal["float32", "bfloat16", "nf4"] = "float32"
    """Storage of the frozen base: ``float32``, ``bfloat16`` (the targeted layers' weights in half the bytes), or
    ``nf4`` (QLoRA: every frozen weight matrix, the token embedding and output projection included, in 4-bit
    NormalFloat via torchao; norms stay fp32; the whole base about 0.26x its bf16 bytes; needs the ``qlora``
    extra). The adapters are fp32; the compute dtype is ``parallel.param_dtype``."""
    merge_into: Literal["training_base", "original_base"] = "training_base"
    """Which base weights the merged export (``final/``, ``shardlm export`` of a LoRA checkpoint) adds the scaled
    adapters to: ``training_base``, the base exactly as training held it (an NF4 base dequantised, a bfloat16 base
    as rounded): the merged model equals the trained one; or ``original_base``, the weights of ``model.init_from``
    as stored there (e.g. 16-bit): an approximation of the trained model when the training base was rounded
    (``nf4``, or ``bfloat16`` of wider weights), since the adapters learnt to correct the rounded base. Recorded in
    the exported directory's ``lora_merge.json`` and in the log."""


@dataclass
class PreferenceConfig:
    """Preference tuning on ``data.format = "preference"`` pairs (shardlm/train/preference.py, formulas and sources
    there). The global batch and the micro-batch count pairs; each pair is two sequences in one forward."""

    loss: Literal["dpo", "ipo", "hinge", "simpo", "orpo"] = "dpo"
    """``dpo`` (Rafailov et al. 2023; TRL's ``sigmoid``), ``ipo`` (Azar et al. 2023, per-token averaged as TRL),
    ``hinge`` (SLiC, Zhao et al. 2023), and the reference-free ``simpo`` (Meng et al. 2024) and ``orpo`` (Hong et al.
    2024)."""
    beta: float = 0.1
    """β: the inverse temperature of the implicit reward (dpo, hinge, simpo), IPO's τ, and ORPO's λ (the weight of
    the odds-ratio term, as TRL's ``ORPOConfig.beta``)."""
    label_smoothing: float = 0.0
    """ε of conservative DPO (Mitchell 2023): the loss ``-(1-ε)·logσ(βΔ) - ε·logσ(-βΔ)``; dpo and simpo only, in
    [0, 0.5)."""
    simpo_gamma: float = 0.5
    """SimPO's target reward margin γ (the loss is ``-logσ(β·(avg logp_c - avg logp_r) - γ)``)."""
    rpo_alpha: float = 0.0
    """Weight α of an added NLL term on the chosen completions (mean over their tokens of the global batch; RPO,
    Pang et al. 2024; TRL's ``loss_type=["sigmoid", "sft"]`` with weights ``[1, α]``, CPO's ``cpo_alpha``). ORPO
    always has this term with weight 1; α adds to it."""
    reference: Literal["auto", "model", "lora_base"] = "auto"
    """The reference policy of dpo / ipo / hinge: ``model``, a frozen copy FSDP-sharded beside the policy (eval, no
    gradients), loaded from ``reference_from``; ``lora_base``, the policy itself with its LoRA adapters switched off
    (needs ``lora.enabled``; no second copy); ``auto`` is ``lora_base`` under LoRA, else ``model``."""
    reference_from: str = ""
    """HF model directory of the reference model; empty means ``model.init_from`` (or, without it, the policy's
    own random initialisation). Its tokenizer must equal the policy's."""
    precompute_reference: bool = False
    """Compute the reference log-probs of every training pair once, before step 1 (FSDP-sharded, the pairs split
    over ranks), store them in the run directory keyed by the reference's identity and the data, and reuse them on
    resume or a second run; the reference model is freed before training."""


@dataclass
class Config:
    """The whole configuration of a run: one section per dataclass."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    run: RunConfig = field(default_factory=RunConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    preference: PreferenceConfig = field(default_factory=PreferenceConfig)

    def to_dict(self) -> dict[str, Any]:
        """The config as nested plain dicts (tuples become lists), for JSON/TOML output; keys are the TOML keys
        (``checkpoint.async``, not the attribute ``async_``)."""
        data = json.loads(json.dumps(dataclasses.asdict(self)))
        for section in data.values():
            for key, attr in KEYWORD_KEYS.items():
                if isinstance(section, dict) and attr in section:
                    section[key] = section.pop(attr)
        return data


#: config keys that are Python keywords -> the attribute that holds them (``checkpoint.async`` -> ``async_``)
KEYWORD_KEYS = {"async": "async_"}


def _coerce(key: str, value: Any, typ: Any) -> Any:
    """Check ``value`` against the annotation ``typ`` and convert it; raise ConfigError naming ``key``."""
    origin = typing.get_origin(typ)
    if origin in (typing.Union, types.UnionType):  # e.g. ``bool | int``: the first arm that accepts the value
        for arm in typing.get_args(typ):
            try:
                return _coerce(key, value, arm)
            except ConfigError:
                continue
        names = " or ".join(getattr(a, "__name__", str(a)) for a in typing.get_args(typ))
        raise ConfigError(f"{key}: expected {names}, got {value!r}")
    if origin is Literal:
        if value not in typing.get_args(typ):
            raise ConfigError(f"{key}: {value!r} is not one of {list(typing.get_args(typ))}")
        return value
    if origin is list and dataclasses.is_dataclass(typing.get_args(typ)[0]):
        item_type = typing.get_args(typ)[0]
        if not isinstance(value, list) or not all(isinstance(v, dict) for v in value):
            raise ConfigError(f"{key}: expected a list of tables ([[{key}]]), got {value!r}")
        items = []
        for i, table in enumerate(value):
            item = item_type()
            for k, v in table.items():
                _apply(item, f"{key}[{i}]", k, v)
            items.append(item)
        return items
    if origin is tuple and typing.get_args(typ)[1:] == (Ellipsis,):  # e.g. ``tuple[str, ...]``: any length
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key}: expected a list, got {value!r}")
        return tuple(_coerce(f"{key}[{i}]", v, typing.get_args(typ)[0]) for i, v in enumerate(value))
    if origin is tuple:
        args = typing.get_args(typ)
        if not isinstance(value, (list, tuple)) or len(value) != len(args):
            raise ConfigError(f"{key}: expected a list of {len(args)} values, got {value!r}")
        return tuple(_coerce(f"{key}[{i}]", v, t) for i, (v, t) in enumerate(zip(value, args)))
    if typ is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{key}: expected true or false, got {value!r}")
        return value
    if typ is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key}: expected an integer, got {value!r}")
        return value
    if typ is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{key}: expected a number, got {value!r}")
        return float(value)
    if typ is str:
        if not isinstance(value, str):
            raise ConfigError(f"{key}: expected a string, got {value!r}")
        return value
    raise ConfigError(f"{key}: unsupported field type {typ!r}")  # pragma: no cover - a bug in this file


def _parse_cli_value(text: str) -> Any:
    """Read a command-line value as a TOML value, falling back to a bare string."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


parse_cli_value = _parse_cli_value  # public: what an override's value means (shardlm.cli.train reads --run.dir)


def _apply(section_obj: Any, section: str, key: str, value: Any) -> None:
    hints = typing.get_type_hints(type(section_obj))
    attrs = {f.name for f in dataclasses.fields(section_obj)}
    attr = KEYWORD_KEYS.get(key, key)
    if attr not in attrs or attr in KEYWORD_KEYS.values() and key == attr:  # ``async_`` is spelt ``async``
        keys = {next((k for k, a in KEYWORD_KEYS.items() if a == name), name) for name in attrs}
        raise ConfigError(f"unknown config key '{section}.{key}' (known: {', '.join(sorted(keys))})")
    setattr(section_obj, attr, _coerce(f"{section}.{key}", value, hints[attr]))


def load_config(path: str | list[str] | None = None, overrides: list[str] | None = None,
                base: dict[str, Any] | None = None, base_name: str = "the recorded config") -> Config:
    """Build a :class:`Config` from optional TOML files and ``--section.key=value`` overrides.

    Args:
        base: sections applied first, as ``Config.to_dict()`` writes them (a run directory's ``config.json``, for a
            resume from the run directory); ``base_name`` names it in errors.
        path: TOML file with sections named like the :class:`Config` fields, a list of such files applied in
            order (a later file's keys replace an earlier one's; e.g. a config, then the settings
            ``shardlm tune`` wrote), or None for defaults. ``run.name`` defaults to the first file's stem.
        overrides: command-line items such as ``--train.steps=50`` (values are parsed as TOML
            values, so ``true``, ``3e-4`` and ``[0.9, 0.95]`` work; bare words are strings).

    Raises:
        ConfigError: missing or unparsable file, unknown section or key, or a value of the wrong type.
    """
    cfg = Config()
    sections = {f.name for f in dataclasses.fields(cfg)}
    paths = [] if path is None else [path] if isinstance(path, str) else list(path)
    for section, table in (base or {}).items():
        if section not in sections or not isinstance(table, dict):
            raise ConfigError(f"unknown config section '{section}' in {base_name}")
        for key, value in table.items():
            _apply(getattr(cfg, section), section, key, value)
    for file in paths:
        p = Path(file)
        if not p.is_file():
            raise ConfigError(f"config file not found: {file}")
        try:
            data = tomllib.loads(p.read_text())
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"{file}: invalid TOML: {e}") from None
        for section, table in data.items():
            if section not in sections:
                raise ConfigError(f"unknown config section '{section}' in {file} (known: {', '.join(sorted(sections))})")
            if not isinstance(table, dict):
                raise ConfigError(f"'{section}' in {file} must be a [section] table")
            for key, value in table.items():
                _apply(getattr(cfg, section), section, key, value)
    if paths and not cfg.run.name:
        cfg.run.name = Path(paths[0]).stem
    for item in overrides or []:
        if not item.startswith("--") or "=" not in item:
            raise ConfigError(f"override {item!r} must look like --section.key=value")
        dotted, text = item[2:].split("=", 1)
        if dotted.count(".") != 1:
            raise ConfigError(f"override {item!r} must name one section and one key, e.g. --train.steps=50")
        section, key = dotted.split(".")
        if section not in sections:
            raise ConfigError(f"unknown config section '{section}' in override {item!r}")
        _apply(getattr(cfg, section), section, key, _parse_cli_value(text))
    if not cfg.run.name:
        cfg.run.name = "default"
    if cfg.model.init_from:
        apply_init_from(cfg)
    validate(cfg)
    return cfg


def apply_init_from(cfg: Config) -> None:
    """Make ``cfg.model`` the shape of ``cfg.model.init_from``'s ``config.json`` (in place).

    Every shape field is replaced (``init_std``, ``init_from`` and the attention settings are kept): the pretrained weights
    decide the model. ``data.tokenizer`` defaults to the directory's ``tokenizer.json`` when empty.

    Raises:
        ModelDirError: the directory or its ``config.json`` is missing or invalid, or not a Llama.
    """
    src = read_model_dir_config(cfg.model.init_from)
    for f in dataclasses.fields(ModelConfig):
        if f.name not in ("init_std", "init_from", "attention", "attention_backend"):
            setattr(cfg.model, f.name, getattr(src, f.name))
    tokenizer = Path(cfg.model.init_from) / "tokenizer.json"
    if not cfg.data.tokenizer and tokenizer.is_file():
        cfg.data.tokenizer = str(tokenizer)


def validate_moe(m: ModelConfig) -> None:
    """Check the mixture-of-experts fields of ``m`` (``n_experts`` and its companions); raise ConfigError naming the key."""
    if m.arch.moe != (m.n_experts > 0):
        moe_families = " and ".join(repr(f.name) for f in FAMILIES.values() if f.moe)
        raise ConfigError(f"model.n_experts={m.n_experts}: model.family {m.family!r} is "
                          + ("a mixture of experts: set model.n_experts > 0" if m.arch.moe else
                             f"dense (the mixtures of experts are {moe_families}): leave it 0"))
    if not m.n_experts:
        return
    if not 1 <= m.n_experts_per_token <= m.n_experts:
        raise ConfigError(f"model.n_experts_per_token={m.n_experts_per_token} must be between 1 and "
                          f"model.n_experts={m.n_experts}")
    for key in ("moe_layer_step",):
        if getattr(m, key) < 1:
            raise ConfigError(f"model.{key} must be >= 1, got {getattr(m, key)}")
    if m.moe_ffn_hidden < 0:
        raise ConfigError(f"model.moe_ffn_hidden must be >= 0 (0 = model.ffn_hidden), got {m.moe_ffn_hidden}")
    bad = [i for i in m.dense_layers if not 0 <= i < m.n_layers]
    if bad:
        raise ConfigError(f"model.dense_layers {list(m.dense_layers)}: layer {bad[0]} is not in [0, {m.n_layers})")
    for key in ("router_aux_loss_coef", "router_z_loss_coef"):
        if getattr(m, key) < 0:
            raise ConfigError(f"model.{key} must be >= 0, got {getattr(m, key)}")


def validate(cfg: Config) -> None:
    """Check values that do not depend on the world size; raise ConfigError naming the key."""
    m, t = cfg.model, cfg.train
    for section in dataclasses.fields(cfg):  # NaN passes every comparison below: refuse it first
        obj = getattr(cfg, section.name)
        for f in dataclasses.fields(obj):
            values = getattr(obj, f.name)
            for v in values if isinstance(values, tuple) else (values,):
                if isinstance(v, float) and not math.isfinite(v):
                    raise ConfigError(f"{section.name}.{f.name} must be a finite number, got {v}")
    if cfg.parallel.timeout_s <= 0:
        raise ConfigError(f"parallel.timeout_s must be positive (seconds), got {cfg.parallel.timeout_s}")
    positive = {
        "model.dim": m.dim, "model.n_layers": m.n_layers, "model.n_heads": m.n_heads,
        "model.vocab_size": m.vocab_size, "model.max_seq_len": m.max_seq_len,
        "train.steps": t.steps, "train.seq_len": t.seq_len, "train.global_batch_size": t.global_batch_size,
        "train.micro_batch_size": t.micro_batch_size, "train.log_interval": t.log_interval,
    }
    for key, value in positive.items():
        if value <= 0:
            raise ConfigError(f"{key} must be positive, got {value}")
    if m.head_width < 0:
        raise ConfigError(f"model.head_width must be >= 0, got {m.head_width}")
    if not m.head_width and m.dim % m.n_heads:
        raise ConfigError(f"model.n_heads={m.n_heads} must divide model.dim={m.dim} (or set model.head_width)")
    if m.head_dim % 2:
        raise ConfigError(f"the head width {m.head_dim} (model.head_width, or model.dim / model.n_heads) must be even "
                          "for rotary embeddings")
    for key in ("sliding_window", "sliding_window_pattern", "rope_local_theta", "query_pre_attn_scalar",
                "final_logit_softcap", "rope_linear_factor"):
        if getattr(m, key) < 0:
            raise ConfigError(f"model.{key} must be >= 0, got {getattr(m, key)}")
    m.arch.check(m)  # the family's refusals (an unregistered model.family is refused by ``arch`` itself)
    validate_moe(m)
    if m.rope_linear_factor > 0 and m.rope_scaling_factor > 0:
        raise ConfigError("model.rope_linear_factor and model.rope_scaling_factor (llama3) cannot both be set")
    kv = m.kv_heads
    if kv < 0 or m.n_heads % kv:
        raise ConfigError(f"model.n_kv_heads={m.n_kv_heads} must divide model.n_heads={m.n_heads}")
    if t.seq_len > m.max_seq_len:
        raise ConfigError(f"train.seq_len={t.seq_len} exceeds the model's maximum model.max_seq_len={m.max_seq_len}")
    d = cfg.data
    for key in ("tokenizer_sample_bytes", "piece_bytes"):
        if getattr(d, key) <= 0:
            raise ConfigError(f"data.{key} must be positive, got {getattr(d, key)}")
    if d.workers < 0:
        raise ConfigError(f"data.workers must be >= 0 (0 = the available cores), got {d.workers}")
    names = [s.name or f"source{i}" for i, s in enumerate(d.sources)]
    for i, source in enumerate(d.sources):
        if not source.path:
            raise ConfigError(f"data.sources[{i}].path must name a corpus")
        if not source.weight > 0:
            raise ConfigError(f"data.sources[{i}].weight must be positive, got {source.weight}")
    if len(set(names)) != len(names):
        raise ConfigError(f"data.sources names must differ, got {names}")
    if d.sources and d.format != "text":
        raise ConfigError("data.sources (a mixture) needs data.format = 'text'")
    validate_preference(cfg)
    if d.pack and d.format != "instruct":
        raise ConfigError("data.pack packs instruction examples: it needs data.format = 'instruct' (text windows are "
                          "already full; for document masking there set model.attention = 'block_causal')")
    if d.pack and cfg.model.attention != "block_causal":
        raise ConfigError("data.pack needs model.attention = 'block_causal': under 'causal' the packed examples would "
                          "attend to each other")
    if not 0.0 < cfg.data.val_fraction < 1.0:
        raise ConfigError(f"data.val_fraction must be in (0, 1), got {cfg.data.val_fraction}")
    if t.min_lr > t.lr or t.lr <= 0:
        raise ConfigError(f"train.lr={t.lr} must be positive and at least train.min_lr={t.min_lr}")
    for key in ("warmup_steps", "eval_interval", "eval_tokens"):
        if getattr(t, key) < 0:
            raise ConfigError(f"train.{key} must be >= 0, got {getattr(t, key)}")
    if t.peak_flops < 0:
        raise ConfigError(f"train.peak_flops must be >= 0 (FLOP/s; 0 = automatic), got {t.peak_flops}")
    if t.grad_clip < 0:
        raise ConfigError(f"train.grad_clip must be >= 0, got {t.grad_clip}")
    if t.loss_chunk_tokens < 0:
        raise ConfigError(f"train.loss_chunk_tokens must be >= 0 (scored tokens per chunk of the fused output "
                          f"projection and loss; 0 = the plain loss), got {t.loss_chunk_tokens}")
    for key in ("dp_replicate", "dp_shard"):
        if getattr(cfg.parallel, key) < 1 and getattr(cfg.parallel, key) != -1:
            raise ConfigError(f"parallel.{key} must be >= 1 or -1 (all remaining ranks), "
                              f"got {getattr(cfg.parallel, key)}")
    if cfg.parallel.tp < 1:
        raise ConfigError(f"parallel.tp must be >= 1 (1 = no tensor parallel), got {cfg.parallel.tp}")
    if cfg.parallel.tp > 1 and cfg.parallel.mode != "fsdp":
        raise ConfigError(f"parallel.tp={cfg.parallel.tp} needs parallel.mode='fsdp' (FSDP over the data-parallel "
                          f"ranks), not {cfg.parallel.mode!r}")
    if cfg.parallel.async_tp and (cfg.parallel.tp == 1 or not cfg.parallel.compile):
        raise ConfigError("parallel.async_tp needs tensor parallel (parallel.tp > 1) and parallel.compile = true "
                          "(TorchInductor builds the micro-pipelined collectives)")
    if cfg.parallel.dp_replicate == cfg.parallel.dp_shard == -1:
        raise ConfigError("parallel.dp_replicate and parallel.dp_shard cannot both be -1: set one of them")
    if cfg.parallel.cp < 1 or (cfg.parallel.cp > 1 and cfg.parallel.mode == "single"):
        raise ConfigError(f"parallel.cp must be >= 1 (ranks per sequence), and 1 in parallel.mode='single', "
                          f"got {cfg.parallel.cp}")
    split = [f"parallel.{k}={getattr(cfg.parallel, k)}" for k in ("tp", "cp") if getattr(cfg.parallel, k) > 1]
    if cfg.data.format == "preference" and (split or cfg.model.n_experts):
        what = " and ".join(split) if split else f"a mixture-of-experts model (model.n_experts={cfg.model.n_experts})"
        raise ConfigError(f"preference tuning (data.format = 'preference') with {what} is not built yet: use FSDP "
                          "(parallel.mode = 'fsdp'), with LoRA if the model is large")
    if cfg.model.n_experts and split:
        raise ConfigError(f"{' and '.join(split)} on a mixture-of-experts model (model.n_experts="
                          f"{cfg.model.n_experts}) is not built yet: use expert parallelism (parallel.ep) with FSDP")
    for key in ("interval", "keep"):
        if getattr(cfg.checkpoint, key) < 0:
            raise ConfigError(f"checkpoint.{key} must be >= 0, got {getattr(cfg.checkpoint, key)}")
    p = cfg.parallel
    for key in ("forward_prefetch", "backward_prefetch"):
        if getattr(p, key) < 0:
            raise ConfigError(f"parallel.{key} must be >= 0, got {getattr(p, key)}")
    if not 1 <= p.blocks_per_group <= m.n_layers:
        raise ConfigError(f"parallel.blocks_per_group must be between 1 and model.n_layers={m.n_layers} (one group "
                          f"of all blocks), got {p.blocks_per_group}")
    if p.activation_checkpoint_n < 1:
        raise ConfigError(f"parallel.activation_checkpoint_n must be >= 1, got {p.activation_checkpoint_n}")
    if not isinstance(p.reshard_after_forward, bool) and p.reshard_after_forward < 2:
        raise ConfigError(f"parallel.reshard_after_forward must be true, false or an integer N > 1, "
                          f"got {p.reshard_after_forward}")
    if p.mode != "fsdp":
        fsdp_only = {"param_dtype": "float32", "reduce_dtype": "float32", "reshard_after_forward": True,
                     "forward_prefetch": 0, "backward_prefetch": 0, "async_all_gather": False, "cpu_offload": False,
                     "reduce_scatter": "auto", "blocks_per_group": 1}
        for key, default in fsdp_only.items():
            if getattr(p, key) != default:
                raise ConfigError(f"parallel.{key} applies to parallel.mode='fsdp' only (mode is {p.mode!r})")
    lora = cfg.lora
    if lora.enabled:
        if lora.rank < 1:
            raise ConfigError(f"lora.rank must be >= 1, got {lora.rank}")
        if not 0.0 <= lora.dropout < 1.0:
            raise ConfigError(f"lora.dropout must be in [0, 1), got {lora.dropout}")
        if t.trainable or t.frozen:
            raise ConfigError("train.trainable / train.frozen cannot be combined with lora.enabled (LoRA trains the "
                              "adapters only)")
        if lora.merge_into == "original_base" and not cfg.model.init_from:
            raise ConfigError("lora.merge_into='original_base' needs model.init_from (the original weights are read "
                              "from it); a randomly initialised base has only the training base")
    elif lora.base_dtype != "float32":
        raise ConfigError(f"lora.base_dtype={lora.base_dtype!r} needs lora.enabled = true")
    if m.rope_scaling_factor > 0 and m.rope_high_freq_factor <= m.rope_low_freq_factor:
        raise ConfigError(f"model.rope_high_freq_factor={m.rope_high_freq_factor} must exceed "
                          f"model.rope_low_freq_factor={m.rope_low_freq_factor}")
    scalings = [key for key in ("rope_scaling_factor", "rope_linear_factor", "rope_yarn_factor", "rope_dynamic_factor")
                if getattr(m, key) != 0]
    if len(scalings) > 1:
        raise ConfigError(f"one RoPE scaling at a time: model.{' and model.'.join(scalings)} are all set")
    for key in scalings:
        if getattr(m, key) < 1:
            raise ConfigError(f"model.{key} must be >= 1 (0 = no scaling), got {getattr(m, key)}")
    if m.rope_yarn_factor and (m.rope_yarn_beta_fast < m.rope_yarn_beta_slow or m.rope_yarn_attention_factor < 0
                               or m.rope_original_max_seq_len < 1):
        raise ConfigError(f"YaRN needs model.rope_yarn_beta_fast >= rope_yarn_beta_slow (got {m.rope_yarn_beta_fast} "
                          f"and {m.rope_yarn_beta_slow}), rope_yarn_attention_factor >= 0 (got "
                          f"{m.rope_yarn_attention_factor}) and rope_original_max_seq_len >= 1 (got "
                          f"{m.rope_original_max_seq_len})")


def validate_preference(cfg: Config) -> None:
    """Check ``[preference]`` against the rest of the config; raise ConfigError naming the key."""
    pref, d = cfg.preference, cfg.data
    if d.format != "preference":
        changed = [f.name for f in dataclasses.fields(pref) if getattr(pref, f.name) != f.default]
        if changed:
            raise ConfigError(f"preference.{changed[0]} applies to data.format = 'preference' (format is {d.format!r})")
        return
    if d.pack:
        raise ConfigError("data.pack does not apply to data.format = 'preference': preference pairs are not packed "
                          "(each sequence is one row of the concatenated chosen/rejected forward)")
    if cfg.model.attention != "causal":
        raise ConfigError("data.format = 'preference' needs model.attention = 'causal' (pairs are not packed)")
    if not pref.beta > 0:
        raise ConfigError(f"preference.beta must be positive, got {pref.beta}")
    if not 0.0 <= pref.label_smoothing < 0.5:
        raise ConfigError(f"preference.label_smoothing must be in [0, 0.5), got {pref.label_smoothing}")
    if pref.label_smoothing and pref.loss not in ("dpo", "simpo"):
        raise ConfigError(f"preference.label_smoothing applies to loss 'dpo' or 'simpo' (loss is {pref.loss!r})")
    if pref.rpo_alpha < 0:
        raise ConfigError(f"preference.rpo_alpha must be >= 0, got {pref.rpo_alpha}")
    if pref.reference == "lora_base" and not cfg.lora.enabled:
        raise ConfigError("preference.reference = 'lora_base' needs lora.enabled = true (the base with the adapters "
                          "off is the reference)")
    if pref.reference == "lora_base" and pref.reference_from:
        raise ConfigError("preference.reference_from names a reference model: it needs preference.reference = "
                          "'model' (or 'auto' without LoRA), not 'lora_base'")


def gradient_accumulation_steps(cfg: Config, dp_world_size: int) -> int:
    """Micro-batches per optimizer step: G / (data-parallel world size × micro-batch size).

    Raises:
        ConfigError: when that is not an integer >= 1.
    """
    g, mbs = cfg.train.global_batch_size, cfg.train.micro_batch_size
    per_step = dp_world_size * mbs
    if g % per_step:
        raise ConfigError(
            f"train.global_batch_size={g} must be divisible by world size × train.micro_batch_size "
            f"= {dp_world_size} × {mbs} = {per_step}"
            + (f" (the data-parallel world size: world size / parallel.tp={cfg.parallel.tp})" if cfg.parallel.tp > 1
               else "")
        )
    return g // per_step
