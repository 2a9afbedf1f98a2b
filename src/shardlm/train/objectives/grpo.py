"""Online reinforcement learning of the GRPO family (``data.format = "prompts"``, the ``[rl]`` section) as an
objective of the training step, in TRL 1.16's order.

Generation cycles (TRL's ``_prepare_inputs``): with S = ``rl.steps_per_generation`` (or
``rl.generation_batch_size / train.global_batch_size``) and μ = ``rl.num_iterations``, the steps come in
cycles of S·μ. The first step of a cycle samples and scores one generation batch of S global batches
(:class:`~shardlm.data.prompts.CompletionSampler`: prompt batches ``c·S .. c·S + S - 1``) with the policy of
that step; step ``s`` of the run trains on slice ``s % S`` of it, so the whole generation batch is trained on
μ times. S = μ = 1 is one rollout per optimizer step.

:meth:`GRPOObjective.generate`, at the first step ``c0`` of a cycle (every rank, in the same order):

1. this rank's prompts: its contiguous share of each of the S global batches (completion ids ``p · G + g``),
   whole groups per rank (checked when the objective is built);
2. one rollout of all of them by the policy itself (:func:`shardlm.rl.rollout.rollout`, or with
   ``rl.rollout = "exact"`` :func:`shardlm.rl.exact.exact_rollout`, micro-batch by micro-batch as step 4
   cuts them; collectives: one all-gather per FSDP group on entry), each completion's stream keyed by
   (``train.seed``, ``c0``, prompt id, generation);
3. one all-gather of every rank's completions (lengths, truncation flags, token ids), put in the generation
   batch's order: every rank then holds them all and scores all of them with the reward functions
   (:func:`shardlm.rl.rewards.score`; a reward that raises raises on every rank: no hang), the group-relative
   advantages over the whole generation batch (:func:`shardlm.rl.advantages.group_advantages`; its std
   for ``scale_rewards = "batch"``, as TRL's over the gathered generation batch), the ``completions/*`` and
   reward metrics, and the denominator of each step's loss (:func:`shardlm.rl.loss.loss_denominator` of the
   loss mask's lengths of the generation batch);
4. each step's micro-batches: this rank's rollout rows as the trainer reads them
   (:func:`shardlm.rl.logps.trainer_batch`; the exact rollout's window), the same the training step runs;
5. when S·μ > 1, the old policy's log-probs (:func:`shardlm.rl.logps.score_rollout`): the trainer's forward
   of those micro-batches without gradients, before any update of the cycle, so the first update's
   importance ratio is exactly 1 (bit for bit: the same rows, batches and widths; with LoRA dropout > 0 the
   training forward drops units and it is not), and later updates' ratios are those of the updated policy
   to the sampling one (under the exact rollout equal to its own, bit for bit: this forward measures it,
   ``sampling/logprob_diff_max``, at every step of the cycle). At S·μ = 1 there are none: the old log-probs
   are ``logps.detach()`` (TRL at one update per generation).

:meth:`GRPOObjective.prepare_step` serves step ``s`` its slice (after :meth:`~GRPOObjective.generate` at a
cycle's first step). The cycle's buffer (this rank's rollout, advantages and old log-probs, the generation
batch's completions, reward table and metrics, the steps' loss denominator) lives in memory; a checkpoint
saved inside a cycle (any ``checkpoint.interval``, a preemption, the last step) holds it, per rank
(:meth:`GRPOObjective.rank_state`: ``rank-<r>.state.safetensors``, :mod:`shardlm.checkpoint.rank_state`,
:mod:`shardlm.rl.buffer`), and a resume there takes it back (:meth:`GRPOObjective.load_rank_state`): the run
continues with the uninterrupted run's completions, losses and weights, bit for bit at the same layout. A
checkpoint at a cycle's start holds nothing more (S = μ = 1: every checkpoint). The buffer is this rank's
share: a resume inside a cycle at another world size is refused by name (resume at the saved world size, or
from a checkpoint at a cycle's start); ``parallel.mode`` and ``train.micro_batch_size`` may change (the
buffer's rows are split into the new micro-batches; the bits of the losses may then differ).

Per micro-batch, :meth:`GRPOObjective.loss`: the reference's log-probs when ``rl.beta`` > 0 (no gradient; a
frozen copy, or the policy with its LoRA adapters off: :mod:`shardlm.train.reference`), the policy's per-token
log-probs and entropies with gradient (:func:`shardlm.rl.logps.token_logps`), and the numerator of
:func:`shardlm.rl.loss.policy_loss_sum` with the old log-probs.

Metrics (TRL's names): ``reward``, ``reward_std``, ``rewards/<f>/mean|std``, ``frac_reward_zero_std``,
``completions/*`` (exact over the generation batch, from the gathered lengths; every step of a cycle
reports its generation batch's), ``kl`` (β > 0), ``entropy``,
``clip_ratio/low_mean|high_mean|region_mean`` (clipped losses) or ``cispo_clip_ratio`` (sums and counts in the
step's one all-reduce); ``sampling/logprob_diff_max``: max |sampler's log-prob - trainer's at generation|
(0 under the exact rollout) over the step's completion tokens, each rank's maximum in its own slot of the
all-reduce's sum (TRL's ``clip_ratio/low_min`` and ``high_max``, which need MIN / MAX reductions, are left
out);
``rewards/all_equal_steps``, the generations so far whose scored rewards were all equal (a warning on the
first); and rank 0's seconds of ``time/rollout_s``, ``time/reward_s`` (gather and scoring) and
``time/logps_s`` (the old log-probs' forwards at generation, the reference's and the policy's forwards),
the generation's own at a cycle's first step and 0 at the others: the update is the rest of
``step_time_s``.
"""

from __future__ import annotations

import sys
import time

import torch
from tokenizers import Tokenizer
from torch import nn

from shardlm.checkpoint.rank_state import RankState
from shardlm.config import Config
from shardlm.data.build import data_dir
from shardlm.data.prompts import CompletionSampler, PromptsDataset
from shardlm.errors import CheckpointError, ConfigError
from shardlm.metrics import format_bytes, local_bytes
from shardlm.parallel.dist import DistInfo
from shardlm.rl.advantages import group_advantages, reward_metrics
from shardlm.rl.buffer import pack_buffer, unpack_buffer
from shardlm.rl.completions import completion_metrics, loss_mask
from shardlm.rl.exact import exact_rollout
from shardlm.rl.logps import RLBatch, logprob_diff_max, score_rollout, token_logps, trainer_batch
from shardlm.rl.loss import CLIPPED, loss_denominator, policy_loss_sum
from shardlm.rl.rewards import (
    RewardFunction,
    check_fields,
    load_reward_functions,
    reward_weights,
    rewards_all_equal,
    score,
)
from shardlm.rl.rollout import Rollout, rollout
from shardlm.train.build import unwrap
from shardlm.train.objectives.objective import Objective, ObjectiveContext, StepInputs
from shardlm.train.preference import adapters_off
from shardlm.train.reference import build_reference, check_reference_tokenizer


def rl_reference_kind(cfg: Config) -> str:
    """``none`` (β = 0), ``lora_base`` or ``model`` (``rl.reference`` with ``auto`` resolved: the base under
    LoRA without ``rl.reference_from``, else a frozen model)."""
    rl = cfg.rl
    if rl.beta == 0:
        return "none"
    if rl.reference == "auto":
        return "lora_base" if cfg.lora.enabled and not rl.reference_from else "model"
    return rl.reference


def stream_keys(prompt_ids: list[int], num_prompts: int) -> list[int]:
    """The rollout's key of each prompt of a global batch, in order: its id, or for its k-th repeat in the
    same batch (a batch that straddles two epochs) ``id + k · num_prompts``, so every completion of the batch
    has its own random stream and the keys do not depend on the world size."""
    seen: dict[int, int] = {}
    out = []
    for p in prompt_ids:
        k = seen.get(p, 0)
        seen[p] = k + 1
        out.append(p + k * num_prompts)
    return out


def sum_metric_names(cfg: Config) -> tuple[str, ...]:
    """The metrics :func:`~shardlm.rl.loss.policy_loss_sum` reports as [sum, count] for this config."""
    rl = cfg.rl
    clip = ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean") \
        if rl.loss_type in CLIPPED else ("cispo_clip_ratio",) if rl.loss_type == "cispo" else ()
    return (("kl",) if rl.beta else ()) + ("entropy",) + clip


class GRPOObjective(Objective):
    """The GRPO family's loss, one rollout per generation cycle (module docstring).

    Args:
        cfg: the run's config. info: this process. model: the policy (FSDP2-sharded, DDP-wrapped or plain).
        data: the training prompts. tokenizer: the data's tokenizer (decodes the completions for the rewards).
        funcs: the loaded reward functions. stop_ids: the ids that end a completion; pad_id: the id after it.
        sampler: the run's order of the completions (the step's sampler): the global batches of a cycle.
        kind: the reference (:func:`rl_reference_kind`); reference: the frozen model of kind ``model``.
    """

    name = "rl"
    progress_keys = ("reward",)
    val_loss = False

    def __init__(self, cfg: Config, info: DistInfo, model: nn.Module, data: PromptsDataset,
                 tokenizer: Tokenizer, funcs: list[RewardFunction], stop_ids: list[int], pad_id: int,
                 sampler: CompletionSampler, kind: str = "none", reference: nn.Module | None = None) -> None:
        self.cfg, self.info, self.model, self.data, self.tokenizer = cfg, info, model, data, tokenizer
        self.funcs, self.stop_ids, self.pad_id, self.kind, self.reference = funcs, stop_ids, pad_id, kind, \
            reference
        self.weights = reward_weights(cfg.rl)
        self.exact = cfg.rl.rollout == "exact"  # shardlm.rl.exact
        #: the trainer rows' window (:func:`~shardlm.rl.logps.trainer_batch`): the exact rollout's, else none
        self.window = cfg.rl.max_completion_length if self.exact else 0
        self.sum_names = sum_metric_names(cfg)
        #: [sum, count] per metric, then one slot per rank for its largest decode-vs-trainer log-prob gap
        self.stat_names = tuple(f"{n}/{part}" for n in self.sum_names for part in ("sum", "count")) + tuple(
            f"sampling/logprob_diff_max/rank{r}" for r in range(info.world_size))
        self.all_equal_steps = 0
        #: the order of the completions (:class:`~shardlm.data.prompts.CompletionSampler`)
        self.sampler = sampler
        #: (the cycle's first step, its S slices: :meth:`generate`); None before the first generation
        self.generation: tuple[int, list[dict]] | None = None

    @classmethod
    def build(cls, ctx: ObjectiveContext) -> GRPOObjective:
        """The objective of ``ctx``'s run: reward functions loaded and checked against every training prompt's
        fields, the reference built when ``rl.beta`` > 0 (a collective under FSDP).

        Raises:
            ConfigError: a rank's share of the global batch that is not whole groups, an unknown or bad reward
            function, a training prompt without a field a reward needs, a tokenizer without an end-of-turn id,
            a reference model with another tokenizer.
        """
        cfg, info = ctx.cfg, ctx.info
        rl, t = cfg.rl, cfg.train
        per_rank = t.global_batch_size // info.world_size
        if per_rank % rl.num_generations:
            raise ConfigError(f"train.global_batch_size = {t.global_batch_size} completions over "
                              f"{info.world_size} ranks gives each {per_rank}, not a whole number of groups "
                              f"of rl.num_generations = {rl.num_generations}: each rank samples whole "
                              "groups; make the global batch a multiple of num_generations x ranks")
        funcs = load_reward_functions(rl)
        data: PromptsDataset = ctx.train_data
        ids = list(range(len(data)))
        check_fields(funcs, data.fields(ids), ids)
        root = data_dir(cfg)
        special = data.meta.get("model_special_ids") or {}
        eos = special.get("eos") or []
        stop_ids = [int(i) for i in ([eos] if isinstance(eos, int) else eos)]
        if not stop_ids:
            raise ConfigError(f"{root / 'tokenizer.json'}: the tokenizer names no end-of-turn (eos) token: "
                              "completions could not stop; set eos_token in its tokenizer_config.json")
        pad = special.get("pad")
        kind = rl_reference_kind(cfg)
        reference = None
        if kind == "model":
            if rl.reference_from:
                check_reference_tokenizer(rl.reference_from,
                                          cfg.data.tokenizer or str(root / "tokenizer.json"))
            reference = build_reference(cfg, info, ctx.mesh, rl.reference_from)
        return cls(cfg, info, ctx.model, data, Tokenizer.from_file(str(root / "tokenizer.json")), funcs,
                   stop_ids, stop_ids[0] if pad is None else int(pad), ctx.sampler, kind, reference)

    def describe(self) -> str:
        """One line for the run summary."""
        rl = self.cfg.rl
        ref = {"none": "no reference", "model": "reference: a frozen model",
               "lora_base": "reference: the base with the LoRA adapters off"}[self.kind]
        if self.reference is not None:
            ref += f" ({format_bytes(sum(local_bytes(q) for q in self.reference.parameters()))} of shards)"
        return (f"{rl.loss_type}, {rl.num_generations} completions per prompt of up to "
                f"{rl.max_completion_length} tokens, temperature {rl.temperature:g}, beta {rl.beta:g}, "
                f"{rl.importance_sampling_level}-level ratio, scale_rewards {rl.scale_rewards}; rewards "
                + ", ".join(f.name for f in self.funcs) + f"; {ref}"
                + ("; exact rollout" if self.exact else "") + self.describe_cycle())

    def describe_cycle(self) -> str:
        """``""`` at one update per generation, else the cycle: generation batch, S and μ."""
        sampler = self.sampler
        if sampler.cycle == 1:
            return ""
        return (f"; a generation batch of {sampler.global_batch_size * sampler.steps_per_generation} "
                f"completions every {sampler.cycle} steps ({sampler.steps_per_generation} step(s) per "
                f"generation x {sampler.num_iterations} iteration(s))")

    # ---- the step ----------------------------------------------------------------------------------
    def prepare_step(self, step: int, micro_ids: list[list[int]], step_ids: list[int]) -> StepInputs:
        """Step ``step``'s slice of its cycle's generation batch (module docstring), sampled and scored first
        when ``step`` starts a cycle (collectives: the rollout's all-gathers, one all-gather of the
        completions and, with several updates per generation, the old log-probs' forwards).

        Raises:
            ConfigError: ``step`` inside a cycle whose buffer this process neither sampled nor took back from
                the checkpoint it resumed (one written without it).
        """
        sampler = self.sampler
        c0 = step - step % sampler.cycle
        if step == c0:
            self.generation = None  # the last cycle's buffer is not held through the next rollout
            self.generation = (c0, self.generate(c0))
        elif self.generation is None or self.generation[0] != c0:
            raise ConfigError(f"step {step + 1} is inside the generation cycle of steps {c0 + 1} .. "
                              f"{c0 + sampler.cycle} (rl.steps_per_generation x rl.num_iterations = "
                              f"{sampler.cycle}) whose completions, old log-probs and advantages the resumed "
                              "checkpoint does not hold: resume from a checkpoint at the start of a cycle "
                              f"(a step that is a multiple of {sampler.cycle})")
        parts = self.generation[1][step % sampler.steps_per_generation]
        if [c for ids in micro_ids for c in ids] != parts["ids"]:
            raise RuntimeError(f"step {step + 1}: the trainer's completion ids differ from the generation "
                               "batch's slice (a bug)")
        fresh = step == c0  # the generation's own times are reported once, by the step that sampled
        context = {**parts["context"], "diff_max": 0.0, "fresh": fresh,
                   "logps_s": parts["context"]["logps_s"] if fresh else 0.0,
                   "rollout_s": parts["context"]["rollout_s"] if fresh else 0.0,
                   "reward_s": parts["context"]["reward_s"] if fresh else 0.0}
        return StepInputs(parts["batches"], parts["denominator"], context)

    def generate(self, c0: int) -> list[dict]:
        """Sample, gather and score the generation batch of the cycle starting at step ``c0`` (module
        docstring, 1-5) and cut it into its S steps: per step, this rank's completion ids (``ids``), its
        micro-batches, the step's denominator and the context :meth:`loss` reads."""
        cfg, rl, info, sampler = self.cfg, self.cfg.rl, self.info, self.sampler
        G, S, W = rl.num_generations, sampler.steps_per_generation, info.world_size
        start = time.perf_counter()
        gen_ids = [c for s in sampler.generation_steps(c0) for c in sampler.step_ids(s)]  # slice after slice
        B = len(gen_ids) // S
        per_rank = B // W
        mine = [j * B + info.rank * per_rank + i for j in range(S) for i in range(per_rank)]  # global rows
        keys = stream_keys([c // G for c in gen_ids[::G]], len(self.data))
        rows = self.slice_rows(c0)[1]  # per slice, its micro-batches' rollout rows
        prompts = self.data.get([gen_ids[r] // G for r in mine[::G]])
        sampling = dict(max_completion_length=rl.max_completion_length, stop_ids=self.stop_ids,
                        seed=cfg.train.seed, step=c0, temperature=rl.temperature, top_p=rl.top_p,
                        top_k=rl.top_k, pad_id=self.pad_id)
        if self.exact:  # each micro-batch decoded as the step will run it
            ro = exact_rollout(unwrap(self.model), prompts, [keys[r // G] for r in mine[::G]], G,
                               [r for rs in rows for r in rs], chunk_tokens=cfg.train.loss_chunk_tokens,
                               **sampling)
        else:
            ro = rollout(unwrap(self.model), prompts, [keys[r // G] for r in mine[::G]], G, **sampling)
        rolled = time.perf_counter()
        lengths, truncated, completions = self.gather_completions(ro)
        # rank-major (rank, slice, row) to the generation batch's order (slice, rank, row)
        order = [w * S * per_rank + j * per_rank + i
                 for j in range(S) for w in range(W) for i in range(per_rank)]
        lengths, truncated = lengths[order], truncated[order]
        completions = [completions[i] for i in order]
        prompt_ids = [c // G for c in gen_ids]
        texts = self.tokenizer.decode_batch(completions, skip_special_tokens=True)
        table = score(self.funcs, texts, completions, self.data.fields(prompt_ids), prompt_ids)
        adv = group_advantages(table, self.weights, G, rl.scale_rewards)  # over the whole generation batch
        kept = lengths * ~truncated if rl.mask_truncated_completions else lengths
        denominator = loss_denominator(rl.loss_type, kept, rl.max_completion_length, S)
        metrics = {**reward_metrics(table, [f.name for f in self.funcs], adv),
                   **completion_metrics(lengths, truncated)}
        if rewards_all_equal(adv.rewards):
            self.all_equal_steps += 1
            if self.all_equal_steps == 1 and self.info.is_main:
                print(f"warning: step {c0 + 1}: every completion of the generation batch has the same "
                      "reward: no group has a learning signal (counted in rewards/all_equal_steps)",
                      file=sys.stderr, flush=True)
        metrics["rewards/all_equal_steps"] = float(self.all_equal_steps)
        scored = time.perf_counter()
        # the old policy's log-probs: the trainer's forward of the same micro-batches, before any update of
        # the cycle (bit for bit the first update's: ratio exactly 1; the exact rollout's own too, measured
        # against them at every step of the cycle); none at one update per generation
        old = None if sampler.cycle == 1 else score_rollout(
            unwrap(self.model), ro, [r for rs in rows for r in rs], rl.temperature,
            cfg.train.loss_chunk_tokens, self.pad_id)
        context = {"rollout": ro, "advantages": adv.advantages[mine], "old_logps": old,
                   "completion_ids": completions, "rewards": table,  # the generation batch's
                   "metrics": metrics, "logps_s": time.perf_counter() - scored,
                   "rollout_s": rolled - start, "reward_s": scored - rolled}
        return self.slices(c0, context, denominator)

    def slice_rows(self, c0: int) -> tuple[list[list[list[int]]], list[list[range]]]:
        """Per step of the cycle starting at ``c0`` (its slice of the generation batch): this rank's
        micro-batches' completion ids (the sampler's) and their rows of this rank's rollout."""
        sampler, info = self.sampler, self.info
        per_rank = self.cfg.train.global_batch_size // info.world_size
        micro = [sampler.micro_batches(s, info.rank, info.world_size, self.cfg.train.micro_batch_size)
                 for s in sampler.generation_steps(c0)]
        rows = []
        for j, ids in enumerate(micro):
            firsts = [j * per_rank]
            for m in ids:
                firsts.append(firsts[-1] + len(m))
            rows.append([range(a, b) for a, b in zip(firsts, firsts[1:])])
        return micro, rows

    def slices(self, c0: int, context: dict, denominator: float) -> list[dict]:
        """The generation of the cycle starting at ``c0`` cut into its S steps: per step, this rank's
        completion ids (``ids``), its micro-batches, the step's ``denominator`` and the shared ``context``."""
        micro, rows = self.slice_rows(c0)
        ro = context["rollout"]
        return [{"ids": [c for m in micro[j] for c in m], "denominator": denominator, "context": context,
                 "batches": [trainer_batch(ro, r, self.pad_id, self.window) for r in rows[j]]}
                for j in range(len(micro))]

    # ---- a checkpoint inside a cycle --------------------------------------------------------------
    def rank_state(self, step: int) -> RankState | None:
        """After ``step`` steps inside a generation cycle: this rank's buffer (:func:`~shardlm.rl.buffer.
        pack_buffer`, with ``what``, ``advice`` and ``cycle_start`` in the header); None at a cycle's start
        (S = μ = 1: always), where the next step samples anew."""
        cycle = self.sampler.cycle
        if step % cycle == 0 or self.generation is None:
            return None
        c0, parts = self.generation
        if c0 != step - step % cycle:
            raise RuntimeError(f"after step {step} the buffer held is the cycle's at {c0 + 1} (a bug)")
        tensors, header = pack_buffer(parts[0]["context"], parts[0]["denominator"])
        return tensors, {**header, "cycle_start": str(c0),
                         "what": f"the buffer of the generation cycle of steps {c0 + 1} .. {c0 + cycle}: its "
                                 "completions, old log-probs and advantages, each rank its share",
                         "advice": f"from a checkpoint at the start of a generation cycle (after a number of "
                                   f"steps that is a multiple of {cycle}) at any world size"}

    def load_rank_state(self, step: int, state: RankState | None) -> None:
        """At a resume after ``step`` steps: take back the cycle's buffer that :meth:`rank_state` saved (None:
        the checkpoint holds none; inside a cycle :meth:`prepare_step` then refuses to train).

        Raises:
            CheckpointError: a buffer of another cycle than ``step``'s.
        """
        if state is None:
            return
        c0 = step - step % self.sampler.cycle
        tensors, header = state
        if header.get("cycle_start") != str(c0) or step == c0:
            raise CheckpointError(f"the checkpoint after step {step} holds the buffer of the generation "
                                  f"cycle starting at step {int(header.get('cycle_start', -1)) + 1}, not of "
                                  f"the cycle of step {step + 1} (rl.steps_per_generation x "
                                  f"rl.num_iterations = {self.sampler.cycle})")
        context, denominator = unpack_buffer(tensors, header)
        self.generation = (c0, self.slices(c0, context, denominator))
        self.all_equal_steps = int(context["metrics"]["rewards/all_equal_steps"])

    def gather_completions(self, ro: Rollout) -> tuple[torch.Tensor, torch.Tensor, list[list[int]]]:
        """Every rank's completions in rank order (the global batch's order): (N,) int64 lengths, (N,) bool
        truncation flags and the token-id lists; one all-gather of (rows, 2 + max_completion_length) int64
        (every rank has the same number of rows)."""
        width = self.cfg.rl.max_completion_length
        local = torch.full((ro.completion_ids.shape[0], 2 + width), self.pad_id, dtype=torch.long)
        local[:, 0], local[:, 1] = ro.lengths, ro.truncated.long()
        local[:, 2:2 + ro.completion_ids.shape[1]] = ro.completion_ids
        if self.info.world_size > 1:
            out = torch.empty((self.info.world_size * local.shape[0], local.shape[1]), dtype=torch.long,
                              device=self.info.device)
            torch.distributed.all_gather_single(out, local.to(self.info.device))
            local = out.cpu()
        lengths = local[:, 0]
        return lengths, local[:, 1].bool(), [row[2:2 + n].tolist() for row, n in zip(local, lengths.tolist())]

    def loss(self, model: nn.Module, batch: RLBatch, ids: list[int], inputs: StepInputs
             ) -> tuple[torch.Tensor, torch.Tensor]:
        """This micro-batch's numerator (0-dim fp32, with gradient) and its statistic sums (fp64)."""
        rl, ctx = self.cfg.rl, inputs.context
        chunk = self.cfg.train.loss_chunk_tokens
        ro: Rollout = ctx["rollout"]
        start = time.perf_counter()
        ref = None
        if self.kind != "none":
            with torch.no_grad():
                if self.kind == "lora_base":
                    with adapters_off(model):
                        ref = token_logps(model, batch, rl.temperature, chunk)[0]
                else:
                    ref = token_logps(self.reference, batch, rl.temperature, chunk)[0]
        logps, entropies = token_logps(model, batch, rl.temperature, chunk)
        ctx["logps_s"] += time.perf_counter() - start
        device = logps.device
        mask = loss_mask(batch.completion_mask, ro.truncated[batch.rows], rl.mask_truncated_completions)
        old = None if ctx["old_logps"] is None else ctx["old_logps"][batch.rows].to(device)
        terms = policy_loss_sum(rl, logps, ctx["advantages"][batch.rows].to(device), mask.to(device),
                                old_logps=old, ref_logps=ref, entropies=entropies.detach())
        stats = torch.zeros(len(self.stat_names), dtype=torch.float64)
        for i, name in enumerate(self.sum_names):
            stats[2 * i:2 * i + 2] = terms.sums[name].double().cpu()
        # the rank's running maximum, as increments: their sum over micro-batches is the maximum
        # the trainer's at generation: this forward's at a cycle's first step (no update yet), else the
        # cycle's old log-probs
        trainer = logps.detach().cpu() if old is None or ctx["fresh"] else ctx["old_logps"][batch.rows]
        gap = logprob_diff_max(ro.logps[batch.rows], trainer, batch.completion_mask)
        new = max(ctx["diff_max"], gap)
        stats[2 * len(self.sum_names) + self.info.rank] = new - ctx["diff_max"]
        ctx["diff_max"] = new
        return terms.loss_sum, stats.to(device)

    def metrics(self, sums: list[float], inputs: StepInputs) -> dict[str, float]:
        """The step's metrics (module docstring) from the all-reduced sums and the host values."""
        ctx = inputs.context
        out = dict(ctx["metrics"])
        for i, name in enumerate(self.sum_names):
            out[name] = sums[2 * i] / max(sums[2 * i + 1], 1.0)
        out["sampling/logprob_diff_max"] = max(sums[2 * len(self.sum_names):])
        out.update({"time/rollout_s": ctx["rollout_s"], "time/reward_s": ctx["reward_s"],
                    "time/logps_s": ctx["logps_s"]})
        return out
