"""The model families against transformers: Llama (llama3 RoPE scaling), Qwen2 (tied and untied), Qwen3,
Mistral (sliding window shorter than the sequence) and Gemma 3 (local and global layers, linear RoPE scaling
on the global ones).

Each family is a small random transformers model (2 layers, every parameter perturbed so that norms and biases
matter), saved with ``save_pretrained``: shardlm imports it, its fp32 logits match transformers' (eager
attention); the export loads in transformers with no missing or unexpected keys and identical logits. Then bad
input (one clear message each) and the planner's parameter count of each family's real shapes against
transformers on the meta device. FSDP at 2 ranks per family is in tests/dist/test_families_fsdp.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import cli_error
from shardlm.cli.main import main as shardlm_main
from shardlm.convert.hf_config import model_config_from_hf_dict
from shardlm.convert.hf_in import load_model_dir
from shardlm.errors import ModelDirError
from shardlm.model.decoder import CausalLM, num_params
from tolerance import EPS, assert_close

transformers = pytest.importorskip("transformers", reason="pip install -e '.[test]'")

VOCAB = 512  # the prepared test corpus' tokenizer size (conftest.small_data)
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-6)


def hf_configs() -> dict[str, object]:
    """One small transformers config per family case."""
    t = transformers
    return {
        "llama": t.LlamaConfig(**COMMON, rope_parameters={
            "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 16}),
        "qwen2_tied": t.Qwen2Config(**COMMON, tie_word_embeddings=True),
        "qwen2_untied": t.Qwen2Config(**COMMON, tie_word_embeddings=False, rope_parameters={
            "rope_type": "default", "rope_theta": 1e6}),
        "qwen3": t.Qwen3Config(**COMMON, head_dim=24),
        "mistral": t.MistralConfig(**COMMON, sliding_window=8),
        "gemma3": t.Gemma3TextConfig(**COMMON, head_dim=32, sliding_window=8, query_pre_attn_scalar=24,
                                     sliding_window_pattern=2,
                                     rope_scaling={"rope_type": "linear", "factor": 2.0}),
    }


FAMILY_CASES = list(hf_configs())


def random_family_dir(path: Path, name: str) -> Path:
    """Save a random transformers model of case ``name``: every parameter (norms and biases too) perturbed."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(hf_configs()[name], dtype=torch.float32)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.05)
    # Qwen3 as a sharded checkpoint (several model-0000N-of-0000M.safetensors and their index), as large
    # models come
    model.save_pretrained(str(path), **({"max_shard_size": "40KB"} if name == "qwen3" else {}))
    return path


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("families")
    return {name: random_family_dir(root / name, name) for name in FAMILY_CASES}


def hf_model(path: Path):
    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        str(path), dtype=torch.float32, attn_implementation="eager", output_loading_info=True)
    return model.eval(), info


# longer than the windows (8)
IDS = torch.randint(0, VOCAB, (2, 40), generator=torch.Generator().manual_seed(2))


@pytest.mark.parametrize("name", FAMILY_CASES)
def test_logits_equal_transformers_and_export_loads(family_dirs, name, tmp_path):
    src = family_dirs[name]
    hf, _ = hf_model(src)
    ours = load_model_dir(src).eval()
    family = name.split("_")[0]
    assert ours.cfg.family == family
    with torch.no_grad():
        theirs, mine = hf(IDS).logits, ours(IDS)
    diff = (theirs - mine).abs().max().item()
    print(f"\n{name}: fp32 logits vs transformers (eager), max abs diff {diff:.2e} (logit scale "
          f"{theirs.abs().max().item():.2f})")
    assert_close(mine, theirs, rtol=64 * EPS, what=f"{name} vs transformers")
    # export: transformers loads it with no missing or unexpected keys, same logits
    out = tmp_path / "exported"
    assert shardlm_main(["export", str(src), str(out), "--format", "hf"]) == 0
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == hf.config.model_type
    exported, info = hf_model(out)
    assert type(exported) is type(hf)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    with torch.no_grad():
        assert torch.equal(exported(IDS).logits, theirs)


def test_family_traits_are_where_expected(family_dirs):
    """Each family has the parameters that make it that family (and no others)."""
    names = {n: {k for k, _ in load_model_dir(p).named_parameters()} for n, p in family_dirs.items()}
    assert "model.layers.0.self_attn.q_proj.bias" in names["qwen2_untied"]
    assert "model.layers.0.self_attn.o_proj.bias" not in names["qwen2_untied"]
    assert (
        "model.layers.0.self_attn.q_norm.weight" in names["qwen3"]
        and "model.layers.0.self_attn.q_norm.weight" in names["gemma3"]
    )
    assert "model.layers.1.post_feedforward_layernorm.weight" in names["gemma3"]
    assert not any("bias" in k or "q_norm" in k for k in names["llama"] | names["mistral"])
    assert "lm_head.weight" not in names["qwen2_tied"] and "lm_head.weight" in names["qwen2_untied"]
    assert len(list(family_dirs["qwen3"].glob("model-*.safetensors"))) > 1
    assert (family_dirs["qwen3"] / "model.safetensors.index.json").is_file()
    gemma = load_model_dir(family_dirs["gemma3"])
    assert [b.local for b in gemma.model.layers] == [True, False]  # sliding_window_pattern 2: layer 1 global
    assert gemma.cfg.rope_linear_factor == 2.0 and gemma.cfg.rope_local_theta == 10000.0
    assert not torch.equal(gemma.model.rope_cos, gemma.model.rope_local_cos)  # own RoPE base per layer kind


@pytest.mark.parametrize("name", ["mistral", "gemma3"])
def test_greedy_generation_past_the_window_equals_transformers(family_dirs, name):
    """KV-cached decoding past the sliding window (8): the cache's mask limits local layers to the window."""
    from shardlm.model.generate import SamplingConfig, decode_steps

    hf, _ = hf_model(family_dirs[name])
    ours = load_model_dir(family_dirs[name]).eval()
    prompt = IDS[0, :12].tolist()
    expected = hf.generate(torch.tensor([prompt]), max_new_tokens=20, do_sample=False, top_k=None, top_p=None,
                           eos_token_id=None, pad_token_id=0)[0, 12:].tolist()
    greedy = SamplingConfig(temperature=0.0)
    cached = [int(step[1][0]) for step in decode_steps(ours, [prompt], 20, greedy)]
    uncached = [int(step[1][0]) for step in decode_steps(ours, [prompt], 20, greedy, use_cache=False)]
    assert cached == uncached == expected


def test_compile_and_bf16_kernel_keep_each_family(family_dirs):
    """Compiled blocks give the eager logits (Gemma 3: local and global layers, its norms); the CPU bf16
    kernel takes the bias-free linear layers only, and a Qwen2 model with it runs in bf16."""
    from shardlm.model.cpu_matmul import Fp32MatmulLinear, apply_fp32_matmul
    from shardlm.parallel.ac import apply_compile

    qwen2 = load_model_dir(family_dirs["qwen2_untied"]).eval()
    changed = apply_fp32_matmul(qwen2)
    attn = qwen2.model.layers[0].self_attn
    assert (
        changed == 2 * 4 + 1
        and type(attn.q_proj) is torch.nn.Linear
        and type(attn.o_proj) is Fp32MatmulLinear
    )
    with torch.no_grad():
        fp32 = qwen2(IDS)
        bf16 = qwen2.to(torch.bfloat16)(IDS).float()
    assert_close(bf16, fp32, rtol=8 * 2 ** -8, what="bf16 vs fp32")  # 8 bf16 roundings of the largest
    assert len(list(family_dirs["qwen3"].glob("model-*.safetensors"))) > 1
    assert (family_dirs["qwen3"] / "model.safetensors.index.json").is_file()
    gemma = load_model_dir(family_dirs["gemma3"]).eval()
    with torch.no_grad():
        eager = gemma(IDS)
        apply_compile(gemma.model.layers)
        compiled = gemma(IDS)
    assert_close(compiled, eager, rtol=64 * EPS, what="compiled vs eager")


# ---- bad input: one clear message naming the field or tensor -----------------------------------------------


def test_bad_input(family_dirs, tmp_path, capsys):
    base = json.loads((family_dirs["qwen3"] / "config.json").read_text())

    def write(name: str, config: dict, weights: dict | None = None) -> Path:
        d = tmp_path / name
        d.mkdir()
        (d / "config.json").write_text(json.dumps(config))
        if weights is None:  # the Qwen3 case is sharded: all its files
            weights = {
                k: v for f in family_dirs["qwen3"].glob("*.safetensors") for k, v in load_file(str(f)).items()
            }
        save_file(weights, str(d / "model.safetensors"))
        return d

    moe = write("moe",
                {**base, "model_type": "deepseek_v3", "architectures": ["DeepseekV3ForCausalLM"],
                 "n_group": 8})
    err = cli_error(capsys, ["import", str(moe), str(tmp_path / "o1")])
    assert "model_type='deepseek_v3'" in err and "not built" in err and "group-limited routing" in err
    # a Qwen3-MoE config.json beside a dense Qwen3's weights: the first tensor it lacks is named
    moe = write("moe3",
                {**base, "model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"],
                 "num_experts": 8})
    err = cli_error(capsys, ["import", str(moe), str(tmp_path / "o1")])
    assert err.endswith("tensor model.layers.0.mlp.gate.weight is missing from the weights"), err
    longrope = write("longrope",
                     {**base, "rope_parameters": {"rope_type": "longrope", "factor": 4.0, "rope_theta": 1e6}})
    err = cli_error(capsys, ["import", str(longrope), str(tmp_path / "o2")])
    assert "rope_type 'longrope' is not supported (built: default, linear, llama3, yarn, dynamic)" in err
    softcap = write("softcap", {**json.loads((family_dirs["gemma3"] / "config.json").read_text()),
                                "attn_logit_softcapping": 50.0},
                    load_file(str(family_dirs["gemma3"] / "model.safetensors")))
    assert "attn_logit_softcapping" in cli_error(capsys, ["import", str(softcap), str(tmp_path / "o3")])
    wrong = write("wrong", {**base, "head_dim": 16})  # the tensors were made with head_dim 24
    err = cli_error(capsys, ["import", str(wrong), str(tmp_path / "o4")])
    assert "model.layers.0.self_attn.q_proj.weight has shape (96, 64)" in err and "(64, 64)" in err
    assert not any((tmp_path / f"o{i}").exists() for i in range(1, 5))
    # a QAT run's final-quantized/ (torchao): refused naming the run's unquantised final/ (the config is read
    # as generate and model.init_from read it)
    quantized = write("quantized", {**base, "quantization_config": {"quant_method": "torchao"}})
    err = cli_error(capsys, ["import", str(quantized), str(tmp_path / "o5")])
    assert "weights quantised with torchao (quantization_config)" in err and "run's final/ holds" in err, err
    assert not (tmp_path / "o5").exists()


def test_gguf_quantisation_not_dequantisable(tmp_path, capsys):
    """A GGUF tensor in a type the gguf package cannot dequantise (Q8_1) is refused, naming tensor
    and type."""
    import gguf
    import numpy as np

    path = tmp_path / "q81.gguf"
    writer = gguf.GGUFWriter(str(path), "qwen2")
    for key, value in (("embedding_length", 64), ("block_count", 1), ("attention.head_count", 4),
                       ("feed_forward_length", 96), ("context_length", 64)):
        writer.add_uint32(f"qwen2.{key}", value)
    writer.add_float32("qwen2.attention.layer_norm_rms_epsilon", 1e-6)
    block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType.Q8_1]
    writer.add_tensor("token_embd.weight", np.zeros((VOCAB, 64 // block * size), dtype=np.uint8),
                      raw_dtype=gguf.GGMLQuantizationType.Q8_1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    err = cli_error(capsys, ["import", "--gguf", str(path), str(tmp_path / "out")])
    assert "token_embd.weight" in err and "Q8_1" in err and "cannot be dequantised" in err
    assert not (tmp_path / "out").exists()


# ---- the planner's parameter count of each family's real shapes --------------------------------------------

#: public config.json fields of the real models (the shape fields only)
REAL = {
    "Qwen2.5-7B": ("Qwen2Config", dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                                       num_attention_heads=28, num_key_value_heads=4, vocab_size=152064,
                                       max_position_embeddings=131072, tie_word_embeddings=False)),
    "Qwen3-8B": ("Qwen3Config", dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                                     num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                                     vocab_size=151936, max_position_embeddings=40960,
                                     tie_word_embeddings=False)),
    "Mistral-7B-v0.1": ("MistralConfig", dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                                              num_attention_heads=32, num_key_value_heads=8, vocab_size=32000,
                                              max_position_embeddings=32768, sliding_window=4096,
                                              tie_word_embeddings=False)),
    "Gemma-3-270M": ("Gemma3TextConfig", dict(hidden_size=640, intermediate_size=2048, num_hidden_layers=18,
                                              num_attention_heads=4, num_key_value_heads=1, head_dim=256,
                                              vocab_size=262144, sliding_window=512,
                                              max_position_embeddings=32768)),
    "Gemma-3-1B": ("Gemma3TextConfig", dict(hidden_size=1152, intermediate_size=6912, num_hidden_layers=26,
                                            num_attention_heads=4, num_key_value_heads=1, head_dim=256,
                                            vocab_size=262144, sliding_window=512,
                                            max_position_embeddings=32768)),
    "Gemma-3-4B": ("Gemma3TextConfig", dict(hidden_size=2560, intermediate_size=10240, num_hidden_layers=34,
                                            num_attention_heads=8, num_key_value_heads=4, head_dim=256,
                                            vocab_size=262208, sliding_window=1024,
                                            max_position_embeddings=131072,
                                            rope_scaling={"rope_type": "linear", "factor": 8.0})),
}


@pytest.mark.parametrize("name", list(REAL))
def test_plan_parameter_count_equals_transformers(name, tmp_path, capsys):
    cls, fields = REAL[name]
    hf_config = getattr(transformers, cls)(**fields)
    with torch.device("meta"):
        theirs = sum(p.numel() for p in transformers.AutoModelForCausalLM.from_config(hf_config).parameters())
    cfg = model_config_from_hf_dict(hf_config.to_dict())
    with torch.device("meta"):
        assert num_params(CausalLM(cfg)) == theirs
    # `shardlm plan` from a model directory with that config.json prints the same count
    model_dir = tmp_path / name
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps(hf_config.to_dict()))
    toml = tmp_path / "plan.toml"
    toml.write_text(f'[model]\ninit_from = "{model_dir}"\n[train]\nseq_len = 512\nmicro_batch_size = 1\n')
    capsys.readouterr()
    assert shardlm_main(["plan", str(toml), "--world-size", "8"]) == 0
    printed = capsys.readouterr().out
    print(f"\n{name}: {theirs:,} parameters")
    assert f"{theirs:,}" in printed, printed[:600]


def test_config_refuses_a_window_where_the_family_has_none():
    from shardlm.config import ConfigError, load_config

    with pytest.raises(ConfigError,
                       match="model.sliding_window applies to model.family 'mistral' or 'gemma3'"):
        load_config(None, ["--model.family=qwen2", "--model.sliding_window=16"])
    with pytest.raises(ModelDirError, match="use_sliding_window=true"):
        model_config_from_hf_dict(
            {**transformers.Qwen2Config(**COMMON).to_dict(), "use_sliding_window": True}
        )


@pytest.mark.parametrize("family", ["mistral", "gemma3", "mixtral", "gpt_oss"])
def test_a_model_without_a_window_exports_what_transformers_loads(family, tmp_path):
    """A sliding-window family with ``model.sliding_window = 0`` (every layer global): its export loads in
    transformers with the same logits, and imports back to the same config. Gemma 3 and gpt-oss wrote
    ``sliding_window: null``, which their transformers configs refuse (they need an int; 0 with every layer
    ``full_attention``); Mistral's and Mixtral's null means no window."""
    from shardlm.convert.hf_out import save_model_dir
    from shardlm.model.config import ModelConfig

    moe = family in ("mixtral", "gpt_oss")  # 4 experts of width 32, top 2
    cfg = ModelConfig(family=family, dim=64, n_layers=2, n_heads=4, n_kv_heads=2,
                      ffn_hidden=32 if moe else 96, vocab_size=VOCAB, max_seq_len=64, sliding_window=0,
                      n_experts=4 if moe else 0)
    model = CausalLM(cfg).eval()
    model.init_weights(seed=3)
    out = save_model_dir(model.state_dict(), cfg, tmp_path / family)
    config = json.loads((out / "config.json").read_text())
    assert config.get("sliding_window") is not None or family in ("mistral", "mixtral"), config
    assert model_config_from_hf_dict(config) == cfg
    hf, info = hf_model(out)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    with torch.no_grad():
        theirs, mine = hf(IDS).logits, model(IDS)
    scale = theirs.abs().max().item()
    assert (theirs - mine).abs().max().item() <= 1e-5 * max(scale, 1.0), (family, scale)
