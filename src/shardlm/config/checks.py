"""The checks of a whole :class:`~shardlm.config.sections.Config` that do not depend on the world size,
section by section and across sections (the model's own rules are
:meth:`~shardlm.model.config.ModelConfig.check`), and the gradient accumulation that the world size gives.
Each failure raises :class:`ConfigError` naming the key."""

from __future__ import annotations

import dataclasses
import math
import re
from typing import TYPE_CHECKING

from shardlm.config.auto import AUTO
from shardlm.config.layout import check_ep, check_pp, check_tp
from shardlm.errors import ConfigError, ModelDirError
from shardlm.model.hf_config import read_model_dir_config

if TYPE_CHECKING:
    from shardlm.config.sections import Config


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
    m.check()  # the model's own rules (shape, family, mixture of experts, RoPE scaling)
    check_transformers_backend(cfg)
    positive = {
        "train.steps": t.steps, "train.seq_len": t.seq_len, "train.global_batch_size": t.global_batch_size,
        "train.micro_batch_size": t.micro_batch_size, "train.log_interval": t.log_interval,
    }
    for key, value in positive.items():
        if value <= 0:
            raise ConfigError(f"{key} must be positive, got {value}")
    if t.seq_len > m.max_seq_len:
        raise ConfigError(f"train.seq_len={t.seq_len} exceeds the model's maximum "
                          f"model.max_seq_len={m.max_seq_len}")
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
    validate_distill(cfg)
    validate_low_precision(cfg)
    validate_rl(cfg)
    if d.pack and d.format != "instruct":
        raise ConfigError("data.pack packs instruction examples: it needs data.format = 'instruct' (text "
                          "windows are already full, and block-causal by default where the data records "
                          "document starts)")
    if d.pack and cfg.model.attention == "causal":
        raise ConfigError("data.pack needs model.attention = 'block_causal' (or 'auto', the default): under "
                          "'causal' the packed examples would attend to each other")
    if d.pad_multiple < 0:
        raise ConfigError(f"data.pad_multiple must be >= 0 (0 pads every row to train.seq_len + 1), got "
                          f"{d.pad_multiple}")
    if d.group_by_length_steps:
        validate_length_groups(cfg)
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
    if t.loss_chunk_tokens != AUTO and t.loss_chunk_tokens < 0:
        raise ConfigError("train.loss_chunk_tokens must be >= 0 (scored tokens per chunk of the fused "
                          f"output projection and loss; 0 = the plain loss), got {t.loss_chunk_tokens}")
    for key in ("dp_replicate", "dp_shard"):
        if getattr(cfg.parallel, key) < 1 and getattr(cfg.parallel, key) != -1:
            raise ConfigError(f"parallel.{key} must be >= 1 or -1 (all remaining ranks), "
                              f"got {getattr(cfg.parallel, key)}")
    if cfg.parallel.tp < 1:
        raise ConfigError(f"parallel.tp must be >= 1 (1 = no tensor parallel), got {cfg.parallel.tp}")
    if cfg.parallel.tp > 1 and cfg.parallel.mode != "fsdp":
        raise ConfigError(f"parallel.tp={cfg.parallel.tp} needs parallel.mode='fsdp' (FSDP over the "
                          f"data-parallel ranks), not {cfg.parallel.mode!r}")
    if cfg.parallel.async_tp and (cfg.parallel.tp == 1 or not cfg.parallel.compile):
        raise ConfigError("parallel.async_tp needs tensor parallel (parallel.tp > 1) and parallel.compile = "
                          "true (TorchInductor builds the micro-pipelined collectives)")
    if cfg.parallel.dp_replicate == cfg.parallel.dp_shard == -1:
        raise ConfigError("parallel.dp_replicate and parallel.dp_shard cannot both be -1: set one of them")
    if cfg.parallel.cp < 1 or (cfg.parallel.cp > 1 and cfg.parallel.mode == "single"):
        raise ConfigError(f"parallel.cp must be >= 1 (ranks per sequence), and 1 in parallel.mode='single', "
                          f"got {cfg.parallel.cp}")
    cp = cfg.parallel.cp
    if cp > t.seq_len:  # as ContextParallel refuses it in training: here for plan and tune too
        raise ConfigError(f"train.seq_len={t.seq_len} is shorter than parallel.cp={cp}: a sequence "
                          f"split over {cp} ranks needs at least {cp} tokens (one per rank)")
    split = [k for k in ("tp", "cp") if getattr(cfg.parallel, k) > 1]
    tuning = {"preference": "preference tuning", "prompts": "reinforcement learning"}.get(cfg.data.format)
    if tuning and split:  # the advice is the setting to change, not a mode
        given = " and ".join(f"parallel.{k}={getattr(cfg.parallel, k)}" for k in split)
        fix = " and ".join(f"parallel.{k} = 1" for k in split)
        raise ConfigError(f"{tuning} (data.format = {cfg.data.format!r}) with {given} is not built yet: "
                          f"set {fix} (FSDP alone then shards the model over every rank; add LoRA if it is "
                          "still too large)")
    if tuning and cfg.model.n_experts:
        raise ConfigError(f"{tuning} (data.format = {cfg.data.format!r}) with a mixture-of-experts model "
                          f"(model.n_experts={cfg.model.n_experts}) is not built yet: tune a dense model "
                          "(model.n_experts = 0)")
    if cfg.model.n_experts and cfg.parallel.tp > 1:  # CP is built for MoE (router statistics pooled)
        raise ConfigError(f"parallel.tp={cfg.parallel.tp} on a mixture-of-experts model (model.n_experts="
                          f"{cfg.model.n_experts}) is not built yet: set parallel.tp = 1 (expert "
                          "parallelism, parallel.ep, splits the experts instead)")
    # the split's sizes against the model and the sequence: here, before any data is prepared
    check_tp(m, cfg.parallel.tp, t.seq_len, cfg.lora.enabled, cp)
    check_ep(m.n_experts, cfg.parallel.ep, None, cfg.parallel.mode, cfg.parallel.dp_replicate)
    check_pp(cfg, None)
    for key in ("interval", "keep"):
        if getattr(cfg.checkpoint, key) < 0:
            raise ConfigError(f"checkpoint.{key} must be >= 0, got {getattr(cfg.checkpoint, key)}")
    p = cfg.parallel
    for key in ("forward_prefetch", "backward_prefetch"):
        if getattr(p, key) < 0:
            raise ConfigError(f"parallel.{key} must be >= 0, got {getattr(p, key)}")
    if p.blocks_per_group != AUTO and not 1 <= p.blocks_per_group <= m.n_layers:
        raise ConfigError(f"parallel.blocks_per_group must be between 1 and model.n_layers={m.n_layers} (one "
                          f"group of all blocks), got {p.blocks_per_group}")
    if p.activation_checkpoint_n < 1:
        raise ConfigError(f"parallel.activation_checkpoint_n must be >= 1, got {p.activation_checkpoint_n}")
    if not isinstance(p.reshard_after_forward, bool) and p.reshard_after_forward != AUTO and \
            p.reshard_after_forward < 2:
        raise ConfigError(f"parallel.reshard_after_forward must be true, false or an integer N > 1, "
                          f"got {p.reshard_after_forward}")
    if p.mode != "fsdp":
        fsdp_only = {"param_dtype": "float32", "reduce_dtype": "float32", "reshard_after_forward": True,
                     "forward_prefetch": 0, "backward_prefetch": 0, "async_all_gather": False,
                     "cpu_offload": False, "reduce_scatter": "auto", "all_gather": "auto",
                     "blocks_per_group": 1}
        for key, default in fsdp_only.items():
            if getattr(p, key) not in (default, AUTO):
                raise ConfigError(f"parallel.{key} applies to parallel.mode='fsdp' only (mode is {p.mode!r})")
    lora = cfg.lora
    if lora.enabled:
        if lora.rank < 1:
            raise ConfigError(f"lora.rank must be >= 1, got {lora.rank}")
        if not 0.0 <= lora.dropout < 1.0:
            raise ConfigError(f"lora.dropout must be in [0, 1), got {lora.dropout}")
        if t.trainable or t.frozen:
            raise ConfigError("train.trainable / train.frozen cannot be combined with lora.enabled (LoRA "
                              "trains the adapters only)")
        if lora.merge_into == "original_base" and not cfg.model.init_from:
            raise ConfigError("lora.merge_into='original_base' needs model.init_from (the original weights "
                              "are read from it); a randomly initialised base has only the training base")
    elif lora.base_dtype != "float32":
        raise ConfigError(f"lora.base_dtype={lora.base_dtype!r} needs lora.enabled = true")


def check_transformers_backend(cfg: Config) -> None:
    """Refuse, by name, what ``model.backend = "transformers"`` does not run yet: tensor, context and expert
    parallelism (the transformers model has no plans for them here), preference tuning (its reference model is
    the native decoder's), NF4 LoRA bases (not checked on these models).

    Raises:
        ConfigError: naming the setting and what to set instead.
    """
    if cfg.model.backend != "transformers":
        return
    p = cfg.parallel
    split = [f"parallel.{k}={getattr(p, k)}" for k in ("tp", "cp", "ep", "pp") if getattr(p, k) > 1]
    if split:
        raise ConfigError(f"model.backend='transformers' with {' and '.join(split)} is not built yet: "
                          "FSDP (and HSDP, DDP) only; set them to 1 or use model.backend='native' for its "
                          "families")
    if cfg.data.format in ("preference", "prompts") or cfg.distill.teacher_from:
        what = "distill.teacher_from" if cfg.distill.teacher_from else f"data.format={cfg.data.format!r}"
        raise ConfigError(f"model.backend='transformers' with {what} is not built yet (the reference, the "
                          "sampler and the teacher use the native decoder): use data.format 'text' or "
                          "'instruct' without a teacher")
    if cfg.lora.enabled and cfg.lora.base_dtype == "nf4":
        raise ConfigError("model.backend='transformers' with lora.base_dtype='nf4' is not built yet: use "
                          "'fp32' or 'bf16'")


def set_fields(section: object) -> list[str]:
    """The names of a config section's (a dataclass instance's) fields that differ from their defaults, in
    declaration order: a section set while what turns it on is off is refused naming the first."""
    return [f.name for f in dataclasses.fields(section) if getattr(section, f.name) != f.default]


def validate_length_groups(cfg: Config) -> None:
    """Check ``data.group_by_length_steps`` (set) against the data it groups; raise ConfigError naming why."""
    d = cfg.data
    if d.group_by_length_steps < 2:
        raise ConfigError("data.group_by_length_steps must be 0 (off) or at least 2 (steps whose samples are "
                          f"sorted by length together), got {d.group_by_length_steps}")
    if d.format not in ("instruct", "preference") or d.pack:
        what = "packed rows are already full" if d.pack else f"data.format = {d.format!r} has no " + (
            "per-sample lengths to group (its windows are full)" if d.format == "text" else
            "length grouping (online RL keeps each prompt's completions together)")
        raise ConfigError(f"data.group_by_length_steps groups unpacked instruction examples and preference "
                          f"pairs by length: {what}")
    if d.pad_multiple == 0:
        raise ConfigError("data.group_by_length_steps needs data.pad_multiple > 0: with 0 every row is "
                          "padded to train.seq_len + 1, so grouping by length would save nothing")


def validate_preference(cfg: Config) -> None:
    """Check ``[preference]`` against the rest of the config; raise ConfigError naming the key."""
    pref, d = cfg.preference, cfg.data
    if d.format != "preference":
        changed = set_fields(pref)
        if changed:
            raise ConfigError(f"preference.{changed[0]} applies to data.format = 'preference' (format is "
                              f"{d.format!r})")
        return
    if d.pack:
        raise ConfigError("data.pack does not apply to data.format = 'preference': preference pairs are not "
                          "packed (each sequence is one row of the concatenated chosen/rejected forward)")
    if cfg.model.attention == "block_causal":
        raise ConfigError("data.format = 'preference' needs model.attention = 'causal' or 'auto' (pairs are "
                          "not packed)")
    if not pref.beta > 0:
        raise ConfigError(f"preference.beta must be positive, got {pref.beta}")
    if not 0.0 <= pref.label_smoothing < 0.5:
        raise ConfigError(f"preference.label_smoothing must be in [0, 0.5), got {pref.label_smoothing}")
    if pref.label_smoothing and pref.loss not in ("dpo", "simpo"):
        raise ConfigError("preference.label_smoothing applies to loss 'dpo' or 'simpo' (loss is "
                          f"{pref.loss!r})")
    if pref.rpo_alpha < 0:
        raise ConfigError(f"preference.rpo_alpha must be >= 0, got {pref.rpo_alpha}")
    if pref.nll_tokens != "auto" and pref.loss != "orpo" and not pref.rpo_alpha:
        raise ConfigError(f"preference.nll_tokens chooses the tokens of the NLL term, which loss "
                          f"{pref.loss!r} has only with preference.rpo_alpha > 0")
    if pref.reference == "lora_base" and not cfg.lora.enabled:
        raise ConfigError("preference.reference = 'lora_base' needs lora.enabled = true (the base with the "
                          "adapters off is the reference)")
    if pref.reference == "lora_base" and pref.reference_from:
        raise ConfigError("preference.reference_from names a reference model: it needs preference.reference "
                          "= 'model' (or 'auto' without LoRA), not 'lora_base'")


def validate_distill(cfg: Config) -> None:
    """Check ``[distill]`` against the rest of the config, the teacher's ``config.json`` included (its
    vocabulary against the student's); raise ConfigError naming the key. The teacher's tokenizer is compared
    with the student's when the teacher is built (:func:`shardlm.train.teacher.build_teacher`)."""
    dist = cfg.distill
    if not dist.teacher_from:
        changed = set_fields(dist)
        if changed:
            raise ConfigError(f"distill.{changed[0]} applies to distillation, which distill.teacher_from "
                              "turns on (it is empty)")
        return
    if cfg.data.format != "instruct":
        raise ConfigError(f"distillation (distill.teacher_from) is built for data.format = 'instruct' (the "
                          f"divergence over the response tokens); format is {cfg.data.format!r}")
    for key in ("tp", "cp"):
        if getattr(cfg.parallel, key) > 1:
            raise ConfigError(f"distillation with parallel.{key}={getattr(cfg.parallel, key)} is not built "
                              f"yet: set parallel.{key} = 1 (FSDP alone shards student and teacher)")
    if dist.lmbda != 0:
        if not 0 <= dist.lmbda <= 1:
            raise ConfigError(f"distill.lmbda must be in [0, 1], got {dist.lmbda}")
        raise ConfigError(f"distill.lmbda={dist.lmbda}: on-policy distillation (responses sampled by the "
                          "student) needs the RL rollout (shardlm/rl), which is not built yet: set "
                          "distill.lmbda = 0 (offline, on the dataset's responses)")
    if dist.loss == "jsd" and not 0 < dist.beta < 1:
        raise ConfigError(f"distill.beta must be in (0, 1) for loss 'jsd' (0 is forward_kl, 1 reverse_kl), "
                          f"got {dist.beta}")
    if dist.loss != "jsd" and dist.beta != 0.5:
        raise ConfigError(f"distill.beta applies to loss 'jsd' (loss is {dist.loss!r})")
    if not dist.temperature > 0:
        raise ConfigError(f"distill.temperature must be positive, got {dist.temperature}")
    if not 0 <= dist.alpha <= 1:
        raise ConfigError(f"distill.alpha must be in [0, 1] (the divergence's weight), got {dist.alpha}")
    vocab = cfg.model.vocab_size
    if not 0 <= dist.top_k < vocab:
        raise ConfigError(f"distill.top_k={dist.top_k} must be in [0, {vocab}) (0 = the whole vocabulary; "
                          f"the student's vocabulary has {vocab} tokens)")
    try:
        teacher = read_model_dir_config(dist.teacher_from)
    except ModelDirError as e:
        raise ConfigError(f"distill.teacher_from: {e}") from None
    if teacher.vocab_size != vocab:
        raise ConfigError(f"distill.teacher_from {dist.teacher_from} has a vocabulary of "
                          f"{teacher.vocab_size} tokens, the student (model.vocab_size) {vocab}: the teacher "
                          "must use the student's tokenizer")
def validate_low_precision(cfg: Config) -> None:
    """Check ``train.float8`` and ``train.qat`` against the rest of the config (the device is checked when the
    model is built: :func:`shardlm.parallel.float8.check_float8_device`); raise ConfigError naming the key."""
    t, p = cfg.train, cfg.parallel
    for key in ("float8", "qat"):
        value = getattr(t, key)
        if value != "none" and cfg.lora.enabled:
            raise ConfigError(f"train.{key}={value!r} with lora.enabled is not built: LoRA's frozen base "
                              f"is not an nn.Linear the {key} conversion can reach; set train.{key} = 'none' "
                              "or turn LoRA off")
    if t.qat_group_size < 0:
        raise ConfigError(f"train.qat_group_size must be >= 0 (0 = one scale per output row), got "
                          f"{t.qat_group_size}")
    if t.float8 != "none" and t.qat != "none":
        raise ConfigError(f"train.float8={t.float8!r} and train.qat={t.qat!r} both replace the linear "
                          "layers: choose one")
    if (t.float8 != "none" or t.qat != "none") and p.pp > 1:
        given = f"train.float8={t.float8!r}" if t.float8 != "none" else f"train.qat={t.qat!r}"
        raise ConfigError(f"{given} with parallel.pp={p.pp} is not built yet (low precision through pipeline "
                          "stages): set parallel.pp = 1")
    if t.float8 != "none" and p.tp > 1:
        raise ConfigError(f"train.float8={t.float8!r} with parallel.tp={p.tp} is not built yet (float8 "
                          "tensor parallel): set parallel.tp = 1")
    if t.float8 == "mxfp8" and p.param_dtype != "bfloat16":
        raise ConfigError("train.float8='mxfp8' computes in bf16: it needs parallel.mode = 'fsdp' with "
                          f"parallel.param_dtype = 'bfloat16' (param_dtype is {p.param_dtype!r})")


def validate_rl(cfg: Config) -> None:
    """Check ``[rl]`` against the rest of the config; raise ConfigError naming the key."""
    rl, d, t = cfg.rl, cfg.data, cfg.train
    if d.format != "prompts":
        changed = set_fields(rl)
        if changed:
            raise ConfigError(f"rl.{changed[0]} applies to data.format = 'prompts' (format is {d.format!r})")
        return
    if d.pack:
        raise ConfigError("data.pack does not apply to data.format = 'prompts': each completion is one row")
    if cfg.model.attention == "block_causal":
        raise ConfigError("data.format = 'prompts' needs model.attention = 'causal' or 'auto' (completions "
                          "are not packed)")
    for key in ("num_generations", "max_prompt_length", "max_completion_length", "steps_per_generation",
                "num_iterations"):
        if getattr(rl, key) < 1:
            raise ConfigError(f"rl.{key} must be >= 1, got {getattr(rl, key)}")
    if rl.num_generations == 1 and rl.scale_rewards != "none":
        raise ConfigError(f"rl.num_generations = 1 with rl.scale_rewards = {rl.scale_rewards!r}: the "
                          "standard deviation of a group of one completion is undefined (and its advantage "
                          "always 0); sample rl.num_generations >= 2 per prompt")
    if rl.max_prompt_length + rl.max_completion_length > t.seq_len + 1:
        raise ConfigError(f"rl.max_prompt_length + rl.max_completion_length = {rl.max_prompt_length} + "
                          f"{rl.max_completion_length} tokens cannot fit train.seq_len + 1 = "
                          f"{t.seq_len + 1}: raise train.seq_len or lower one of them")
    if not rl.temperature > 0:
        raise ConfigError(f"rl.temperature must be positive, got {rl.temperature}")
    if not 0 < rl.top_p <= 1:
        raise ConfigError(f"rl.top_p must be in (0, 1], got {rl.top_p}")
    if rl.top_k < 0:
        raise ConfigError(f"rl.top_k must be >= 0 (0 = all tokens), got {rl.top_k}")
    if rl.rollout == "exact":
        why = ("a mixture of experts (each expert multiplies the tokens routed to it, later ones too)"
               if cfg.model.n_experts else "parallel.compile (the compiled training graph computes otherwise "
               "than the eager sampling forward)" if cfg.parallel.compile else
               "train.float8 = 'tensorwise' (one activation scale per tensor, from every row and the later "
               "positions)" if cfg.train.float8 == "tensorwise" else
               "train.float8 = 'mxfp8' (not checked: it needs a GPU)" if cfg.train.float8 == "mxfp8" else
               "LoRA dropout (the training forward drops units the sampler keeps)"
               if cfg.lora.enabled and cfg.lora.dropout else "")
        if why:
            raise ConfigError(f"rl.rollout = 'exact' draws each token from the training step's own forward "
                              f"so that their log-probs are equal bit for bit, which {why} breaks: use "
                              "rl.rollout = 'kv_cache'")
    if rl.generation_batch_size and rl.steps_per_generation != 1:
        raise ConfigError("set rl.generation_batch_size or rl.steps_per_generation, not both (one gives the "
                          "other: generation_batch_size = train.global_batch_size × steps_per_generation)")
    gen = rl.generation_batch_size or t.global_batch_size * rl.steps_per_generation
    if gen % t.global_batch_size or gen % rl.num_generations:
        source = ("" if rl.generation_batch_size else
                  f" (train.global_batch_size {t.global_batch_size} × rl.steps_per_generation "
                  f"{rl.steps_per_generation})")
        raise ConfigError(f"the completions generated at once, rl.generation_batch_size = {gen}{source}, "
                          f"must be a multiple of train.global_batch_size = {t.global_batch_size} and of "
                          f"rl.num_generations = {rl.num_generations} (whole groups): change "
                          "rl.num_generations or the batch")
    if not 0 <= rl.epsilon < 1 or rl.epsilon_high < 0:
        raise ConfigError(f"rl.epsilon must be in [0, 1) and rl.epsilon_high >= 0, got {rl.epsilon} and "
                          f"{rl.epsilon_high}")
    if rl.delta and (rl.loss_type not in ("grpo", "dr_grpo", "dapo") or rl.delta <= 1):
        raise ConfigError(f"rl.delta = {rl.delta} caps the ratio of a clipped loss: it needs rl.loss_type "
                          "grpo, dr_grpo or dapo and a value > 1 (0 = off)")
    if not (rl.sapo_temperature_pos > 0 and rl.sapo_temperature_neg > 0):
        raise ConfigError("rl.sapo_temperature_pos and rl.sapo_temperature_neg must be positive")
    if rl.beta < 0:
        raise ConfigError(f"rl.beta must be >= 0, got {rl.beta}")
    if rl.reference == "lora_base" and not cfg.lora.enabled:
        raise ConfigError("rl.reference = 'lora_base' needs lora.enabled = true (the base with the adapters "
                          "off is the reference)")
    if rl.reference == "lora_base" and rl.reference_from:
        raise ConfigError("rl.reference_from names a reference model: it needs rl.reference = 'model' (or "
                          "'auto' without LoRA), not 'lora_base'")
    if not rl.rewards:
        raise ConfigError("rl.rewards is empty: name at least one reward function")
    if rl.reward_weights and len(rl.reward_weights) != len(rl.rewards):
        raise ConfigError(f"rl.reward_weights has {len(rl.reward_weights)} weights for {len(rl.rewards)} "
                          "rl.rewards")
    try:
        re.compile(rl.format_pattern)
    except re.error as e:
        raise ConfigError(f"rl.format_pattern is not a regular expression: {e}") from e
    if any(s.endswith(":overlong") for s in rl.rewards) and not 1 <= rl.overlong_cache \
            <= rl.max_completion_length:
        raise ConfigError(f"the overlong reward needs rl.overlong_cache between 1 and "
                          f"rl.max_completion_length = {rl.max_completion_length} (the tokens over which "
                          f"the penalty grows), got {rl.overlong_cache}")


def steps_per_generation(cfg: Config) -> int:
    """S, the optimizer steps (global batches) each generation batch of online RL is split into:
    ``rl.generation_batch_size / train.global_batch_size`` when that is set, else ``rl.steps_per_generation``
    (:func:`validate_rl` checks the division)."""
    rl = cfg.rl
    return rl.generation_batch_size // cfg.train.global_batch_size if rl.generation_batch_size \
        else rl.steps_per_generation


def gradient_accumulation_steps(cfg: Config, dp_world_size: int) -> int:
    """Micro-batches per optimizer step: G / (data-parallel world size × micro-batch size).

    Raises:
        ConfigError: when that is not an integer >= 1.
    """
    g, mbs = cfg.train.global_batch_size, cfg.train.micro_batch_size
    per_step = dp_world_size * mbs
    inner = " × ".join(f"parallel.{k}={getattr(cfg.parallel, k)}" for k in ("pp", "cp", "tp")
                       if getattr(cfg.parallel, k) > 1)  # the dimensions whose ranks share samples
    if g % per_step:
        raise ConfigError(
            f"train.global_batch_size={g} must be divisible by world size × train.micro_batch_size "
            f"= {dp_world_size} × {mbs} = {per_step}"
            + (f" (the data-parallel world size: world size / {inner})" if inner else "")
        )
    return g // per_step
