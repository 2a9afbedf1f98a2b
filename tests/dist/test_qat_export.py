"""Quantisation-aware training (``train.qat``) under FSDP at 2 ranks, and its quantised export: transformers
loads ``final-quantized`` (torchao tensors in safetensors, ``quantization_config`` in config.json) and it
computes what the fake-quantised model trained with, i.e. the trained weights under the scheme's fake
quantisation. The plain ``final`` export keeps the usual names and loads in shardlm as any run's."""

from __future__ import annotations

import json

import pytest
import torch
import transformers

from conftest import run_scenarios, scenario
from shardlm.convert.hf_in import load_model_dir
from shardlm.model.qat import apply_qat

SCHEME = "int8_dynamic_activation_int4_weight"



@pytest.fixture(scope="module")
def run(small_data, tmp_path_factory):
    runs = tmp_path_factory.mktemp("qat")
    out = run_scenarios(2, [scenario("qat", small_data, runs, {
        "train.qat": f'"{SCHEME}"', "train.steps": 4, "train.eval_interval": 4, "train.micro_batch_size": 4,
        "checkpoint.enabled": "false"})], runs)
    return out["qat"], runs / "qat"


@pytest.mark.dist
def test_the_quantised_export_loads_in_transformers_and_computes_what_training_computed(run):
    reports, run_dir = run
    hist = reports[0]["history"]
    assert len(hist) == 4 and hist[-1]["loss"] < hist[0]["loss"]  # FSDP trained through the fake quantisers
    quantized = run_dir / "final-quantized"
    record = json.loads((quantized / "qat.json").read_text())
    assert record == {"scheme": SCHEME, "group_size": 32, "torchao_config": "Int8DynamicActivationIntxWeightConfig",
                      "not_quantized": ["lm_head"], "source": str(run_dir / "final")}
    config = json.loads((quantized / "config.json").read_text())["quantization_config"]
    assert config["quant_method"] == "torchao" and config["modules_to_not_convert"] == ["lm_head"]
    assert config["quant_type"]["default"]["_type"] == "Int8DynamicActivationIntxWeightConfig"
    assert (quantized / "tokenizer.json").is_file()
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(quantized)).eval()
    weight = hf.model.layers[0].self_attn.q_proj.weight
    assert type(weight).__name__ == "IntxUnpackedToInt8Tensor" and weight.qdata.dtype == torch.int8
    trained = load_model_dir(run_dir / "final")  # the plain export: fp32 weights under the usual names
    apply_qat(trained, SCHEME)
    tokens = torch.randint(0, 512, (2, 32), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        a, b = hf(tokens).logits, trained(tokens)
        plain = load_model_dir(run_dir / "final")(tokens)
    scale = b.abs().max().item()
    print(f"quantised export vs fake-quantised: {(a - b).abs().max().item():.2e} of {scale:.2f}; vs the "
          f"unquantised weights {(a - plain).abs().max().item():.2e}")
    assert (a - b).abs().max().item() <= 1e-5 * scale
    assert (a - plain).abs().max().item() > 1e-3 * scale  # int4 rounding is visible: the check is not vacuous
