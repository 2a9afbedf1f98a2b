"""Reward functions: loaded from ``rl.rewards`` and called as TRL's ``GRPOTrainer`` calls them, the
built-ins, and the checks of what they return.

A reward function is named ``package.module:function`` (imported with importlib) or
``path/to/file.py:function`` (a file, relative to the working directory, loaded as a module): the user's
own code, run in the training processes. It is called on a batch of completions as TRL calls it::

    f(prompts=[...], completions=[...], completion_ids=[[...], ...], **fields) -> [float | None, ...]

one entry per completion: ``prompts`` the prompts as the data gave them (text, or a list of chat messages),
``completions`` the decoded completions (text; for a chat prompt, TRL's conversational form ``[{"role":
"assistant", "content": text}]``), ``completion_ids`` their token ids, and each other field of the prompts
(for example ``answer``) as a keyword of per-completion values. None means "not scored": NaN in the reward
table, left out of the weighted sum (see :mod:`shardlm.rl.advantages`). A function's required parameters
beyond these are the fields it needs: each prompt must have them.

Built-ins (``shardlm.rl.rewards:<name>``):

- ``accuracy``: 1 if the completion's final answer equals the prompt's ``answer`` field, else 0. The final
  answer is the content of the last ``\\boxed{...}`` when there is one, else the last number in the text
  (``-12``, ``3.5``, ``1,000``, ``3/4``); the two are equal when both read as numbers (commas dropped, a
  fraction divided) that are equal within 1e-9 relative, else when their stripped texts are equal.
- ``format``: 1 if the whole completion matches ``rl.format_pattern`` (``re.fullmatch``, ``re.DOTALL``).
- ``overlong``: DAPO's soft over-length penalty (Yu et al. 2025, Eq. 13; TRL's
  ``get_soft_overlong_punishment``): with L = ``rl.max_completion_length``, C = ``rl.overlong_cache`` and
  n the completion's tokens, 0 for n <= L - C, (L - C - n) / C up to n = L, -1 beyond.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import inspect
import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from shardlm.errors import ConfigError

if TYPE_CHECKING:
    from shardlm.config.sections import RLConfig

#: the keywords every reward function receives; its other required parameters are fields of the prompts
STANDARD_ARGS = ("prompts", "completions", "completion_ids")
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:/\d+)?")


def _text(completion: Any) -> str:
    """A completion's text, plain or conversational (``[{"role": "assistant", "content": ...}]``)."""
    if isinstance(completion, list):
        return "".join(str(m.get("content", "")) for m in completion)
    return str(completion)


def _last_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` (braces balanced), or None."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 1, start + len("\\boxed{")
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j]
    return None


def final_answer(text: str) -> str | None:
    """The final answer of a completion: the last ``\\boxed{}``'s content, else the last number, else None."""
    boxed = _last_boxed(text)
    if boxed is not None:
        return boxed.strip()
    numbers = _NUMBER.findall(text)
    return numbers[-1].rstrip(",") if numbers else None


def _as_number(text: str) -> float | None:
    """``text`` read as a number (commas dropped, ``a/b`` divided), or None."""
    text = text.strip().replace(",", "").strip("$ ")
    try:
        if "/" in text:
            num, den = text.split("/", 1)
            return float(num) / float(den)
        return float(text)
    except (ValueError, ZeroDivisionError):
        return None


def answers_equal(given: str | None, expected: Any) -> bool:
    """Numerically equal (1e-9 relative) when both read as numbers, else equal stripped texts."""
    if given is None:
        return False
    a, b = _as_number(given), _as_number(str(expected))
    if a is not None and b is not None:
        return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12)
    return given.strip() == str(expected).strip()


def accuracy(prompts: list, completions: list, answer: list, **kwargs: Any) -> list[float]:
    """1.0 where the completion's :func:`final_answer` equals the prompt's ``answer`` field, else 0.0."""
    return [1.0 if answers_equal(final_answer(_text(c)), a) else 0.0 for c, a in zip(completions, answer)]


def format(prompts: list, completions: list, *, pattern: str, **kwargs: Any) -> list[float]:  # noqa: A001
    """1.0 where the whole completion matches ``pattern`` (``rl.format_pattern``, DOTALL), else 0.0."""
    regex = re.compile(pattern, re.DOTALL)
    return [1.0 if regex.fullmatch(_text(c)) else 0.0 for c in completions]


def overlong(prompts: list, completions: list, completion_ids: list, *, max_completion_length: int,
             cache: int, **kwargs: Any) -> list[float]:
    """DAPO's soft over-length penalty of each completion (module docstring), from its token count."""
    out = []
    for ids in completion_ids:
        n, soft = len(ids), max_completion_length - cache
        out.append(0.0 if n <= soft else (soft - n) / cache if n <= max_completion_length else -1.0)
    return out


def _builtin_settings(rl: RLConfig) -> dict[Callable, dict[str, Any]]:
    """The settings each built-in is bound to."""
    return {format: {"pattern": rl.format_pattern},
            overlong: {"max_completion_length": rl.max_completion_length, "cache": rl.overlong_cache}}


@dataclass(frozen=True)
class RewardFunction:
    """One loaded entry of ``rl.rewards``."""

    spec: str
    """The entry as written (``module:function`` or ``file.py:function``)."""
    name: str
    """The function's name: the ``rewards/<name>/mean`` and ``/std`` metrics."""
    fn: Callable[..., list]
    """The callable (a built-in bound to its settings)."""
    needs: tuple[str, ...]
    """Fields of the prompts it requires (its required parameters beyond :data:`STANDARD_ARGS`)."""


def _import(spec: str, key: str) -> Callable:
    """The function named by ``spec``; ConfigError naming ``key`` when it cannot be found."""
    where, sep, attr = spec.rpartition(":")
    if not sep or not where or not attr:
        raise ConfigError(f"{key} = {spec!r}: expected 'package.module:function' or "
                          "'path/to/file.py:function'")
    try:
        if where.endswith(".py") or "/" in where:
            path = Path(where)
            if not path.is_file():
                raise ConfigError(f"{key} = {spec!r}: no file {path.resolve()}")
            mod_spec = importlib.util.spec_from_file_location(f"shardlm_reward_{path.stem}", path)
            module = importlib.util.module_from_spec(mod_spec)
            mod_spec.loader.exec_module(module)
        else:
            module = importlib.import_module(where)
    except ConfigError:
        raise
    except Exception as e:  # the user's module failed to import: name it and the cause
        raise ConfigError(f"{key} = {spec!r}: cannot load {where!r}: {type(e).__name__}: {e}") from e
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ConfigError(f"{key} = {spec!r}: {where!r} has no function {attr!r}")
    return fn


def load_reward_functions(rl: RLConfig) -> list[RewardFunction]:
    """Load ``rl.rewards`` (built-ins bound to their ``[rl]`` settings).

    Raises:
        ConfigError: an entry that is malformed, names a module or file that cannot be loaded or a function
            it lacks (one message naming ``rl.rewards[i]``), two functions of one name, or a number of
            ``rl.reward_weights`` other than the number of functions.
    """
    if not rl.rewards:
        raise ConfigError("rl.rewards is empty: name at least one reward function")
    if rl.reward_weights and len(rl.reward_weights) != len(rl.rewards):
        raise ConfigError(f"rl.reward_weights has {len(rl.reward_weights)} weights for {len(rl.rewards)} "
                          "rl.rewards")
    bound = _builtin_settings(rl)
    out: list[RewardFunction] = []
    for i, spec in enumerate(rl.rewards):
        fn = _import(spec, f"rl.rewards[{i}]")
        params = inspect.signature(fn).parameters.values()
        needs = tuple(p.name for p in params if p.default is inspect.Parameter.empty
                      and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
                      and p.name not in STANDARD_ARGS and p.name not in bound.get(fn, {}))
        name = getattr(fn, "__name__", spec.rpartition(":")[2])
        if fn in bound:
            fn = functools.partial(fn, **bound[fn])
        if any(r.name == name for r in out):
            raise ConfigError(f"rl.rewards: two functions named {name!r} (their metrics would share a name)")
        out.append(RewardFunction(spec=spec, name=name, fn=fn, needs=needs))
    return out


def reward_weights(rl: RLConfig) -> list[float]:
    """``rl.reward_weights``, or 1.0 per function when empty."""
    return list(rl.reward_weights) if rl.reward_weights else [1.0] * len(rl.rewards)


def _prompt_label(index: int, prompt: Any) -> str:
    """``prompt 12 ('What is 3 + 4?...')``: the index in the prepared data and the first characters."""
    text = prompt if isinstance(prompt, str) else " ".join(str(m.get("content", "")) for m in prompt)
    return f"prompt {index} ({text[:40]!r}{'...' if len(text) > 40 else ''})"


def check_fields(funcs: Sequence[RewardFunction], fields: Sequence[dict],
                 prompt_index: Sequence[int]) -> None:
    """Refuse a prompt without a field a reward function needs.

    Args:
        funcs: the loaded functions. fields: each prompt's fields (its ``prompt`` included).
        prompt_index: each prompt's index in the prepared data (for the message).

    Raises:
        ConfigError: naming the function, the field and the prompt.
    """
    for f in funcs:
        for row, index in zip(fields, prompt_index):
            missing = [k for k in f.needs if row.get(k) is None]
            if missing:
                raise ConfigError(f"reward function {f.spec!r} needs the field {missing[0]!r}, which "
                                  f"{_prompt_label(index, row.get('prompt', ''))} does not have")


def _checked(f: RewardFunction, values: Any, n: int, prompts: list,
             prompt_index: Sequence[int]) -> list[float]:
    """``values`` as floats (None -> NaN); ConfigError on a wrong length, a non-number or a NaN / inf."""
    if not isinstance(values, (list, tuple)) or len(values) != n:
        got = f"{len(values)} values" if isinstance(values, (list, tuple)) else type(values).__name__
        first = _prompt_label(prompt_index[0], prompts[0])
        raise ConfigError(f"reward function {f.spec!r} returned {got} for {n} completions (one float or None "
                          f"each expected), on the batch starting at {first}")
    out = []
    for v, p, index in zip(values, prompts, prompt_index):
        if v is None:
            out.append(math.nan)
            continue
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise ConfigError(f"reward function {f.spec!r} returned {v!r} (not a finite number or None) "
                              f"for a completion of {_prompt_label(index, p)}")
        out.append(float(v))
    return out


def score(funcs: Sequence[RewardFunction], completions: Sequence[str],
          completion_ids: Sequence[Sequence[int]], fields: Sequence[dict],
          prompt_index: Sequence[int]) -> Tensor:
    """Every reward function on a batch of completions: the reward table.

    Call it on the whole global batch (every rank the same, rewards are cheap) or on the rank's own rows and
    all-gather the (N, F) table; either way :func:`~shardlm.rl.advantages.group_advantages` then takes the
    global table.

    Args:
        funcs: :func:`load_reward_functions`' result.
        completions: N decoded completion texts.
        completion_ids: N lists of completion token ids (up to, and with, the end-of-turn id).
        fields: N dicts, each completion's prompt's fields (``prompt`` as the data gave it, and the others),
            as :meth:`~shardlm.rl.prompts.PromptsDataset.fields` returns them, repeated per completion.
        prompt_index: N indices of the prompts in the prepared data (for messages).

    Returns:
        (N, F) float32 on the CPU, NaN where a function returned None.

    Raises:
        ConfigError: a missing field (:func:`check_fields`), or a function that raised (naming the first
            prompt it raises on, found by calling it one completion at a time), returned a wrong number of
            values, a non-number, NaN or an infinity: one message naming the function and the prompt.
    """
    n = len(completions)
    check_fields(funcs, fields, prompt_index)
    prompts = [row.get("prompt", "") for row in fields]
    chat = [isinstance(p, list) for p in prompts]
    shown = [[{"role": "assistant", "content": c}] if is_chat else c for c, is_chat in zip(completions, chat)]
    keys = sorted({k for row in fields for k in row if k != "prompt"} - set(STANDARD_ARGS))
    table = torch.empty(n, len(funcs), dtype=torch.float32)

    def call(f: RewardFunction, rows: range) -> Any:
        extra = {k: [fields[i].get(k) for i in rows] for k in keys}
        return f.fn(prompts=[prompts[i] for i in rows], completions=[shown[i] for i in rows],
                    completion_ids=[list(completion_ids[i]) for i in rows], **extra)

    for k, f in enumerate(funcs):
        try:
            values = call(f, range(n))
        except Exception as e:
            culprit = prompt_index[0], prompts[0]
            for i in range(n):  # find the first completion it fails on
                try:
                    call(f, range(i, i + 1))
                except Exception:
                    culprit = prompt_index[i], prompts[i]
                    break
            raise ConfigError(f"reward function {f.spec!r} raised {type(e).__name__}: {e} on "
                              f"{_prompt_label(*culprit)}") from e
        table[:, k] = torch.tensor(_checked(f, values, n, prompts, prompt_index))
    return table


def rewards_all_equal(rewards: Tensor) -> bool:
    """True when every scored completion of the batch has the same reward (or none is scored): no group has
    a learning signal. The step warns and counts it.

    Args:
        rewards: (N,) float32 combined rewards (:func:`~shardlm.rl.advantages.combine_rewards`), NaN unscored.
    """
    scored = rewards[~torch.isnan(rewards)]
    return scored.numel() == 0 or bool((scored == scored[0]).all())
