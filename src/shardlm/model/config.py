"""The model's shape: :class:`ModelConfig`, a dataclass with a docstring per field and its derived sizes.

Field names follow the Llama papers; Hugging Face ``config.json`` names are given in brackets. Values
derived from the fields (head width, key/value heads, MLP width) are properties, computed in one place.

The model families (Llama, Qwen2/2.5, Qwen3, Mistral, Gemma 3) are one decoder with a few switches:
:data:`~shardlm.model.families.FAMILIES` holds, per family, the fixed traits of its architecture (biases, q/k
norm, Gemma's norms and GeGLU) and its particulars (:mod:`shardlm.model.families`); the sizes a family varies
(head width, sliding window, RoPE bases) are fields. The model's own rules are :meth:`ModelConfig.check`,
beside its fields; a run's config calls it among its checks (:func:`shardlm.config.checks.validate`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from shardlm.errors import ConfigError
from shardlm.model.families import FAMILIES, Family, get

__all__ = ["FAMILIES", "Family", "ModelConfig"]  # the registry, importable from here as before


@dataclass
class ModelConfig:
    """Shape of the decoder (Hugging Face config names in brackets)."""

    family: str = "llama"
    """Model family, a name registered in :data:`~shardlm.model.families.FAMILIES` (``llama``, ``qwen2``,
    ``qwen3``, ``mistral``, ``gemma3``, ``qwen3_moe``, ``mixtral``, ``gpt_oss``): its fixed traits and
    particulars [model_type]."""
    dim: int = 256
    """Hidden size, the width of the residual stream [hidden_size]."""
    n_layers: int = 4
    """Number of transformer blocks [num_hidden_layers]."""
    n_heads: int = 8
    """Number of query heads [num_attention_heads]; must divide ``dim`` unless ``head_width`` is set."""
    n_kv_heads: int = 0
    """Number of key/value heads for grouped-query attention [num_key_value_heads]; 0 means ``n_heads``."""
    head_width: int = 0
    """Width of one attention head [head_dim]; 0 means ``dim // n_heads`` (see the ``head_dim`` property)."""
    ffn_hidden: int = 0
    """Hidden size of the SwiGLU MLP [intermediate_size]; 0 means the Llama rule: 8/3·dim rounded up
    to 256."""
    vocab_size: int = 4096
    """Rows of the token embedding [vocab_size]; must hold every tokenizer id."""
    max_seq_len: int = 1024
    """Longest sequence the rotary tables cover, in tokens [max_position_embeddings]."""
    rope_theta: float = 10000.0
    """Base of the rotary frequencies [rope_theta]; of the global (full-attention) layers when some
    are local."""
    sliding_window: int = 0
    """Local layers attend to the last ``sliding_window`` tokens only, their own included [sliding_window]; 0
    means every layer attends to the whole sequence."""
    sliding_window_pattern: int = 0
    """With ``sliding_window``: every ``sliding_window_pattern``-th layer (1-based) is global, the others
    local (Gemma 3: 6) [sliding_window_pattern / layer_types]; 0 means every layer is local (Mistral)."""
    rope_local_theta: float = 0.0
    """Rotary base of the local layers (Gemma 3: 10000) [rope_local_base_freq]; 0 means ``rope_theta``."""
    query_pre_attn_scalar: float = 0.0
    """Attention scores are scaled by ``query_pre_attn_scalar ** -0.5`` (Gemma) [query_pre_attn_scalar]; 0
    means ``head_dim``."""
    final_logit_softcap: float = 0.0
    """Logits become ``c · tanh(logits / c)`` with this c [final_logit_softcapping]; 0 means none."""
    norm_eps: float = 1e-5
    """Epsilon inside RMSNorm [rms_norm_eps]."""
    tie_embeddings: bool = False
    """Share the input embedding with the output projection [tie_word_embeddings]."""
    init_std: float = 0.02
    """Standard deviation of the normal initialisation of weight matrices."""
    rope_scaling_factor: float = 0.0
    """Llama 3.1 RoPE scaling ``factor`` (8 for Llama 3.1) [rope_scaling.factor, rope_type llama3]; 0 means
    no scaling."""
    rope_low_freq_factor: float = 1.0
    """Llama 3.1 RoPE scaling ``low_freq_factor`` [rope_scaling.low_freq_factor]; used when
    rope_scaling_factor > 0."""
    rope_high_freq_factor: float = 4.0
    """Llama 3.1 RoPE scaling ``high_freq_factor`` [rope_scaling.high_freq_factor]; used when
    rope_scaling_factor > 0."""
    rope_original_max_seq_len: int = 8192
    """Pre-training context that llama3 and YaRN scaling extend, in tokens
    [rope_scaling.original_max_position_embeddings]."""
    rope_linear_factor: float = 0.0
    """Linear RoPE scaling (position interpolation, Gemma 3 4B+): the global layers' frequencies are divided
    by this factor [rope_scaling.factor, rope_type linear]; 0 means none."""
    rope_yarn_factor: float = 0.0
    """YaRN RoPE scaling (Peng et al., "YaRN", 2023; Qwen3 128k, gpt-oss, DeepSeek): the context
    ``rope_original_max_seq_len`` is extended ``factor`` times [rope_scaling.factor, rope_type yarn]; 0
    means none."""
    rope_yarn_beta_fast: float = 32.0
    """YaRN: rotations over the original context above which a frequency is kept
    (extrapolated) [beta_fast]."""
    rope_yarn_beta_slow: float = 1.0
    """YaRN: rotations over the original context below which a frequency is divided by the factor
    (interpolated) [beta_slow]."""
    rope_yarn_attention_factor: float = 0.0
    """YaRN: factor of the cos and sin tables (the attention temperature ``sqrt(1/t)``) [attention_factor]; 0
    means HF's default ``0.1 · ln(factor) + 1`` (an import resolves DeepSeek's ``mscale`` / ``mscale_all_dim``
    into it)."""
    rope_yarn_truncate: bool = True
    """YaRN: round the correction range of dimensions outward to integers, as HF does by default (gpt-oss:
    false) [truncate]."""
    rope_dynamic_factor: float = 0.0
    """Dynamic NTK RoPE scaling [rope_scaling.factor, rope_type dynamic]: HF changes the base only for
    sequences past ``max_seq_len``, which this model never runs, so within it the frequencies are the default
    ones; kept for export. 0 means none."""
    n_experts: int = 0
    """Experts of each MoE layer [num_experts / num_local_experts]; 0 means a dense model (families
    with ``moe``)."""
    n_experts_per_token: int = 2
    """Experts each token is routed to, the k of top-k [num_experts_per_tok]."""
    moe_ffn_hidden: int = 0
    """Hidden size of one expert's SwiGLU [moe_intermediate_size; Mixtral: intermediate_size]; 0
    means ``ffn_dim``."""
    norm_topk_prob: bool = False
    """Renormalise the top-k routing probabilities to sum to 1 [norm_topk_prob] (Mixtral always does)."""
    moe_layer_step: int = 1
    """Every ``moe_layer_step``-th layer (1-based) is a MoE layer, the others dense [decoder_sparse_step]."""
    dense_layers: tuple[int, ...] = ()
    """Layers (0-based) that stay dense MLPs whatever ``moe_layer_step`` says [mlp_only_layers]."""
    router_aux_loss_coef: float = 0.001
    """Weight of the load-balancing loss added to the training loss [router_aux_loss_coef]; 0 means none. Its
    statistics (tokens per expert, mean router probabilities) are pooled per micro-step over the micro-batches
    of all ranks (one forward each): the whole global batch with one micro-batch per rank; under gradient
    accumulation each micro-step's term is transformers' ``aux_loss`` of that micro-step's tokens in one
    forward, and the step adds (and logs) their mean, not the whole batch's ``aux_loss``."""
    router_z_loss_coef: float = 0.0
    """Weight of the router z-loss (ST-MoE) added to the training loss; 0 means none (transformers
    has none)."""
    swiglu_alpha: float = 1.702
    """gpt-oss experts: the gate's sigmoid slope, ``glu = gate · sigmoid(alpha · gate)`` [swiglu_alpha]."""
    swiglu_limit: float = 7.0
    """gpt-oss experts: gate clamped to at most ``limit``, up to [-limit, limit] [swiglu_limit]."""
    attention: Literal["auto", "causal", "block_causal"] = "auto"
    """Attention pattern over a training sample: ``causal`` (every token sees all earlier ones of the sample)
    or ``block_causal`` (document masking: a token sees only earlier tokens of its own document, with rotary
    positions restarting at 0 per document; packed instruction examples, pre-training windows over document
    boundaries; see shardlm/model/attention.py). ``auto`` (the default) is resolved once at set-up: a resumed
    run keeps its checkpoint's value; a new one trains ``block_causal`` when its samples hold documents
    (pre-training data that records its document starts, ``data.pack``), else ``causal``
    (shardlm/data/attention_choice.py); checkpoints and ``config.json`` record the resolved value. A model
    used directly (``CausalLM(cfg)(tokens, documents=...)``) reads ``auto`` the same way: block-causal when
    it is given documents; ``causal`` refuses them (ValueError). Not a shape: kept on ``init_from``."""
    attention_backend: Literal["auto", "per_document", "sdpa", "flex", "varlen"] = "auto"
    """Kernel of block-causal attention: ``per_document`` (SDPA over each document of a row alone: the scores
    between documents are never computed; any device), ``sdpa`` (a dense additive mask over the whole row,
    any device: the reference), ``flex`` (flex_attention with a BlockMask: compiled on CUDA, eager on CPU,
    no CPU backward), ``auto`` (flex on CUDA, per_document elsewhere). Same results up to rounding.
    ``varlen`` (flash attention over cu_seqlens, CUDA only) is refused by name: not built until it can be
    tested."""
    backend: Literal["native", "transformers"] = "native"
    """Which code runs the model: ``native`` (shardlm's own decoder, the families above) or ``transformers``
    (any causal LM of the installed transformers, ``AutoModelForCausalLM.from_config`` of ``init_from``'s
    ``config.json``, sharded per decoder layer by shardlm's FSDP2; shardlm/model/hf_backend.py). The
    transformers backend needs ``init_from`` with weights, reads the shape fields from its config, and refuses
    tensor, context and expert parallelism, a KV cache and remote code (``trust_remote_code`` is never turned
    on)."""
    init_from: str = ""
    """Hugging Face model directory (``config.json`` + ``*.safetensors``) to start from instead of a random
    init; empty means random. When set, the model's shape (every field above except ``init_std`` and the two
    attention settings) is read
    from its ``config.json`` and overrides the TOML and command line; the tokenizer defaults to its
    ``tokenizer.json``. Each rank reads only the rows of its own shards."""

    @property
    def arch(self) -> Family:
        """The family's record (traits and particulars),
        :data:`~shardlm.model.families.FAMILIES` ``[family]``.

        Raises:
            ConfigError: ``family`` is not registered.
        """
        return get(self.family)

    def check(self) -> None:
        """Check the model's own fields (sizes, the family's refusals, the mixture of experts, RoPE scaling);
        the rules across sections (``train.seq_len`` against ``max_seq_len``, ...) are in
        :mod:`shardlm.config.checks`.

        Raises:
            ConfigError: naming the first key that breaks a rule (``model.<field>``), or an
            unregistered family.
        """
        m = self
        if m.backend not in ("native", "transformers"):
            raise ConfigError(f"model.backend must be 'native' or 'transformers', got {m.backend!r}")
        if m.backend == "transformers":
            if not m.init_from:
                raise ConfigError("model.backend='transformers' needs model.init_from: a Hugging Face model "
                                  "directory with config.json and *.safetensors (for a random start, write "
                                  "one with transformers: AutoModelForCausalLM.from_config(config)"
                                  ".save_pretrained)")
            return  # the shape is transformers' (from init_from); the native families' rules do not apply
        positive = {
            "model.dim": m.dim, "model.n_layers": m.n_layers, "model.n_heads": m.n_heads,
            "model.vocab_size": m.vocab_size, "model.max_seq_len": m.max_seq_len,
        }
        for key, value in positive.items():
            if value <= 0:
                raise ConfigError(f"{key} must be positive, got {value}")
        if m.head_width < 0:
            raise ConfigError(f"model.head_width must be >= 0, got {m.head_width}")
        if not m.head_width and m.dim % m.n_heads:
            raise ConfigError(f"model.n_heads={m.n_heads} must divide model.dim={m.dim} (or set "
                              "model.head_width)")
        if m.head_dim % 2:
            raise ConfigError(f"the head width {m.head_dim} (model.head_width, or model.dim / model.n_heads) "
                              "must be even for rotary embeddings")
        for key in ("sliding_window", "sliding_window_pattern", "rope_local_theta", "query_pre_attn_scalar",
                    "final_logit_softcap", "rope_linear_factor"):
            if getattr(m, key) < 0:
                raise ConfigError(f"model.{key} must be >= 0, got {getattr(m, key)}")
        m.arch.check(m)  # the family's refusals (an unregistered model.family is refused by ``arch`` itself)
        m.check_moe()
        if m.rope_linear_factor > 0 and m.rope_scaling_factor > 0:
            raise ConfigError("model.rope_linear_factor and model.rope_scaling_factor (llama3) cannot both "
                              "be set")
        kv = m.kv_heads
        if kv < 0 or m.n_heads % kv:
            raise ConfigError(f"model.n_kv_heads={m.n_kv_heads} must divide model.n_heads={m.n_heads}")
        if m.rope_scaling_factor > 0 and m.rope_high_freq_factor <= m.rope_low_freq_factor:
            raise ConfigError(f"model.rope_high_freq_factor={m.rope_high_freq_factor} must exceed "
                              f"model.rope_low_freq_factor={m.rope_low_freq_factor}")
        scalings = [key for key in ("rope_scaling_factor", "rope_linear_factor", "rope_yarn_factor",
                                    "rope_dynamic_factor")
                    if getattr(m, key) != 0]
        if len(scalings) > 1:
            raise ConfigError(f"one RoPE scaling at a time: model.{' and model.'.join(scalings)} are all set")
        for key in scalings:
            if getattr(m, key) < 1:
                raise ConfigError(f"model.{key} must be >= 1 (0 = no scaling), got {getattr(m, key)}")
        if m.rope_yarn_factor and (
            m.rope_yarn_beta_fast < m.rope_yarn_beta_slow
            or m.rope_yarn_attention_factor < 0
            or m.rope_original_max_seq_len < 1
        ):
            raise ConfigError("YaRN needs model.rope_yarn_beta_fast >= rope_yarn_beta_slow (got "
                              f"{m.rope_yarn_beta_fast} and {m.rope_yarn_beta_slow}), "
                              f"rope_yarn_attention_factor >= 0 (got {m.rope_yarn_attention_factor}) and "
                              f"rope_original_max_seq_len >= 1 (got {m.rope_original_max_seq_len})")

    def check_moe(self) -> None:
        """Check the mixture-of-experts fields (``n_experts`` and its companions) against the family.

        Raises:
            ConfigError: naming the key.
        """
        m = self
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
            raise ConfigError("model.moe_ffn_hidden must be >= 0 (0 = model.ffn_hidden), got "
                              f"{m.moe_ffn_hidden}")
        bad = [i for i in m.dense_layers if not 0 <= i < m.n_layers]
        if bad:
            raise ConfigError(f"model.dense_layers {list(m.dense_layers)}: layer {bad[0]} is not in [0, "
                              f"{m.n_layers})")
        for key in ("router_aux_loss_coef", "router_z_loss_coef"):
            if getattr(m, key) < 0:
                raise ConfigError(f"model.{key} must be >= 0, got {getattr(m, key)}")

    @property
    def head_dim(self) -> int:
        """Width of one attention head: ``head_width``, or ``dim // n_heads`` when 0."""
        return self.head_width or self.dim // self.n_heads

    @property
    def attn_scale(self) -> float:
        """Factor of the attention scores q·k: ``query_pre_attn_scalar ** -0.5``, by default ``head_dim
        ** -0.5``."""
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    def is_local(self, layer: int) -> bool:
        """Whether block ``layer`` (0-based) uses the sliding window (and ``rope_local_theta``)."""
        if not self.sliding_window:
            return False
        return not self.sliding_window_pattern or (layer + 1) % self.sliding_window_pattern != 0

    def is_moe_layer(self, layer: int) -> bool:
        """Whether block ``layer`` (0-based) has a MoE feed-forward (HF ``Qwen3MoeDecoderLayer``'s rule)."""
        return (self.arch.moe and self.n_experts > 0 and layer not in self.dense_layers
                and (layer + 1) % self.moe_layer_step == 0)

    @property
    def expert_ffn_dim(self) -> int:
        """Hidden size of one expert: ``moe_ffn_hidden``, or :attr:`ffn_dim` when 0."""
        return self.moe_ffn_hidden or self.ffn_dim

    @property
    def kv_heads(self) -> int:
        """Key/value heads actually used: ``n_kv_heads``, or ``n_heads`` when 0 (no grouping)."""
        return self.n_kv_heads or self.n_heads

    @property
    def ffn_dim(self) -> int:
        """SwiGLU hidden size: ``ffn_hidden``, or the Llama rule when 0: 8/3·dim rounded up to a multiple
        of 256."""
        if self.ffn_hidden:
            return self.ffn_hidden
        return 256 * math.ceil(int(8 * self.dim / 3) / 256)
