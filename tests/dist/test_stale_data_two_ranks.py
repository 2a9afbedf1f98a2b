"""2-rank training on changed data: prepared again or refused, naming the change
(tests/workers/stale_worker.py)."""

from __future__ import annotations

import json

import pytest

from conftest import ROOT, torchrun
from test_stale_data import (
    TEMPLATE,
    docs,
    tokenizer,  # noqa: F401 (fixtures)
    write_jsonl,
)

# ----------------------------------------------------------------------------- 2 ranks


@pytest.mark.dist
def test_two_rank_training_prepares_again_or_refuses_naming_the_change(tmp_path, tokenizer):
    """One torchrun launch at 2 ranks (tests/workers/stale_worker.py): before each run rank 0 changes
    something (a byte of the corpus, a file added, the text field, only tokenizer_config.json, the chat
    template of instruction data), then both ranks build a Trainer and train 2 steps. The default data.dir is
    prepared again (each rank reports the same new content hash); unchanged data keeps its token files; a
    data.dir the config names is refused with the same message on both ranks."""
    corpus = tmp_path / "corpus"
    write_jsonl(corpus / "a.jsonl", docs(400))
    write_jsonl(corpus / "b.jsonl", docs(300, seed=3))
    a = corpus / "a.jsonl"
    base = [f"--data.corpus={corpus}", f"--data.tokenizer={tokenizer}", "--model.vocab_size=300",
            "--model.dim=32", "--model.n_layers=1", "--model.n_heads=2", "--model.n_kv_heads=1",
            "--model.ffn_hidden=64", "--model.max_seq_len=32", "--train.seq_len=16",
            "--train.global_batch_size=4", "--train.micro_batch_size=2", "--train.steps=2",
            "--train.eval_interval=0", "--data.workers=1", "--run.name=stale", "--run.overwrite=true",
            "--train.warmup_steps=0"]
    flipped = bytearray(a.read_bytes())
    flipped[flipped.index(b'": "') + 4] = ord("Z")  # a letter of the first text
    config = tokenizer.parent / "tokenizer_config.json"
    edited_config = json.dumps({**json.loads(config.read_text()), "model_max_length": 99})
    examples = ROOT / "examples" / "instruct-shakespeare.jsonl"
    instruct = [*base, f"--data.corpus={examples}", '--data.format="instruct"', "--data.val_fraction=0.2",
                "--model.max_seq_len=128", "--train.seq_len=96", "--run.name=chat"]
    steps = [
        {"name": "first", "overrides": base},
        {"name": "unchanged", "overrides": base},
        {"name": "byte", "overrides": base, "write": [str(a), flipped.hex()]},
        {
            "name": "added",
            "overrides": base,
            "write": [str(corpus / "c.jsonl"), (json.dumps(docs(1, seed=8)[0]) + "\n").encode().hex()],
        },
        {"name": "text_field", "overrides": base + ["--data.text_field=body"]},
        {
            "name": "tokenizer_config",
            "overrides": base + ["--data.text_field=body"],
            "write": [str(config), edited_config.encode().hex()],
        },
        {
            "name": "chosen_dir",
            "overrides": base + ["--data.text_field=body", f"--data.dir={tmp_path / 'data' / 'stale'}"],
            "write": [str(a), (json.dumps(docs(1)[0]) + "\n").encode().hex()],
            "expect_error": True,
        },
        {"name": "instruct", "overrides": instruct},
        {
            "name": "template",
            "overrides": instruct,
            "write": [str(tokenizer.parent / "chat_template.jinja"), TEMPLATE.encode().hex()],
        },
        {"name": "instruct_unchanged", "overrides": instruct},
    ]
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"out": str(tmp_path / "out"), "steps": steps}))
    proc = torchrun(2, [str(ROOT / "tests" / "workers" / "stale_worker.py"), str(spec)], timeout=400,
                    cwd=tmp_path)
    reports = {
        s["name"]: [json.loads((tmp_path / "out" / s["name"] / f"rank{r}.json").read_text()) for r in (0, 1)]
        for s in steps
    }
    for name, (r0, r1) in reports.items():
        assert r0.get("content_sha256") == r1.get("content_sha256") and r0.get("error") == r1.get("error"), (
            name
        )
    sha = {name: r[0].get("content_sha256") for name, r in reports.items()}
    assert reports["unchanged"][0]["mtimes"] == reports["first"][0]["mtimes"]  # not prepared again
    assert sha["unchanged"] == sha["first"]
    changed = ["first", "byte", "added", "text_field", "tokenizer_config"]
    assert len({sha[n] for n in changed[:-1]}) == 4  # each change gives other token files
    assert reports["tokenizer_config"][0]["mtimes"] != reports["text_field"][0]["mtimes"]  # prepared again
    for name in changed:
        assert reports[name][0]["steps"] == 2, name  # and trained on it
    out = proc.stderr
    assert f"stale is out of date: data.corpus ({corpus}): {a} was modified" in out
    assert f"{corpus / 'c.jsonl'} added; preparing it again" in out
    assert 'data.text_field changed "text" -> "body"; preparing it again' in out
    assert f"data.tokenizer: tokenizer_config.json beside {tokenizer} changed; preparing it again" in out
    error = reports["chosen_dir"][0]["error"]
    assert (
        "holds data prepared from other inputs or settings than this config describes: data.corpus "
        f"({corpus}): {a} changed (size" in error
    ), error
    assert reports["chosen_dir"][0]["mtimes"] == reports["tokenizer_config"][0]["mtimes"]  # left as it was
    inst = {name: reports[name][0] for name in ("instruct", "template", "instruct_unchanged")}
    assert inst["template"]["mtimes"] != inst["instruct"]["mtimes"] and inst["template"]["steps"] == 2
    assert inst["instruct_unchanged"]["mtimes"] == inst["template"]["mtimes"]
    assert (
        "chat is out of date: the chat template changed (now from "
        f"{tokenizer.parent / 'chat_template.jinja'})"
        in out
    )
