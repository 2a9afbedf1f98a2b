"""The objectives' configuration sections: ``[preference]`` (DPO and its family), ``[distill]`` (knowledge
distillation from a teacher) and ``[rl]`` (online RL of the GRPO family), each read by its objective in
:mod:`shardlm.train.objectives`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

#: choices other trainers offer that shardlm does not, and why (said in the error): dotted key -> {value: why}
NOT_OFFERED = {
    "rl.loss_type": {"bnpo": "TRL's bnpo normalises over each process's local batch; over the global batch, "
                             "as shardlm normalises, it is 'dapo': set rl.loss_type = 'dapo'"},
}


@dataclass
class PreferenceConfig:
    """Preference tuning on ``data.format = "preference"`` pairs (shardlm/train/preference.py, formulas and
    sources there). The global batch and the micro-batch count pairs; each pair is two sequences in
    one forward."""

    loss: Literal["dpo", "ipo", "hinge", "simpo", "orpo"] = "dpo"
    """``dpo`` (Rafailov et al. 2023; TRL's ``sigmoid``), ``ipo`` (Azar et al. 2023, per-token averaged as
    TRL), ``hinge`` (SLiC, Zhao et al. 2023), and the reference-free ``simpo`` (Meng et al. 2024) and ``orpo``
    (Hong et al. 2024)."""
    beta: float = 0.1
    """β: the inverse temperature of the implicit reward (dpo, hinge, simpo), IPO's τ, and ORPO's λ (the
    weight of the odds-ratio term, as TRL's ``ORPOConfig.beta``)."""
    label_smoothing: float = 0.0
    """ε of conservative DPO (Mitchell 2023): the loss ``-(1-ε)·logσ(βΔ) - ε·logσ(-βΔ)``; dpo and simpo only,
    in [0, 0.5)."""
    simpo_gamma: float = 0.5
    """SimPO's target reward margin γ (the loss is ``-logσ(β·(avg logp_c - avg logp_r) - γ)``)."""
    rpo_alpha: float = 0.0
    """Weight α of an added NLL term on the chosen completions (mean over their tokens of the global batch;
    RPO, Pang et al. 2024; TRL's ``loss_type=["sigmoid", "sft"]`` with weights ``[1, α]``, CPO's
    ``cpo_alpha``). ORPO always has this term with weight 1; α adds to it. Which tokens: ``nll_tokens``."""
    nll_tokens: Literal["auto", "completion", "prompt_and_completion"] = "auto"
    """The tokens of the chosen sequences whose mean NLL is the NLL term (ORPO's, and ``rpo_alpha``'s):
    ``completion``, the chosen completion's tokens (Hong et al. 2024's L_SFT; TRL's DPOTrainer ``sft`` and
    CPOTrainer's ``cpo_alpha``); or ``prompt_and_completion``, every next-token target of prompt + chosen
    completion, that is every token of the sequence but its first (TRL 1.16's ORPOTrainer). ``auto`` is
    ``prompt_and_completion`` for ``orpo`` (as TRL's ORPOTrainer) and ``completion`` for the other losses.
    Either way the mean is over those tokens of the whole global batch; the preference loss itself (rewards,
    odds ratio, ``logps/*``) stays over the completions."""
    reference: Literal["auto", "model", "lora_base"] = "auto"
    """The reference policy of dpo / ipo / hinge: ``model``, a frozen copy FSDP-sharded beside the policy
    (eval, no gradients), loaded from ``reference_from``; ``lora_base``, the policy itself with its LoRA
    adapters switched off (needs ``lora.enabled``; no second copy); ``auto`` is ``lora_base`` under LoRA,
    else ``model``."""
    reference_from: str = ""
    """HF model directory of the reference model; empty means ``model.init_from`` (or, without it, the
    policy's own random initialisation). Its tokenizer must equal the policy's."""
    precompute_reference: bool = False
    """Compute the reference log-probs of every training pair once, before step 1 (FSDP-sharded, the pairs
    split over ranks), store them in the run directory keyed by the reference's identity and the data, and
    reuse them on resume or a second run; the reference model is freed before training."""


@dataclass
class DistillConfig:
    """Knowledge distillation from a frozen teacher (shardlm/train/distill_loss.py, formulas and sources
    there): on instruction data (``data.format = "instruct"``) the student's loss at each response token is
    ``alpha · D(student, teacher) + (1 - alpha) · cross-entropy``, averaged over the global batch's response
    tokens. On when ``teacher_from`` names a teacher."""

    teacher_from: str = ""
    """HF model directory of the teacher (any family shardlm imports), FSDP-sharded beside the student on the
    same mesh, frozen, in eval mode. Its vocabulary size and tokenizer (``tokenizer.json``) must equal the
    student's. Empty: no distillation."""
    loss: Literal["forward_kl", "reverse_kl", "jsd"] = "forward_kl"
    """The divergence D: ``forward_kl`` KL(teacher ‖ student) (Hinton et al. 2015), ``reverse_kl``
    KL(student ‖ teacher) (MiniLLM, Gu et al. 2024), ``jsd`` the generalised Jensen-Shannon divergence of
    GKD (Agarwal et al. 2024) with weight ``beta``; TRL's ``GKDTrainer.generalized_jsd_loss`` with beta 0, 1
    and ``beta``."""
    beta: float = 0.5
    """β of ``jsd``, in (0, 1): ``β · KL(teacher ‖ M) + (1 - β) · KL(student ‖ M)`` with ``M = β · teacher +
    (1 - β) · student``; near 0 it approaches the forward KL, near 1 the reverse KL."""
    temperature: float = 1.0
    """T > 0: both models' logits are divided by T before the divergence (no T² factor, as TRL); the
    cross-entropy term stays at temperature 1."""
    alpha: float = 0.5
    """Weight of the divergence in [0, 1]; the student's cross-entropy on the response tokens has
    ``1 - alpha`` (torchtune's ``kd_ratio``). 1: distillation alone (TRL's GKD); 0: plain fine-tuning with
    the teacher only measured."""
    top_k: int = 0
    """0: the divergence over the whole vocabulary. k in [1, vocabulary): over the teacher's k most likely
    tokens plus one bucket for all the others (TRL's sparse teacher form with its tail bucket)."""
    lmbda: float = 0.0
    """GKD's on-policy share λ: the fraction of batches whose responses the student samples itself. Only 0
    (offline: the dataset's responses) is built; on-policy needs the RL rollout (shardlm/rl), not there
    yet."""


@dataclass
class RLConfig:
    """Online reinforcement learning of the GRPO family on ``data.format = "prompts"`` (shardlm/rl/: the
    formulas, as TRL 1.16's ``GRPOTrainer``, in advantages.py and loss.py). Names are TRL's ``GRPOConfig``
    names. ``train.global_batch_size`` and ``train.micro_batch_size`` count completions (sequences); a global
    batch holds ``global_batch_size / num_generations`` prompts."""

    num_generations: int = 8
    """G: completions sampled per prompt, the group whose rewards give each completion its advantage."""
    max_prompt_length: int = 512
    """Most tokens of a rendered prompt (chat template and generation prompt included); longer prompts are
    left out when the data is prepared, and counted in its output."""
    max_completion_length: int = 256
    """Most tokens sampled per completion; a completion that reaches it without an end-of-turn id is
    truncated. ``max_prompt_length + max_completion_length`` must fit ``train.seq_len + 1``."""
    temperature: float = 1.0
    """Sampling temperature (the log-probs of the loss are of the logits divided by it, as TRL)."""
    top_p: float = 1.0
    """Nucleus sampling: the smallest set of tokens whose probability reaches this; 1 = all tokens."""
    top_k: int = 0
    """Sample among the k most probable tokens only; 0 = all tokens."""
    rollout: Literal["kv_cache", "exact"] = "kv_cache"
    """How the policy samples its completions (shardlm/rl): ``kv_cache``, one prefill and one-token forwards
    over a key-value cache (fast; the sampler's log-probs differ from the training step's in their last bits,
    ``sampling/logprob_diff_max``, about 1e-5 in fp32); ``exact``, each token drawn from the training step's
    own forward of the micro-batch it trains in (the sampler's log-probs equal the trainer's bit for bit and
    the metric is 0; one forward of the micro-batch per completion token, for short completions; not with a
    mixture of experts, ``parallel.compile``, tensorwise or mxfp8 float8, or LoRA dropout)."""
    steps_per_generation: int = 1
    """S, optimizer steps (global batches) per generation batch: the completions sampled at once, with the
    policy of the step that samples, are split into this many global batches, step ``s`` of a cycle of S ×
    num_iterations steps training on slice ``s % S`` (TRL's buffer; without TRL's per-process shuffle: the
    slices are the sampler's global batches, whole groups). Advantages are over the whole generation batch.
    TRL counts this in micro-steps (its default, the gradient accumulation steps, is one optimizer step: 1
    here). A checkpoint inside a cycle holds its buffer (per rank: resumed at the same world size)."""
    generation_batch_size: int = 0
    """Completions sampled per generation batch, all ranks together; 0 = ``train.global_batch_size ×
    steps_per_generation``. Set one of the two (as TRL): a multiple of ``train.global_batch_size``, it sets
    steps_per_generation to their ratio."""
    num_iterations: int = 1
    """μ: updates per generation batch: the whole generation batch is trained on μ times (S × μ steps per
    generation), each update with the old policy's log-probs in the importance ratio: the trainer's forward
    of the same micro-batches at generation, without gradients, so the first update's ratio is exactly 1.
    A checkpoint inside a cycle holds the old log-probs with the rest of its buffer."""
    loss_type: Literal["grpo", "dr_grpo", "dapo", "cispo", "sapo"] = "dapo"
    """How the per-token losses are normalised, over the whole global batch: ``grpo`` mean over each
    sequence's tokens, then over sequences; ``dr_grpo`` sum over tokens / (sequences ×
    max_completion_length) (Liu et al. 2025); ``dapo`` sum over tokens / the completion tokens (with
    steps_per_generation S > 1: the generation batch's / S, as TRL) (Yu et al. 2025; TRL's default);
    ``cispo`` the clipped importance weight, detached, times the advantage and the log-prob, normalised as
    dapo (MiniMax-M1, 2025); ``sapo`` a soft sigmoid gate instead of the clip, normalised as grpo (Gao et
    al. 2025). TRL's ``bnpo`` normalises over its local batch; over the global batch it is ``dapo``, so it is
    not offered."""
    importance_sampling_level: Literal["token", "sequence"] = "token"
    """``token``: one importance ratio per token; ``sequence``: one per completion, the exponent of its
    mean per-token log-ratio (GSPO, Zheng et al. 2025; with ``loss_type = "grpo"`` as in the paper)."""
    epsilon: float = 0.2
    """ε: the ratio is clipped to [1 - ε, 1 + epsilon_high]."""
    epsilon_high: float = 0.0
    """Upper ε of the clip (clip-higher, DAPO recommends 0.28); for ``cispo`` the largest importance weight
    (ScaleRL recommends 5.0). 0 = ``epsilon``."""
    delta: float = 0.0
    """Two-sided clipping (INTELLECT-2): the unclipped ratio is also capped at δ (> 1 + epsilon_high);
    0 = off."""
    sapo_temperature_pos: float = 1.0
    """SAPO's gate temperature for tokens of a positive advantage."""
    sapo_temperature_neg: float = 1.05
    """SAPO's gate temperature for tokens of a zero or negative advantage."""
    beta: float = 0.0
    """β: weight of the per-token KL to the reference policy (k3 estimator ``exp(ref - logp) - (ref - logp) -
    1``); 0 = no reference is built."""
    use_bias_correction_kl: bool = True
    """Multiply the per-token KL by the importance ratio (TRL's default)."""
    reference: Literal["auto", "model", "lora_base"] = "auto"
    """The reference policy of the KL term (β > 0), as ``preference.reference``: ``model`` a frozen copy,
    ``lora_base`` the policy with its LoRA adapters off, ``auto`` the latter under LoRA."""
    reference_from: str = ""
    """HF model directory of the reference model; empty means ``model.init_from``."""
    scale_rewards: Literal["group", "batch", "none"] = "group"
    """Divide each advantage by the standard deviation of its group's rewards (``group``), of the whole
    global batch's (``batch``, Hu et al. 2025), or not at all (``none``, Dr. GRPO)."""
    mask_truncated_completions: bool = False
    """Leave completions that reached ``max_completion_length`` without an end-of-turn id out of the loss
    (DAPO's overlong filtering); they still count in the reward metrics."""
    rewards: tuple[str, ...] = ("shardlm.rl.rewards:accuracy",)
    """Reward functions, each ``package.module:function`` or ``path/to/file.py:function``, called as TRL's
    (``prompts``, ``completions``, ``completion_ids`` and the prompt's other fields as keywords; one float or
    None per completion). Built-ins: ``shardlm.rl.rewards:accuracy``, ``:format``, ``:overlong``."""
    reward_weights: tuple[float, ...] = ()
    """Weight of each reward function in the summed reward; empty = 1 each."""
    format_pattern: str = r"^<think>.*?</think>\s*<answer>.*?</answer>$"
    """The regular expression ``shardlm.rl.rewards:format`` matches the whole completion against
    (``re.DOTALL``): 1 on a match, else 0."""
    overlong_cache: int = 0
    """L_cache of ``shardlm.rl.rewards:overlong``: the penalty grows linearly from 0 at
    ``max_completion_length - overlong_cache`` tokens to -1 at ``max_completion_length`` (DAPO, Eq. 13)."""
