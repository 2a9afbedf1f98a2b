"""Reward functions: loading by module or file path, the built-ins (the over-length penalty equal to TRL
1.16's ``get_soft_overlong_punishment``), the reward table, and one message for each kind of bad reward."""

from __future__ import annotations

import math

import pytest
import torch

from shardlm.config.sections import RLConfig
from shardlm.errors import ConfigError
from shardlm.rl.completions import completion_metrics, loss_mask, truncated
from shardlm.rl.rewards import (
    RewardFunction,
    accuracy,
    final_answer,
    load_reward_functions,
    reward_weights,
    rewards_all_equal,
    score,
)

trl = pytest.importorskip("trl", reason="pip install -e '.[test]' (trl==1.16.0)")
from trl.rewards import get_soft_overlong_punishment  # noqa: E402


def fields(n, **extra):
    """``n`` prompts' fields: text prompts and the given per-prompt values."""
    return [{"prompt": f"What is {i} + {i}?", **{k: v[i] for k, v in extra.items()}} for i in range(n)]


@pytest.mark.parametrize(("text", "want"), [
    ("so 3 + 4 = 7", "7"),
    ("The answer is \\boxed{12}. Check: 5", "12"),
    ("\\boxed{\\frac{1}{2}} then \\boxed{x^{2}}", "x^{2}"),
    ("it is -3.5 or 1,000", "1,000"),
    ("three quarters: 3/4.", "3/4"),
    ("no number", None),
])
def test_final_answer(text, want):
    assert final_answer(text) == want


def test_accuracy_numeric_and_conversational():
    completions = ["It is 85.", "\\boxed{85.0}", "85 or 86", "1,000",
                   [{"role": "assistant", "content": "= 7"}], "x", "\\boxed{abc}"]
    answers = [85, "85", "85", 1000, "7", 3, "abc"]
    assert accuracy([""] * 7, completions, answers) == [1.0, 1.0, 0.0, 1.0, 1.0, 0.0, 1.0]


def test_builtins_loaded_and_bound(tmp_path):
    rl = RLConfig(rewards=("shardlm.rl.rewards:accuracy", "shardlm.rl.rewards:format",
                           "shardlm.rl.rewards:overlong"), reward_weights=(1.0, 0.5, 1.0),
                  format_pattern=r"<answer>.*</answer>", max_completion_length=10, overlong_cache=4)
    funcs = load_reward_functions(rl)
    assert [f.name for f in funcs] == ["accuracy", "format", "overlong"]
    assert [f.needs for f in funcs] == [("answer",), (), ()]
    table = score(funcs, ["<answer>4</answer>", "<answer>5", "nothing 4"], [[1] * 3, [1] * 8, [1] * 11],
                  fields(3, answer=[4, 4, 4]), [0, 1, 2])
    want = torch.tensor([[1.0, 1.0, 0.0], [0.0, 0.0, -0.5], [1.0, 0.0, -1.0]])
    assert torch.equal(table, want)
    assert reward_weights(rl) == [1.0, 0.5, 1.0]
    assert reward_weights(RLConfig(rewards=("a:b", "c:d"))) == [1.0, 1.0]


@pytest.mark.parametrize(("max_len", "cache"), [(100, 20), (16, 16), (8, 1)])
def test_overlong_equals_trl(max_len, cache):
    rl = RLConfig(rewards=("shardlm.rl.rewards:overlong",), max_completion_length=max_len,
                  overlong_cache=cache)
    (f,) = load_reward_functions(rl)
    ids = [[0] * n for n in range(0, max_len + 5)]
    want = get_soft_overlong_punishment(max_len, cache)(completion_ids=ids)
    got = f.fn(prompts=[""] * len(ids), completions=[""] * len(ids), completion_ids=ids)
    assert got == want
    assert min(got) == -1.0 and max(got) == 0.0


def test_user_function_from_file_and_module(tmp_path, monkeypatch):
    code = ("def length_bonus(prompts, completions, completion_ids, difficulty, **kw):\n"
            "    return [None if d is None else d * len(c) for c, d in zip(completion_ids, difficulty)]\n"
            "def not_scored(completions, **kw):\n"
            "    return [None] * len(completions)\n")
    (tmp_path / "my_rewards.py").write_text(code)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    rl = RLConfig(rewards=("my_rewards.py:length_bonus", "my_rewards:not_scored"))
    funcs = load_reward_functions(rl)
    assert funcs[0].needs == ("difficulty",)
    table = score(funcs, ["a", "b"], [[1, 2], [3]], fields(2, difficulty=[2.0, 0.5]), [0, 1])
    assert table[:, 0].tolist() == [4.0, 0.5] and table[:, 1].isnan().all()


def test_extra_fields_passed_per_completion():
    seen = {}

    def spy(prompts, completions, completion_ids, **kw):
        seen.update(kw, prompts=prompts, completions=completions)
        return [0.0] * len(completions)

    chat = [{"role": "user", "content": "hi"}]
    rows = [{"prompt": chat, "answer": 1, "tag": "x"}, {"prompt": "text", "answer": 2}]
    score([RewardFunction("t:spy", "spy", spy, ())], ["c0", "c1"], [[1], [2]], rows, [5, 6])
    assert seen["answer"] == [1, 2] and seen["tag"] == ["x", None]
    assert seen["prompts"] == [chat, "text"]
    assert seen["completions"] == [[{"role": "assistant", "content": "c0"}], "c1"]


@pytest.mark.parametrize(("spec", "match"), [
    ("no_colon", "expected 'package.module:function'"),
    ("shardlm_no_such_module:f", "cannot load 'shardlm_no_such_module': ModuleNotFoundError"),
    ("shardlm.rl.rewards:no_such", "has no function 'no_such'"),
    ("missing/file.py:f", "no file"),
])
def test_unknown_path_one_message(spec, match):
    with pytest.raises(ConfigError, match=match) as err:
        load_reward_functions(RLConfig(rewards=(spec,)))
    assert "rl.rewards[0]" in str(err.value)


def test_weights_and_names_refused():
    with pytest.raises(ConfigError, match="2 weights for 1"):
        load_reward_functions(RLConfig(reward_weights=(1.0, 2.0)))
    with pytest.raises(ConfigError, match="two functions named 'accuracy'"):
        load_reward_functions(RLConfig(rewards=("shardlm.rl.rewards:accuracy",) * 2))


def test_missing_field_one_message():
    funcs = load_reward_functions(RLConfig())
    rows = fields(3, answer=[1, None, 3])
    want = r"needs the field 'answer', which prompt 11 \('What is 1 \+ 1\?'\)"
    with pytest.raises(ConfigError, match=want):
        score(funcs, ["1", "2", "3"], [[1]] * 3, rows, [10, 11, 12])


def _bad(kind):
    def f(prompts, completions, **kw):
        if kind == "raise":
            if any("boom" in c for c in completions):
                raise ValueError("boom")
            return [0.0] * len(completions)
        if kind == "length":
            return [0.0]
        if kind == "nan":
            return [0.0, math.nan, 0.0]
        return [0.0, 0.0, "1"]
    return f


@pytest.mark.parametrize(("kind", "match"), [
    ("raise", r"raised ValueError: boom on prompt 8 \('What is 1 \+ 1\?'\)"),
    ("length", r"returned 1 values for 3 completions .* prompt 7"),
    ("nan", r"returned nan .* prompt 8"),
    ("string", r"returned '1' .* prompt 9 \('What is 2 \+ 2\?'\)"),
])
def test_bad_reward_one_message(kind, match):
    f = RewardFunction("mine:f", "f", _bad(kind), ())
    with pytest.raises(ConfigError, match=match) as err:
        score([f], ["ok", "boom", "ok"], [[1]] * 3, fields(3), [7, 8, 9])
    assert "'mine:f'" in str(err.value)


def test_rewards_all_equal():
    assert rewards_all_equal(torch.tensor([1.0, 1.0, math.nan]))
    assert rewards_all_equal(torch.tensor([math.nan]))
    assert not rewards_all_equal(torch.tensor([1.0, 0.0]))


def test_truncation_mask_and_completion_metrics():
    """TRL 1.16.0 grpo_trainer.py lines 2294-2310 and 2488-2493, on a batch with ended and truncated
    completions (stop ids: end-of-turn 2, pad 0)."""
    ids = [[5, 6, 2], [5, 6, 7, 8], [2], [9, 9, 9, 0], [4, 4, 4, 4]]
    cut = truncated(ids, {2, 0})
    assert cut.tolist() == [False, True, False, False, True]
    lengths = torch.tensor([len(x) for x in ids])
    m = completion_metrics(lengths, cut)
    assert m["completions/mean_length"] == lengths.float().mean().item() and m["completions/max_length"] == 4
    assert m["completions/clipped_ratio"] == torch.tensor(0.4).item()  # fp32, as TRL's mean
    assert m["completions/mean_terminated_length"] == torch.tensor(8 / 3).item()
    assert (m["completions/min_terminated_length"], m["completions/max_terminated_length"]) == (1.0, 4.0)
    assert completion_metrics(lengths[[1, 4]], cut[[1, 4]])["completions/mean_terminated_length"] == 0.0
    mask = (torch.arange(4).unsqueeze(0) < lengths.unsqueeze(1)).long()
    assert torch.equal(loss_mask(mask, cut, False), mask)
    masked = loss_mask(mask, cut, True)
    assert masked.sum(1).tolist() == [3, 0, 1, 4, 0] and masked.dtype == mask.dtype
