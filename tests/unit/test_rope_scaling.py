"""RoPE scaling types against transformers 5.24: YaRN (Qwen3 128k, gpt-oss, DeepSeek), dynamic NTK; import
from ``config.json``, export back, refusal by name of a type not built.

Each case is a small random transformers model saved with ``save_pretrained`` whose context is extended past
the original one; shardlm imports it and its fp32 logits on a sequence longer than the original context match
transformers' (eager attention); the exported directory loads in transformers with the same logits.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from shardlm.cli.main import main as shardlm_main
from shardlm.config import Config, validate
from shardlm.convert.hf_config import model_config_from_hf_dict
from shardlm.convert.hf_in import load_model_dir
from shardlm.errors import ConfigError, ModelDirError
from shardlm.model.config import ModelConfig
from tolerance import EPS, assert_close

transformers = pytest.importorskip("transformers", reason="pip install -e '.[test]'")

# the original context, the extended one, the test sequence (> ORIGINAL)
ORIGINAL, EXTENDED, SEQ = 64, 256, 200
SHAPE = dict(vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=EXTENDED, rms_norm_eps=1e-6, head_dim=16)
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
        "original_max_position_embeddings": ORIGINAL}
CASES = {
    "qwen3_yarn4": (transformers.Qwen3Config, YARN),  # Qwen3's 32k -> 128k recipe, scaled down
    # gpt-oss's: truncate false, an explicit attention factor
    "qwen3_yarn_gptoss": (
        transformers.Qwen3Config,
        {
            **YARN,
            "factor": 32.0,
            "truncate": False,
            "attention_factor": 1.2,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
        },
    ),
    # DeepSeek's: mscale and mscale_all_dim give the attention factor, other betas
    "qwen3_yarn_deepseek": (
        transformers.Qwen3Config,
        {**YARN, "factor": 40.0, "mscale": 0.707, "mscale_all_dim": 1.0, "beta_fast": 16, "beta_slow": 2},
    ),
    "llama_dynamic": (
        transformers.LlamaConfig,
        {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0},
    ),
}
IDS = torch.randint(0, 512, (2, SEQ), generator=torch.Generator().manual_seed(3))


def random_dir(path, config):
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.05)
    model.save_pretrained(str(path))
    return path


def hf_logits(path) -> torch.Tensor:
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32,
                                                              attn_implementation="eager").eval()
    with torch.no_grad():
        return model(IDS).logits


@pytest.mark.parametrize("name", list(CASES))
def test_logits_equal_transformers_past_the_original_context_and_export_round_trips(name, tmp_path):
    cls, rope = CASES[name]
    src = random_dir(tmp_path / "src", cls(**SHAPE, rope_parameters=dict(rope)))
    theirs = hf_logits(src)
    ours = load_model_dir(src).eval()
    with torch.no_grad():
        mine = ours(IDS)
    diff = (theirs - mine).abs().max().item()
    print(f"\n{name}: fp32 logits at {SEQ} tokens vs transformers (eager), max abs diff {diff:.2e}")
    assert_close(mine, theirs, rtol=64 * EPS, what=f"{name} vs transformers")
    if rope["rope_type"] == "yarn":
        assert ours.cfg.rope_yarn_factor == rope["factor"] and ours.cfg.rope_original_max_seq_len == ORIGINAL
        # the scaling matters: the same weights under plain RoPE give other logits
        plain = random_dir(tmp_path / "plain", cls(**SHAPE, rope_parameters={"rope_type": "default",
                                                                              "rope_theta": 10000.0}))
        assert (hf_logits(plain) - theirs).abs().max().item() > 1e-2
    out = tmp_path / "exported"
    assert shardlm_main(["export", str(src), str(out), "--format", "hf"]) == 0
    scaling = json.loads((out / "config.json").read_text())["rope_scaling"]
    assert scaling["rope_type"] == rope["rope_type"] and scaling["factor"] == rope["factor"]
    assert torch.equal(hf_logits(out), theirs)


def test_deepseek_mscale_becomes_the_attention_factor():
    cfg = model_config_from_hf_dict({"model_type": "qwen3", **SHAPE,
                                     "rope_scaling": CASES["qwen3_yarn_deepseek"][1]})
    s = 40.0
    assert cfg.rope_yarn_attention_factor == pytest.approx(
        (0.1 * 0.707 * math.log(s) + 1) / (0.1 * math.log(s) + 1)
    )
    assert (cfg.rope_yarn_beta_fast, cfg.rope_yarn_beta_slow, cfg.rope_yarn_truncate) == (16.0, 2.0, True)
    # no factor: the ratio of the contexts, as transformers computes it
    no_factor = {k: v for k, v in YARN.items() if k != "factor"}
    cfg = model_config_from_hf_dict({"model_type": "qwen3", **SHAPE, "rope_scaling": no_factor})
    assert cfg.rope_yarn_factor == EXTENDED / ORIGINAL


@pytest.mark.parametrize("rope_type", ["longrope", "proportional"])
def test_a_rope_type_not_built_is_refused_by_name(rope_type):
    with pytest.raises(ModelDirError,
                       match=rf"rope_type '{rope_type}' is not supported \(built: default, linear, "
                                            r"llama3, yarn, dynamic\)"):
        model_config_from_hf_dict({"model_type": "qwen3", **SHAPE,
                                   "rope_scaling": {"rope_type": rope_type, "factor": 2.0}})


@pytest.mark.parametrize("scaling, message", [
    ({"rope_type": "llama3", "factor": None, "low_freq_factor": 1.0, "high_freq_factor": 4.0},
     r"rope_scaling \(llama3\) field 'factor' must be a positive number, got None"),
    ({"rope_type": "llama3", "factor": "eight", "low_freq_factor": 1.0, "high_freq_factor": 4.0},
     r"rope_scaling \(llama3\) field 'factor' must be a positive number, got 'eight'"),
    ({"rope_type": "llama3", "low_freq_factor": 1.0, "high_freq_factor": 4.0},
     r"rope_scaling \(llama3\) lacks field 'factor'"),
    ({"rope_type": "linear", "factor": 0},
     r"rope_scaling \(linear\) field 'factor' must be a positive number, got 0"),
    ({"rope_type": "yarn", "factor": 0},
     r"rope_scaling \(yarn\) field 'factor' must be a positive number, got 0"),
    ({"rope_type": "dynamic", "factor": True},
     r"rope_scaling \(dynamic\) field 'factor' must be a positive number"),
    ("yarn", r"rope_scaling must be an object \(a dict with rope_type\), got 'yarn'"),
])
def test_a_rope_scaling_factor_that_is_not_a_positive_number_is_refused_by_name(scaling, message):
    # before: null or a string raised TypeError / ValueError (a traceback), and a factor of 0 imported
    # the model with no scaling at all (0 is shardlm's "off"), without a word
    with pytest.raises(ModelDirError, match=message):
        model_config_from_hf_dict({"model_type": "llama", **SHAPE, "rope_scaling": scaling})


def test_two_scalings_or_a_bad_yarn_setting_are_one_clear_error():
    def check(**fields):
        cfg = Config()
        cfg.model = ModelConfig(**fields)
        validate(cfg)

    with pytest.raises(ConfigError, match="one RoPE scaling at a time: model.rope_linear_factor and "
                                          "model.rope_yarn_factor are all set"):
        check(rope_linear_factor=2.0, rope_yarn_factor=4.0)
    with pytest.raises(ConfigError, match=r"model.rope_yarn_factor must be >= 1 \(0 = no scaling\), got 0.5"):
        check(rope_yarn_factor=0.5)
    with pytest.raises(ConfigError, match="YaRN needs model.rope_yarn_beta_fast >= rope_yarn_beta_slow"):
        check(rope_yarn_factor=4.0, rope_yarn_beta_fast=1.0, rope_yarn_beta_slow=32.0)
