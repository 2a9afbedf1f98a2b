"""Qwen3-MoE and Mixtral against transformers 5.24: logits, the load-balancing loss, import of the hub's
per-expert layout (sharded safetensors + index) and export that transformers loads."""

from __future__ import annotations

import json

import pytest
import torch

from shardlm.convert.hf_config import read_model_dir_config
from shardlm.convert.hf_in import load_model_dir
from shardlm.convert.hf_out import save_model_dir
from shardlm.errors import ConfigError, ModelDirError
from shardlm.train.moe_loss import moe_loss_term
from tolerance import EPS, assert_close

transformers = pytest.importorskip("transformers")

TOKENS = torch.randint(0, 128, (2, 40), generator=torch.Generator().manual_seed(0))


def hf_config(family: str):
    common = dict(vocab_size=128, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=128, initializer_range=0.1, rms_norm_eps=1e-6,
                  tie_word_embeddings=False)
    if family == "qwen3_moe":  # layer 1 dense (mlp_only_layers), the others MoE; top-2 renormalised
        return transformers.Qwen3MoeConfig(**common, num_hidden_layers=3, head_dim=16, intermediate_size=96,
                                           moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
                                           norm_topk_prob=True, mlp_only_layers=[1],
                                           router_aux_loss_coef=0.01)
    if family == "gpt_oss":  # sinks, biases, clamped SwiGLU; layer 0 sliding (window 8 < 40), layer 1 full
        return transformers.GptOssConfig(**common, num_hidden_layers=2, head_dim=16, intermediate_size=32,
                                         num_local_experts=4, num_experts_per_tok=2, sliding_window=8,
                                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                                         router_aux_loss_coef=0.02, swiglu_limit=0.5,  # the clamps bite
                                         attn_implementation="eager")
    # Mixtral: a sliding window shorter than the 40-token sequence
    return transformers.MixtralConfig(**common, num_hidden_layers=2, intermediate_size=32,
                                      num_local_experts=4, num_experts_per_tok=2, sliding_window=16,
                                      router_aux_loss_coef=0.02)


@pytest.fixture(scope="module", params=["qwen3_moe", "mixtral", "gpt_oss"])
def hf_dir(request, tmp_path_factory):
    torch.manual_seed(1)
    model = transformers.AutoModelForCausalLM.from_config(hf_config(request.param)).eval()
    with torch.no_grad():  # biases and norm weights start at 0 and 1: perturb them so that they are tested
        for name, p in model.named_parameters():
            if name.endswith(("bias", "norm.weight")):
                p.add_(torch.randn_like(p) * 0.1)
    out = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(out, max_shard_size="100KB")  # several files and an index, per-expert tensors
    return request.param, out, model


def test_logits_and_aux_loss_equal_transformers(hf_dir):
    family, path, hf = hf_dir
    assert (path / "model.safetensors.index.json").is_file()
    weight_map = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    # the hub's per-expert layout on disk (gpt-oss: its stacked tensors)
    assert any((".experts.gate_up_proj" if family == "gpt_oss" else ".experts.3.") in k for k in weight_map)
    ours = load_model_dir(path)
    assert ours.cfg.family == family
    with torch.no_grad():
        want = hf(TOKENS, output_router_logits=True)
        got = ours(TOKENS)
    assert_close(got, want.logits, rtol=64 * EPS, what=f"{family} vs transformers")
    term = moe_loss_term(ours, ours.cfg.router_aux_loss_coef)
    assert_close(term.aux, want.aux_loss, rtol=16 * EPS, what="aux")
    assert_close(term.term, hf.config.router_aux_loss_coef * want.aux_loss, rtol=16 * EPS, what="aux term")
    if family == "qwen3_moe":
        assert (
            type(ours.model.layers[1].mlp).__name__ == "MLP"
            and type(ours.model.layers[0].mlp).__name__ == "MoE"
        )
    elif family == "mixtral":
        assert ours.cfg.sliding_window == 16
    else:
        assert ours.cfg.sliding_window == 8 and [b.local for b in ours.model.layers] == [True, False]


def test_export_loads_in_transformers_with_identical_logits(hf_dir, tmp_path):
    family, path, hf = hf_dir
    ours = load_model_dir(path)
    out = save_model_dir(dict(ours.state_dict()), ours.cfg, tmp_path / "export")
    keys = set()
    for f in out.glob("*.safetensors"):
        from safetensors import safe_open
        with safe_open(str(f), "pt") as st:
            keys |= set(st.keys())
    if family != "gpt_oss":
        assert any(".experts.0." in k for k in keys) and not any("gate_up_proj" in k for k in keys)
    back, info = transformers.AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    with torch.no_grad():
        torch.testing.assert_close(back.eval()(TOKENS).logits, hf(TOKENS).logits, atol=0, rtol=0)
    assert read_model_dir_config(out) == ours.cfg


def test_refused_routing_and_attention_name_the_cause(tmp_path):
    from shardlm.convert.hf_config import model_config_from_hf_dict
    ds = {"model_type": "deepseek_v3", "architectures": ["DeepseekV3ForCausalLM"], "hidden_size": 64,
          "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 96, "vocab_size": 128,
          "topk_method": "noaux_tc", "n_group": 8, "topk_group": 4, "kv_lora_rank": 512}
    with pytest.raises(ModelDirError, match="deepseek_v3.*group-limited routing.*MLA"):
        model_config_from_hf_dict(ds)
    q = hf_config("qwen3_moe").to_dict()
    q["use_sliding_window"] = True
    with pytest.raises(ModelDirError, match="use_sliding_window"):
        model_config_from_hf_dict(q)


def test_moe_config_checks_name_the_key():
    from shardlm.config import load_config
    base = ["--model.family=\"qwen3_moe\"", "--model.n_heads=4", "--model.dim=64"]
    with pytest.raises(ConfigError,
                       match="model.n_experts=0: model.family 'qwen3_moe' is a mixture of experts"):
        load_config(None, base)
    with pytest.raises(ConfigError,
                       match="model.n_experts_per_token=5 must be between 1 and model.n_experts=4"):
        load_config(None, base + ["--model.n_experts=4", "--model.n_experts_per_token=5"])
    with pytest.raises(ConfigError, match="model.n_experts=4: model.family 'llama' is dense"):
        load_config(None, ["--model.n_experts=4"])


#: gpt-oss-20b's and -120b's RoPE on the hub (``rope_scaling`` of their config.json)
RELEASED_YARN = {"rope_type": "yarn", "factor": 32.0, "original_max_position_embeddings": 4096,
                 "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False}


def test_gpt_oss_with_yarn_equals_transformers_past_the_original_context_and_exports(tmp_path):
    # the released recipe over an original context of 32 tokens (not 4096): 40 tokens are past it, the window
    # is 8; at 32 (not at 16) the ramp of truncate=false differs from the rounded one, so that field is
    # tested too
    yarn = {**RELEASED_YARN, "original_max_position_embeddings": 32, "rope_theta": 10000.0}
    hf_cfg = transformers.GptOssConfig.from_dict({**hf_config("gpt_oss").to_dict(), "rope_parameters": yarn,
                                                  "max_position_embeddings": 32 * 32})
    torch.manual_seed(2)
    hf = transformers.AutoModelForCausalLM.from_config(hf_cfg).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith(("bias", "norm.weight")):
                p.add_(torch.randn_like(p) * 0.1)
    hf.save_pretrained(tmp_path / "src")
    ours = load_model_dir(tmp_path / "src")
    c = ours.cfg
    assert (c.rope_yarn_factor, c.rope_original_max_seq_len, c.rope_yarn_beta_fast, c.rope_yarn_beta_slow,
            c.rope_yarn_truncate, c.rope_yarn_attention_factor) == (32.0, 32, 32.0, 1.0, False, 0.0)
    with torch.no_grad():
        want = hf(TOKENS, output_router_logits=True)
        got = ours(TOKENS)
        plain = transformers.GptOssConfig.from_dict({**hf_cfg.to_dict(), "rope_parameters": {
            "rope_type": "default", "rope_theta": 10000.0}})
        unscaled = transformers.AutoModelForCausalLM.from_config(plain).eval()
        unscaled.load_state_dict(hf.state_dict())
        assert (unscaled(TOKENS).logits - want.logits).abs().max() > 1e-2  # YaRN changes these logits
        rounded = transformers.GptOssConfig.from_dict({**hf_cfg.to_dict(),
                                                       "rope_parameters": {**yarn, "truncate": True}})
        rounded = transformers.AutoModelForCausalLM.from_config(rounded).eval()
        rounded.load_state_dict(hf.state_dict())
        assert (rounded(TOKENS).logits - want.logits).abs().max() > 1e-2  # and so does truncate
    print(f"\ngpt-oss YaRN: fp32 logits vs transformers, max abs diff {(got - want.logits).abs().max():.2e}")
    assert_close(got, want.logits, rtol=64 * EPS, what="gpt-oss YaRN vs transformers")
    assert_close(moe_loss_term(ours, c.router_aux_loss_coef).aux, want.aux_loss, rtol=16 * EPS, what="aux")
    out = save_model_dir(dict(ours.state_dict()), c, tmp_path / "export")
    written = json.loads((out / "config.json").read_text())
    assert written["rope_scaling"] == {k: v for k, v in yarn.items() if k != "rope_theta"}
    assert "rope_parameters" not in written and written["rope_theta"] == 10000.0
    back, info = transformers.AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    with torch.no_grad():
        torch.testing.assert_close(back.eval()(TOKENS).logits, want.logits, atol=0, rtol=0)
    assert read_model_dir_config(out) == c
    from shardlm.model.kv_cache import KVCache
    with torch.no_grad():  # decoding with a KV cache reads the same scaled tables by position
        cache = KVCache(c, torch.zeros(2, dtype=torch.long), torch.float32, "cpu", capacity=40)
        steps = [ours(TOKENS[:, :30], cache=cache)] + [
            ours(TOKENS[:, i : i + 1], cache=cache) for i in range(30, 40)
        ]
    assert_close(torch.cat(steps, dim=1), got, rtol=64 * EPS, what="KV-cache decoding")


def test_the_released_gpt_oss_rope_imports_and_mxfp4_weights_are_refused():
    from shardlm.convert.hf_config import model_config_from_hf_dict
    shape = dict(PUBLIC["gpt-oss-20b"][1])
    del shape["rope_parameters"]
    hub = {"model_type": "gpt_oss", "architectures": ["GptOssForCausalLM"], **shape, "rms_norm_eps": 1e-5,
           "rope_theta": 150000, "rope_scaling": RELEASED_YARN}  # the hub's 4.x layout
    cfg = model_config_from_hf_dict(hub)
    assert (cfg.rope_yarn_factor, cfg.rope_original_max_seq_len, cfg.rope_theta, cfg.rope_yarn_truncate) == (
        32.0, 4096, 150000.0, False)
    # no RoPE fields at all: transformers' GptOssConfig default, the same YaRN
    bare = {k: v for k, v in hub.items() if k not in ("rope_theta", "rope_scaling")}
    assert transformers.GptOssConfig(**shape).rope_parameters == {**RELEASED_YARN, "rope_theta": 150000.0}
    assert model_config_from_hf_dict(bare) == cfg
    assert model_config_from_hf_dict(transformers.GptOssConfig(**shape).to_dict()) == cfg
    no_window = {k: v for k, v in bare.items() if k != "sliding_window"}  # transformers' default window: 128
    assert (
        model_config_from_hf_dict(no_window).sliding_window
        == transformers.GptOssConfig().sliding_window
        == 128
    )
    with pytest.raises(ModelDirError, match=r"quantization_config \(quant_method 'mxfp4'\) is not supported: "
                                            r"quantised expert weights \(MXFP4\) are not read; dequantise"):
        model_config_from_hf_dict(
            {
                **hub,
                "quantization_config": {
                    "quant_method": "mxfp4",
                    "modules_to_not_convert": ["model.layers.*.self_attn"],
                },
            }
        )


#: the public config.json shapes (Hugging Face hub) of the MoE models the planner is checked on
PUBLIC = {
    "Qwen3-30B-A3B": ("qwen3_moe", dict(hidden_size=2048, num_hidden_layers=48, num_attention_heads=32,
                                        num_key_value_heads=4, head_dim=128, intermediate_size=6144,
                                        moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8,
                                        vocab_size=151936, norm_topk_prob=True, tie_word_embeddings=False)),
    "Qwen3-235B-A22B": ("qwen3_moe", dict(hidden_size=4096, num_hidden_layers=94, num_attention_heads=64,
                                          num_key_value_heads=4, head_dim=128, intermediate_size=12288,
                                          moe_intermediate_size=1536, num_experts=128, num_experts_per_tok=8,
                                          vocab_size=151936, norm_topk_prob=True, tie_word_embeddings=False)),
    "gpt-oss-20b": ("gpt_oss", dict(hidden_size=2880, num_hidden_layers=24, num_attention_heads=64,
                                    num_key_value_heads=8, head_dim=64, intermediate_size=2880,
                                    num_local_experts=32, num_experts_per_tok=4, vocab_size=201088,
                                    sliding_window=128, tie_word_embeddings=False,
                                    max_position_embeddings=131072,
                                    rope_parameters={**RELEASED_YARN, "rope_theta": 150000.0})),
    "Mixtral-8x7B": ("mixtral", dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
                                     num_key_value_heads=8, intermediate_size=14336, num_local_experts=8,
                                     num_experts_per_tok=2, vocab_size=32000, tie_word_embeddings=False)),
}


@pytest.mark.parametrize("name", list(PUBLIC))
def test_planner_parameter_counts_equal_transformers_meta_models(name):
    from shardlm.config import Config
    from shardlm.convert.hf_config import model_config_from_hf_dict
    from shardlm.model.moe import inactive_expert_params
    from shardlm.plan.memory import meta_model, param_groups
    family, shape = PUBLIC[name]
    hf_cfg = {"qwen3_moe": transformers.Qwen3MoeConfig, "mixtral": transformers.MixtralConfig,
              "gpt_oss": transformers.GptOssConfig}[family](**shape)
    with torch.device("meta"):
        hf = transformers.AutoModelForCausalLM.from_config(hf_cfg)
    want = sum(p.numel() for p in hf.parameters())
    cfg = Config()
    cfg.model = model_config_from_hf_dict(hf_cfg.to_dict())
    _, total, _ = param_groups(cfg, 8)
    active = total - inactive_expert_params(meta_model(cfg))
    print(f"{name}: {total:,} parameters ({want:,} in transformers), {active:,} active")
    assert total == want
    # active: every layer runs k of its E experts, each 3 matrices of dim x expert width
    e, k = (
        hf_cfg.num_experts if family == "qwen3_moe" else hf_cfg.num_local_experts,
        hf_cfg.num_experts_per_tok,
    )
    width = hf_cfg.moe_intermediate_size if family == "qwen3_moe" else hf_cfg.intermediate_size
    per_expert = 3 * hf_cfg.hidden_size * width + (
        2 * width + hf_cfg.hidden_size if family == "gpt_oss" else 0
    )
    assert active == want - hf_cfg.num_hidden_layers * (e - k) * per_expert


def test_kv_cached_decoding_equals_the_full_forward(hf_dir):
    from shardlm.model.kv_cache import KVCache
    family, path, _ = hf_dir
    ours = load_model_dir(path)
    with torch.no_grad():
        full = ours(TOKENS)
        cache = KVCache(ours.cfg, torch.zeros(2, dtype=torch.long), torch.float32, "cpu", capacity=40)
        steps = [ours(TOKENS[:, :30], cache=cache)] + [
            ours(TOKENS[:, i : i + 1], cache=cache) for i in range(30, 40)
        ]
    assert_close(torch.cat(steps, dim=1), full, rtol=64 * EPS, what=f"{family} KV-cache decoding")


def test_lora_on_a_moe_models_attention_exports_to_peft_and_merged(tmp_path):
    peft = pytest.importorskip("peft")
    from shardlm.config import load_config
    from shardlm.convert.peft_out import gather_full_params, merge_lora, save_peft_dir
    from shardlm.model.lora import LoRASpec, lora_modules
    from shardlm.parallel.dist import DistInfo
    from shardlm.train.build import build_model
    targets = "q_proj,k_proj,v_proj,o_proj"
    cfg = load_config(None,
                      ["--model.family=\"qwen3_moe\"", "--model.dim=64", "--model.n_layers=2",
                       "--model.n_heads=4",
                             "--model.n_kv_heads=2", "--model.head_width=16", "--model.ffn_hidden=64",
                             "--model.n_experts=4", "--model.moe_ffn_hidden=32", "--model.vocab_size=128",
                             "--lora.enabled=true", "--lora.rank=4", "--lora.alpha=8.0",
                       f"--lora.targets={targets}",
                             "--parallel.mode=single", "--train.seq_len=32", "--model.max_seq_len=64"])
    model, _ = build_model(cfg, DistInfo(0, 0, 1, torch.device("cpu"), "gloo"), None)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():  # trained-looking adapters
        for _, m in lora_modules(model):
            m.lora_B.weight.copy_(torch.randn(m.lora_B.weight.shape, generator=gen) * 0.05)
    want = model(TOKENS)
    state = gather_full_params(model, True)
    merged = load_model_dir(save_model_dir(merge_lora(state, 8.0 / 4), model.cfg, tmp_path / "merged"))
    assert_close(merged(TOKENS), want, rtol=64 * EPS, what="merged")
    base_dir = save_model_dir({k: v for k, v in state.items() if ".lora_" not in k}, model.cfg,
                              tmp_path / "base")
    adapter = save_peft_dir(state, LoRASpec(4, 8.0, 0.0, targets), tmp_path / "adapter", str(base_dir))
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(base_dir), torch_dtype=torch.float32)
    with torch.no_grad():
        got = peft.PeftModel.from_pretrained(hf, str(adapter)).eval()(TOKENS).logits
    assert_close(got, want, rtol=64 * EPS, what="peft in transformers")
