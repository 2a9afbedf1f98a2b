"""HF model directories are read through ``model.safetensors.index.json`` when they have one (issue 26,
item 4).

A small random Llama saved by transformers as a sharded checkpoint (several
``model-0000N-of-0000M.safetensors`` and their index): a missing shard is named; a stray ``model.safetensors``
(other values) and a mistralai-style ``consolidated.safetensors`` beside the shards are ignored with a note,
and the logits equal transformers' on the clean directory; without an index, two files holding one tensor are
refused by every reader (``import``, ``export``, ``generate``, ``eval``, and ``init_from``'s sharded loader).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import cli_error
from shardlm.cli.main import main as shardlm_main
from shardlm.cli.train import main as train_main
from shardlm.convert.hf_config import read_model_dir_config
from shardlm.convert.hf_in import INDEX_NAME, load_model_dir, load_pretrained_
from shardlm.errors import ModelDirError
from shardlm.model.decoder import CausalLM
from tolerance import EPS, assert_close

transformers = pytest.importorskip("transformers", reason="pip install -e '.[test]'")

VOCAB = 512  # conftest.small_data's tokenizer
IDS = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(3))


@pytest.fixture(scope="module")
def sharded(tmp_path_factory, small_data) -> tuple[Path, torch.Tensor]:
    """(a sharded Llama directory with small_data's tokenizer, transformers' logits of IDS on it)."""
    path = tmp_path_factory.mktemp("index") / "sharded"
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=64, tie_word_embeddings=False,
                                      bos_token_id=None, eos_token_id=None)
    model = transformers.LlamaForCausalLM(config).eval()
    model.save_pretrained(str(path), max_shard_size="60KB")
    assert (path / INDEX_NAME).is_file() and len(list(path.glob("model-*.safetensors"))) > 2
    shutil.copy(small_data / "tokenizer.json", path / "tokenizer.json")
    hf = transformers.LlamaForCausalLM.from_pretrained(str(path), dtype=torch.float32,
                                                       attn_implementation="eager")
    with torch.no_grad():
        return path, hf.eval()(IDS).logits


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _logits(path: Path) -> torch.Tensor:
    with torch.no_grad():
        return load_model_dir(path).eval()(IDS).float()


def test_missing_shard_is_named(sharded, tmp_path, capsys):
    src, _ = sharded
    d = _copy(src, tmp_path / "d")
    shard = sorted(d.glob("model-*.safetensors"))[1]
    # the index names a deleted shard while its tensors sit in a stray model.safetensors: still refused
    state = {k: v for f in src.glob("model-*.safetensors") for k, v in load_file(str(f)).items()}
    shard.unlink()
    save_file(state, str(d / "model.safetensors"))
    for argv in (["import", str(d), str(tmp_path / "o")], ["export", str(d), str(tmp_path / "o")],
                 ["generate", "--model", str(d), "--prompt", "To be", "--max-new-tokens", "2"]):
        err = cli_error(capsys, argv)
        assert shard.name in err and "do not exist" in err and INDEX_NAME in err, err
    assert not (tmp_path / "o").exists()


def test_stray_and_consolidated_files_beside_the_index_are_ignored(sharded, tmp_path, capsys):
    src, theirs = sharded
    d = _copy(src, tmp_path / "d")
    state = {k: v for f in src.glob("model-*.safetensors") for k, v in load_file(str(f)).items()}
    save_file({k: v + 1.0 for k, v in state.items()}, str(d / "model.safetensors"))  # stale, other values
    # mistralai's original layout beside the HF shards (names the HF config does not describe)
    save_file({"layers.0.attention.wk.weight": state["model.layers.0.self_attn.k_proj.weight"],
               "tok_embeddings.weight": state["model.embed_tokens.weight"]},
              str(d / "consolidated.safetensors"))
    capsys.readouterr()
    ours = _logits(d)
    note = capsys.readouterr().err
    assert "note:" in note and "consolidated.safetensors, model.safetensors" in note and INDEX_NAME in note, (
        note
    )
    assert_close(ours, theirs, rtol=64 * EPS, what="sharded index vs transformers")
    # the import reads the index too; its output loads in transformers with the same logits
    assert shardlm_main(["import", str(d), str(tmp_path / "imported")]) == 0
    out = tmp_path / "imported"
    hf = transformers.LlamaForCausalLM.from_pretrained(str(out), dtype=torch.float32,
                                                       attn_implementation="eager")
    with torch.no_grad():
        assert_close(hf.eval()(IDS).logits, theirs, rtol=0, what="imported, in transformers")
    # the sharded (init_from) loader takes the same files: the layer-0 key projection is the shard's, not
    # the stray's
    with torch.device("meta"):
        model = CausalLM(read_model_dir_config(d))
    model.to_empty(device="cpu")
    load_pretrained_(model, d)
    assert torch.equal(model.get_parameter("model.layers.0.self_attn.k_proj.weight"),
                       state["model.layers.0.self_attn.k_proj.weight"])


def test_an_index_that_disagrees_with_its_files(sharded, tmp_path):
    src, _ = sharded
    d = _copy(src, tmp_path / "d")
    index = json.loads((d / INDEX_NAME).read_text())
    name = "model.layers.1.mlp.up_proj.weight"
    holder = index["weight_map"][name]
    other = next(f for f in sorted(set(index["weight_map"].values())) if f != holder)
    (d / INDEX_NAME).write_text(json.dumps({**index, "weight_map": {**index["weight_map"], name: other}}))
    with pytest.raises(ModelDirError, match=rf"lists tensor {name} in {other}, which does not hold it"):
        load_model_dir(d)
    del index["weight_map"][name]  # a tensor a file holds that the index does not list
    (d / INDEX_NAME).write_text(json.dumps(index))
    with pytest.raises(ModelDirError, match=rf"{holder} holds tensor {name}, but .* does not list it"):
        load_model_dir(d)
    (d / INDEX_NAME).write_text("{not json")
    with pytest.raises(ModelDirError, match="not a safetensors index"):
        load_model_dir(d)


def test_one_tensor_in_two_files_without_an_index_is_refused_by_every_reader(sharded, small_corpus, tmp_path,
                                                                             capsys):
    src, _ = sharded
    d = tmp_path / "d"
    d.mkdir()
    for f in ("config.json", "tokenizer.json"):
        shutil.copy(src / f, d / f)
    state = {k: v for f in src.glob("model-*.safetensors") for k, v in load_file(str(f)).items()}
    name = "model.layers.0.self_attn.q_proj.weight"
    save_file(state, str(d / "model.safetensors"))
    save_file({name: state[name] * 2}, str(d / "extra.safetensors"))
    expected = f"tensor {name} is in both extra.safetensors and model.safetensors"
    for argv in (["import", str(d), str(tmp_path / "o")], ["export", str(d), str(tmp_path / "o")],
                 ["generate", "--model", str(d), "--prompt", "To be", "--max-new-tokens", "2"],
                 ["eval", "--model", str(d), "--data", str(small_corpus), "--context", "16"]):
        assert expected in cli_error(capsys, argv), argv
    assert not (tmp_path / "o").exists()
    with torch.device("meta"):
        model = CausalLM(read_model_dir_config(d))
    model.to_empty(device="cpu")
    with pytest.raises(ModelDirError, match=expected):  # init_from's loader (train/build.py)
        load_pretrained_(model, d)
    capsys.readouterr()  # and a training run from it, in this process
    code = train_main([f"--model.init_from={d}", f"--data.corpus={small_corpus}",
                       f"--data.dir={tmp_path / 'data'}", "--train.seq_len=16", "--train.steps=1",
                       f"--run.dir={tmp_path / 'run'}"])
    err = capsys.readouterr().err
    assert code == 2 and expected in err and "Traceback" not in err, err
