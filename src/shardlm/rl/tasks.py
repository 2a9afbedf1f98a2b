"""Verifiable example tasks, generated from a seed (no download): prompts ``.jsonl`` files for
``data.format = "prompts"`` with the ``answer`` field that ``shardlm.rl.rewards:accuracy`` checks.

Write 2000 arithmetic prompts::

    python -m shardlm.rl.tasks arithmetic.jsonl --n 2000 --seed 0

Each line is ``{"prompt": "What is 37 + 48?", "answer": "85"}``; the same seed writes the same file.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import random
from collections.abc import Sequence

#: the operations of :func:`arithmetic_prompts`, by symbol
OPERATIONS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}


def arithmetic_prompts(n: int, seed: int = 0, max_operand: int = 99, ops: str = "+-",
                       system: str = "") -> list[dict[str, str]]:
    """``n`` prompts ``"What is a <op> b?"`` with their ``answer`` (the exact integer, as text).

    Args:
        n: how many. seed: the random seed (``random.Random(seed)``: the same prompts on any machine).
        max_operand: operands are drawn uniformly from 0..max_operand.
        ops: the operations drawn from, uniformly: any of ``+``, ``-``, ``*``.
        system: when not empty, every row gets a ``system`` field with this text (rendered as the chat's
            system message, :mod:`shardlm.data.prompts`); the random draws do not depend on it.

    Raises:
        ValueError: ``n`` < 1, ``max_operand`` < 1, or an unknown operation.
    """
    if n < 1 or max_operand < 1:
        raise ValueError(f"n and max_operand must be >= 1, got {n} and {max_operand}")
    unknown = set(ops) - set(OPERATIONS)
    if not ops or unknown:
        raise ValueError(f"ops must be made of {''.join(OPERATIONS)}, got {ops!r}")
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        a, b, op = rng.randint(0, max_operand), rng.randint(0, max_operand), rng.choice(ops)
        row = {"prompt": f"What is {a} {op} {b}?", "answer": str(OPERATIONS[op](a, b))}
        out.append({**row, "system": system} if system else row)
    return out


def write_jsonl(path: str | pathlib.Path, rows: Sequence[dict]) -> pathlib.Path:
    """Write ``rows`` to ``path``, one JSON object per line; return the path."""
    p = pathlib.Path(path).expanduser()
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return p


def main(argv: Sequence[str] | None = None) -> None:
    """``python -m shardlm.rl.tasks OUT.jsonl [--n N] [--seed S] [--max-operand M] [--ops +-*]
    [--system TEXT]``."""
    parser = argparse.ArgumentParser(prog="python -m shardlm.rl.tasks",
                                     description="Write seeded arithmetic prompts with their answers.")
    parser.add_argument("out", help="the .jsonl file to write")
    parser.add_argument("--n", type=int, default=2000, help="number of prompts")
    parser.add_argument("--seed", type=int, default=0, help="random seed")
    parser.add_argument("--max-operand", type=int, default=99, help="largest operand")
    parser.add_argument("--ops", default="+-", help="operations drawn from (any of + - *)")
    parser.add_argument("--system", default="", help="a system message for every prompt (default: none)")
    args = parser.parse_args(argv)
    rows = arithmetic_prompts(args.n, args.seed, args.max_operand, args.ops, args.system)
    path = write_jsonl(args.out, rows)
    print(f"wrote {args.n} arithmetic prompts to {path}")


if __name__ == "__main__":
    main()
