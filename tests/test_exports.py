"""Exported directories of a LoRA run and of its checkpoints: the model's own special ids everywhere, chat generation
that stops at the end-of-turn token, PEFT adapters that load from any working directory, and the merge base.

The README's LoRA example (``configs/smollm2-135m-lora.toml`` on SmolLM2-135M-Instruct imported from its GGUF) runs
once, shortened to 2 steps, in a working directory laid out as the README's (``configs/``, ``examples/``,
``models/smollm2-135m``); everything else reads what it wrote.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import ROOT, cli_error, torchrun
from shardlm.cli.main import main as shardlm_main
from shardlm.config import load_config
from shardlm.convert.export import rebuild_partial_model
from shardlm.convert.hf_in import load_model_dir
from shardlm.convert.hf_out import save_model_dir
from shardlm.convert.peft_out import MERGE_RECORD, gather_full_params, merge_lora, save_merged_dir
from shardlm.errors import ConfigError
from shardlm.model.lora import LoRASpec, lora_modules
from shardlm.parallel.dist import DistInfo
from shardlm.train.build import build_model

IDS = ("bos_token_id", "eos_token_id", "pad_token_id")
QUESTION = "What is the capital of France?"


def ids_of(path: Path) -> dict:
    data = json.loads(path.read_text())
    return {k: data.get(k) for k in IDS}


@pytest.fixture(scope="module")
def lora_run(smol_dir, tmp_path_factory) -> dict:
    """The README's LoRA command, run as written in a README-shaped directory, with 2 steps and a checkpoint
    after each (the only overrides), no evaluation."""
    work = tmp_path_factory.mktemp("readme")
    (work / "models").mkdir()
    os.symlink(ROOT / "configs", work / "configs")
    os.symlink(ROOT / "examples", work / "examples")
    os.symlink(smol_dir, work / "models" / "smollm2-135m")
    proc = torchrun(2, ["-m", "shardlm.train", "--config", "configs/smollm2-135m-lora.toml", "--train.steps=2",
                        "--train.eval_interval=0", "--checkpoint.interval=1"], timeout=900, cwd=work)
    return {"work": work, "run": work / "runs" / "smollm2-135m-lora", "stdout": proc.stdout}


@pytest.mark.dist
def test_readme_lora_example_writes_the_models_special_ids(lora_run, smol_dir):
    """``final/`` and ``final-adapter/`` carry the imported model's bos/eos/pad ids (SmolLM2: 1 / 2 / 2, not the
    data's), as does every checkpoint manifest; the end-of-run line names both directories."""
    run = lora_run["run"]
    want = ids_of(smol_dir / "config.json")
    assert want == {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2}
    assert ids_of(run / "final" / "config.json") == want
    assert ids_of(run / "final" / "generation_config.json") == want
    assert ids_of(run / "final-adapter" / "generation_config.json") == want
    manifest = json.loads((run / "checkpoints" / "step-1" / "manifest.json").read_text())
    assert manifest["special_ids"] == {"bos": 1, "eos": [2], "pad": 2}
    adapter = json.loads((run / "final-adapter" / "adapter_config.json").read_text())
    assert adapter["base_model_name_or_path"] == str(smol_dir.resolve())  # absolute: loads from anywhere
    record = json.loads((run / "final" / MERGE_RECORD).read_text())
    assert record["merged_into"] == "training_base" and record["base_dtype"] == "float32" and not record["approximate"]
    assert (f"model written to runs/smollm2-135m-lora/final (Hugging Face model directory, LoRA merged into the "
            f"training base) and runs/smollm2-135m-lora/final-adapter (PEFT adapter on {smol_dir.resolve()})"
            ) in lora_run["stdout"]


@pytest.mark.dist
def test_final_generates_and_stops_at_im_end_in_transformers_and_shardlm(lora_run, capsys):
    """Greedy chat generation on ``final/``: transformers' ``generate`` ends with ``<|im_end|>`` (id 2) well before
    the limit; ``shardlm generate --chat`` runs on the directory and prints the same reply, then stops."""
    transformers = pytest.importorskip("transformers", reason="pip install -e '.[test]'")
    final = lora_run["run"] / "final"
    tok = transformers.AutoTokenizer.from_pretrained(str(final))
    model = transformers.AutoModelForCausalLM.from_pretrained(str(final), dtype=torch.float32).eval()
    ids = tok.apply_chat_template([{"role": "user", "content": QUESTION}], add_generation_prompt=True,
                                  return_tensors="pt", return_dict=True)["input_ids"]
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=100, do_sample=False)[0, ids.shape[1]:].tolist()
    assert out[-1] == tok.convert_tokens_to_ids("<|im_end|>") == 2 and len(out) < 100, out
    reply = tok.decode(out[:-1])
    assert reply.strip()
    capsys.readouterr()
    assert shardlm_main(["generate", "--model", str(final), "--chat", "--prompt", QUESTION, "--temperature", "0",
                         "--max-new-tokens", "100"]) == 0
    printed = capsys.readouterr().out
    assert printed.rstrip().endswith(reply.rstrip()), (printed, reply)  # nothing after the reply: it stopped


@pytest.mark.dist
def test_lora_checkpoint_exports_as_peft_and_merged(lora_run, smol_dir, tmp_path, monkeypatch, capsys):
    """``shardlm export --format peft`` of an intermediate LoRA checkpoint gives an adapter that
    ``AutoPeftModelForCausalLM`` loads from another working directory, with the logits of shardlm's merged export
    of the same checkpoint; the last checkpoint's exports equal ``final-adapter/`` and ``final/`` bit for bit."""
    peft = pytest.importorskip("peft", reason="pip install -e '.[test]'")
    run, work = lora_run["run"], lora_run["work"]
    monkeypatch.chdir(work)  # the training's working directory (model.init_from is relative to it)
    out = tmp_path / "out"
    for step, fmt in ((1, "peft"), (1, "hf"), (2, "peft"), (2, "hf")):
        assert shardlm_main(["export", f"runs/smollm2-135m-lora/checkpoints/step-{step}", str(out / f"{fmt}-{step}"),
                             "--format", fmt]) == 0
    assert "PEFT adapter" in capsys.readouterr().out
    a2, final_adapter = load_file(out / "peft-2" / "adapter_model.safetensors"), load_file(
        run / "final-adapter" / "adapter_model.safetensors")
    assert sorted(a2) == sorted(final_adapter) and all(torch.equal(a2[k], final_adapter[k]) for k in a2)
    a1 = load_file(out / "peft-1" / "adapter_model.safetensors")
    assert not all(torch.equal(a1[k], a2[k]) for k in a1)  # step 1's adapters are not step 2's
    m2, final = load_file(out / "hf-2" / "model.safetensors"), load_file(run / "final" / "model.safetensors")
    assert sorted(m2) == sorted(final) and all(torch.equal(m2[k], final[k]) for k in m2)
    assert ids_of(out / "hf-1" / "config.json") == ids_of(run / "final" / "config.json")
    assert ids_of(out / "peft-1" / "generation_config.json") == ids_of(run / "final" / "config.json")
    ours = rebuild_partial_model(run / "checkpoints" / "step-1")[0].eval()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    err = cli_error(capsys, ["export", str(run / "checkpoints" / "step-1"), str(tmp_path / "x"), "--format", "peft"])
    assert "trained on the base model directory 'models/smollm2-135m'" in err and not (tmp_path / "x").exists()
    hf = peft.AutoPeftModelForCausalLM.from_pretrained(str(out / "peft-1"), dtype=torch.float32,
                                                       attn_implementation="eager").eval()
    merged = load_model_dir(out / "hf-1").eval()
    tokens = torch.randint(0, 49152, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got, want, got_merged = hf(tokens).logits, ours(tokens), merged(tokens)
        with hf.disable_adapter():  # the same kernels' difference on the base alone, for scale
            base_diff = (hf(tokens).logits - load_model_dir(smol_dir).eval()(tokens)).abs().max().item()
    diff, diff_merged = (got - want).abs().max().item(), (got_merged - want).abs().max().item()
    print(f"MEASURED step-1 LoRA checkpoint, max logit diff vs shardlm's adapter model: PEFT adapter in peft "
          f"{diff:.3g} (base alone, transformers vs shardlm: {base_diff:.3g}), shardlm's merged export {diff_merged:.3g}")
    assert diff <= 2e-4, diff  # fp32 kernels of two libraries over 30 layers (the base alone is of the same order)
    assert diff_merged <= 1e-3, diff_merged  # W + s·B·A rounded once in fp32, over 30 layers


# ---- in this process -----------------------------------------------------------------------------------
TINY = ["--model.dim=64", "--model.n_layers=2", "--model.n_heads=4", "--model.n_kv_heads=2", "--model.ffn_hidden=128",
        "--model.vocab_size=512", "--model.max_seq_len=64", "--parallel.mode=single", "--train.seq_len=32"]
ONE = DistInfo(0, 0, 1, torch.device("cpu"), "gloo")


def test_qlora_merge_records_its_base_and_can_use_the_original_weights(tmp_path):
    """A QLoRA merge goes into the dequantised NF4 base by default (the trained model exactly) and says so in
    ``lora_merge.json``; ``lora.merge_into = original_base`` merges into ``model.init_from``'s bf16 weights,
    recorded as approximate."""
    pytest.importorskip("torchao", reason="pip install -e '.[qlora]'")
    base, _ = build_model(load_config(None, TINY), ONE, None)
    original = {n: p.detach().to(torch.bfloat16) for n, p in base.named_parameters()}  # a 16-bit original
    src = save_model_dir(original, base.cfg, tmp_path / "base")
    cfg = load_config(None, TINY + [f"--model.init_from={src}", "--lora.enabled=true", "--lora.rank=4",
                                    "--lora.alpha=8.0", "--lora.base_dtype=nf4"])
    model, _ = build_model(cfg, ONE, None)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for _, m in lora_modules(model):
            m.lora_B.weight.copy_(torch.randn(m.lora_B.weight.shape, generator=gen) * 0.05)
    state = gather_full_params(model, True)
    spec = LoRASpec(4, 8.0, 0.0, cfg.lora.targets, "nf4")
    tokens = torch.randint(0, 512, (2, 16), generator=gen)
    with torch.no_grad():
        want = model(tokens)
    exact = save_merged_dir(state, cfg.model, spec, "training_base", str(src), tmp_path / "exact", None, None)
    approx = save_merged_dir(state, cfg.model, spec, "original_base", str(src), tmp_path / "approx", None, None)
    assert json.loads((tmp_path / "exact" / MERGE_RECORD).read_text()) == exact
    assert exact["merged_into"] == "training_base" and not exact["approximate"] and "NF4" in exact["description"]
    assert approx["merged_into"] == "original_base" and approx["approximate"]
    assert approx["init_from"] == str(src.resolve()) and "approximate" in approx["description"]
    with torch.no_grad():
        got_exact, got_approx = load_model_dir(tmp_path / "exact")(tokens), load_model_dir(tmp_path / "approx")(tokens)
    assert (got_exact - want).abs().max().item() <= 1e-5
    merged = load_file(tmp_path / "approx" / "model.safetensors")
    adapters = {k: v for k, v in state.items() if ".lora_" in k}
    expected = merge_lora({**{k: v.float() for k, v in original.items()}, **adapters}, 8.0 / 4)
    q = "model.layers.0.self_attn.q_proj.weight"
    assert torch.equal(merged[q], expected[q]) and torch.equal(merged["model.norm.weight"], expected["model.norm.weight"])
    diff = (got_approx - want).abs().max().item()
    print(f"MEASURED QLoRA merged into the original bf16 weights vs the trained model, max logit diff: {diff:.3g}")
    assert diff > 1e-4  # the NF4 rounding the adapters were trained against is gone: an approximation


def test_merge_into_original_needs_a_pretrained_base_and_may_change_at_resume():
    from shardlm.checkpoint.resume_config import TAKES_EFFECT, config_changes

    with pytest.raises(ConfigError, match=r"lora.merge_into='original_base' needs model.init_from"):
        load_config(None, TINY + ["--lora.enabled=true", "--lora.merge_into=original_base"])
    old = load_config(None, TINY + ["--lora.enabled=true"]).to_dict()
    new = json.loads(json.dumps(old))
    new["lora"]["merge_into"] = "original_base"
    (change,) = config_changes(old, new)
    assert change.key == "lora.merge_into" and change.rule == TAKES_EFFECT


def test_export_format_peft_refuses_a_model_directory(tmp_path, capsys):
    base, _ = build_model(load_config(None, TINY), ONE, None)
    src = save_model_dir(dict(base.named_parameters()), base.cfg, tmp_path / "model")
    err = cli_error(capsys, ["export", str(src), str(tmp_path / "out"), "--format", "peft"])
    assert "export a LoRA checkpoint" in err and "final-adapter/" in err
