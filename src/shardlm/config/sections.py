"""The sections of a run's configuration: one dataclass per TOML section, a docstring per field, and
:class:`Config`, which holds them. ``[model]`` is :class:`~shardlm.model.config.ModelConfig` and
``[parallel]`` :class:`~shardlm.config.parallelism.ParallelConfig`, each beside its own rules; the objectives'
sections (``[preference]``, ``[distill]``, ``[rl]``) are in :mod:`shardlm.config.objectives`."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any, Literal

from shardlm.config.objectives import DistillConfig, PreferenceConfig, RLConfig
from shardlm.config.parallelism import ParallelConfig
from shardlm.model.config import ModelConfig


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
    """``shakespeare`` (the embedded default); a .txt/.md/.jsonl file (each also .gz/.zst) or .parquet; a
    datasets ``save_to_disk`` directory; ``hf:NAME[:SPLIT]`` (the local Hugging Face cache, offline); a
    directory of any of these (recursive) or a glob."""
    tokenizer: str = ""
    """Path to an existing ``tokenizer.json``; empty trains a byte-level BPE on a sample of the corpus."""
    tokenizer_vocab_size: int = 0
    """Vocabulary size of a trained tokenizer; 0 means ``model.vocab_size``."""
    tokenizer_sample_bytes: int = 100_000_000
    """Most text a trained tokenizer learns from, in bytes: a seeded sample of the corpus (``train.seed``)."""
    text_field: str = "text"
    """The field of a JSONL object, or the column of Parquet and datasets, that holds the text."""
    workers: int = 0
    """Encoding processes per rank; 0 means the cores this process may use, divided by the ranks of
    the node."""
    piece_bytes: int = 64 << 20
    """Input bytes per piece: the unit of work shared between ranks and kept when a preparation restarts."""
    val_fraction: float = 0.05
    """Fraction of the token stream (its tail) held out for validation."""
    dir: str = ""
    """Directory of the prepared token ids; empty means ``data/<config name>``."""
    format: Literal["text", "instruct", "preference", "prompts"] = "text"
    """``text``: a corpus for language modelling; ``instruct``: a .jsonl of ``messages`` or
    ``prompt``/``response`` examples, chat-formatted, loss on response tokens only (see
    shardlm/data/instruct.py); ``preference``: a .jsonl of ``prompt``/``chosen``/``rejected`` pairs for the
    ``[preference]`` objective (shardlm/data/preference.py); ``prompts``: ``prompt`` (text or chat
    messages) and any other fields the reward functions read, for the ``[rl]`` objective
    (shardlm/data/prompts.py)."""
    pack: bool = False
    """Pack several instruction examples into each sample of ``seq_len + 1`` tokens (best-fit decreasing, the
    rest padded; shardlm/data/packing.py), under block-causal attention so that no example sees another
    (``model.attention = "auto"``, the default, then resolves to ``block_causal``; ``causal`` is refused).
    Only for ``format = "instruct"``: pre-training windows are already full (block-causal there
    by default)."""
    pad_multiple: int = 8
    """Unpacked instruction examples and preference pairs: each micro-batch's rows are padded to its longest
    sequence, the positions the model computes rounded up to a multiple of this (and of what
    ``parallel.cp`` and ``parallel.tp`` need), at most ``train.seq_len`` (shardlm/data/instruct.py's
    ``row_width``). 0 pads every row to ``train.seq_len + 1`` tokens. Packed rows and text windows are always
    full. Same losses up to summation order; bit-identical where the longest row fills ``seq_len``."""
    group_by_length_steps: int = 0
    """Length-grouped sampling (Hugging Face's ``group_by_length``) for unpacked instruction examples and
    preference pairs: the samples of every this many consecutive steps are sorted by length and cut into
    that many global batches, which then take those steps in a seeded random order, so each micro-batch
    pads little (shardlm/data/length_groups.py); a group never crosses the end of an epoch. It changes which
    samples share a step, not which samples an epoch sees; the order still does not depend on the number of
    ranks. 0 (the default) is off; 50 is what Hugging Face's sampler groups. Needs ``data.pad_multiple`` >
    0."""
    sources: list[DataSource] = field(default_factory=list)
    """A mixture, instead of ``corpus``: ``[[data.sources]]`` tables with ``path`` and ``weight`` (and
    ``name``). Each global batch draws its samples from the sources in proportion to the weights; all sources
    share one tokenizer; each is prepared into ``<data.dir>/<name>``."""


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
    """Write a metrics record every this many steps (and at the last step, and on evaluation and checkpoint
    steps). Only these steps read values to the host; a preemption signal is acted on at the next of them."""
    log_per_rank: bool = False
    """Also write each per-rank figure as a full list over ranks (``<key>_per_rank`` in metrics.jsonl, one
    TensorBoard tag per rank); otherwise only its summary (min, max, mean, rank of the max)."""
    log_moe_layers: bool = False
    """A mixture of experts: also write tokens per expert for each MoE layer
    (``tokens_per_expert_min/layer<i>``, ``_max/layer<i>``, i the block index); otherwise only over all layers
    and experts together."""
    seed: int = 0
    """Seed of the initialisation and the data order."""
    peak_flops: float = 0.0
    """Peak dense FLOP/s of one rank's device that MFU is measured against; 0 = automatic: the datasheet peak
    of a known GPU in the precision that runs (bf16, TF32 or fp32; shardlm/metrics/flops.py), or on a CPU (or
    an unknown GPU) a rate measured at start-up with large matrix products in that precision."""
    trainable: str = ""
    """Comma-separated name patterns of the parameters to train; every other parameter is frozen (no gradient,
    no optimizer state, no gradient communication). ``*`` matches any text, ``[a-b]`` any integer from a to b,
    and a pattern may match any dot-separated run of a name: ``model.layers.[0-11].*``, ``embed_tokens``,
    ``norm``. Empty: everything is trainable (see shardlm/model/freeze.py)."""
    frozen: str = ""
    """Comma-separated name patterns of parameters to freeze (as ``trainable``), applied after it."""
    loss_chunk_tokens: int | Literal["auto"] = "auto"
    """Scored tokens per chunk of the fused output projection and cross-entropy (training and evaluation):
    each chunk's logits (this many × vocab fp32 values) are made, turned into its loss and gradients, and
    freed, so the whole logits never exist (``shardlm/train/loss.py``); same results as the plain loss up to
    summation order. 0 = the plain loss (the whole logits, their fp32 log-softmax and gradients). ``auto``:
    chosen at start-up (``shardlm train``: one chunk of a micro-batch's tokens when their fp32 logits are at
    most 64 MiB and the planned step fits, else 256; shardlm/plan/defaults.py), kept on resume; 256 where
    nothing chooses. One chunk holds about half the plain loss's memory and is no slower: it writes neither
    the log-softmax nor the logits' gradient."""
    float8: Literal["none", "tensorwise", "rowwise", "mxfp8"] = "none"
    """Float8 training of the blocks' linear layers with torchao (shardlm/parallel/float8.py): ``tensorwise``
    (one scale per tensor; under FSDP the weights are all-gathered in float8), ``rowwise`` (a scale per row;
    weights all-gathered in ``parallel.param_dtype``), ``mxfp8`` (MX blocks of 32, Blackwell only; needs
    ``parallel.param_dtype = "bfloat16"``). Not converted: ``lm_head``, MoE routers and experts, layers
    whose dimensions are not multiples of 16 (32 for mxfp8). A GPU needs float8 tensor cores (compute
    capability 8.9; 10.0 for mxfp8), else the run is refused; on a CPU float8 always runs emulated
    (numerics, not speed). Use with ``parallel.compile = true`` on a GPU. Not with ``[lora]``, ``train.qat``
    or ``parallel.tp > 1``."""
    qat: Literal["none", "int8_dynamic_activation_int4_weight", "int8_dynamic_activation_int8_weight",
                 "int4_weight_only", "int8_weight_only"] = "none"
    """Quantisation-aware training with torchao (shardlm/model/qat.py): the blocks' linear layers (not
    ``lm_head`` or routers) train through the fake quantisation of this scheme, and the run also writes
    ``final-quantized/``, the trained model quantised with it (torchao's ``IntxUnpackedToInt8Tensor`` in
    safetensors, ``quantization_config`` in config.json: transformers loads it with torchao installed).
    ``int8_dynamic_activation_int4_weight``: int4 weights (a scale per ``qat_group_size`` inputs) and int8
    dynamic activations; ``int8_dynamic_activation_int8_weight``: int8 weights per row;
    ``int4_weight_only``, ``int8_weight_only``: weights only. Needs the ``lowprec`` extra (torchao,
    transformers); not with ``[lora]`` or ``train.float8``."""
    qat_group_size: int = 32
    """Inputs per weight scale of ``train.qat``'s int4 schemes (torchao's group size); 0 = one scale per
    output row (coarser: a larger quantisation error). A layer whose input width it does not divide stays in
    full precision. The int8 schemes always use one scale per row."""


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
    """``""`` starts fresh (unless torchrun restarted the job: then ``auto``), ``auto`` resumes from the
    newest complete checkpoint of the run directory's run (``config.json``'s ``run_id``) if there is one, or a
    path to a ``step-<N>`` checkpoint directory. ``--resume=auto`` is the same; with it and no ``--config``
    the run's settings come from the run directory's ``config.json``
    (:func:`shardlm.cli.train.train_config`)."""
    async_: bool = False
    """``checkpoint.async`` in TOML and on the command line (``async`` is a Python keyword): stage the state
    to host memory (a copy of this rank's shards: ~12 bytes per parameter / world size with AdamW in fp32) and
    write it in the background with DCP's ``async_save`` on a gloo process group of its own (timeout
    :data:`shardlm.checkpoint.dcp.CHECKPOINT_TIMEOUT`) while training continues. At most one save is in flight
    (the next save and the end of the run wait for it); the checkpoint becomes ``step-<N>`` only when every
    rank has written and the manifest is there, and a failed background save stops the run at the next step
    with the cause and path. False: the training loop waits for each save."""


@dataclass
class MetricsConfig:
    """Experiment trackers that receive the metrics records besides ``metrics.jsonl`` and TensorBoard.

    Rank 0 logs; a tracker that fails prints one warning and training goes on
    (``shardlm/metrics/trackers.py``).
    """

    wandb: bool = False
    """Log to Weights & Biases (``pip install 'shardlm[wandb]'``): the config, every logged step, the final
    model path."""
    wandb_project: str = ""
    """W&B project; empty means ``WANDB_PROJECT`` or ``shardlm``."""
    wandb_entity: str = ""
    """W&B entity (user or team); empty means ``WANDB_ENTITY`` or the account's default."""
    wandb_name: str = ""
    """W&B run name; empty means ``WANDB_NAME`` or ``run.name``."""
    wandb_tags: tuple[str, ...] = ()
    """W&B run tags; empty means ``WANDB_TAGS`` (comma-separated) or none."""
    wandb_mode: Literal["", "online", "offline"] = ""
    """``online`` uploads as it goes; ``offline`` writes ``<run dir>/wandb/offline-run-*`` for ``wandb sync``;
    empty means ``WANDB_MODE`` or online."""
    wandb_rewind: bool = True
    """On resume, rewind the W&B run to the checkpoint's step (``resume_from``; a W&B preview feature) so the
    resumed steps replace those logged past it; false, or a server that refuses it, continues with
    ``resume="allow"``."""
    mlflow: bool = False
    """Log to MLflow (``pip install 'shardlm[mlflow]'``): the config as parameters and artefact, every logged
    step, the final model path, the report PNGs."""
    mlflow_tracking_uri: str = ""
    """MLflow tracking URI (``http://host:5000``, ``file:/path/mlruns``, ``sqlite:///mlflow.db``...); empty
    means ``MLFLOW_TRACKING_URI``, else MLflow's default in the working directory: ``sqlite:///mlflow.db``, or
    ``file:./mlruns`` without sqlalchemy/alembic (said in one line) or when it already holds experiments."""
    mlflow_experiment: str = ""
    """MLflow experiment name; empty means ``MLFLOW_EXPERIMENT_NAME`` or ``shardlm``."""
    mlflow_run_name: str = ""
    """MLflow run name; empty means ``run.name``."""


@dataclass
class LoRAConfig:
    """Low-rank adapters (LoRA) on the targeted linear layers; everything else is frozen
    (shardlm/model/lora.py).

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
    """Storage of the frozen base: ``float32``, ``bfloat16`` (the targeted layers' weights in half the bytes),
    or ``nf4`` (QLoRA: every frozen weight matrix, the token embedding and output projection included, in
    4-bit NormalFloat via torchao; norms stay fp32; the whole base about 0.26x its bf16 bytes; needs the
    ``qlora`` extra). The adapters are fp32; the compute dtype is ``parallel.param_dtype``."""
    merge_into: Literal["training_base", "original_base"] = "training_base"
    """Which base weights the merged export (``final/``, ``shardlm export`` of a LoRA checkpoint) adds the
    scaled adapters to: ``training_base``, the base exactly as training held it (an NF4 base dequantised, a
    bfloat16 base as rounded): the merged model equals the trained one; or ``original_base``, the weights of
    ``model.init_from`` as stored there (e.g. 16-bit): an approximation of the trained model when the training
    base was rounded (``nf4``, or ``bfloat16`` of wider weights), since the adapters learnt to correct the
    rounded base. Recorded in the exported directory's ``lora_merge.json`` and in the log."""


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
    distill: DistillConfig = field(default_factory=DistillConfig)
    rl: RLConfig = field(default_factory=RLConfig)

    def to_dict(self) -> dict[str, Any]:
        """The config as nested plain dicts (tuples become lists), for JSON/TOML output; keys are the TOML
        keys (``checkpoint.async``, not the attribute ``async_``)."""
        data = json.loads(json.dumps(dataclasses.asdict(self)))
        for section in data.values():
            for key, attr in KEYWORD_KEYS.items():
                if isinstance(section, dict) and attr in section:
                    section[key] = section.pop(attr)
        return data


#: config keys that are Python keywords -> the attribute that holds them (``checkpoint.async`` -> ``async_``)
KEYWORD_KEYS = {"async": "async_"}
