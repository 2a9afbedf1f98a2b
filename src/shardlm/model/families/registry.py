"""What a model family is (:class:`Family`) and the registry of them (:data:`FAMILIES`,
:func:`register`, :func:`get`).

A family is one record: the fixed traits of its architecture, which the decoder reads as ``cfg.arch.<trait>``,
and what is particular to it outside the model: its Hugging Face ``config.json`` fields both ways, its GGUF
tensor names and value fixes, its refusals. The decoder, ``convert/``, the configuration checks and the
planner consult this record; none of them branches on a family's name. Imports no torch (the configuration
reads it).

Adding a family that the existing traits express: one file in this package defining its record ``FAMILY`` and
its module in ``BUILT`` (``__init__.py``), plus its tests; :func:`register` alone adds one at run time (a
test's toy family). Adding a trait (mixture-of-experts layers, attention sinks, YaRN RoPE, ...): a field of
:class:`Family` with a default that keeps every existing family as it is (``False``, ``0``, an empty tuple, or
a hook that does nothing), read where it matters as ``cfg.arch.<trait>``; a family that has it sets it in its
own file. Per-family ``config.json`` or GGUF metadata beyond the shared fields goes in the family's hooks
(:attr:`Family.hf_fields_out`, :attr:`Family.hf_fields_in`, :attr:`Family.gguf_fields_in`), never in an ``if
family == ...`` elsewhere.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from shardlm.errors import ConfigError, ModelDirError


class ModelFields(Protocol):
    """What a family's functions read and set of a model's :class:`~shardlm.model.config.ModelConfig`,
    declared here so that no family imports the config module (which imports the families)."""

    family: str
    dim: int
    n_layers: int
    n_heads: int
    rope_theta: float
    rope_local_theta: float
    sliding_window: int
    sliding_window_pattern: int
    query_pre_attn_scalar: float
    final_logit_softcap: float
    n_experts: int
    n_experts_per_token: int
    moe_ffn_hidden: int
    moe_layer_step: int
    dense_layers: tuple[int, ...]
    norm_topk_prob: bool
    router_aux_loss_coef: float
    swiglu_alpha: float
    swiglu_limit: float

    @property
    def arch(self) -> Family: ...

    @property
    def head_dim(self) -> int: ...

    @property
    def expert_ffn_dim(self) -> int: ...

    def is_local(self, layer: int) -> bool: ...

#: the decoder's gate activations -> their Hugging Face ``config.json`` names
HF_ACTIVATIONS = {"silu": "silu", "gelu_tanh": "gelu_pytorch_tanh"}

#: llama.cpp's names of a block's tensors (``blk.N.<name>.weight``) -> HF's names under ``model.layers.N.``
GGUF_BLOCK_NAMES: Mapping[str, str] = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
}


def _no_fields(cfg: ModelFields) -> dict[str, Any]:
    """No ``config.json`` fields beyond the shared ones."""
    return {}


def _read_nothing(cfg: ModelFields, config: dict[str, Any], local_rope: dict[str, Any], source: str) -> None:
    """Read no ``config.json`` fields beyond the shared ones."""


def _read_no_metadata(cfg: ModelFields, metadata: Callable[[str, Any], Any]) -> None:
    """Read no GGUF metadata beyond the shared keys."""


@dataclass(frozen=True)
class Family:
    """One model family: the fixed traits of its architecture (what no config field varies) and its
    particulars in ``config.json``, GGUF files and the checks. Registered with :func:`register`; read
    as ``cfg.arch``."""

    name: str
    """Our name of the family, the value of ``model.family``."""
    model_type: str
    """Hugging Face ``config.json`` ``model_type``, written on export and recognised on import."""
    architecture: str
    """Hugging Face ``architectures[0]`` (the ``*ForCausalLM`` class)."""

    # ---- traits of the architecture: read by the decoder and the planner (plan/activations.py's Shape) -----
    qkv_bias: bool = False
    """Bias on the query, key and value projections (Qwen2)."""
    qk_norm: bool = False
    """RMSNorm over each query and key head (width ``head_dim``) before RoPE (Qwen3, Gemma 3)."""
    gemma_norms: bool = False
    """Gemma's conventions: RMSNorm scales by ``1 + weight`` (weights start at 0), a norm before *and* after
    the attention and the MLP (four per block), the embedding multiplied by sqrt(dim) in its dtype."""
    activation: Literal["silu", "gelu_tanh"] = "silu"
    """Gate activation of the gated MLP: SiLU (SwiGLU) or tanh-approximated GELU (GeGLU) [hidden_act]."""
    sliding_window: bool = False
    """The family has sliding-window (local) layers, so ``model.sliding_window`` may be set (Mistral,
    Gemma 3)."""
    window_patterns: tuple[int, ...] | None = None
    """The ``model.sliding_window_pattern`` values its ``config.json`` can express with a window (None: any):
    Mistral and Mixtral (0: every layer local), gpt-oss (2: sliding / full alternating)."""
    moe: bool = False
    """A mixture of experts: the feed-forward of its sparse layers is :class:`shardlm.model.moe.MoE`, so
    ``model.n_experts`` must be set (Qwen3-MoE, Mixtral)."""
    routing: Literal["softmax_topk", "topk_softmax"] = "softmax_topk"
    """Top-k routing of the MoE layers (:func:`shardlm.model.moe.route`): softmax then top-k, or top-k
    then softmax."""
    always_norm_topk: bool = False
    """The top-k routing weights are always renormalised to sum to 1 (Mixtral), whatever
    ``norm_topk_prob`` says."""
    router_bias: bool = False
    """The MoE router has a bias (gpt-oss)."""
    router_name: str = "gate"
    """Attribute (and parameter) name of the MoE router under ``mlp``: ``gate`` (Qwen3-MoE,
    Mixtral), ``router``."""
    experts: Literal["swiglu", "clamped_swiglu"] = "swiglu"
    """The experts' MLP: SwiGLU without biases, or gpt-oss's clamped SwiGLU with biases and interleaved
    gate/up columns (:class:`shardlm.model.moe.ClampedSwiGLUExperts`)."""
    attention_sinks: bool = False
    """A learned sink logit per head joins each query's softmax and takes probability mass (gpt-oss)."""
    attention_out_bias: bool = False
    """Bias on the attention's output projection ``o_proj`` (gpt-oss)."""
    hf_expert_names: tuple[str, ...] = ()
    """The hub's on-disk names of a MoE layer's experts, ``(module, gate, up, down)``: expert e's gate matrix
    is ``model.layers.i.<module>.experts.e.<gate>.weight`` (:mod:`shardlm.convert.hf_experts`); empty:
    no experts."""

    # ---- Hugging Face config.json: read by model/hf_config.py ----------------------------------------------
    hf_activation_key: str = "hidden_act"
    """The ``config.json`` field naming the activation (Gemma: ``hidden_activation``)."""
    hf_false_flags: tuple[str, ...] = ()
    """Boolean ``config.json`` fields of the family that the decoder builds only as false (biases it lacks,
    Qwen's ``use_sliding_window``): written false on export, refused naming the field when true on import."""
    hf_default_rope_theta: float = 10000.0
    """``rope_theta`` when ``config.json`` has none (the family's transformers default)."""
    hf_default_rope: Mapping[str, Any] = field(default_factory=dict, compare=False)
    """The RoPE scaling dict (``rope_type``...) that transformers gives the family when ``config.json`` has
    neither ``rope_scaling`` nor ``rope_parameters`` (gpt-oss: YaRN); empty: plain RoPE. A family that has one
    gets an explicit ``rope_type = "default"`` on export when the model has no scaling."""
    hf_default_head_dim: int = 0
    """``head_dim`` when ``config.json`` has none; 0 means ``hidden_size / num_attention_heads``."""
    hf_default_tie: bool = False
    """``tie_word_embeddings`` when ``config.json`` has none."""
    hf_fields_out: Callable[[ModelFields], dict[str, Any]] = _no_fields
    """``config.json`` fields of the family beyond the shared shape, activation and false flags (a sliding
    window, Gemma's local RoPE base...): ``hf_fields_out(cfg) -> dict``."""
    hf_fields_in: Callable[[ModelFields, dict[str, Any], dict[str, Any], str], None] = _read_nothing
    """Sets ``cfg``'s family fields from a ``config.json`` dict, in place, after the shared ones:
    ``hf_fields_in(cfg, config, local_rope, source)``, ``local_rope`` the 5.x ``rope_parameters`` of the
    sliding-window layers ({} if none); raises ModelDirError naming ``source`` and the field it refuses."""

    # ---- GGUF (llama.cpp) files: read by convert/gguf_in.py ----------------------------------------------
    gguf_architecture: str = ""
    """GGUF ``general.architecture`` of the family; empty means GGUF files of it are not imported."""
    gguf_block_names: Mapping[str, str] = field(default_factory=lambda: GGUF_BLOCK_NAMES, compare=False)
    """llama.cpp's block tensor names -> HF's (:data:`GGUF_BLOCK_NAMES` unless the family names
    them otherwise)."""
    gguf_qk_permuted: bool = False
    """llama.cpp permuted the query and key rows from rotate-half to interleaved RoPE (Llama): undone
    on import."""
    gguf_norm_offset: float = 0.0
    """llama.cpp added this to every RMSNorm weight (Gemma: 1, its norms scale by 1 + weight): subtracted on
    import."""
    gguf_rope_freqs: bool = False
    """A ``rope_freqs`` tensor is llama3 RoPE scaling, rebuilt into the config (Llama); otherwise refused."""
    gguf_linear_rope: bool = False
    """``rope.scaling.type = linear`` is read as ``rope_linear_factor`` (Gemma 3); otherwise refused."""
    gguf_fields_in: Callable[[ModelFields, Callable[[str, Any], Any]], None] = _read_no_metadata
    """Sets ``cfg``'s family fields from GGUF metadata, in place: ``gguf_fields_in(cfg, metadata)`` with
    ``metadata(key, default)`` the value of ``<architecture>.<key>``."""

    def check(self, cfg: ModelFields) -> None:
        """Refuse a configuration this family does not build, naming the key.

        Raises:
            ConfigError: ``model.sliding_window`` set for a family without sliding-window layers, or with a
                ``model.sliding_window_pattern`` its exported ``config.json`` cannot express (the trained
                model would not load).
        """
        if cfg.sliding_window and not self.sliding_window:
            names = " or ".join(repr(f.name) for f in FAMILIES.values() if f.sliding_window)
            raise ConfigError(f"model.sliding_window applies to model.family {names} (family is "
                              f"{self.name!r})")
        patterns = self.window_patterns
        if cfg.sliding_window and patterns is not None and cfg.sliding_window_pattern not in patterns:
            allowed = " or ".join(str(p) for p in patterns)
            raise ConfigError(f"model.family {self.name!r} with model.sliding_window builds "
                              f"model.sliding_window_pattern = {allowed} (its config.json's layer layout), "
                              f"not {cfg.sliding_window_pattern}: set "
                              f"--model.sliding_window_pattern={allowed}")


#: every family the decoder builds, by ``model.family``, in the order registered
FAMILIES: dict[str, Family] = {}


def register(family: Family) -> Family:
    """Add ``family`` to :data:`FAMILIES` and return it.

    Raises:
        ValueError: a family of that name, ``model_type`` or GGUF architecture is already registered.
    """
    for other in FAMILIES.values():
        clash = [key for key in ("name", "model_type", "gguf_architecture")
                 if getattr(family, key) and getattr(family, key) == getattr(other, key)]
        if clash:
            raise ValueError(f"family {family.name!r}: {clash[0]} {getattr(family, clash[0])!r} is already "
                             f"registered by {other.name!r}")
    FAMILIES[family.name] = family
    return family


def unregister(name: str) -> None:
    """Remove family ``name`` from :data:`FAMILIES` (tests that register a toy family); absent is no error."""
    FAMILIES.pop(name, None)


def get(name: str) -> Family:
    """The registered family ``name``.

    Raises:
        ConfigError: no family of that name is registered (the message lists those that are).
    """
    try:
        return FAMILIES[name]
    except KeyError:
        raise ConfigError(f"model.family: {name!r} is not one of {list(FAMILIES)}") from None


#: ``model_type`` of families that are not built -> what of them is missing (named in the refusal)
NOT_BUILT: dict[str, str] = {
    "deepseek_v3": "DeepSeek V3's group-limited routing (n_group / topk_group, noaux_tc with a "
                   "score-correction bias), shared experts and multi-head latent attention (MLA) are not "
                   "built",
    "kimi_k2": "Kimi K2 is DeepSeek V3's architecture: group-limited routing and multi-head latent attention "
               "(MLA) are not built",
    "qwen2_moe": "Qwen2-MoE's shared expert and its gate are not built",
}


def by_model_type(model_type: Any, architectures: Any, source: str) -> Family:
    """The family of a ``config.json``'s ``model_type`` and ``architectures`` (absent: the family's own).

    Raises:
        ModelDirError: naming both, when no registered family has them (for a known architecture of
            :data:`NOT_BUILT`, also what of it is not built).
    """
    if model_type in NOT_BUILT and not any(f.model_type == model_type for f in FAMILIES.values()):
        raise ModelDirError(f"{source}: model_type={model_type!r}: not built: {NOT_BUILT[model_type]}")
    family = next((f for f in FAMILIES.values() if f.model_type == model_type), None)
    arch = architectures or [family.architecture if family else None]
    if family is None or arch != [family.architecture]:
        built = ", ".join(f"{f.model_type!r} ({f.architecture})" for f in FAMILIES.values())
        raise ModelDirError(f"{source}: model_type={model_type!r}, architectures={arch}: not built; the "
                            f"built families are {built}")
    return family


def by_gguf_architecture(arch: Any, source: str) -> Family:
    """The family of a GGUF file's ``general.architecture``.

    Raises:
        ModelDirError: no registered family imports GGUF files of that architecture (those that do are named).
    """
    for family in FAMILIES.values():
        if family.gguf_architecture and family.gguf_architecture == arch:
            return family
    built = ", ".join(f.gguf_architecture for f in FAMILIES.values() if f.gguf_architecture)
    raise ModelDirError(f"{source}: general.architecture={arch!r}; the GGUF architectures built are {built}")
