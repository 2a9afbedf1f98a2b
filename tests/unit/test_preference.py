"""Preference tuning: data prepared as TRL 1.16 tokenizes it, log-probs, losses and reward metrics equal TRL's
(DPOTrainer's own ``_compute_loss`` for dpo / ipo / hinge / rpo; CPOTrainer's and ORPOTrainer's loss functions
on the same forward for simpo / orpo), the LoRA reference is the base with adapters off, and bad input.

The model is a small random Llama built with transformers and imported by shardlm; the tokenizer a small BPE
with a ChatML template (SmolLM2's). fp32 throughout, tolerance 1e-6.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from shardlm.convert.hf_in import load_model_dir
from shardlm.data.instruct import IGNORE_INDEX, read_instructions, row_width, split_batch
from shardlm.data.preference import PreferencePairs, prepare_preferences, read_preferences
from shardlm.errors import DataError
from shardlm.model.lora import LoRASpec, apply_lora
from shardlm.train.preference import (
    adapters_off,
    completion_logps,
    metrics_of,
    micro_batch_loss,
    pair_losses,
    pair_stats,
)
from tolerance import assert_close, check

transformers = pytest.importorskip("transformers", reason="pip install -e '.[test]'")
trl = pytest.importorskip("trl", reason="pip install -e '.[test]' (trl==1.16.0)")
ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples" / "instruct-shakespeare.jsonl"
CHATML = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
          "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
          "Face<|im_end|>\n' }}{% endif %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
          "'<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% "
          "endif %}")
SEQ_LEN = 95  # max_length = 96 tokens: long pairs are truncated (keep_start)
TOL = 1e-6


def pairs_from_examples(n: int) -> list[dict]:
    """Preference pairs from the project's instruction examples: the reply as chosen, another example's reply
    as rejected; every third pair in the conversational format."""
    rows = [msgs for _, msgs in read_instructions(str(EXAMPLES))]
    out = []
    for i in range(n):
        msgs, other = rows[i % len(rows)], rows[(i + 3) % len(rows)]
        user = next(m["content"] for m in msgs if m["role"] == "user")
        chosen = next(m["content"] for m in msgs if m["role"] == "assistant")
        rejected = next(m["content"] for m in other if m["role"] == "assistant")
        if i % 3 == 2:
            out.append({"prompt": [{"role": "user", "content": user}],
                        "chosen": [{"role": "assistant", "content": chosen}],
                        "rejected": [{"role": "assistant", "content": rejected}]})
        else:
            out.append({"prompt": user, "chosen": chosen, "rejected": rejected})
    return out


def conversational(row: dict) -> dict:
    """A pair in TRL's conversational format (shardlm renders standard strings as a user/assistant chat)."""
    if isinstance(row["prompt"], list):
        return row
    return {"prompt": [{"role": "user", "content": row["prompt"]}],
            "chosen": [{"role": "assistant", "content": row["chosen"]}],
            "rejected": [{"role": "assistant", "content": row["rejected"]}]}


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def write_tokenizer_dir(d: Path) -> Path:
    """Write into ``d`` a 512-id byte-level BPE with ChatML's special tokens and SmolLM2's template."""
    texts = [m["content"] for _, msgs in read_instructions(str(EXAMPLES)) for m in msgs] * 4
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=512, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "pad_token": "<|im_end|>",
        "unk_token": "<|endoftext|>", "chat_template": CHATML}))
    return d


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory) -> Path:
    """The tokenizer of :func:`write_tokenizer_dir`."""
    return write_tokenizer_dir(tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory, tok_dir) -> dict[str, Path]:
    """A random transformers Llama (policy) and a perturbed copy (reference), saved with save_pretrained."""
    cfg = transformers.LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                   rms_norm_eps=1e-6, tie_word_embeddings=False)
    root = tmp_path_factory.mktemp("hf")
    out = {}
    for name, seed in (("policy", 1), ("reference", 2)):
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(cfg).float()
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn(p.shape, generator=gen) * 0.05)
        model.save_pretrained(str(root / name))
        for f in ("tokenizer.json", "tokenizer_config.json"):
            (root / name / f).write_bytes((tok_dir / f).read_bytes())
        out[name] = root / name
    return out


@pytest.fixture(scope="module")
def prepared(tmp_path_factory, tok_dir) -> tuple[list[dict], Path]:
    rows = pairs_from_examples(10)
    root = tmp_path_factory.mktemp("pref")
    path = write_jsonl(root / "pairs.jsonl", rows)
    out = root / "data"
    prepare_preferences(str(path), str(out), str(tok_dir / "tokenizer.json"), 512, 0.2)
    return rows, out


def trl_trainer(hf_dirs: dict[str, Path], tok_dir: Path, rows: list[dict], tmp: Path, **args):
    """TRL 1.16's DPOTrainer on the policy and reference models and the pairs, max_length = SEQ_LEN + 1."""
    from datasets import Dataset

    tokenizer = transformers.PreTrainedTokenizerFast.from_pretrained(str(tok_dir))
    policy = transformers.AutoModelForCausalLM.from_pretrained(str(hf_dirs["policy"]), dtype=torch.float32)
    ref = transformers.AutoModelForCausalLM.from_pretrained(str(hf_dirs["reference"]), dtype=torch.float32)
    config = trl.DPOConfig(output_dir=str(tmp), max_length=SEQ_LEN + 1, report_to=[], use_cpu=True,
                           # fp32: TRL defaults to bf16
                           per_device_train_batch_size=len(rows), bf16=False, **args)
    return trl.DPOTrainer(model=policy, ref_model=ref, args=config, processing_class=tokenizer,
                          train_dataset=Dataset.from_list([conversational(r) for r in rows]))


def test_prepared_pairs_equal_trls_tokenization_and_truncation(prepared, hf_dirs, tok_dir, tmp_path):
    rows, out = prepared
    trainer = trl_trainer(hf_dirs, tok_dir, rows[:8], tmp_path)  # the train split: the first 8 of 10 pairs
    ours = PreferencePairs(str(out), "train", SEQ_LEN)
    assert len(ours) == len(trainer.train_dataset) == 8
    assert ours.truncated > 0  # the rule is exercised
    batch = ours.get(list(range(8)))
    theirs = trainer.data_collator([trainer.train_dataset[i] for i in range(8)])
    ids, mask = theirs["input_ids"], theirs["completion_mask"]
    for row in range(16):
        n = int(theirs["attention_mask"][row].sum())
        assert batch[row, 0, :n].tolist() == ids[row, :n].tolist()
        labels = torch.where(mask[row, :n].bool(), ids[row, :n], IGNORE_INDEX)
        assert batch[row, 1, :n].tolist() == labels.tolist()
        assert (batch[row, 1, n:] == IGNORE_INDEX).all()


def shardlm_model(path: Path, lora: bool = False) -> torch.nn.Module:
    model = load_model_dir(path).eval()
    if lora:
        state = model.state_dict()
        apply_lora(model, LoRASpec(4, 8.0, 0.0, "q_proj,v_proj,down_proj", "float32"))
        # the base weights into the LoRA layers
        missing, unexpected = model.load_state_dict(state, strict=False)
        assert not unexpected and all("lora_" in k for k in missing)
    return model


@pytest.mark.parametrize("loss_type", ["dpo", "ipo", "hinge", "dpo_rpo"])
def test_dpo_ipo_hinge_equal_trls_dpo_trainer(loss_type, prepared, hf_dirs, tok_dir, tmp_path):
    rows, out = prepared
    beta, alpha = 0.3, 0.7
    loss = "dpo" if loss_type == "dpo_rpo" else loss_type
    trl_args = ({"loss_type": ["sigmoid", "sft"], "loss_weights": [1.0, alpha]} if loss_type == "dpo_rpo" else
                {"loss_type": ["sigmoid" if loss == "dpo" else loss]})
    trainer = trl_trainer(hf_dirs, tok_dir, rows[:8], tmp_path, beta=beta, **trl_args)
    inputs = trainer.data_collator([trainer.train_dataset[i] for i in range(8)])
    trl_loss = trainer._compute_loss(trainer.model, inputs, False)
    mode = "train" if trainer.model.training else "eval"  # where TRL files the metrics it logs
    theirs = {k: v[-1] for k, v in trainer._metrics[mode].items()}

    data = PreferencePairs(str(out), "train", SEQ_LEN)
    ids = list(range(8))
    batch = data.get(ids)
    policy, reference = shardlm_model(hf_dirs["policy"]), shardlm_model(hf_dirs["reference"])
    inp, tgt = split_batch(batch)
    with torch.no_grad():
        ref_logps, _, _ = completion_logps(reference, inp, tgt, 0)
        trl_ref = trainer.ref_model(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"],
                                    labels=inputs["input_ids"].masked_fill(inputs["completion_mask"] == 0,
                                                                           -100),
                                    fused_lm_head=True).log_probs.sum(1)  # TRL's per-sequence log-probs
    assert_close(ref_logps, trl_ref, rtol=TOL, what="reference log-probs")
    for chunk in (0, 7):  # the plain and the chunked log-probs: the same loss and metrics
        ours_loss, stats = micro_batch_loss(policy, batch, loss, beta, 0.0, 0.5,
                                            alpha if loss_type == "dpo_rpo" else 0.0, chunk, ref_logps, 8,
                                            data.num_chosen_targets(ids))
        ours = metrics_of(stats.tolist(), 8)
        # the losses are β-scaled differences of summed log-probs (~100 nats here, whose fp32 rounding by
        # summation order is ~1e-5): the tolerance is 1e-6 relative to those
        loss_tol = TOL * max(1.0, beta * abs(theirs["logps/chosen"]))
        print(f"{loss_type} chunk {chunk}: |loss - TRL's| = {abs(ours_loss.item() - trl_loss.item()):.2e}")
        check(abs(ours_loss.item() - trl_loss.item()), loss_tol, what=f"{loss_type} loss, chunk {chunk}")
        for key in ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins",
                    "logps/chosen", "logps/rejected", "logits/chosen", "logits/rejected"):
            # summed log-probs of ~100 nats carry fp32 rounding of ~1e-5 (summation order): relative to them
            scale = max(1.0, abs(theirs["logps/chosen"]) * (beta if key.startswith("rewards/") else 1.0))
            check(abs(ours[key] - theirs[key]), TOL * scale, scale=scale, what=f"{loss_type} {key}")
    assert 0 < theirs["rewards/accuracies"] < 1  # a batch where the metric can be wrong either way


def test_conservative_dpo_equals_trls_label_smoothing(prepared, hf_dirs, tok_dir, tmp_path):
    """``preference.label_smoothing`` with dpo (cDPO, Mitchell 2023): TRL 1.16's DPOTrainer uses its
    ``label_smoothing`` only in ``robust`` and ``exo_pair`` (its ``sigmoid`` loss ignores it, asserted here),
    so the reference is TRL's own code of the cDPO form: CPOTrainer's ``sigmoid`` loss with
    ``label_smoothing``, given the policy-minus-reference log-ratios that DPOTrainer computes (its TRL
    forward, its reference model)."""
    from trl.experimental.cpo import CPOTrainer

    rows, out = prepared
    beta, eps = 0.3, 0.2
    trainer = trl_trainer(hf_dirs, tok_dir, rows[:8], tmp_path, beta=beta, label_smoothing=eps)
    inputs = trainer.data_collator([trainer.train_dataset[i] for i in range(8)])
    plain = trl_trainer(hf_dirs, tok_dir, rows[:8], tmp_path / "plain", beta=beta)
    assert trainer._compute_loss(trainer.model, inputs, False).item() == pytest.approx(
        plain._compute_loss(plain.model, inputs, False).item(), abs=1e-7)  # DPOTrainer's sigmoid: ε ignored
    labels = inputs["input_ids"].masked_fill(inputs["completion_mask"] == 0, -100)
    with torch.no_grad():
        logps = [m(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"], labels=labels,
                   fused_lm_head=True).log_probs.sum(1) for m in (trainer.model, trainer.ref_model)]
    ratios = logps[0] - logps[1]
    ns = SimpleNamespace(alpha=0.0, loss_type="sigmoid", beta=beta, label_smoothing=eps,
                         accelerator=SimpleNamespace(device=torch.device("cpu")))
    expected, c_rew, r_rew = CPOTrainer.cpo_loss(ns, ratios[:8], ratios[8:])
    assert expected.mean() > plain._compute_loss(plain.model, inputs, False) + 1e-3  # ε changes the loss

    data = PreferencePairs(str(out), "train", SEQ_LEN)
    batch = data.get(list(range(8)))
    policy, reference = shardlm_model(hf_dirs["policy"]), shardlm_model(hf_dirs["reference"])
    inp, tgt = split_batch(batch)
    with torch.no_grad():
        ref_logps, _, _ = completion_logps(reference, inp, tgt, 0)
    for chunk in (0, 7):
        ours_loss, stats = micro_batch_loss(policy, batch, "dpo", beta, eps, 0.5, 0.0, chunk, ref_logps, 8,
                                            data.num_chosen_targets(list(range(8))))
        loss_tol = TOL * max(1.0, beta * abs(logps[0][:8].mean().item()))  # as in the DPO test above
        print(f"cDPO chunk {chunk}: |loss - TRL's| = {abs(ours_loss.item() - expected.mean().item()):.2e}")
        check(abs(ours_loss.item() - expected.mean().item()), loss_tol, what=f"cDPO loss, chunk {chunk}")
        ours = metrics_of(stats.tolist(), 8)
        check(abs(ours["rewards/margins"] - (c_rew - r_rew).mean().item()), loss_tol,  # CPO's β·log-ratios
              what="cDPO margins")


def trl_concatenated_forward(
    hf_dirs: dict[str, Path], batch: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' logits of the concatenated batch and TRL-style labels (-100
    off-completion), unshifted."""
    model = transformers.AutoModelForCausalLM.from_pretrained(str(hf_dirs["policy"]), dtype=torch.float32)
    ids = batch[:, 0]
    logits = model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits
    return logits, batch[:, 1]


@pytest.mark.parametrize("loss", ["simpo", "orpo"])
def test_simpo_orpo_equal_trls_cpo_and_orpo_losses(loss, prepared, hf_dirs):
    """simpo with cpo_alpha (CPOTrainer's NLL: the chosen completions) and orpo with ``nll_tokens =
    "completion"`` (the paper's L_SFT) from TRL's loss functions on the same logits; orpo's default, TRL's
    ORPOTrainer end to end, is :func:`test_orpo_equals_trls_orpo_trainer_loss_and_gradient`."""
    from trl.experimental.cpo import CPOTrainer
    from trl.experimental.orpo import ORPOTrainer

    rows, out = prepared
    data = PreferencePairs(str(out), "train", SEQ_LEN)
    ids = list(range(8))
    batch = data.get(ids)
    beta, gamma, smoothing = 2.0, 0.4, 0.1 if loss == "simpo" else 0.0
    logits, labels = trl_concatenated_forward(hf_dirs, batch)
    avg = CPOTrainer.get_batch_logps(logits, labels.clone(), average_log_prob=True)
    nll = torch.nn.CrossEntropyLoss()(logits[:8, :-1].reshape(-1, logits.shape[-1]),
                                      labels[:8, 1:].reshape(-1))
    ns = SimpleNamespace(alpha=0.0, loss_type="simpo", simpo_gamma=gamma, beta=beta,
                         label_smoothing=smoothing, accelerator=SimpleNamespace(device=torch.device("cpu")))
    if loss == "simpo":
        losses, c_rew, r_rew = CPOTrainer.cpo_loss(ns, avg[:8], avg[8:])
        cpo_alpha = 0.5
        expected = losses.mean() + cpo_alpha * nll
    else:
        losses, c_rew, r_rew, _, _ = ORPOTrainer.odds_ratio_loss(ns, avg[:8], avg[8:])
        cpo_alpha = 0.0
        expected = nll - losses.mean()
    policy = shardlm_model(hf_dirs["policy"])
    ours_loss, stats = micro_batch_loss(policy, batch, loss, beta, smoothing, gamma, cpo_alpha, 5, None, 8,
                                        data.num_chosen_targets(ids), nll_tokens="completion")
    ours = metrics_of(stats.tolist(), 8)
    # fp32 rounding is relative to the operands: the β-scaled average log-probs and the NLL
    scale = max(1.0, abs(nll.item()), beta * avg.abs().max().item())
    check(abs(ours_loss.item() - expected.item()), TOL * scale, scale=scale, what=f"{loss} loss")
    trl_metrics = {"rewards/chosen": c_rew.mean(), "rewards/rejected": r_rew.mean(),
                   "rewards/accuracies": (c_rew > r_rew).float().mean(),
                   "rewards/margins": (c_rew - r_rew).mean(), "logps/chosen": avg[:8].mean(),
                   "logps/rejected": avg[8:].mean()}
    for key, value in trl_metrics.items():
        check(abs(ours[key] - value.item()), TOL * scale, scale=scale, what=f"{loss} {key}")


def trl_orpo_batch(batch: torch.Tensor, pad: int) -> dict[str, torch.Tensor]:
    """shardlm's concatenated rows (2P, 2, T + 1) as the batch TRL's ORPOTrainer collates: per side
    ``*_input_ids`` (right-padded with ``pad``), ``*_attention_mask`` (1 on the real tokens: up to the end of
    the completion) and ``*_labels`` (-100 off the completion)."""
    p = batch.shape[0] // 2
    out = {}
    for side, rows in (("chosen", batch[:p]), ("rejected", batch[p:])):
        labelled = rows[:, 1].ne(IGNORE_INDEX)
        lengths = [int(torch.nonzero(row).max()) + 1 for row in labelled]
        width = max(lengths)
        mask = torch.arange(width) < torch.tensor(lengths)[:, None]
        out[f"{side}_input_ids"] = torch.where(mask, rows[:, 0, :width], pad)
        out[f"{side}_attention_mask"] = mask.long()
        out[f"{side}_labels"] = torch.where(mask, rows[:, 1, :width], -100)
    return out


def test_orpo_equals_trls_orpo_trainer_loss_and_gradient(prepared, hf_dirs, tok_dir, tmp_path):
    """``orpo`` at its default (``preference.nll_tokens = "auto"``: the NLL term over prompt + chosen
    completion) equals TRL 1.16's ORPOTrainer's whole objective, its own ``get_batch_loss_metrics`` on the
    same token rows (its NLL is the cross-entropy of the chosen rows' ``input_ids`` where ``attention_mask``
    is 1, shifted: the prompt included): the loss, every parameter's gradient and its metrics, with the
    log-probs plain and in chunks of 7 tokens; with ``nll_tokens = "completion"`` the loss differs from it
    (by the prompt's share of the NLL)."""
    from datasets import Dataset
    from trl.experimental.orpo import ORPOConfig, ORPOTrainer

    rows, out = prepared
    data = PreferencePairs(str(out), "train", SEQ_LEN)
    ids = list(range(8))
    batch = data.get(ids)
    beta = 0.25
    tokenizer = transformers.PreTrainedTokenizerFast.from_pretrained(str(tok_dir))
    hf_policy = transformers.AutoModelForCausalLM.from_pretrained(str(hf_dirs["policy"]), dtype=torch.float32)
    config = ORPOConfig(output_dir=str(tmp_path), beta=beta, max_length=SEQ_LEN + 1, report_to=[],
                        use_cpu=True, bf16=False, per_device_train_batch_size=8)
    trainer = ORPOTrainer(model=hf_policy, args=config, processing_class=tokenizer,
                          train_dataset=Dataset.from_list([conversational(r) for r in rows[:8]]))
    trl_loss, trl_metrics = trainer.get_batch_loss_metrics(trainer.model, trl_orpo_batch(batch,
                                                                                         trainer.padding_value))
    trl_loss.backward()
    trl_grads = {n: q.grad for n, q in trainer.model.named_parameters()}
    nll_targets = data.num_chosen_targets(ids, prompt=True)
    assert nll_targets > data.num_chosen_targets(ids) + 8 * 10  # the prompts (>= 10 tokens each) count

    policy = shardlm_model(hf_dirs["policy"])
    for chunk in (0, 7):
        policy.zero_grad(set_to_none=True)
        ours_loss, stats = micro_batch_loss(policy, batch, "orpo", beta, 0.0, 0.5, 0.0, chunk, None, 8,
                                            nll_targets)
        ours_loss.backward()
        assert abs(ours_loss.item() - trl_loss.item()) < TOL * abs(trl_loss.item()), chunk
        grads, worst = dict(policy.named_parameters()), 0.0
        assert grads.keys() == trl_grads.keys()
        for name, theirs in trl_grads.items():
            # each gradient: sums over ~700 tokens of fp32 products, rounded in another order than TRL's
            diff = (grads[name].grad - theirs).norm() / theirs.norm()
            worst = max(worst, diff.item())
            assert diff < TOL, (chunk, name, diff.item())
        print(f"orpo chunk {chunk}: loss relative difference "
              f"{abs(ours_loss.item() - trl_loss.item()) / trl_loss.item():.1e}, gradients' largest "
              f"{worst:.1e}")
        ours = metrics_of(stats.tolist(), 8)
        for key in ("nll_loss", "rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins",
                    "logps/chosen", "logps/rejected"):
            assert abs(ours[key] - trl_metrics[key]) < TOL * max(1.0, abs(trl_metrics[key])), (key, ours[key],
                                                                                            trl_metrics[key])
    completion_only, _ = micro_batch_loss(policy, batch, "orpo", beta, 0.0, 0.5, 0.0, 0, None, 8,
                                          data.num_chosen_targets(ids), nll_tokens="completion")
    print(f"orpo, NLL over the completions only: loss {completion_only.item():.6f}, TRL's "
          f"{trl_loss.item():.6f}")
    assert abs(completion_only.item() - trl_loss.item()) > 1e-2


def test_lora_reference_is_the_base_with_adapters_off(prepared, hf_dirs):
    _, out = prepared
    batch = PreferencePairs(str(out), "train", SEQ_LEN).get([0, 1, 2])
    inp, tgt = split_batch(batch)
    base = shardlm_model(hf_dirs["policy"])
    policy = shardlm_model(hf_dirs["policy"], lora=True)
    with torch.no_grad():  # trained adapters: B no longer zero
        for name, p in policy.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))) * 0.1)
        base_logps, _, _ = completion_logps(base, inp, tgt, 0)

    def reference(model: torch.nn.Module, switch_off: bool) -> torch.Tensor:
        with torch.no_grad(), (adapters_off(model) if switch_off else torch.enable_grad()):
            return completion_logps(model, inp, tgt, 0)[0]

    def adapters_are_off_in_reference_and_on_in_policy(ref: torch.Tensor) -> bool:
        policy_logps = completion_logps(policy, inp, tgt, 0)[0]
        return torch.equal(ref, base_logps) and not torch.allclose(policy_logps, base_logps, atol=1e-3)

    assert adapters_are_off_in_reference_and_on_in_policy(reference(policy, switch_off=True))
    # the control
    assert not adapters_are_off_in_reference_and_on_in_policy(reference(policy, switch_off=False))
    assert all(m.adapters_enabled for m in policy.modules() if hasattr(m, "adapters_enabled"))  # restored


def test_precomputed_table_is_keyed_by_the_references_and_the_datas_content(prepared, hf_dirs, tok_dir,
                                                                            tmp_path):
    """A reference whose weights changed (same size, same modification time) gets another table key, so its
    table is not reused; the same files elsewhere or touched get the same key (reused); so do the
    prepared tokens."""
    import os
    import shutil

    from shardlm.config import load_config
    from shardlm.data.preference import PreferencePairs
    from shardlm.parallel.dist import DistInfo
    from shardlm.train.reference import reference_table_path

    _, data = prepared
    info = DistInfo(0, 0, 1, torch.device("cpu"), "gloo")

    def table(ref: Path, data_dir: Path = data) -> Path:
        cfg = load_config(None,
                          ["--data.format=preference", f"--data.dir={data_dir}", "--model.vocab_size=512",
                                 f"--data.tokenizer={tok_dir / 'tokenizer.json'}",
                           f"--preference.reference_from={ref}",
                                 "--train.seq_len=127"])
        return reference_table_path(cfg, "model", tmp_path / "run",
                                    PreferencePairs(str(data_dir), "train", 127), info)

    copy = tmp_path / "copy"
    shutil.copytree(hf_dirs["reference"], copy)
    key = table(hf_dirs["reference"])
    assert table(copy) == key  # same content, another directory and modification times: reused
    weights = copy / "model.safetensors"
    os.utime(weights, ns=(0, 0))
    assert table(copy) == key  # touched: reused
    raw = bytearray(weights.read_bytes())
    raw[-1] ^= 1  # one weight's last byte: same size
    weights.write_bytes(bytes(raw))
    os.utime(weights, ns=(0, 0))  # and the same modification time as before
    assert table(copy) != key  # not reused
    assert table(hf_dirs["policy"]) != key
    other = tmp_path / "data2"
    shutil.copytree(data, other)
    assert table(hf_dirs["reference"], other) == key  # the same prepared tokens elsewhere
    tokens = bytearray((other / "train.bin").read_bytes())
    tokens[-1] ^= 1
    (other / "train.bin").write_bytes(bytes(tokens))
    assert table(hf_dirs["reference"], other) != key


@pytest.mark.parametrize("chunk", [0, 3])
def test_rows_without_scored_tokens_still_give_the_head_a_gradient(chunk):
    """No scored token in a micro-batch: log-probs 0, and the output weight still gets a (zero) gradient, as
    on the ranks that have some (under FSDP2 a parameter without one would change the
    group's reduce-scatter)."""
    from shardlm.config import load_config
    from shardlm.model.decoder import CausalLM
    from shardlm.train.preference import head_logps

    cfg = load_config(None,
                      ["--model.dim=32", "--model.n_layers=1", "--model.n_heads=2", "--model.n_kv_heads=1",
                             "--model.ffn_hidden=64", "--model.vocab_size=64", "--model.max_seq_len=16",
                             "--train.seq_len=8"])
    model = CausalLM(cfg.model)
    hidden = torch.randn(2, 5, 32, requires_grad=True)
    logps, means, nll = head_logps(model, hidden, torch.full((2, 5), IGNORE_INDEX), chunk)
    logps.sum().backward()
    assert logps.tolist() == [0.0, 0.0] and means.tolist() == [0.0, 0.0] and nll.tolist() == [0.0, 0.0]
    assert model.lm_head.weight.grad is not None and not model.lm_head.weight.grad.any()
    assert hidden.grad is not None and not hidden.grad.any()


def test_pair_stats_count_ties_as_wrong_and_average_logits_per_token():
    logps = torch.tensor([-3.0, -5.0, -4.0, -5.0])
    terms = pair_losses("dpo", 0.5, 0.0, 0.0, logps, torch.tensor([3, 2, 4, 2]),
                        torch.tensor([-4.0, -5.0, -4.0, -5.0]))
    stats = metrics_of(pair_stats(terms, torch.tensor([3.0, 2.0, 8.0, 2.0]), torch.tensor([3, 2, 4, 2]),
                                  torch.tensor([-6.0, -9.0]), torch.tensor([5, 7])).tolist(), 2)
    assert stats["rewards/accuracies"] == 0.5  # pair 1 wins (0.5 > 0), pair 2 ties (0 == 0): counted wrong
    assert stats["logits/chosen"] == 5.0 / 5 and stats["logits/rejected"] == 10.0 / 6
    assert stats["nll_loss"] == 15.0 / 12  # over the NLL term's tokens, not the completions' (7)


def test_bad_preference_input(tok_dir, tmp_path, capsys):
    tokenizer = str(tok_dir / "tokenizer.json")
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "a", "chosen": "b", "rejected": "c"},
                                               {"prompt": "a", "chosen": "b"}])
    with pytest.raises(DataError, match=r"bad.jsonl:2: missing field 'rejected': a preference pair needs"):
        read_preferences(str(bad))
    mixed = write_jsonl(tmp_path / "mixed.jsonl",
                        [{"prompt": "a", "chosen": [{"role": "assistant", "content": "b"}],
                                                    "rejected": "c"}])
    with pytest.raises(DataError, match="mixed.jsonl:1: .* must all be strings or all be message lists"):
        read_preferences(str(mixed))
    rows = pairs_from_examples(4) + [{"prompt": "same?", "chosen": "yes", "rejected": "yes"}]
    out = tmp_path / "data"
    meta = prepare_preferences(str(write_jsonl(tmp_path / "same.jsonl", rows)), str(out), tokenizer, 512,
                               0.25)
    assert meta["skipped_identical"] == 1 and meta["skipped_identical_lines"] == [5]
    assert meta["train_pairs"] + meta["val_pairs"] == 4
    assert "skipped 1 with chosen identical to rejected (lines 5)" in capsys.readouterr().err
    short = PreferencePairs(str(out), "train", 75)  # max_length 76: two of the three prompts fill it
    assert short.dropped > 0 and len(short) + short.dropped == meta["train_pairs"]
    assert f"{short.dropped} dropped: prompt fills max_length" in short.summary()
    with pytest.raises(DataError, match=r"every prompt fills max_length = train.seq_len \+ 1 = 4 tokens"):
        PreferencePairs(str(out), "train", 3)
    only_same = write_jsonl(tmp_path / "only_same.jsonl",
                            [{"prompt": "q", "chosen": "a", "rejected": "a"}] * 3)
    with pytest.raises(DataError, match=r"0 usable pair\(s\) \(3 skipped: chosen identical to rejected\)"):
        prepare_preferences(str(only_same), str(tmp_path / "x"), tokenizer, 512, 0.25)
    assert not (tmp_path / "x").exists()


def test_bad_preference_settings_and_a_reference_with_another_tokenizer(tok_dir, hf_dirs, tmp_path, capsys):
    from conftest import cli_error
    from shardlm.config import load_config
    from shardlm.errors import ConfigError
    from shardlm.train.reference import check_reference_tokenizer

    pairs = write_jsonl(tmp_path / "pairs.jsonl", pairs_from_examples(4))
    base = ["--data.format=preference", f"--data.corpus={pairs}",
            f"--data.tokenizer={tok_dir / 'tokenizer.json'}"]
    for extra, message in (
            (["--data.pack=true", "--model.attention=block_causal"],
             "data.pack does not apply to data.format = "
                                                                      "'preference': preference pairs are "
                                                                      "not packed"),
            (["--preference.loss=ipo", "--preference.label_smoothing=0.1"],
             "preference.label_smoothing applies to loss 'dpo' or 'simpo' (loss is 'ipo')"),
            (["--preference.reference=lora_base"],
             "preference.reference = 'lora_base' needs lora.enabled = true"),
            (["--preference.beta=0"], "preference.beta must be positive, got 0.0"),
            (["--preference.nll_tokens=prompt_and_completion"],
             "preference.nll_tokens chooses the tokens of the NLL term, which loss 'dpo' has only with "
             "preference.rpo_alpha > 0"),
            (["--preference.loss=orpo", "--preference.nll_tokens=prompt"],
             "preference.nll_tokens")):
        with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
            load_config(None, base + extra)
    with pytest.raises(ConfigError,
                       match="preference.beta applies to data.format = 'preference' .format is 'text'."):
        load_config(None, ["--preference.beta=0.3"])  # a [preference] setting that would be ignored
    err = cli_error(capsys, ["prepare", "--config", str(ROOT / "configs/shakespeare-tiny.toml"), *base,
                             "--data.pack=true", "--model.attention=block_causal"])
    assert "data.pack does not apply" in err
    # the same: accepted
    check_reference_tokenizer(str(hf_dirs["reference"]), str(tok_dir / "tokenizer.json"))
    other = tmp_path / "other"
    other.mkdir()
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator(["a different corpus entirely"] * 10,
                            trainers.BpeTrainer(vocab_size=300, show_progress=False))
    tok.save(str(other / "tokenizer.json"))
    with pytest.raises(ConfigError,
                       match=r"preference.reference_from .*other: its tokenizer differs from the policy's"):
        check_reference_tokenizer(str(other), str(tok_dir / "tokenizer.json"))
    with pytest.raises(ConfigError, match="has no tokenizer.json"):
        check_reference_tokenizer(str(tmp_path), str(tok_dir / "tokenizer.json"))


def test_pairs_padded_to_the_longest_row_are_the_full_rows_cut(prepared):
    """``pad_multiple``: chosen and rejected rows of a micro-batch share one width, the longest sequence's
    positions rounded up to the multiple; the rows are the full-width rows cut there (the rest padding only),
    and the chosen-only rows (validation) take the chosen sequences' own width."""
    _, out = prepared
    full = PreferencePairs(str(out), "train", SEQ_LEN)
    trimmed = PreferencePairs(str(out), "train", SEQ_LEN, pad_multiple=4)
    ids = [0, 1, 2]
    a, b = full.get(ids), trimmed.get(ids)
    assert b.shape[2] == trimmed.width(ids) and (b.shape[2] - 1) % 4 == 0 or b.shape[2] == SEQ_LEN + 1
    assert torch.equal(a[:, :, :b.shape[2]], b) and (a[:, 1, b.shape[2]:] == IGNORE_INDEX).all()
    chosen = trimmed.chosen_examples()
    assert torch.equal(chosen.get(ids), a[:3, :, :chosen.width(ids)])
    assert chosen.width(ids) <= b.shape[2]
    assert min(trimmed.width([i]) for i in range(len(trimmed))) < SEQ_LEN + 1  # some rows are trimmed


def test_a_pairs_row_length_is_its_longest_sequence_what_length_grouping_sorts_by(prepared):
    """``row_lengths()``: each pair's prompt and longer completion, cut at ``seq_len + 1``: the tokens of the
    last real position of its longer row, so a pair alone is padded to exactly :func:`row_width` of it."""
    _, out = prepared
    full = PreferencePairs(str(out), "train", SEQ_LEN)
    trimmed = PreferencePairs(str(out), "train", SEQ_LEN, pad_multiple=4)
    lengths = trimmed.row_lengths()
    assert lengths.shape == (len(trimmed),) and len(set(lengths.tolist())) > 1
    for i in range(len(trimmed)):
        rows = full.get([i])  # chosen and rejected at full width: the last position any of them trains
        last = max(int(torch.nonzero(row[1] != IGNORE_INDEX).max()) for row in rows)
        assert int(lengths[i]) == last + 1
        assert trimmed.width([i]) == row_width(int(lengths[i]), SEQ_LEN, 4)
