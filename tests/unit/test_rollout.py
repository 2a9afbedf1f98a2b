"""The rollout (shardlm/rl/rollout.py) and the trainer's log-probs of it (shardlm/rl/logps.py), one process,
a tiny fp32 model: the same completions whatever the generation batch size, the prompts' order and their split
into calls (ranks); stop ids end a completion, kept in it; each completion's stream keyed by (seed, step,
prompt id, generation); the decode's log-probs against the full forward's (measured: not bit for bit), the
scored log-probs against the step's forward (bit for bit); the trainer's rows as instruction rows are."""

from __future__ import annotations

import pytest
import torch

from shardlm.data.instruct import IGNORE_INDEX
from shardlm.model.config import ModelConfig
from shardlm.model.decoder import CausalLM
from shardlm.model.generate import filter_logits, inverse_cdf
from shardlm.rl.logps import logprob_diff_max, score_rollout, token_logps, trainer_batch
from shardlm.rl.rollout import rollout, stream_seed, stream_uniforms
from tolerance import EPS, assert_close

VOCAB = 48
STOP = [1, 2, 3]  # frequent enough with this model that most completions stop before the limit


def tiny_model(softcap: float = 0.0) -> CausalLM:
    """A 2-layer fp32 model whose weights are scaled up so its next-token distributions are far from uniform
    (completions of many lengths, top-k / top-p filters that bite)."""
    cfg = ModelConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=64, vocab_size=VOCAB,
                      max_seq_len=96, final_logit_softcap=softcap)
    model = CausalLM(cfg)
    model.init_weights(0)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(8)
    return model


def prompts_of(n: int, seed: int = 1) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(2, 15, (n,), generator=gen).tolist()
    return [torch.randint(4, VOCAB, (k,), generator=gen).tolist() for k in lengths]


KW = dict(max_completion_length=24, stop_ids=STOP, seed=7, step=3, temperature=0.9, top_p=0.95, top_k=30)


def by_key(ro) -> dict[tuple[int, int], list[int]]:
    return {(p, g): c for p, g, c in zip(ro.prompt_index.tolist(), ro.generation_index.tolist(),
                                         ro.completions())}


def test_same_completions_for_any_batch_size_prompt_order_and_split():
    model = tiny_model()
    prompts, ids = prompts_of(8), [10 * i + 3 for i in range(8)]
    ref = rollout(model, prompts, ids, 3, batch_size=0, **KW)
    assert ref.completion_ids.shape[0] == 24
    assert 1 < len({len(c) for c in ref.completions()})  # completions of several lengths
    assert ref.truncated.any() and not ref.truncated.all()
    changed = 0
    runs = [rollout(model, prompts, ids, 3, batch_size=bs, **KW) for bs in (1, 5, 7)]
    runs.append(rollout(model, prompts[::-1], ids[::-1], 3, batch_size=4, **KW))
    # two "ranks": an uneven split of the prompts, each its own call
    halves = [rollout(model, prompts[:3], ids[:3], 3, batch_size=2, **KW),
              rollout(model, prompts[3:], ids[3:], 3, batch_size=6, **KW)]
    split = {**by_key(halves[0]), **by_key(halves[1])}
    want = by_key(ref)
    for run in [*map(by_key, runs), split]:
        changed += sum(a != b for k in want for a, b in zip(want[k], run[k])) + sum(
            len(want[k]) != len(run[k]) for k in want)
    assert changed == 0, f"{changed} tokens changed with the batch composition"
    # the decode's log-probs move only in their last bits with the batch composition (MKL blocks by rows)
    other = runs[0]
    assert torch.equal(other.completion_mask, ref.completion_mask)
    assert_close(other.logps, ref.logps, rtol=64 * EPS, what="decode log-probs, batch size 1 vs all rows")


def test_stop_ids_end_completions_and_the_rest_is_padding():
    model = tiny_model()
    ro = rollout(model, prompts_of(6), list(range(6)), 4, pad_id=0, **KW)
    width = ro.completion_ids.shape[1]
    assert width == int(ro.lengths.max()) <= KW["max_completion_length"]
    for row, (ids, n, cut) in enumerate(zip(ro.completion_ids.tolist(), ro.lengths.tolist(),
                                            ro.truncated.tolist())):
        body = ids[:n]
        assert all(t not in STOP for t in body[:-1]), f"row {row}: a stop id inside the completion"
        if cut:
            assert n == KW["max_completion_length"] and body[-1] not in STOP
        else:
            assert body[-1] in STOP  # kept, as TRL keeps the EOS
        assert ids[n:] == [0] * (width - n)
        assert ro.completion_mask[row].tolist() == [True] * n + [False] * (width - n)
        assert (ro.logps[row, :n] < 0).all() and (ro.logps[row, n:] == 0).all()
    assert ro.generation_index.tolist() == [0, 1, 2, 3] * 6
    assert ro.prompt_index.tolist() == [i for i in range(6) for _ in range(4)]
    # no stop id at all: every completion runs to the limit
    free = rollout(model, prompts_of(2), [0, 1], 2, **{**KW, "stop_ids": []})
    assert free.truncated.all() and (free.lengths == KW["max_completion_length"]).all()


def test_streams_are_keyed_by_seed_step_prompt_id_and_generation():
    keys = [(s, t, p, g) for s in (0, 1) for t in (0, 5) for p in (0, 3) for g in (0, 1)]
    assert len({stream_seed(*k) for k in keys}) == len(keys)
    assert stream_seed(7, 3, 2, 1) == stream_seed(7, 3, 2, 1) < 2**63
    model = tiny_model()
    prompts = prompts_of(3)
    base = by_key(rollout(model, prompts, [4, 5, 6], 2, **KW))
    renamed = by_key(rollout(model, prompts, [5, 4, 6], 2, **KW))  # the first two prompts swap their ids
    # the first token of each completion is its own stream's first uniform inverted through the filtered
    # softmax: the prompt's id keys the stream, not its position
    with torch.no_grad():
        for i, p in enumerate(prompts):
            logits = model(torch.tensor([p]))[:, -1].float() / KW["temperature"]
            probs = torch.softmax(filter_logits(logits, KW["top_k"], KW["top_p"]), -1)
            for ids, got in (([4, 5, 6], base), ([5, 4, 6], renamed)):
                for g in range(2):
                    u = stream_uniforms(KW["seed"], KW["step"], ids[i], g, 1)
                    assert got[(ids[i], g)][0] == int(inverse_cdf(probs, u)[0])
    assert renamed[(6, 0)] == base[(6, 0)] and renamed[(4, 0)] != base[(4, 0)]
    for change in ({"step": 4}, {"seed": 8}):
        other = by_key(rollout(model, prompts, [4, 5, 6], 2, **{**KW, **change}))
        assert sum(other[k] != base[k] for k in base) >= 4, f"{change} left the completions unchanged"


def test_inverse_cdf_never_draws_a_filtered_token():
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.5, 0.0]] * 4)
    u = torch.tensor([0.0, 0.49, 0.5, 1.0 - 2**-24])
    assert inverse_cdf(probs, u).tolist() == [1, 1, 3, 3]
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(2000, 40, generator=gen) * 3
    probs = torch.softmax(filter_logits(logits, 5, 0.8), -1)
    drawn = inverse_cdf(probs, torch.rand(2000, generator=gen))
    assert (probs.gather(1, drawn.unsqueeze(1)) > 0).all()


@pytest.mark.parametrize("softcap", [0.0, 2.5])
def test_sampler_logprobs_against_the_full_forward(softcap):
    """The decode's log-probs are log_softmax(logits / T) of the sampled tokens: against the full forward
    they agree to a few roundings, not bit for bit (measured and bounded here). The scored log-probs
    (score_rollout) equal the step's forward on the same micro-batches bit for bit, with gradients."""
    model = tiny_model(softcap)
    ro = rollout(model, prompts_of(5), list(range(5)), 3, batch_size=4, **KW)
    rows = list(range(ro.completion_ids.shape[0]))
    micro = [rows[i:i + 4] for i in range(0, len(rows), 4)]
    scored = score_rollout(model, ro, micro, KW["temperature"], chunk_tokens=16)
    mask = ro.completion_mask
    diff = logprob_diff_max(ro.logps, scored, mask)
    assert_close(ro.logps[mask], scored[mask], rtol=64 * EPS, what="decode vs full-forward log-probs")
    assert diff > 0  # measured: the two computations differ in the last bits on this CPU (MKL, AVX2)
    # the reference: log_softmax of the whole logits / T, one row at a time
    with torch.no_grad():
        for r in (0, 7, 14):
            seq = ro.prompts[r] + ro.completions()[r]
            logits = model(torch.tensor([seq[:-1]]))[0].float() / KW["temperature"]
            lp = torch.log_softmax(logits, -1)[len(ro.prompts[r]) - 1:].gather(
                1, torch.tensor(seq[len(ro.prompts[r]):]).unsqueeze(1)).squeeze(1)
            assert_close(scored[r, :int(ro.lengths[r])], lp, rtol=64 * EPS, what=f"row {r} vs reference")
    # the training step: same micro-batches and chunking, with gradients -> the same bits (ratio exactly 1)
    model.train()
    for rows_ in micro:
        batch = trainer_batch(ro, rows_)
        logps, entropy = token_logps(model, batch, KW["temperature"], chunk_tokens=16)
        assert torch.equal(logps.detach(), scored[batch.rows])
        assert torch.equal(torch.exp(logps - scored[batch.rows])[batch.completion_mask],
                           torch.ones(int(batch.completion_mask.sum())))
        assert (entropy[batch.completion_mask] > 0).all()
        logps.sum().backward()
    assert model.lm_head.weight.grad.abs().sum() > 0


def test_lora_policy_samples_in_eval_mode_and_scores_bit_for_bit():
    """LoRA adapters (dropout 0.5, which must not act in the rollout) on q_proj, v_proj and lm_head: the
    rollout does not depend on the batch size, and the step's forward (train mode, dropout 0 here as the
    exactness claim needs) reproduces the scored log-probs bit for bit, gradients reaching the adapters
    only."""
    from shardlm.model.lora import LoRASpec, apply_lora, lora_modules

    model = tiny_model()
    bases = {name: p.detach().clone() for name, p in model.named_parameters()}
    apply_lora(model, LoRASpec(4, 8.0, 0.5, "q_proj,v_proj,lm_head"))
    with torch.no_grad():
        for name, module in lora_modules(model):
            module.weight.copy_(bases[f"{name}.weight"])  # apply_lora's base is torch.empty until loaded
            module.lora_A.weight.copy_(module.initial_adapters(name, 0)[0])
            module.lora_B.weight.normal_(0, 0.5, generator=torch.Generator().manual_seed(2))
    model.train()
    ro = rollout(model, prompts_of(4), list(range(4)), 2, batch_size=3, **KW)
    assert model.training  # restored after the rollout
    assert by_key(rollout(model, prompts_of(4), list(range(4)), 2, batch_size=0, **KW)) == by_key(ro)
    rows = list(range(ro.completion_ids.shape[0]))
    scored = score_rollout(model, ro, [rows], KW["temperature"])
    for _, module in lora_modules(model):
        module.dropout.p = 0.0
    batch = trainer_batch(ro, rows)
    logps, _ = token_logps(model, batch, KW["temperature"])
    assert torch.equal(logps.detach(), scored)
    logps.sum().backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert grads and all("lora_" in n for n in grads)


def test_trainer_rows_are_right_padded_with_targets_on_the_completion_only():
    model = tiny_model()
    ro = rollout(model, prompts_of(3), [0, 1, 2], 2, **KW)
    batch = trainer_batch(ro, [4, 1, 2], pad_id=0)
    lengths = [len(ro.prompts[r]) + int(ro.lengths[r]) for r in (4, 1, 2)]
    assert batch.inputs.shape == (3, max(lengths) - 1)
    for i, r in enumerate((4, 1, 2)):
        p, c = ro.prompts[r], ro.completions()[r]
        n = len(p) + len(c) - 1
        assert batch.inputs[i, :n].tolist() == (p + c)[:-1] and (batch.inputs[i, n:] == 0).all()
        assert batch.real[i].tolist() == [True] * n + [False] * (batch.inputs.shape[1] - n)
        scored = batch.targets[i] != IGNORE_INDEX
        assert batch.targets[i, scored].tolist() == c
        assert scored.nonzero().squeeze(1).tolist() == list(range(len(p) - 1, len(p) - 1 + len(c)))
    assert torch.equal(batch.completion_mask, ro.completion_mask[[4, 1, 2]])
    with pytest.raises(ValueError, match="rollout rows"):
        trainer_batch(ro, [6])


@pytest.mark.parametrize("change, message", [
    ({"prompt_ids": [1, 1]}, "prompt ids repeat"),
    ({"temperature": 0.0}, "temperature must be > 0"),
    ({"top_p": 0.0}, "top_p"),
    ({"max_completion_length": 90}, "exceeds the model's context"),
    ({"num_generations": 0}, "num_generations"),
])
def test_bad_rollout_arguments_are_refused(change, message):
    args = {"prompts": prompts_of(2), "prompt_ids": [0, 1], "num_generations": 2, **KW, **change}
    with pytest.raises(ValueError, match=message):
        rollout(tiny_model(), **args)


def test_a_rank_with_no_prompts_returns_an_empty_rollout():
    ro = rollout(tiny_model(), [], [], 4, **KW)
    assert ro.completion_ids.shape == (0, 0) and ro.completions() == []
