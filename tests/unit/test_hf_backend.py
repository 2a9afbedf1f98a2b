"""``model.backend = "transformers"`` in one process: on the same weights it trains as the native decoder does
(Llama, Qwen3, Qwen3-MoE: losses and parameters over 3 steps), packed rows equal each document alone and keep
documents apart (every architecture that packs), and bad input is refused with one message each.

The tiny random models are tests/hf_models.py's, saved with transformers' ``save_pretrained``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from hf_models import ARCHS, hf_dir
from tolerance import EPS, assert_close, assert_norm_close

transformers = pytest.importorskip("transformers")


def train_three_steps(data: Path, run: Path, init_from: Path, backend: str, extra: dict | None = None):
    """3 steps of shardlm's trainer in this process (a group of one rank): (losses, final state dict)."""
    from conftest import tiny_overrides
    from shardlm.config import load_config
    from shardlm.parallel import init_distributed
    from shardlm.train.trainer import Trainer

    cfg = load_config(None, tiny_overrides(data, run, {
        "model.init_from": f'"{init_from}"', "model.backend": f'"{backend}"', "parallel.mode": '"single"',
        "train.seq_len": 16, "train.global_batch_size": 4, "train.micro_batch_size": 2, "train.steps": 3,
        "train.warmup_steps": 0, "train.eval_interval": 0, "train.loss_chunk_tokens": 24,
        "checkpoint.interval": 0, **(extra or {})}))
    started = torch.distributed.is_initialized()
    try:
        trainer = Trainer(cfg, init_distributed(cfg.parallel), keep_history=True)
        history = trainer.train()
        state = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
    finally:
        if not started and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    return [r["loss"] for r in history if "loss" in r], state


@pytest.mark.parametrize("arch", ["llama", "qwen3", "qwen3_moe"])
def test_transformers_backend_trains_as_the_native_decoder(arch, small_data, tmp_path):
    """The same transformers checkpoint trained 3 steps (packed pre-training windows: block-causal attention,
    chunked loss, gradient accumulation 2) by the native decoder and by the transformers backend: losses
    within 1e-6 of the largest, parameters within 1e-6 in norm (Llama: bit-identical, measured; Qwen3-MoE: the
    expert sums run in another order, AdamW's normalisation lifts the difference of a rarely-routed expert's
    small gradient to ~3e-7 in one element)."""
    init = hf_dir(tmp_path / "init", arch)
    native, native_state = train_three_steps(small_data, tmp_path / "native", init, "native")
    hf, hf_state = train_three_steps(small_data, tmp_path / "hf", init, "transformers")
    assert len(hf) == len(native) == 3
    print(f"\n{arch}: native {native}, transformers {hf}")
    assert_close(hf, native, rtol=1e-6, scale=max(native), what=f"{arch} losses")
    assert hf_state.keys() == native_state.keys()
    assert_norm_close(hf_state, native_state, rtol=1e-6, what=f"{arch} parameters")
    loaded = transformers.AutoModelForCausalLM.from_pretrained(str(init)).state_dict()
    start = {k: v for k, v in loaded.items() if k in hf_state}
    moved = max((hf_state[k] - start[k]).abs().max().item() for k in start)
    assert moved > 1e-4  # the weights did train: the comparison is not of two untouched copies


def hf_backend_model(path: Path):
    """The transformers backend's model of ``path`` loaded whole by shardlm's loader (as one rank of one)."""
    from shardlm.convert.hf_in import load_pretrained_
    from shardlm.model.config import ModelConfig
    from shardlm.model.hf_backend import build_hf_model, fill_model_config, read_hf_config

    cfg = ModelConfig(backend="transformers", init_from=str(path), attention="block_causal")
    fill_model_config(cfg, read_hf_config(path))
    with torch.device("meta"):
        model = build_hf_model(cfg)
    model.to_empty(device="cpu")
    load_pretrained_(model, path)
    return model.eval()


@pytest.mark.parametrize("arch", [a for a in ARCHS if a != "qwen3_next"])
def test_packed_rows_equal_documents_alone_and_keep_them_apart(arch, tmp_path):
    """A row packing documents of 5, 4 and 3 tokens: each document's logits equal its own forward (1e-5 of
    the largest), and changing every token of the middle document leaves the others' logits within 1e-6 (exact
    for dense models; a mixture of experts batches each expert's tokens together, which reorders sums), while
    its own change by more than 1e-3. The plain forward equals transformers' own model exactly."""
    path = hf_dir(tmp_path / arch, arch)
    model = hf_backend_model(path)
    reference = transformers.AutoModelForCausalLM.from_pretrained(str(path)).eval()
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(3, 512, (1, 12), generator=gen)
    docs = torch.tensor([[0] * 5 + [1] * 4 + [2] * 3])
    bounds = [(0, 5), (5, 9), (9, 12)]
    with torch.no_grad():
        assert torch.equal(model(tokens), reference(tokens).logits)
        packed = model(tokens, documents=docs)
        for a, b in bounds:
            alone = model(tokens[:, a:b])
            assert_close(packed[:, a:b], alone, rtol=1e-5, what=f"{arch} document [{a}, {b})")
        changed = tokens.clone()
        changed[:, 5:9] = (changed[:, 5:9] + 17) % 509 + 3
        perturbed = model(changed, documents=docs)
    for a, b in (bounds[0], bounds[2]):  # MoE: other tokens in an expert's batch change the sums' order only
        assert_close(perturbed[:, a:b], packed[:, a:b], rtol=1e-6,
                     what=f"{arch} untouched document [{a}, {b})")
    assert (perturbed[:, 5:9] - packed[:, 5:9]).abs().max() > 1e-3


def test_hybrid_linear_attention_refuses_packed_documents(tmp_path):
    """Qwen3-Next's linear-attention layers run over the whole row whatever the mask: a packed row would
    leak one document into the next (measured: the unmasked row differs), so documents are refused by name;
    the plain forward equals transformers'."""
    path = hf_dir(tmp_path / "qwen3_next", "qwen3_next")
    model = hf_backend_model(path)
    reference = transformers.AutoModelForCausalLM.from_pretrained(str(path)).eval()
    tokens = torch.randint(3, 512, (1, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert_close(model(tokens), reference(tokens).logits, rtol=16 * EPS, what="qwen3_next logits")
        with pytest.raises(ValueError, match="packed documents on model_type 'qwen3_next': not verified"):
            model(tokens, documents=torch.tensor([[0] * 6 + [1] * 6]))


def load_with(path: Path, extra: dict | None = None):
    from shardlm.config import load_config

    overrides = {"model.backend": '"transformers"', "model.init_from": f'"{path}"', **(extra or {})}
    return load_config(None, [f"--{k}={v}" for k, v in overrides.items()])


def test_bad_input_one_message_each(tmp_path):
    """An architecture transformers does not know, a base model without its LM head and a masked LM, a
    remote-code model, a model without a decoder-layer list
    (GPT-2: ``transformer.h``), an attention without sdpa (Gemma 2), a logit scale the loss does not apply
    (Cohere), tensor parallel, no ``init_from``: each refused with a message naming the cause."""
    from shardlm.errors import ConfigError, ModelDirError
    from shardlm.model.hf_backend import build_hf_model

    unknown = tmp_path / "unknown"
    unknown.mkdir()
    (unknown / "config.json").write_text(json.dumps({"model_type": "wonderlm",
                                                     "architectures": ["WonderLM"]}))
    with pytest.raises(ModelDirError, match="model_type 'wonderlm' is not an architecture transformers"):
        load_with(unknown)
    for model_type, architecture, head in (("llama", "LlamaModel", "LlamaForCausalLM"),
                                           ("bert", "BertForMaskedLM", "BertLMHeadModel")):
        headless = tmp_path / architecture
        headless.mkdir()
        (headless / "config.json").write_text(json.dumps({"model_type": model_type,
                                                          "architectures": [architecture]}))
        with pytest.raises(ModelDirError, match=rf"architectures \['{architecture}'\] is not a causal "
                                                rf"language model with its head \({head}\)"):
            load_with(headless)
    remote = tmp_path / "remote"
    remote.mkdir()
    (remote / "config.json").write_text(json.dumps({"model_type": "llama", "auto_map": {
        "AutoModelForCausalLM": "modeling_x.XForCausalLM"}}))
    with pytest.raises(ModelDirError, match="remote-code model .* shardlm never turns on trust_remote_code"):
        load_with(remote)
    gpt2 = tmp_path / "gpt2"
    transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=64).save_pretrained(str(gpt2))
    cfg = load_with(gpt2)
    with pytest.raises(ConfigError, match="GPT2LMHeadModel: no decoder-layer list at model.layers"):
        with torch.device("meta"):
            build_hf_model(cfg.model)
    gemma2 = tmp_path / "gemma2"  # attention soft-capping: eager only in transformers, no sdpa
    transformers.Gemma2Config(num_hidden_layers=1, hidden_size=16, intermediate_size=32,
                              num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                              vocab_size=64).save_pretrained(str(gemma2))
    with pytest.raises(ConfigError, match="cannot build Gemma2Config as a causal LM with sdpa attention"):
        with torch.device("meta"):
            build_hf_model(load_with(gemma2).model)
    cohere = tmp_path / "cohere"
    transformers.CohereConfig(num_hidden_layers=1, hidden_size=16, intermediate_size=32,
                              num_attention_heads=2, vocab_size=64,
                              logit_scale=0.0625).save_pretrained(str(cohere))
    with pytest.raises(ModelDirError, match="logit_scale=0.0625 scales the logits"):
        load_with(cohere)
    llama = hf_dir(tmp_path / "llama", "llama")
    with pytest.raises(ConfigError, match="model.backend='transformers' with parallel.tp=2 is not built yet"):
        load_with(llama, {"parallel.tp": 2})
    with pytest.raises(ConfigError, match="model.backend='transformers' needs model.init_from"):
        load_with(llama, {"model.init_from": '""'})


def test_lora_through_shardlm_adapters_equals_native(small_data, tmp_path):
    """LoRA on the transformers backend is shardlm's own (``LoRALinear`` on the targeted ``nn.Linear`` layers
    by name, which transformers' models name as shardlm does): 3 steps equal the native decoder's losses
    (1e-6), and the merged export and the PEFT adapter equal the native run's bit for bit (measured)."""
    from safetensors.torch import load_file

    init = hf_dir(tmp_path / "init", "llama")
    lora = {"lora.enabled": "true", "lora.rank": 4, "lora.alpha": 8.0}
    native, _ = train_three_steps(small_data, tmp_path / "native", init, "native", lora)
    hf, _ = train_three_steps(small_data, tmp_path / "hf", init, "transformers", lora)
    assert_close(hf, native, rtol=1e-6, scale=max(native), what="LoRA losses")
    for sub in ("final/model.safetensors", "final-adapter/adapter_model.safetensors"):
        a, b = load_file(str(tmp_path / "hf" / sub)), load_file(str(tmp_path / "native" / sub))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), sub


def test_plan_counts_the_transformers_model_and_marks_activations_an_estimate(tmp_path):
    """``shardlm plan`` of a DeepSeek V3 model: the parameter count is the transformers model's own (its
    meta model's, latent attention and shared experts included), and the activations are marked an
    estimate."""
    from shardlm.plan.report import format_plan

    path = hf_dir(tmp_path / "deepseek_v3", "deepseek_v3")
    cfg = load_with(path, {"train.seq_len": 32, "train.global_batch_size": 8, "train.micro_batch_size": 4})
    reference = transformers.AutoModelForCausalLM.from_pretrained(str(path))
    expected = sum(p.numel() for p in reference.parameters())
    text = format_plan(cfg, 2, "cpu", 0.05)
    assert f": {expected:,} parameters, fsdp at world size 2" in text, text
    assert "activations an estimate, the native decoder's formula" in text
