"""Which tokens a mixture of experts' router statistics count: the real ones (transformers'
``attention_mask``), per row, for padded instruction samples and packed rows.

Against transformers 5.24's ``load_balancing_loss_func(gate_logits, num_experts, top_k, attention_mask)``
(Qwen3-MoE and Mixtral): the aux loss, the z-loss and the tokens per expert of a padded batch with different
padding per row, and the aux term's gradient; a packed row's statistics equal those of its examples one per
row; the trainer's step logs transformers' masked values on padded instruction data.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import prepare_chat_examples
from shardlm.convert.hf_in import load_model_dir
from shardlm.data.instruct import InstructionExamples, split_batch
from shardlm.data.packing import PackedExamples, batch_documents, batch_real_tokens
from shardlm.model.config import ModelConfig
from shardlm.model.decoder import CausalLM
from shardlm.model.moe import MoE
from shardlm.train.moe_loss import moe_layers, moe_loss_term

transformers = pytest.importorskip("transformers")
from transformers.models.mixtral.modeling_mixtral import (  # noqa: E402
    load_balancing_loss_func as mixtral_balancing_loss,
)
from transformers.models.qwen3_moe.modeling_qwen3_moe import (  # noqa: E402
    load_balancing_loss_func as qwen3_moe_balancing_loss,
)

REFERENCE = {"qwen3_moe": qwen3_moe_balancing_loss, "mixtral": mixtral_balancing_loss}
LENGTHS = (24, 17, 9, 3)  # real tokens of each row of 24: right padding, a different amount per row


def hf_config(family: str):
    """A small Qwen3-MoE (a dense layer between two MoE layers, top-2 of 8 renormalised) or Mixtral (top-2
    of 4)."""
    common = dict(vocab_size=128, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=128, initializer_range=0.1, rms_norm_eps=1e-6,
                  tie_word_embeddings=False, num_experts_per_tok=2)
    if family == "qwen3_moe":
        return transformers.Qwen3MoeConfig(**common, num_hidden_layers=3, head_dim=16, intermediate_size=96,
                                           moe_intermediate_size=32, num_experts=8, norm_topk_prob=True,
                                           mlp_only_layers=[1], router_aux_loss_coef=0.01)
    return transformers.MixtralConfig(**common, num_hidden_layers=2, intermediate_size=32,
                                      num_local_experts=4, router_aux_loss_coef=0.02)


@pytest.fixture(scope="module", params=list(REFERENCE))
def pair(request, tmp_path_factory):
    """(family, transformers' model, ours loaded from its export)."""
    torch.manual_seed(3)
    hf = transformers.AutoModelForCausalLM.from_config(hf_config(request.param)).eval()
    out = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(out)
    return request.param, hf, load_model_dir(out)


def padded_batch() -> tuple[torch.Tensor, torch.Tensor]:
    """tokens (4, 24) int64 and their attention mask (4, 24) bool: row i real up to ``LENGTHS[i]``."""
    tokens = torch.randint(0, 128, (len(LENGTHS), 24), generator=torch.Generator().manual_seed(0))
    mask = torch.arange(24).expand(len(LENGTHS), 24) < torch.tensor(LENGTHS).unsqueeze(1)
    return tokens, mask


def routed(model: torch.nn.Module, tokens: torch.Tensor, **kwargs) -> list[torch.Tensor]:
    """Run ``model`` on ``tokens``; return each MoE layer's router logits (tokens, E), in the graph."""
    logits: list[torch.Tensor] = []
    hooks = [getattr(m, m.router_name).register_forward_hook(lambda _m, _a, out: logits.append(out))
             for m in moe_layers(model)]
    try:
        model(tokens, **kwargs)
    finally:
        for h in hooks:
            h.remove()
    return logits


def close(got: torch.Tensor, want: torch.Tensor, rel: float) -> bool:
    """Whether ``got`` is within ``rel`` of ``want``, relative to the largest magnitude of ``want``."""
    return (got - want).abs().max().item() <= rel * want.abs().max().item()


def test_padded_batch_router_statistics_equal_transformers_masked(pair):
    """Different padding per row: the aux loss equals transformers' ``load_balancing_loss_func`` under the
    attention mask, on our router logits and from transformers' own forward (1e-6, relative); the z-loss is
    the mean of logsumexp² over the same (layer, real token) rows and the tokens per expert their top-k
    choices; the unmasked function differs (padding would change the loss)."""
    family, hf, ours = pair
    tokens, mask = padded_batch()
    with torch.no_grad():
        logits = routed(ours, tokens, real_tokens=mask)
        want_hf = hf(tokens, attention_mask=mask.long(), output_router_logits=True).aux_loss
    cfg = ours.cfg
    term = moe_loss_term(ours, cfg.router_aux_loss_coef, 0.01)
    want = REFERENCE[family](tuple(logits), cfg.n_experts, cfg.n_experts_per_token, mask)
    unmasked = REFERENCE[family](tuple(logits), cfg.n_experts, cfg.n_experts_per_token)
    print(f"\n{family}: aux {term.aux.item():.8f}, transformers masked {want.item():.8f} (its forward "
          f"{want_hf.item():.8f}), unmasked {unmasked.item():.8f}")
    assert close(term.aux, want, 1e-6) and close(term.aux, want_hf, 1e-6)
    assert not close(unmasked, want, 1e-4)
    real = mask.reshape(-1)
    z = torch.cat([torch.logsumexp(lg[real], -1).pow(2) for lg in logits]).mean()
    assert close(term.z, z, 1e-6)
    for layer, lg in enumerate(logits):
        chosen = torch.topk(lg[real], cfg.n_experts_per_token).indices.reshape(-1)
        assert term.counts[layer].tolist() == torch.bincount(chosen, minlength=cfg.n_experts).float().tolist()
    assert all(m.stats.tokens.item() == sum(LENGTHS) for m in moe_layers(ours))


def test_router_gradient_of_the_aux_term_equals_transformers(pair):
    """The gradient of the aux term with respect to every MoE layer's router logits and router weight equals
    autograd of transformers' masked ``load_balancing_loss_func`` on the same logits (1e-5, relative to the
    gradient's largest entry); the unmasked function's gradient is another one."""
    family, _, ours = pair
    tokens, mask = padded_batch()
    logits = routed(ours, tokens, real_tokens=mask)
    cfg = ours.cfg
    weights = [getattr(m, m.router_name).weight for m in moe_layers(ours)]
    term = moe_loss_term(ours, 1.0)
    got = torch.autograd.grad(term.term, logits + weights, retain_graph=True)
    want = torch.autograd.grad(REFERENCE[family](tuple(logits), cfg.n_experts, cfg.n_experts_per_token, mask),
                               logits + weights, retain_graph=True)
    unmasked = torch.autograd.grad(REFERENCE[family](tuple(logits), cfg.n_experts, cfg.n_experts_per_token),
                                   logits + weights)
    for g, w, u in zip(got, want, unmasked):
        assert close(g, w, 1e-5), (family, (g - w).abs().max().item(), w.abs().max().item())
        assert not close(u, w, 1e-2)
    cosine = torch.nn.functional.cosine_similarity(torch.cat([g.flatten() for g in got[len(logits):]]),
                                                   torch.cat([u.flatten() for u in unmasked[len(logits):]]),
                                                   dim=0)
    print(f"\n{family}: cosine of the router weights' aux gradient with the unmasked one {cosine.item():.3f}")


# ---- instruction data: packed rows and the trainer ---------------------------------------------------------
SEQ = 64


@pytest.fixture(scope="module")
def chat_data(small_data, tmp_path_factory) -> Path:
    """40 short prompt/response examples (1-3 prompt words, 1-6 response words), prepared as instruction data
    with the small corpus' tokenizer: most are far shorter than ``SEQ``, each padded differently."""
    return prepare_chat_examples(tmp_path_factory.mktemp("chat"), small_data)


def moe_model() -> CausalLM:
    """A small Qwen3-MoE under block-causal attention, fp32, its weights perturbed (seeded)."""
    cfg = ModelConfig(family="qwen3_moe", dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=96,
                      vocab_size=512, max_seq_len=64, n_experts=8, n_experts_per_token=2, moe_ffn_hidden=32,
                      norm_topk_prob=True, attention="block_causal")
    model = CausalLM(cfg)
    model.init_weights(0)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.05)
    return model


def statistics(model: CausalLM, batch: torch.Tensor, masked: bool = True) -> list:
    """Each MoE layer's :class:`~shardlm.model.moe.RouterStats` of ``batch`` run as the trainer runs it
    (documents and, when ``masked``, the real tokens from the batch), and the batch's MoE loss term."""
    inputs, _ = split_batch(batch)
    with torch.no_grad():
        model(inputs, documents=batch_documents(batch),
              real_tokens=batch_real_tokens(batch) if masked else None)
    return [m.stats for m in moe_layers(model)] + [moe_loss_term(model, 1.0, 1.0)]


def test_instruction_samples_mark_their_padding(chat_data):
    """An instruction sample's real tokens are exactly its example's (prompt and response), per row."""
    plain = InstructionExamples(str(chat_data), "train", SEQ)
    ids = list(range(6))
    lengths = np.diff(plain.offsets)[ids]
    want = torch.arange(SEQ).expand(len(ids), SEQ) < torch.from_numpy(lengths).unsqueeze(1)
    assert len(set(lengths.tolist())) > 2 and (lengths < SEQ).all()
    assert torch.equal(batch_real_tokens(plain.get(ids)), want)


def test_packed_rows_statistics_equal_their_examples_one_per_row(chat_data):
    """The router statistics of packed rows (block-causal, each example from position 0) equal those of their
    examples one per padded row: counts and tokens exactly, probability and z sums and the aux and z losses
    to 1e-6 (relative); the padding tail counted as a document would change them. Rows whose examples fill
    all ``SEQ + 1`` positions are left out: the last token of a full row is only a target, never routed."""
    plain = InstructionExamples(str(chat_data), "train", SEQ)
    packed = PackedExamples(plain, seed=0)
    lengths = np.diff(plain.offsets)
    rows = [i for i, members in enumerate(packed.rows) if lengths[members].sum() <= SEQ]
    members = [e for i in rows for e in packed.rows[i]]
    assert len(rows) >= 3 and len(members) > 2 * len(rows)
    model = moe_model()
    together = statistics(model, packed.get(rows))
    alone = statistics(model, plain.get(members))
    tail = statistics(model, packed.get(rows), masked=False)
    for p, a in zip(together[:-1], alone[:-1]):
        assert p.tokens.item() == a.tokens.item() == lengths[members].sum()
        assert torch.equal(p.counts, a.counts)
        assert close(p.prob_sum, a.prob_sum, 1e-6) and close(p.z_sum, a.z_sum, 1e-6)
    assert tail[0].tokens.item() > together[0].tokens.item()
    p, a, t = together[-1], alone[-1], tail[-1]
    print(f"\naux packed {p.aux.item():.8f}, alone {a.aux.item():.8f}, tail counted {t.aux.item():.8f}")
    assert close(p.aux, a.aux, 1e-6) and close(p.z, a.z, 1e-6) and torch.equal(p.counts, a.counts)
    assert not close(t.aux, a.aux, 1e-5)


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_trainer_logs_transformers_masked_statistics_on_padded_instruction_data(family, chat_data, tmp_path):
    """One training step on unpacked instruction data (one process, one micro-batch of 4 examples, each padded
    differently): the model gets each row's real tokens, and the step's ``moe_aux_loss`` is transformers'
    ``aux_loss`` of the same inputs under their ``attention_mask`` (1e-6, relative), the z-loss and tokens per
    expert those of the same tokens; the unmasked aux loss differs."""
    from conftest import tiny_overrides
    from shardlm.config import load_config
    from shardlm.convert.hf_out import save_model_dir
    from shardlm.parallel import init_distributed
    from shardlm.train.trainer import Trainer
    cfg = load_config(None, tiny_overrides(chat_data, tmp_path / "run", {
        "model.family": f'"{family}"', "model.n_experts": 8, "model.n_experts_per_token": 2,
        "model.head_width": 16, "model.moe_ffn_hidden": 32, "model.norm_topk_prob": "true",
        "model.router_aux_loss_coef": 0.05, "model.router_z_loss_coef": 0.01, "parallel.mode": '"single"',
        "train.seq_len": SEQ, "train.global_batch_size": 4, "train.micro_batch_size": 4,
        "data.pad_multiple": 0}))  # rows of SEQ + 1 tokens, as the mask below
    started = torch.distributed.is_initialized()
    seen = []
    try:
        trainer = Trainer(cfg, init_distributed(cfg.parallel))  # a process group of one rank
        hook = trainer.model.register_forward_pre_hook(
            lambda _m, args, kwargs: seen.append((args[0].clone(), kwargs.get("real_tokens"))),
            with_kwargs=True)
        ids = trainer.sampler.step_ids(0)
        start = save_model_dir({k: v.detach().clone() for k, v in trainer.model.state_dict().items()},
                               cfg.model, tmp_path / "start")
        record = trainer.train_step()
        hook.remove()
    finally:
        if not started and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    lengths = np.diff(InstructionExamples(str(chat_data), "train", SEQ).offsets)[ids]
    mask = torch.arange(SEQ).expand(len(ids), SEQ) < torch.from_numpy(np.minimum(lengths, SEQ)).unsqueeze(1)
    (inputs, real), = seen
    assert torch.equal(real, mask) and len(set(lengths.tolist())) > 1 and not mask.all()
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(start), dtype=torch.float32).eval()
    with torch.no_grad():
        out = hf(inputs, attention_mask=mask.long(), output_router_logits=True)
        unmasked = hf(inputs, output_router_logits=True).aux_loss
    flat = mask.reshape(-1)
    z = torch.cat([torch.logsumexp(lg[flat], -1).pow(2) for lg in out.router_logits]).mean()
    counts = torch.stack([torch.bincount(torch.topk(lg[flat], 2).indices.reshape(-1), minlength=8)
                          for lg in out.router_logits]).float()
    print(f"\n{family}: logged aux {record['moe_aux_loss']:.8f}, transformers masked "
          f"{out.aux_loss.item():.8f}, unmasked {unmasked.item():.8f}")
    assert abs(record["moe_aux_loss"] - out.aux_loss.item()) <= 1e-6 * out.aux_loss.item()
    assert abs(unmasked.item() - out.aux_loss.item()) > 1e-4 * out.aux_loss.item()
    assert abs(record["moe_z_loss"] - z.item()) <= 1e-6 * z.item()
    assert record["tokens_per_expert_mean"] == int(mask.sum()) * 2 / 8
    assert (record["tokens_per_expert_min"], record["tokens_per_expert_max"]) == (counts.min().item(),
                                                                                  counts.max().item())


def test_a_real_tokens_mask_of_another_shape_is_refused():
    model = moe_model()
    tokens = torch.zeros(2, 8, dtype=torch.int64)
    with pytest.raises(ValueError, match=r"real_tokens \(2, 7\) needs the shape of the tokens \(2, 8\)"):
        model(tokens, real_tokens=torch.ones(2, 7, dtype=torch.bool))
    assert isinstance(moe_layers(model)[0], MoE)
