"""Distillation's configuration (``[distill]``): each bad input refused with one message naming its cause."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from shardlm.config import load_config
from shardlm.errors import ConfigError

VOCAB = 256


def write_config_dir(d: Path, vocab: int) -> Path:
    """A model directory's ``config.json`` (a tiny Llama of ``vocab`` tokens): all the config checks read."""
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": vocab, "hidden_size": 32,
        "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 64, "rms_norm_eps": 1e-6, "tie_word_embeddings": False}))
    return d


def distill_config(teacher: Path | str, *more: str):
    return load_config(None, ["--data.format=instruct", f"--model.vocab_size={VOCAB}",
                              f"--distill.teacher_from={teacher}", *more])


def test_a_valid_distill_section_loads(tmp_path):
    teacher = write_config_dir(tmp_path / "teacher", VOCAB)
    cfg = distill_config(teacher, "--distill.loss=jsd", "--distill.beta=0.3", "--distill.top_k=255")
    assert (cfg.distill.loss, cfg.distill.beta, cfg.distill.top_k) == ("jsd", 0.3, 255)


@pytest.mark.parametrize(("overrides", "message"), [
    (["--distill.top_k=256"], r"distill.top_k=256 must be in \[0, 256\)"),
    (["--distill.loss=jsd", "--distill.beta=1.0"], r"distill.beta must be in \(0, 1\) for loss 'jsd'"),
    (["--distill.beta=0.2"], "distill.beta applies to loss 'jsd'"),
    (["--distill.temperature=0"], "distill.temperature must be positive"),
    (["--distill.alpha=1.5"], r"distill.alpha must be in \[0, 1\]"),
    (["--distill.lmbda=0.5"], "needs the RL rollout"),
    (["--data.format=text"], "built for data.format = 'instruct'"),
    (["--parallel.tp=2"], "parallel.tp=2 is not built yet"),
])
def test_bad_distill_settings_are_refused(tmp_path, overrides, message):
    teacher = write_config_dir(tmp_path / "teacher", VOCAB)
    with pytest.raises(ConfigError, match=message):
        distill_config(teacher, *overrides)


def test_a_teacher_path_that_is_not_a_model_is_refused(tmp_path):
    (tmp_path / "empty").mkdir()
    for path in (tmp_path / "empty", tmp_path / "missing"):
        with pytest.raises(ConfigError, match=r"distill.teacher_from: .* is not a model directory"):
            distill_config(path)


def test_a_teacher_of_another_vocabulary_is_refused(tmp_path):
    teacher = write_config_dir(tmp_path / "teacher", VOCAB * 2)
    with pytest.raises(ConfigError, match="has a vocabulary of 512 tokens, the student .* 256"):
        distill_config(teacher)


def test_distill_keys_without_a_teacher_are_refused():
    with pytest.raises(ConfigError, match="distill.alpha applies to distillation"):
        load_config(None, ["--distill.alpha=0.9"])
