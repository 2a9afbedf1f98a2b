"""Everyday use: eval (perplexity at 1 and 2 ranks), generation with a KV cache, TensorBoard, report,
bad input.

One torchrun launch trains two tiny runs (2 ranks); every test reuses them.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from conftest import cpu_env, run_scenarios, tiny_overrides, torchrun
from shardlm.cli.main import main as shardlm_main
from shardlm.train.export import export_checkpoint
from shardlm.convert.hf_in import load_model_dir
from shardlm.data import load_tokenizer, read_documents, special_token_ids
from shardlm.eval import context_windows, token_stream
from shardlm.metrics import read_metrics
from shardlm.metrics.report import FIGURES, load_run, make_figures, write_report
from shardlm.model.generate import SamplingConfig, decode_steps, generate
from tolerance import EPS, assert_close


@pytest.fixture(scope="module")
def runs(tmp_path_factory, small_data) -> dict[str, Path]:
    """Two tiny runs at 2 ranks: ``a`` (20 steps, full per-rank lists) and ``b`` (12 steps, another learning
    rate, per-rank summaries only, ``final/`` written by both ranks as shard files)."""
    out = tmp_path_factory.mktemp("everyday")
    common = {"train.micro_batch_size": 4}
    scenarios = [
        {"name": "a", "overrides": tiny_overrides(small_data, out / "run_a", {**common, "run.name": "a",
                                                                           "train.log_per_rank": "true"})},
        {"name": "b", "overrides": tiny_overrides(small_data, out / "run_b", {
            **common, "run.name": "b", "train.steps": 12, "train.lr": 1e-3, "train.eval_interval": 6,
            "run.export_single_file_bytes": 0})},
    ]
    run_scenarios(2, scenarios, out / "reports")
    return {"a": out / "run_a", "b": out / "run_b"}


@pytest.fixture(scope="module")
def eval_file(tmp_path_factory, small_corpus) -> Path:
    """Three documents (JSON lines) of about 3,000 characters each, from the small corpus."""
    text = small_corpus.read_text()
    path = tmp_path_factory.mktemp("evaltext") / "eval.jsonl"
    path.write_text(
        "".join(json.dumps({"text": text[i * 3000 : (i + 1) * 3000 - 7 * i]}) + "\n" for i in range(3))
    )
    return path


# ---- eval -------------------------------------------------------------------------------------
def direct_mean_loss(model_dir: Path, data: Path) -> tuple[float, int]:
    """Mean next-token loss over the model's context windows, one window at a time, in this process."""
    model = load_model_dir(model_dir).eval()
    tok = load_tokenizer(str(model_dir / "tokenizer.json"))
    stream = token_stream(read_documents(str(data)), tok, special_token_ids(tok))
    losses = []
    with torch.no_grad():
        for start, end in context_windows(len(stream), model.cfg.max_seq_len):
            window = torch.tensor([stream[start:end]])
            logits = model(window[:, :-1])
            losses.append(F.cross_entropy(logits[0].double(), window[0, 1:], reduction="none"))
    all_losses = torch.cat(losses)
    return all_losses.mean().item(), all_losses.numel()


@pytest.mark.dist
def test_eval_perplexity_is_exp_mean_loss_at_1_and_2_ranks(runs, eval_file):
    model_dir = runs["a"] / "final"
    mean, count = direct_mean_loss(model_dir, eval_file)
    assert count > 1000
    stride = str(json.loads((model_dir / "config.json").read_text())["max_position_embeddings"])  # no overlap
    one = subprocess.run([sys.executable, "-m", "shardlm", "eval", "--model", str(model_dir), "--data",
                          str(eval_file), "--json", "--batch-size", "3", "--stride", stride],
                         env=cpu_env(), capture_output=True, text=True, timeout=120)
    assert one.returncode == 0, one.stderr
    two = torchrun(2, ["-m", "shardlm.eval", "--model", str(model_dir), "--data", str(eval_file), "--json",
                       "--stride", stride])
    r1 = json.loads(one.stdout.strip().splitlines()[-1])
    r2 = json.loads(two.stdout.strip().splitlines()[-1])  # rank 0 prints one line; rank 1 stays quiet
    print(f"eval: mean loss {r1['mean_loss']:.6f} (1 rank) {r2['mean_loss']:.6f} (2 ranks) {mean:.6f} "
          f"(direct), perplexity {r1['perplexity']:.4f}, {count} tokens")
    assert r1["world_size"] == 1 and r2["world_size"] == 2
    assert r1["tokens"] == r2["tokens"] == count
    for r in (r1, r2):
        assert_close(r["perplexity"], math.exp(mean), rtol=1e-6, what="perplexity")
        assert_close(r["mean_loss"], mean, rtol=1e-6, what="mean loss")
    assert 1 < r1["perplexity"] < 512  # trained for 20 steps: better than uniform over 512 tokens


# ---- generation -------------------------------------------------------------------------------
@pytest.mark.dist
def test_cached_generation_equals_uncached(runs):
    model = load_model_dir(runs["a"] / "final").eval()
    tok = load_tokenizer(str(runs["a"] / "final" / "tokenizer.json"))
    prompts = [tok.encode(t).ids[:6] for t in ("ROMEO: What light", "JULIET: Ay me, the")]
    assert len(prompts[0]) == len(prompts[1]) == 6
    greedy = SamplingConfig(temperature=0.0)
    cached = list(decode_steps(model, prompts, 40, greedy, use_cache=True))
    uncached = list(decode_steps(model, prompts, 40, greedy, use_cache=False))
    assert len(cached) == len(uncached) == 40
    worst = assert_close(torch.stack([a[0] for a in cached]), torch.stack([b[0] for b in uncached]),
                         rtol=64 * EPS, what="cached vs uncached logits")
    print(f"cached vs uncached greedy, 40 steps x 2 prompts: max logit difference {worst:.2e}")
    assert all(torch.equal(a[1], b[1]) for a, b in zip(cached, uncached))
    # a left-padded row of a batch generates what it generates alone
    short = tok.encode("KING").ids
    alone = generate(model, [short], 20, greedy)
    batched = generate(model, [short, prompts[0] + prompts[1]], 20, greedy)
    assert batched[0] == alone[0] and len(alone[0]) == 20


@pytest.mark.dist
def test_sampling_is_reproducible_with_a_seed(runs):
    model = load_model_dir(runs["a"] / "final").eval()
    prompts = [[1, 40, 41], [1, 50]]
    cfg = SamplingConfig(temperature=1.0, top_k=100, top_p=0.95, seed=7)
    first = generate(model, prompts, 30, cfg)
    assert first == generate(model, prompts, 30, cfg)
    assert first != generate(model, prompts, 30, SamplingConfig(1.0, 100, 0.95, seed=8))
    # top_k=1 is greedy whatever the temperature
    assert generate(model, prompts, 10, SamplingConfig(1.5, 1, 1.0, 3)) == generate(model, prompts, 10,
                                                                                   SamplingConfig(0.0))


@pytest.mark.dist
def test_generate_cli_streams_one_prompt_and_batches_several(runs, capsys):
    model_dir = runs["a"] / "final"
    tok = load_tokenizer(str(model_dir / "tokenizer.json"))
    assert shardlm_main(["generate", "--model", str(model_dir), "--prompt", "ROMEO:", "--temperature", "0",
                         "--max-new-tokens", "15"]) == 0
    streamed = capsys.readouterr().out
    prompt = tok.encode("ROMEO:", add_special_tokens=False).ids
    bos = special_token_ids(tok)["bos"]
    expected = generate(load_model_dir(model_dir).eval(), [([bos] if bos is not None else []) + prompt], 15,
                        SamplingConfig(0.0), special_token_ids(tok)["eod"])[0]
    assert streamed == "ROMEO:" + tok.decode(expected) + "\n"
    assert shardlm_main(["generate", "--model", str(model_dir), "--prompt", "ROMEO:", "--prompt", "KING\\n",
                         "--max-new-tokens", "10", "--top-p", "0.9"]) == 0
    out = capsys.readouterr().out
    # "\\n" in a prompt is a line break
    assert out.startswith("ROMEO:") and "\n" + "-" * 40 + "\nKING\n" in out


@pytest.mark.dist
def test_exported_from_scratch_model_has_the_tokenizer_files(runs, tmp_path):
    """A model trained from scratch, exported from its checkpoint: transformers' AutoTokenizer gets the
    special tokens its training data was built with (BOS first, the end-of-document token after each
    document), and transformers' greedy generation stops where shardlm's does."""
    transformers = pytest.importorskip("transformers")
    out = tmp_path / "exported"
    assert shardlm_main(["export", str(runs["a"] / "checkpoints" / "step-20"), str(out)]) == 0
    tok = transformers.AutoTokenizer.from_pretrained(str(out))
    assert (tok.bos_token, tok.eos_token, tok.pad_token) == ("<|begin_of_text|>", "<|end_of_document|>",
                                                             "<|end_of_document|>")
    assert tok.chat_template is None and tok.model_max_length == 64  # trained on plain text: no template
    config = json.loads((out / "config.json").read_text())
    gen = json.loads((out / "generation_config.json").read_text())
    assert (config["bos_token_id"], config["eos_token_id"], gen["eos_token_id"], gen["pad_token_id"]) == (
        0,
        2,
        2,
        2,
    )
    # 20 steps do not teach the model to end a text: make <|end_of_document|> the greedy choice wherever the
    # token it would pick 5th in the answer to "ROMEO:" wins (its output row = that token's, scaled by 1.05)
    prompt = [0] + tok("ROMEO:", add_special_tokens=False)["input_ids"]
    first = generate(load_model_dir(out).eval(), [prompt], 30, SamplingConfig(0.0), 2)[0]
    weights = load_file(str(out / "model.safetensors"))
    name = "lm_head.weight" if "lm_head.weight" in weights else "model.embed_tokens.weight"
    weights[name][2] = weights[name][first[4]] * 1.05
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(out), attn_implementation="eager").eval()
    ours = load_model_dir(out).eval()
    stopped, lengths = 0, []
    for text in ("ROMEO:", "KING HENRY:", "Exeunt", "First Citizen"):
        ids = [0] + tok(text, add_special_tokens=False)["input_ids"]
        new = generate(ours, [ids], 60 - len(ids), SamplingConfig(0.0), 2)[0]
        with torch.no_grad():
            theirs = hf.generate(
                torch.tensor([ids]),
                max_new_tokens=60 - len(ids),
                do_sample=False,
                attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            )[0, len(ids) :].tolist()
        assert theirs == (new + [2] if len(new) < 60 - len(ids) else new), (text, new, theirs)
        stopped += len(new) < 60 - len(ids)
        lengths.append(len(new))
    print(f"\nexported from-scratch model: greedy generation equals transformers' for 4 prompts, "
          f"{stopped} of them stopped at <|end_of_document|>, after {lengths} tokens")
    assert stopped >= 1 and len(generate(ours, [prompt], 30, SamplingConfig(0.0), 2)[0]) <= 4


@pytest.mark.dist
def test_sharded_final_loads_in_transformers_with_the_checkpoints_logits(runs, tmp_path):
    """Run b's ``final/`` was written by both ranks (a shard file each + the index): transformers loads it,
    and its logits equal those of the one-file export of the same step's checkpoint."""
    transformers = pytest.importorskip("transformers")
    final = runs["b"] / "final"
    index = json.loads((final / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert files == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    one_file = export_checkpoint(runs["b"] / "checkpoints" / "step-12", tmp_path / "one")
    # config, generation config, tokenizer
    others = {p.name for p in one_file.iterdir()} - {"model.safetensors"}
    assert {"config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"} <= others
    assert {p.name for p in final.iterdir()} == {*files, "model.safetensors.index.json", *others}
    for name in others:  # the same files as the one-file export writes
        assert (final / name).read_bytes() == (one_file / name).read_bytes(), name
    sizes = {f: (final / f).stat().st_size for f in files}
    biggest = max(v.numel() * v.element_size() for v in load_model_dir(final).state_dict().values())
    # share + one tensor + header
    assert max(sizes.values()) <= index["metadata"]["total_size"] / 2 + biggest + 4096
    tokens = torch.randint(0, 512, (2, 24), generator=torch.Generator().manual_seed(0))
    logits = []
    for d in (final, one_file):
        hf = transformers.AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32,
                                                               attn_implementation="eager").eval()
        with torch.no_grad():
            logits.append(hf(tokens).logits)
    assert torch.equal(logits[0], logits[1])


# ---- TensorBoard --------------------------------------------------------------------------------
@pytest.mark.dist
def test_training_writes_tensorboard_events_matching_metrics(runs):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    records = read_metrics(runs["a"] / "metrics.jsonl")
    acc = EventAccumulator(str(runs["a"] / "tensorboard"))
    acc.Reload()
    tags = acc.Tags()["scalars"]
    for tag in ("train/loss", "val/loss", "train/lr", "train/grad_norm", "perf/tokens_per_s",
                "memory/shard_MiB/rank0", "memory/shard_MiB/rank1"):
        assert tag in tags, tag
    loss = [(e.step, e.value) for e in acc.Scalars("train/loss")]
    assert [s for s, _ in loss] == [r["step"] for r in records]
    assert all(abs(v - r["loss"]) <= 1e-6 * abs(r["loss"]) for (_, v), r in zip(loss, records))
    val = [(e.step, e.value) for e in acc.Scalars("val/loss")]
    assert val and [s for s, _ in val] == [r["step"] for r in records if "val_loss" in r]
    mem = acc.Scalars("memory/shard_MiB/rank1")
    # TensorBoard stores fp32: one rounding, at most half of EPS relative
    assert_close(mem[-1].value, records[-1]["shard_bytes_per_rank"][1] / 2**20, rtol=EPS, what="rank1 MiB")
    assert_close(acc.Scalars("memory/shard_MiB/max")[-1].value, records[-1]["shard_bytes"]["max"] / 2**20,
                 rtol=EPS, what="max MiB")


@pytest.mark.dist
def test_per_rank_figures_are_summaries_unless_asked(runs):
    full, summary = read_metrics(runs["a"] / "metrics.jsonl"), read_metrics(runs["b"] / "metrics.jsonl")
    # step 1's expected figure == the measured one
    assert len({json.dumps(r["shard_bytes"]) for r in full}) == 1
    for rec in full:
        values = rec["shard_bytes_per_rank"]
        assert len(values) == 2 and rec["world_size"] == 2
        assert rec["shard_bytes"] == {"min": min(values), "max": max(values), "mean": sum(values) / 2,
                                      "max_rank": values.index(max(values))}
        assert len(rec["rss_bytes_per_rank"]) == 2 and rec["rss_bytes"]["max"] == max(
            rec["rss_bytes_per_rank"]
        )
    assert all(k not in rec for rec in summary for k in ("shard_bytes_per_rank", "rss_bytes_per_rank"))
    last = summary[-1]
    assert set(last["shard_bytes"]) == {"min", "max", "mean", "max_rank"} and last["rss_bytes"]["min"] > 2**20


# ---- report -------------------------------------------------------------------------------------
@pytest.mark.dist
def test_report_plots_what_metrics_jsonl_holds(runs, tmp_path):
    a, b = load_run(runs["a"]), load_run(runs["b"])
    figs = make_figures([a, b])
    lines = {
        name: {ln.get_label(): ln.get_xydata() for ax in fig.axes for ln in ax.lines}
        for name, fig in figs.items()
    }
    assert all(ln.get_label().split()[1] == "shard" for ln in figs["memory"].axes[1].lines)  # their own axis
    for run in (a, b):
        recs = read_metrics(run.path / "metrics.jsonl")
        expect = {
            ("loss", run.name): [(r["step"], r["loss"]) for r in recs],
            ("loss", f"{run.name} val"): [(r["step"], r["val_loss"]) for r in recs if "val_loss" in r],
            ("lr", run.name): [(r["step"], r["lr"]) for r in recs],
            ("tokens_per_s", run.name): [(r["step"], r["tokens_per_s"]) for r in recs],
        }
        if run.name == "a":  # full per-rank lists: a line per rank
            expect.update(
                {
                    ("memory", f"a shard rank{k}"): [
                        (r["step"], r["shard_bytes_per_rank"][k] / 2**20) for r in recs
                    ]
                    for k in (0, 1)
                }
            )
        else:  # summaries: max and min
            expect.update({
                ("memory", f"b shard {stat}"): [(r["step"], r["shard_bytes"][stat] / 2**20) for r in recs]
                for stat in ("max", "min")})
        for (fig, label), xy in expect.items():
            assert len(xy) >= 2, (fig, label)
            assert torch.allclose(torch.tensor(lines[fig][label]), torch.tensor(xy, dtype=torch.float64),
                                  rtol=1e-12, atol=0), (fig, label)
    assert len(read_metrics(runs["b"] / "metrics.jsonl")) == 12
    written = write_report([runs["a"], runs["b"]], tmp_path / "report")
    assert sorted(p.name for p in written) == sorted([f"{n}.png" for n in FIGURES] + ["summary.md"])
    for p in written:
        head = p.read_bytes()[:8]
        assert p.stat().st_size > 1000 if p.suffix == ".png" else p.stat().st_size > 100
        if p.suffix == ".png":
            assert head == b"\x89PNG\r\n\x1a\n"
    summary = (tmp_path / "report" / "summary.md").read_text()
    final_a = read_metrics(runs["a"] / "metrics.jsonl")[-1]
    assert (
        f"| a | 64 x 2 | 2 (fsdp) | 8 x 32 | 20 | {final_a['loss']:.4f} | {final_a['val_loss']:.4f}"
        in summary
    )


# ---- bad input ------------------------------------------------------------------------------------
@pytest.mark.dist
def test_bad_input_gives_one_clear_error(runs, tmp_path, capsys):
    model_dir = str(runs["a"] / "final")
    cases = [
        (["generate", "--model", model_dir], "no prompts"),
        (["generate", "--model", model_dir, "--prompt", ""], "prompt 0 is empty"),
        (["generate", "--model", model_dir, "--prompt", "ROMEO " * 200], "the model's context is 64 tokens"),
        (["generate", "--model", model_dir, "--prompt", "x", "--top-p", "0"], "top_p must be in (0, 1]"),
        (["generate", "--model", model_dir, "--prompt", "x", "--temperature", "nan"],
         "temperature must be a finite"),
        (["generate", "--model", model_dir, "--prompt", "x", "--temperature", "inf"],
         "temperature must be a finite"),
        (["eval", "--model", model_dir, "--data", str(runs["a"] / "config.json"), "--context", "0"],
         "--context must be >= 2"),
        (["report", str(tmp_path)], "no metrics.jsonl"),
        (["eval", "--model", model_dir, "--data", str(tmp_path / "missing.txt")], "does not exist"),
        (["eval", "--model", model_dir, "--data", str(runs["a"] / "config.json"), "--context", "65"],
         "exceeds the model's max_seq_len=64"),
    ]
    for argv, message in cases:
        assert shardlm_main(argv) == 2, argv
        err = capsys.readouterr().err
        assert err.startswith("error: ") and message in err and err.count("\n") == 1, (argv, err)
    assert not (tmp_path / "report").exists()  # nothing half-written
    with pytest.raises(ValueError, match="no prompts given"):
        generate(load_model_dir(model_dir), [], 5, SamplingConfig())
