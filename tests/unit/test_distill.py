"""Distillation's configuration (``[distill]``), each bad input refused with one message naming its cause;
the teacher (frozen, eval mode, its tokenizer checked) and one micro-batch's loss from both models against the
whole-logits form."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from shardlm.config import load_config
from shardlm.data.instruct import IGNORE_INDEX
from shardlm.errors import ConfigError
from shardlm.parallel.dist import DistInfo
from shardlm.train.build import build_model
from shardlm.train.distill_loss import DistillSpec, distill_logits_sum
from shardlm.train.teacher import build_teacher, distill_model_loss_sum, distill_spec
from tolerance import EPS, assert_close, assert_norm_close

VOCAB = 256
ONE = DistInfo(0, 0, 1, torch.device("cpu"), "gloo")


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


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> dict[str, Path]:
    """A random transformers Llama teacher (2 layers, width 64) and student (1 layer, width 32) of one
    512-id tokenizer, a teacher of another tokenizer, and a larger teacher (4 layers, width 128: its bytes
    well above the measurement's noise), saved with save_pretrained."""
    transformers = pytest.importorskip("transformers", reason="pip install -e '.[test]'")
    from test_preference import write_tokenizer_dir

    root = tmp_path_factory.mktemp("distill")
    tok = write_tokenizer_dir(root)
    out = {}
    for name, width, layers in (("teacher", 64, 2), ("student", 32, 1), ("other", 64, 2), ("large", 128, 4)):
        torch.manual_seed(len(out))
        cfg = transformers.LlamaConfig(vocab_size=512, hidden_size=width, intermediate_size=2 * width,
                                       num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                                       max_position_embeddings=128, rms_norm_eps=1e-6,
                                       tie_word_embeddings=False)
        transformers.LlamaForCausalLM(cfg).float().save_pretrained(str(root / name))
        for f in ("tokenizer.json", "tokenizer_config.json"):
            (root / name / f).write_bytes((tok / f).read_bytes())
        out[name] = root / name
    # "other": the same vocabulary size, two ids swapped
    vocab = json.loads((out["other"] / "tokenizer.json").read_text())
    ids = vocab["model"]["vocab"]
    a, b = sorted(ids)[100], sorted(ids)[101]
    ids[a], ids[b] = ids[b], ids[a]
    (out["other"] / "tokenizer.json").write_text(json.dumps(vocab))
    return out


def student_and_teacher(dirs: dict[str, Path], teacher: str = "teacher"):
    cfg = load_config(None, ["--data.format=instruct", f"--model.init_from={dirs['student']}",
                             f"--distill.teacher_from={dirs[teacher]}", "--parallel.mode=single",
                             "--distill.loss=jsd", "--distill.beta=0.3", "--distill.temperature=2.0",
                             "--distill.alpha=0.7", "--train.loss_chunk_tokens=5", "--train.seq_len=16"])
    student, _ = build_model(cfg, ONE, None)
    return cfg, student, build_teacher(cfg, ONE, None)


def test_the_teacher_is_frozen_in_eval_mode_and_the_loss_equals_the_whole_logits_one(model_dirs):
    cfg, student, teacher = student_and_teacher(model_dirs)
    assert not teacher.training and not any(p.requires_grad for p in teacher.parameters())
    assert teacher.cfg.dim == 64 and student.cfg.dim == 32
    g = torch.Generator().manual_seed(0)
    inputs = torch.randint(0, 512, (2, 12), generator=g)
    targets = torch.randint(0, 512, (2, 12), generator=g)
    targets[:, :4] = IGNORE_INDEX  # the prompt
    spec = distill_spec(cfg)
    assert spec == DistillSpec(0.3, 2.0, 0.7, 0)
    loss, stats = distill_model_loss_sum(student, teacher, inputs, targets, spec, cfg.train.loss_chunk_tokens)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in student.named_parameters()}
    student.zero_grad()
    with torch.no_grad():
        teacher_logits = teacher(inputs)
    expected, expected_stats = distill_logits_sum(student(inputs), teacher_logits, targets, spec)
    expected.backward()
    assert_close(loss, expected, rtol=8 * EPS, what="loss")
    assert_close(stats, expected_stats, rtol=8 * EPS, what="stats")
    assert_norm_close(grads, {n: p.grad for n, p in student.named_parameters()}, rtol=16 * EPS,
                      what="student gradients")
    assert not any(p.grad is not None for p in teacher.parameters())


def test_a_teacher_with_another_tokenizer_is_refused(model_dirs):
    with pytest.raises(ConfigError, match="distill.teacher_from .*other: its tokenizer differs from the "
                                          "student's"):
        student_and_teacher(model_dirs, "other")
