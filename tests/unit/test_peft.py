"""Parameter-efficient fine-tuning in one process: LoRA at step zero, compiled LoRA, freeze patterns, biased
linears, merged and PEFT-format exports, QLoRA's NF4 storage, the planner's count of frozen and NF4
parameters, and bad input. Training at 2 ranks is in tests/dist/test_peft_training.py."""

from __future__ import annotations

import re
import sys

import pytest
import torch

from shardlm.config import load_config
from shardlm.convert.hf_in import load_model_dir
from shardlm.convert.hf_out import save_model_dir
from shardlm.convert.peft_out import gather_full_params, merge_lora, save_peft_dir
from shardlm.errors import ConfigError
from shardlm.metrics import local_bytes
from shardlm.model.freeze import apply_freeze, name_matches, pattern_regex
from shardlm.model.lora import (
    LoRALinear,
    LoRASpec,
    NF4Embedding,
    is_nf4,
    lora_modules,
    nf4_rows,
    quantize_base_meta_,
)
from shardlm.parallel.dist import DistInfo
from shardlm.plan.memory import meta_model, param_groups, plan_memory
from shardlm.train.build import build_model
from tolerance import EPS, assert_close

TINY = ["--model.dim=64", "--model.n_layers=2", "--model.n_heads=4", "--model.n_kv_heads=2",
        "--model.ffn_hidden=128", "--model.vocab_size=512", "--model.max_seq_len=64",
        "--parallel.mode=single", "--train.seq_len=32"]
ONE = DistInfo(0, 0, 1, torch.device("cpu"), "gloo")
SMOL = ["--model.dim=576", "--model.n_layers=30", "--model.n_heads=9", "--model.n_kv_heads=3",
        "--model.ffn_hidden=1536", "--model.vocab_size=49152", "--model.tie_embeddings=true",
        "--model.max_seq_len=2048", "--train.seq_len=256", "--train.global_batch_size=4",
        "--train.micro_batch_size=2"]


def measured(what: str, value: object) -> None:
    """Print a measured number (run with -s to see them: the README quotes them)."""
    print(f"MEASURED {what}: {value}")


# ---- in this process -----------------------------------------------------------------------------------
def tiny_lora(extra: list[str] = ()) -> torch.nn.Module:
    model, _ = build_model(load_config(None, TINY + ["--lora.enabled=true", "--lora.rank=4", *extra]), ONE,
                           None)
    return model


def test_lora_at_step_zero_equals_the_base():
    base, _ = build_model(load_config(None, TINY), ONE, None)
    tokens = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(0))
    for dtype in ("float32", "bfloat16"):
        lora = tiny_lora([f"--lora.base_dtype={dtype}"])
        assert sum(isinstance(m, LoRALinear) for m in lora.modules()) == 14
        got, want = lora(tokens), base(tokens)
        if dtype == "float32":
            assert torch.equal(got, want)
        else:  # the base rounded to bf16, nothing else
            assert_close(got, want, rtol=8 * 2 ** -8, what="bf16 base")  # 8 bf16 roundings of the largest


def test_compiled_lora_matches_eager():
    """``parallel.compile`` (TorchInductor per block) with LoRA adapters on an fp32 base: the logits equal
    eager ones within 64 fp32 roundings of the largest (a different kernel fusion, the same math). Forward
    only, to keep a cold compile short (about 35 s with backward on a loaded machine; the adapters' gradients
    agreed within 1.2e-9 when checked by hand)."""
    models = {}
    for compiled in (False, True):
        model = tiny_lora(["--lora.alpha=8.0", f"--parallel.compile={str(compiled).lower()}"])
        gen = torch.Generator().manual_seed(1)
        with torch.no_grad():  # B non-zero, so the adapters take part
            for _, m in lora_modules(model):
                m.lora_B.weight.copy_(torch.randn(m.lora_B.weight.shape, generator=gen) * 0.05)
        models[compiled] = model
    tokens = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        eager, compiled = models[False](tokens), models[True](tokens)
    assert all(b._compiled_call_impl is not None for b in models[True].model.layers)  # block.compile() took
    measured("compiled vs eager LoRA, max logit diff", (compiled - eager).abs().max().item())
    assert_close(compiled, eager, rtol=64 * EPS, what="compiled vs eager")


def test_freeze_patterns():
    assert name_matches(pattern_regex("model.layers.[0-11].*"), "model.layers.11.mlp.up_proj.weight")
    assert not name_matches(pattern_regex("model.layers.[0-11].*"), "model.layers.12.mlp.up_proj.weight")
    assert name_matches(pattern_regex("embed_tokens"), "model.embed_tokens.weight")
    assert not name_matches(pattern_regex("norm"), "model.layers.0.input_layernorm.weight")
    with pytest.raises(ConfigError,
                       match=re.escape("train.trainable: pattern 'layers.[7-9]' matches no parameter")):
        build_model(load_config(None, TINY + ["--train.trainable=layers.[7-9]"]), ONE, None)


def random_biases_(model: torch.nn.Module, seed: int) -> None:
    """Give every bias (Qwen2's q/k/v projections) a random value: a freshly initialised bias is zero."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)


def test_lora_on_biased_linears_keeps_the_bias_frozen_and_starts_at_the_base():
    """Qwen2's q/k/v projections have a bias: LoRA adapts them too, the bias frozen under its HF name."""
    base, _ = build_model(load_config(None, TINY + ["--model.family=qwen2"]), ONE, None)
    lora = tiny_lora(["--model.family=qwen2"])
    random_biases_(base, 2)
    random_biases_(lora, 2)
    q = lora.model.layers[0].self_attn.q_proj
    assert isinstance(q, LoRALinear) and not q.bias.requires_grad and q.bias.abs().sum() > 0
    assert "model.layers.0.self_attn.q_proj.bias" in dict(lora.named_parameters())
    tokens = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(0))
    assert torch.equal(lora(tokens), base(tokens))  # B = 0: the base model, bias included, bit for bit


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_merged_and_peft_exports_give_the_adapter_models_logits(tmp_path, family):
    peft = pytest.importorskip("peft", reason="pip install -e '.[test]'")
    transformers = pytest.importorskip("transformers", reason="pip install -e '.[test]'")
    model = tiny_lora(["--lora.alpha=8.0", f"--model.family={family}"])
    random_biases_(model, 3)  # Qwen2: biased q/k/v (frozen; exported with the base)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():  # trained-looking adapters: B no longer zero
        for _, m in lora_modules(model):
            m.lora_B.weight.copy_(torch.randn(m.lora_B.weight.shape, generator=gen) * 0.05)
    tokens = torch.randint(0, 512, (2, 16), generator=gen)
    want = model(tokens)
    state = gather_full_params(model, True)
    merged_dir = save_model_dir(merge_lora(state, 8.0 / 4), model.cfg, tmp_path / "merged")
    merged = load_model_dir(merged_dir)
    measured(f"{family} merged export vs adapter model, max logit diff",
             (merged(tokens) - want).abs().max().item())
    assert_close(merged(tokens), want, rtol=64 * EPS, what=f"{family} merged")
    base_state = {k: v for k, v in state.items() if ".lora_" not in k}
    base_dir = save_model_dir(base_state, model.cfg, tmp_path / "base")
    adapter = save_peft_dir(state,
                            LoRASpec(4, 8.0, 0.0, "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"),
                            tmp_path / "adapter", str(base_dir))
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(base_dir), torch_dtype=torch.float32)
    with_adapter = peft.PeftModel.from_pretrained(hf, str(adapter)).eval()
    with torch.no_grad():
        got = with_adapter(tokens).logits
    measured(f"{family} peft export in transformers vs adapter model, max logit diff",
             (got - want).abs().max().item())
    assert_close(got, want, rtol=64 * EPS, what=f"{family} peft in transformers")


def test_bad_lora_input_one_clear_message():
    with pytest.raises(ConfigError,
                       match=r"lora.targets \['qkv'\] match no linear layer; the linear layers are named "
                                          r"down_proj, gate_proj, k_proj, lm_head, o_proj, q_proj, up_proj, "
                                          r"v_proj"):
        tiny_lora(["--lora.targets=q_proj,qkv"])
    with pytest.raises(ConfigError, match="lora.rank must be >= 1, got 0"):
        tiny_lora(["--lora.rank=0"])
    with pytest.raises(ConfigError,
                       match=r"lora.rank=33 must be between 1 and the layer width min\(in, out\) = 32"):
        tiny_lora(["--lora.rank=33"])


def test_qlora_without_torchao_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "torchao", None)
    monkeypatch.setitem(sys.modules, "torchao.quantization.quantize_.workflows.nf4.nf4_tensor", None)
    with pytest.raises(ConfigError, match=r"needs torchao: pip install 'shardlm\[qlora\]'"):
        tiny_lora(["--lora.base_dtype=nf4"])


def test_qlora_stores_the_tied_embedding_in_nf4_and_looks_up_its_rows():
    pytest.importorskip("torchao", reason="pip install -e '.[test]'")
    model = tiny_lora(["--lora.base_dtype=nf4", "--model.tie_embeddings=true"])
    emb = model.model.embed_tokens
    assert isinstance(emb, NF4Embedding) and is_nf4(emb.weight) and model.lm_head.weight is emb.weight
    frozen = {n: p for n, p in model.named_parameters() if not p.requires_grad}
    assert sorted(n for n, p in frozen.items() if not is_nf4(p)) == sorted(
        n for n in frozen if n.endswith("norm.weight")
    )
    tokens = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(0))
    table = emb.weight.get_original_weight()  # (512, 64) bf16, the whole table dequantised
    assert torch.equal(nf4_rows(emb.weight, tokens), table[tokens])  # only the rows read, bit for bit
    got = emb(tokens)
    assert got.dtype == torch.float32 and torch.equal(got, table[tokens].float())
    # the tied output projection multiplies by the same dequantised table; logits are finite and backward runs
    logits = model(tokens)
    assert logits.shape == (2, 16, 512) and torch.isfinite(logits).all()
    logits.float().square().mean().backward()
    assert emb.weight.grad is None and all(
        p.grad is not None for n, p in model.named_parameters() if p.requires_grad
    )


def test_planner_counts_the_qlora_base_as_stored():
    """The planner's stored bytes of an NF4 base (every frozen matrix, the tied embedding included) equal the
    bytes the built model stores, at one rank, on the meta device (no memory, no compute)."""
    pytest.importorskip("torchao", reason="pip install -e '.[test]'")
    cfg = load_config(None, SMOL + ["--lora.enabled=true", "--lora.base_dtype=nf4", "--parallel.mode=single"])
    model = meta_model(cfg)
    quantize_base_meta_(model, "meta")
    stored = sum(local_bytes(p) for p in model.parameters())
    groups, _, _ = param_groups(cfg, 1)
    # the shared mean scale and code book
    per_tensor_items = 34 * sum(1 for p in model.parameters() if is_nf4(p))
    assert sum(g.stored_shard_bytes for g in groups) == pytest.approx(stored - per_tensor_items, rel=1e-6)
    frozen = [p for p in model.parameters() if not p.requires_grad]
    ratio = sum(local_bytes(p) for p in frozen) / sum(2 * p.numel() for p in frozen)
    measured("smollm2-shaped QLoRA base / bf16 base (planner model)", ratio)
    assert ratio <= 0.3


def test_apply_freeze_refuses_freezing_everything():
    model, _ = build_model(load_config(None, TINY), ONE, None)
    with pytest.raises(ConfigError, match="leave no parameter to train"):
        apply_freeze(model, "", "*")


def test_planner_counts_frozen_parameters_without_gradients_or_adamw_state():
    plans = {name: plan_memory(load_config(None, SMOL + extra), 2) for name, extra in {
        "full": [], "lora": ["--lora.enabled=true"], "bf16": ["--lora.enabled=true",
                                                              "--lora.base_dtype=bfloat16"],
        "nf4": ["--lora.enabled=true", "--lora.base_dtype=nf4"]}.items()}
    adapters = 30 * 8 * (2 * (576 + 576) + 2 * (576 + 192) + 3 * (576 + 1536))  # r = 8 on the 7 projections
    assert adapters == 2_442_240
    # AdamW: exp_avg and exp_avg_sq (fp32) of each rank's half of the adapters, and a step counter per tensor
    assert plans["lora"].breakdown["optimizer"] == 2 * 4 * adapters // 2 + 4 * 30 * 7 * 2
    assert plans["full"].breakdown["optimizer"] > 50 * plans["lora"].breakdown["optimizer"]
    assert (
        plans["nf4"].breakdown["params"]
        < plans["bf16"].breakdown["params"]
        < plans["lora"].breakdown["params"]
    )
    assert plans["nf4"].peak < plans["bf16"].peak < plans["lora"].peak < plans["full"].peak
