"""Write examples/preference-shakespeare.jsonl: preference pairs made from the project's own
instruction examples.

For each example of examples/instruct-shakespeare.jsonl (its prompt or conversation) the chosen completion is
its own reply and the rejected ones are the replies of the next ``--per-prompt`` examples (answers to other
questions): a small set with a clear preference, for configs/smollm2-135m-dpo*.toml. Deterministic;
no download.

    python examples/make_preference_pairs.py            # 48 pairs (4 per prompt)
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

HERE = Path(__file__).resolve().parent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--per-prompt", type=int, default=4, help="rejected replies per prompt (default 4)")
    parser.add_argument("--out", default=str(HERE / "preference-shakespeare.jsonl"))
    args = parser.parse_args()
    rows = [
        json.loads(line)
        for line in (HERE / "instruct-shakespeare.jsonl").read_text().splitlines()
        if line.strip()
    ]
    chats = []
    for row in rows:
        if "messages" in row:
            msgs = row["messages"]
            last = max(i for i, m in enumerate(msgs) if m["role"] == "assistant")
            chats.append((msgs[:last], msgs[last]["content"]))
        else:
            chats.append(([{"role": "user", "content": row["prompt"]}], row["response"]))
    lines = []
    for k in range(1, args.per_prompt + 1):
        # round k: every prompt once, so any prefix of the file mixes prompts
        for i, (prompt, reply) in enumerate(chats):
            other = chats[(i + k) % len(chats)][1]
            lines.append({"prompt": prompt, "chosen": [{"role": "assistant", "content": reply}],
                          "rejected": [{"role": "assistant", "content": other}]})
    Path(args.out).write_text("".join(json.dumps(x) + "\n" for x in lines))
    print(f"{args.out}: {len(lines)} pairs from {len(chats)} prompts")


if __name__ == "__main__":
    main()
