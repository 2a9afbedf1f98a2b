"""Prompts data (``data.format = "prompts"``): rendered as transformers' ``apply_chat_template`` with the
generation prompt, extra fields kept for the reward functions, long prompts counted and left out, bad rows
refused; the seeded arithmetic task; the prepared prompts scored by the accuracy reward; and the completions
each step of a generation cycle trains on, as TRL's sampler and buffer give them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from conftest import write_chatml_tokenizer
from shardlm.config import load_config
from shardlm.data.build import prepare_data
from shardlm.data.prompts import CompletionSampler, PromptsDataset, prepare_prompts
from shardlm.errors import DataError
from shardlm.rl.rewards import load_reward_functions, score
from shardlm.rl.tasks import arithmetic_prompts, main, write_jsonl

transformers = pytest.importorskip("transformers", reason="pip install -e '.[test]'")
VOCAB = 400


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory) -> Path:
    """A small byte-level BPE with ChatML's special tokens and template."""
    return write_chatml_tokenizer(tmp_path_factory.mktemp("tok"))


ROWS = [
    {"prompt": "What is 3 + 4?", "answer": "7", "level": 1},
    {"prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 10 - 4?"}],
     "answer": "6"},
    {"prompt": "What is " + " + ".join(["1"] * 40) + "?", "answer": "40"},  # too long
    {"prompt": "What is 2 * 5?", "system": "Answer with a number.", "answer": "10"},
    {"prompt": "What is 9 + 9?", "answer": "18"},
]


def expected_ids(tok_dir: Path, row: dict) -> list[int]:
    """transformers' rendering of the row's prompt with the generation prompt (a string prompt as one user
    message after the optional system string)."""
    hf = transformers.PreTrainedTokenizerFast.from_pretrained(str(tok_dir))
    messages = row["prompt"] if isinstance(row["prompt"], list) else (
        ([{"role": "system", "content": row["system"]}] if "system" in row else [])
        + [{"role": "user", "content": row["prompt"]}])
    return list(hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)
                ["input_ids"])


def test_prepared_as_transformers_renders_them(tmp_path, tok_dir, capsys):
    src = write_jsonl(tmp_path / "p.jsonl", ROWS)
    meta = prepare_prompts(str(src), str(tmp_path / "out"), str(tok_dir / "tokenizer.json"), VOCAB, 0.25,
                           max_prompt_length=60)
    assert meta["skipped_long"] == 1 and meta["skipped_long_lines"] == [3]
    assert (meta["train_prompts"], meta["val_prompts"]) == (3, 1)
    assert "left out 1 longer than rl.max_prompt_length = 60 tokens (lines 3)" in capsys.readouterr().err
    train, val = PromptsDataset(str(tmp_path / "out"), "train"), PromptsDataset(str(tmp_path / "out"), "val")
    kept = [ROWS[0], ROWS[1], ROWS[3]]
    assert train.get([0, 1, 2]) == [expected_ids(tok_dir, r) for r in kept]
    assert train.get([2, 0]) == [expected_ids(tok_dir, kept[2]), expected_ids(tok_dir, kept[0])]
    assert train.fields([0, 1, 2]) == kept and val.fields([0]) == [ROWS[4]]
    assert train.lines.tolist() == [1, 2, 4] and len(val) == 1
    assert all(len(ids) <= 60 for ids in train.get([0, 1, 2]))
    fields = train.fields([0])
    fields[0]["answer"] = "changed"
    assert train.fields([0])[0]["answer"] == "7"


@pytest.mark.parametrize(("row", "match"), [
    ({"question": "x"}, r"p.jsonl:1: missing field 'prompt'"),
    ({"prompt": ""}, r"p.jsonl:1: field 'prompt' is empty"),
    ({"prompt": [{"role": "user"}]}, r"p.jsonl:1: field 'prompt' must be a string or a non-empty list"),
])
def test_bad_rows_one_message(tmp_path, tok_dir, row, match):
    src = write_jsonl(tmp_path / "p.jsonl", [row, ROWS[0]])
    with pytest.raises(DataError, match=match):
        prepare_prompts(str(src), str(tmp_path / "out"), str(tok_dir / "tokenizer.json"), VOCAB, 0.25, 60)
    assert not (tmp_path / "out").exists()


def test_too_few_prompts_within_length(tmp_path, tok_dir):
    src = write_jsonl(tmp_path / "p.jsonl", ROWS)
    with pytest.raises(DataError, match="0 prompt.s. within rl.max_prompt_length = 20 tokens .5 longer"):
        prepare_prompts(str(src), str(tmp_path / "out"), str(tok_dir / "tokenizer.json"), VOCAB, 0.25, 20)


def test_arithmetic_task_seeded_and_correct(tmp_path):
    rows = arithmetic_prompts(200, seed=3, ops="+-*")
    assert rows == arithmetic_prompts(200, seed=3, ops="+-*") and rows != arithmetic_prompts(200, seed=4)
    for r in rows:
        a, op, b = r["prompt"].removeprefix("What is ").removesuffix("?").split()
        assert int(r["answer"]) == {"+": int(a) + int(b), "-": int(a) - int(b), "*": int(a) * int(b)}[op]
    assert {r["prompt"].split()[3] for r in rows} == {"+", "-", "*"}
    main([str(tmp_path / "a.jsonl"), "--n", "5", "--seed", "3", "--ops", "+-*"])
    lines = (tmp_path / "a.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in lines] == arithmetic_prompts(5, seed=3, ops="+-*")
    with pytest.raises(ValueError, match="ops"):
        arithmetic_prompts(3, ops="/")


def test_arithmetic_task_system_message(tmp_path):
    """``--system`` adds the same ``system`` field to every row and leaves the draws as they were."""
    plain = arithmetic_prompts(20, seed=3)
    with_system = arithmetic_prompts(20, seed=3, system="Answer with the number only.")
    assert [{k: v for k, v in r.items() if k != "system"} for r in with_system] == plain
    assert {r["system"] for r in with_system} == {"Answer with the number only."}
    assert all("system" not in r for r in plain)
    main([str(tmp_path / "s.jsonl"), "--n", "4", "--seed", "3", "--system", "Be brief."])
    rows = [json.loads(line) for line in (tmp_path / "s.jsonl").read_text().splitlines()]
    assert rows == arithmetic_prompts(4, seed=3, system="Be brief.")


def test_prepare_data_dispatches_prompts_and_rewards_read_the_fields(tmp_path, tok_dir):
    """``prepare_data`` of a prompts config (the path ``shardlm prepare`` and training take), then the
    accuracy reward on the prepared fields: the right answer scores 1, another 0."""
    src = write_jsonl(tmp_path / "arith.jsonl", arithmetic_prompts(20, seed=1))
    cfg = load_config(None, ["--data.format=prompts", f"--data.corpus={src}", f"--data.dir={tmp_path / 'd'}",
                             f"--data.tokenizer={tok_dir / 'tokenizer.json'}", f"--model.vocab_size={VOCAB}",
                             "--train.seq_len=64", "--rl.num_generations=2", "--train.global_batch_size=4",
                             "--rl.max_prompt_length=32", "--rl.max_completion_length=16"])
    meta = prepare_data(cfg)
    assert meta["format"] == "prompts" and meta["train_prompts"] + meta["val_prompts"] == 20
    assert meta["identity"]["settings"]["rl.max_prompt_length"] == 32
    data = PromptsDataset(str(tmp_path / "d"), "train")
    fields = data.fields([0, 0, 1, 1])  # two completions per prompt
    completions = [f"It is {fields[0]['answer']}", "It is 1000", "no idea",
                   f"\\boxed{{{fields[2]['answer']}}}"]
    table = score(load_reward_functions(cfg.rl), completions, [[1]] * 4, fields, [0, 0, 1, 1])
    assert table[:, 0].tolist() == [1.0, 0.0, 0.0, 1.0]
    assert prepare_data(cfg) == meta  # prepared once: the second call uses it


@pytest.mark.parametrize("S, mu", [(1, 1), (2, 1), (1, 2), (3, 2)])
def test_steps_of_a_generation_cycle_train_on_trls_slices(S, mu):
    """TRL 1.16 at one process and gradient accumulation 1: its ``RepeatSampler`` (mini_repeat_count G,
    batch_size = generation batch / G, repeat_count S·μ) feeds each step a generation batch, which
    ``_prepare_inputs`` samples at every (S·μ)-th step, splits with ``split_tensor_dict`` into S and serves
    slice ``step % S`` of. Over the same prompt order (the sampler's own; TRL's per-process shuffle of the
    generation batch before the split is left out: CompletionSampler's docstring), every step's completion
    ids are TRL's."""
    trl_utils = pytest.importorskip("trl.trainer.utils", reason="pip install -e '.[test]' (trl==1.16.0)")
    G, P, cycles = 4, 3, 3  # P prompts per global batch of P·G completions
    sampler = CompletionSampler(30, P * G, G, seed=5, steps_per_generation=S, num_iterations=mu)
    order = [p for b in range(cycles * S) for p in sampler.prompts.step_ids(b)]
    positions = list(trl_utils.RepeatSampler(order, mini_repeat_count=G, batch_size=S * P,
                                             repeat_count=S * mu, shuffle=False))
    gen = S * P * G
    assert len(positions) == cycles * S * mu * gen
    buffer = None
    for step in range(cycles * S * mu):
        batch = positions[step * gen:(step + 1) * gen]  # the dataloader's batch of this step
        if step % (S * mu) == 0:  # generate, split, buffer
            ids = torch.tensor([order[k] * G + i % G for i, k in enumerate(batch)])
            buffer = trl_utils.split_tensor_dict({"ids": ids}, S)
        assert sampler.step_ids(step) == buffer[step % S]["ids"].tolist(), step
        c0 = step - step % (S * mu)
        assert sampler.generation_steps(step) == list(range(c0, c0 + S))
    assert sampler.cycle == S * mu
