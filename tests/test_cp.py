"""Context parallelism (shardlm/parallel/cp.py): the load-balanced split, its masks, and attention across it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from conftest import torchrun
from shardlm.errors import ConfigError
from shardlm.parallel.cp import ContextParallel, chunk_indices, gathered_indices, padded_length

WORKER = Path(__file__).resolve().parent / "cp_worker.py"


def test_split_is_head_and_tail_chunks_covering_the_padded_sequence():
    assert padded_length(13, 2) == 16 and padded_length(16, 2) == 16 and padded_length(17, 4) == 24
    assert chunk_indices(13, 2, 0).tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert chunk_indices(13, 2, 1).tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    assert sorted(gathered_indices(17, 4).tolist()) == list(range(24))
    # causal work (keys each query sees) is the same on every rank
    work = [sum(i + 1 for i in chunk_indices(64, 4, r).tolist()) for r in range(4)]
    assert len(set(work)) == 1


def test_one_rank_split_is_the_identity_and_masks_are_the_reference():
    from shardlm.model.attention import dense_mask
    cp = ContextParallel(None)
    x = torch.arange(2 * 7).view(2, 7)
    assert torch.equal(cp.shard(x), x)
    docs = torch.tensor([[0, 0, 1, 1, 1, 2, 2], [0, 1, 1, 1, 1, 1, 1]])
    assert torch.equal(cp.masks(7, docs, {3}, "cpu")[3], dense_mask(docs, 3))
    assert cp.masks(7, None, {0, 7}, "cpu") == {0: None, 7: None}  # causal by position: no mask needed
    assert torch.equal(cp.rope_positions(2, 7, docs, "cpu"), torch.tensor([[0, 1, 0, 1, 2, 0, 1], [0, 0, 1, 2, 3, 4, 5]]))


def test_a_sequence_shorter_than_cp_is_refused_and_padding_may_pass_the_tables():
    cp = ContextParallel(None)
    cp.size = 4
    cp.check_sequence(4)
    with pytest.raises(ConfigError, match=r"train.seq_len=3 is shorter than parallel.cp=4: .* at least 4 tokens"):
        cp.check_sequence(3)
    # a 63-token sequence of a 64-position model pads to 64 at cp 4 and to 72 at cp 6: padding takes position 0
    cp.size = 6
    assert cp.shard(torch.arange(63).view(1, 63)).shape == (1, 12)
    cp.rank = 0
    assert cp.rope_positions(1, 63, None, "cpu").max().item() < 64


def test_cp_not_dividing_the_world_size_is_one_clear_error():
    from shardlm.config import Config, ParallelConfig, validate
    from shardlm.parallel.dist import dp_mesh_shape

    with pytest.raises(ConfigError, match=r"parallel.cp=3 must divide the world size 4 \(each sequence is split"):
        dp_mesh_shape(ParallelConfig(cp=3), 4, 4)
    assert dp_mesh_shape(ParallelConfig(cp=2), 4, 4) == (1, 2)  # 2 data-parallel ranks of 2 CP ranks each
    cfg = Config()
    cfg.parallel.cp, cfg.parallel.mode = 2, "single"
    with pytest.raises(ConfigError, match="parallel.cp must be >= 1 .* and 1 in parallel.mode='single', got 2"):
        validate(cfg)


def test_planner_counts_a_rank_s_share_of_the_sequence():
    from shardlm.config import Config
    from shardlm.plan import plan_memory

    cfg = Config()
    cfg.train.seq_len = cfg.model.max_seq_len = 1024
    cfg.train.global_batch_size, cfg.train.micro_batch_size = 2, 1
    fsdp = plan_memory(cfg, 2, "cpu")
    cfg.parallel.cp, cfg.train.global_batch_size = 2, 1
    cp = plan_memory(cfg, 2, "cpu")
    # same parameters and state per rank; activations of 512 tokens per rank plus attention over all 1024
    assert cp.breakdown["params"] == fsdp.breakdown["params"] and cp.breakdown["optimizer"] == fsdp.breakdown["optimizer"]
    assert 0.5 * fsdp.breakdown["activations"] < cp.breakdown["activations"] < 0.8 * fsdp.breakdown["activations"]


@pytest.mark.dist
def test_cp2_attention_equals_one_rank_forward_and_grads(tmp_path):
    out = tmp_path / "cp.json"
    torchrun(2, [str(WORKER), str(out)], timeout=240)
    results = json.loads(out.read_text())
    assert set(results) == {"causal_odd", "block_causal_odd", "sliding_window", "sliding_block_causal_odd"}
    for name, r in results.items():
        for key in ("out", "dq", "dk", "dv"):
            assert r[key] <= 1e-6, (name, key, r[key])
    assert not results["causal_odd"]["dense_mask"]  # plain causal: SDPA's causal kernel, no T x T mask
    assert all(results[n]["dense_mask"] for n in ("block_causal_odd", "sliding_window", "sliding_block_causal_odd"))
    assert results["causal_odd"]["padding_total"] == 3 and results["sliding_block_causal_odd"]["padding_total"] == 1
    for name in ("block_causal_odd", "sliding_window", "sliding_block_causal_odd"):
        assert results[name]["vs_causal"] > 0.1, name  # documents and windows change the result


# ---- training: CP 2 and FSDP 2 x CP 2 equal one process; a CP 2 checkpoint resumes at CP 1 ---------------------
STEPS = {"train.steps": 3, "train.seq_len": 30, "train.eval_interval": 3, "train.eval_tokens": 960,
         "train.warmup_steps": 1, "checkpoint.interval": 1, "checkpoint.keep": 0}
#: Mistral's sliding window (8 of the 30 tokens): CP's masked path in training
WINDOW = {**STEPS, "model.family": '"mistral"', "model.sliding_window": 8}
#: block-causal attention over windows that cross document boundaries (document ids sharded with the tokens)
DOCS = {**STEPS, "model.attention": '"block_causal"', "train.eval_interval": 0}


def short_documents(corpus: Path, out: Path, tokenizer: Path) -> Path:
    """80 documents of 5-40 words cut from ``corpus``, prepared as a text stream with ``tokenizer``."""
    from shardlm.data import prepare_corpus

    out.mkdir(parents=True)
    words = corpus.read_text().split()[:20000]
    gen = torch.Generator().manual_seed(5)
    with (out / "docs.jsonl").open("w") as f:
        for _ in range(80):
            n = int(torch.randint(5, 40, (), generator=gen))
            start = int(torch.randint(0, len(words) - n, (), generator=gen))
            f.write(json.dumps({"text": " ".join(words[start:start + n])}) + "\n")
    prepare_corpus(str(out / "docs.jsonl"), str(out / "data"), str(tokenizer), 512, 0.1)
    return out / "data"


@pytest.fixture(scope="module")
def cp_runs(small_data, small_corpus, tmp_path_factory):
    from conftest import run_scenarios, scenario, tiny_overrides
    from shardlm.cli.train import main as train_main

    runs = tmp_path_factory.mktemp("cp")
    assert train_main(tiny_overrides(small_data, runs / "one", STEPS)) == 0  # one process, in this one
    assert train_main(tiny_overrides(small_data, runs / "one_window", WINDOW)) == 0
    docs = short_documents(small_corpus, runs / "docs", small_data / "tokenizer.json")
    assert train_main(tiny_overrides(docs, runs / "one_docs", DOCS)) == 0
    out = run_scenarios(2, [
        scenario("cp2", small_data, runs, {**STEPS, "parallel.cp": 2}),
        scenario("cp2_window", small_data, runs, {**WINDOW, "parallel.cp": 2}),
        scenario("cp2_docs", docs, runs, {**DOCS, "parallel.cp": 2}),
        # the CP 2 run's step-2 checkpoint, resumed with FSDP 2 and no CP: step 3 as the CP 2 run made it
        scenario("resumed_fsdp2", small_data, runs, {**STEPS, "train.micro_batch_size": 4,
                                                     "checkpoint.resume": f'"{runs / "cp2" / "checkpoints/step-2"}"'}),
    ], runs)
    # FSDP 2 x CP 2, with full activation checkpointing (the all-gather of K and V runs again in the recompute)
    out.update(run_scenarios(4, [scenario("fsdp2_cp2", small_data, runs, {
        **STEPS, "parallel.cp": 2, "train.micro_batch_size": 4, "parallel.activation_checkpoint": '"full"'})], runs))
    return runs, out


def logged(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.dist
@pytest.mark.parametrize("name,reference", [("cp2", "one"), ("fsdp2_cp2", "one"), ("cp2_window", "one_window"),
                                            ("cp2_docs", "one_docs")])
def test_cp_training_equals_one_process(cp_runs, name, reference):
    from safetensors.torch import load_file
    runs, out = cp_runs
    ref, hist = logged(runs / reference), out[name][0]["history"]
    assert [r["step"] for r in hist] == [r["step"] for r in ref if "loss" in r] == [1, 2, 3]
    ref_loss = [r["loss"] for r in ref if "loss" in r]
    loss_diff = max(abs(a["loss"] - b) for a, b in zip(hist, ref_loss))
    print(f"\n{name} vs {reference}: max loss diff {loss_diff:.2e} over {len(hist)} steps")
    assert loss_diff <= 1e-6, (hist, ref_loss)
    ref_val = [r["val_loss"] for r in ref if "val_loss" in r]
    assert len(ref_val) == (0 if name == "cp2_docs" else 1)
    assert all(abs(hist[-1]["val_loss"] - v) <= 1e-6 for v in ref_val)
    assert hist[0]["loss"] != hist[-1]["loss"]  # it trained
    p, q = (load_file(str(runs / n / "final" / "model.safetensors")) for n in (name, reference))
    assert p.keys() == q.keys() and max((p[k] - q[k]).abs().max().item() for k in p) <= 1e-4  # as test_fsdp_parity


@pytest.mark.dist
def test_cp2_checkpoint_resumes_at_cp1_fsdp2_exactly(cp_runs):
    from safetensors.torch import load_file
    runs, out = cp_runs
    resumed, cp2 = out["resumed_fsdp2"][0]["history"], out["cp2"][0]["history"]
    assert [r["step"] for r in resumed] == [3]
    assert abs(resumed[0]["loss"] - cp2[-1]["loss"]) <= 1e-6
    p, q = (load_file(str(runs / n / "final" / "model.safetensors")) for n in ("resumed_fsdp2", "cp2"))
    assert max((p[k] - q[k]).abs().max().item() for k in p) <= 1e-4


def test_plan_llama3_8b_at_128k_tokens_on_8_h100s_with_cp8(capsys):
    from shardlm.cli.main import main as shardlm_main

    config = str(Path(__file__).resolve().parents[1] / "configs" / "llama3-8b.toml")
    args = ["plan", config, "--world-size", "8", "--device", "h100", "--train.seq_len=131072",
            "--model.max_seq_len=131072", "--train.global_batch_size=1", "--train.micro_batch_size=1",
            "--parallel.activation_checkpoint=full", "--model.attention=causal"]  # CP's causal path (no mask)
    capsys.readouterr()
    assert shardlm_main([*args, "--parallel.cp=8"]) == 0
    out = capsys.readouterr().out
    assert "context parallel 8: each sequence split over 8 ranks, 16,384 tokens per rank" in out and "  fits:" in out
    cp8 = float(out.split("activations (saved for backward)")[1].split()[0])
    assert shardlm_main([*args, "--train.global_batch_size=8"]) == 0  # no CP: a 128k sequence on every rank
    out = capsys.readouterr().out
    assert "does not fit" in out
    assert float(out.split("activations (saved for backward)")[1].split()[0]) > 5 * cp8  # 55.6 against 9.3 GiB
