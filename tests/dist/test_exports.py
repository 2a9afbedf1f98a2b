"""Exported directories of a LoRA run and of its checkpoints: the model's own special ids everywhere, chat
generation that stops at the end-of-turn token, PEFT adapters that load from any working directory.

The README's LoRA example (``configs/smollm2-135m-lora.toml`` on SmolLM2-135M-Instruct imported from its GGUF)
runs once, shortened to 2 steps, in a working directory laid out as the README's (``configs/``, ``examples/``,
``models/smollm2-135m``); everything else reads what it wrote.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import ROOT, cli_error, scratch_dir, torchrun
from shardlm.cli.main import main as shardlm_main
from shardlm.train.export import rebuild_partial_model
from shardlm.convert.hf_in import load_model_dir
from shardlm.convert.peft_out import MERGE_RECORD
from tolerance import EPS, assert_close

IDS = ("bos_token_id", "eos_token_id", "pad_token_id")
QUESTION = "What is the capital of France?"


def ids_of(path: Path) -> dict:
    data = json.loads(path.read_text())
    return {k: data.get(k) for k in IDS}


@pytest.fixture(scope="module")
def lora_run(smol_dir, tmp_path_factory):
    """The README's LoRA command, run as written in a README-shaped directory, with 2 steps and a checkpoint
    after each (the only overrides), no evaluation."""
    with scratch_dir(tmp_path_factory, "readme") as work:  # 0.6 GB: removed when this module ends
        (work / "models").mkdir()
        os.symlink(ROOT / "configs", work / "configs")
        os.symlink(ROOT / "examples", work / "examples")
        os.symlink(smol_dir, work / "models" / "smollm2-135m")
        proc = torchrun(2,
                        ["-m", "shardlm.train", "--config", "configs/smollm2-135m-lora.toml", "--train.steps=2",
                            "--train.eval_interval=0", "--checkpoint.interval=1"], timeout=900, cwd=work)
        yield {"work": work, "run": work / "runs" / "smollm2-135m-lora", "stdout": proc.stdout}


@pytest.mark.dist
def test_readme_lora_example_writes_the_models_special_ids(lora_run, smol_dir):
    """``final/`` and ``final-adapter/`` carry the imported model's bos/eos/pad ids (SmolLM2: 1 / 2 / 2, not
    the data's), as does every checkpoint manifest; the end-of-run line names both directories."""
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
    assert (
        record["merged_into"] == "training_base"
        and record["base_dtype"] == "float32"
        and not record["approximate"]
    )
    assert ("model written to runs/smollm2-135m-lora/final (Hugging Face model directory, LoRA merged into "
            "the training base) and runs/smollm2-135m-lora/final-adapter (PEFT adapter on "
            f"{smol_dir.resolve()})"
            ) in lora_run["stdout"]


@pytest.mark.dist
def test_final_generates_and_stops_at_im_end_in_transformers_and_shardlm(lora_run, capsys):
    """Greedy chat generation on ``final/``: transformers' ``generate`` ends with ``<|im_end|>`` (id 2) well
    before the limit; ``shardlm generate --chat`` runs on the directory and prints the same reply,
    then stops."""
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
    assert shardlm_main(["generate", "--model", str(final), "--chat", "--prompt", QUESTION, "--temperature",
                         "0", "--max-new-tokens", "100"]) == 0
    printed = capsys.readouterr().out
    assert printed.rstrip().endswith(reply.rstrip()), (printed, reply)  # nothing after the reply: it stopped


@pytest.mark.dist
def test_lora_checkpoint_exports_as_peft_and_merged(lora_run, smol_dir, tmp_path, monkeypatch, capsys):
    """``shardlm export --format peft`` of an intermediate LoRA checkpoint gives an adapter that
    ``AutoPeftModelForCausalLM`` loads from another working directory, with the logits of shardlm's merged
    export of the same checkpoint; the last checkpoint's exports equal ``final-adapter/`` and ``final/`` bit
    for bit."""
    peft = pytest.importorskip("peft", reason="pip install -e '.[test]'")
    run, work = lora_run["run"], lora_run["work"]
    monkeypatch.chdir(work)  # the training's working directory (model.init_from is relative to it)
    out = tmp_path / "out"
    for step, fmt in ((1, "peft"), (1, "hf"), (2, "peft"), (2, "hf")):
        assert shardlm_main(["export", f"runs/smollm2-135m-lora/checkpoints/step-{step}",
                             str(out / f"{fmt}-{step}"), "--format", fmt]) == 0
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
    err = cli_error(capsys,
                    ["export", str(run / "checkpoints" / "step-1"), str(tmp_path / "x"), "--format", "peft"])
    assert (
        "trained on the base model directory 'models/smollm2-135m'" in err and not (tmp_path / "x").exists()
    )
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
          f"{diff:.3g} (base alone, transformers vs shardlm: {base_diff:.3g}), shardlm's merged export "
          f"{diff_merged:.3g}")
    # fp32 kernels of two libraries over 30 layers (the base alone is of the same order), relative to the
    # largest logit
    assert_close(got, want, rtol=64 * EPS, what="PEFT adapter in peft")
    assert_close(got_merged, want, rtol=256 * EPS, what="merged")  # W + s·B·A rounded once in fp32, 30 layers
