"""``shardlm tune``'s search in one process: candidates from the planner, the staged search, the time budget,
config layering, TP and EP candidates. The measuring launch is tests/dist/test_tune_launch.py."""

from __future__ import annotations

import json
import time
from types import SimpleNamespace

import pytest
import torch

from conftest import ROOT, cli_error
from shardlm.cli.main import main as shardlm_main
from shardlm.cli.train import parse_args
from shardlm.config import load_config
from shardlm.plan import tune, tune_candidates
from shardlm.plan.devices import GIB
from shardlm.plan.tune import Candidate, Planner, Row, combine, config_candidate, first_round, space

TINY = """[model]
dim = 64
n_layers = 2
n_heads = 4
n_kv_heads = 2
ffn_hidden = 128
vocab_size = 512
max_seq_len = 64

[data]
dir = "{data}"

[train]
seq_len = 32
global_batch_size = 8
micro_batch_size = 4
"""


def table_rows(stdout: str) -> list[dict[str, str]]:
    """The rows of the table ``shardlm tune`` printed, as {column: cell}."""
    lines = [line for line in stdout.splitlines() if line.startswith("| ")]
    head = [c.strip() for c in lines[0].strip("|").split("|")]
    return [dict(zip(head, (c.strip() for c in line.strip("|").split("|")))) for line in lines[1:]]


def as_candidate(row: dict[str, str]) -> Candidate:
    forward, backward = row["prefetch f/b"].split("/")
    micro = int(row["micro-batch x accum"].split(" x ")[0])
    return Candidate(row["reshard"] == "true", int(forward), int(backward), row["AC"], micro,
                     row["grad sync"] if row["grad sync"] != "-" else "every_micro_batch",
                     row["compile"] == "true", int(row["blocks/group"]), int(row["tp"]), int(row["ep"]),
                     int(row["cp"]))


def test_no_candidate_fits_says_what_would(tmp_path, capsys, monkeypatch):
    """No candidate fits at 2 ranks: one error naming the smallest candidate's need and the world size at
    which the model fits (with its checkpointing and micro-batch); nothing is launched or written."""
    config = tmp_path / "wide.toml"
    config.write_text(TINY.format(data=tmp_path / "none").replace("dim = 64", "dim = 512")
                      .replace("vocab_size = 512", "vocab_size = 8192"))  # 11M parameters: state dominates
    cfg = load_config(str(config))
    # the smallest candidate: full checkpointing, micro-batch 1, at whichever cp (1 or 2) needs the least
    at2 = min(Planner(cfg, 2, "cpu", 0).bytes(Candidate(True, 0, 0, "full", 1, "every_micro_batch", cp=cp))
              for cp in (1, 2))
    at4 = Planner(cfg, 4, "cpu", 0).bytes(Candidate(True, 0, 0, "full", 1, "every_micro_batch"))
    assert at4 < at2
    monkeypatch.setattr(tune.subprocess, "Popen", lambda *a, **k: pytest.fail("launched"))
    out = tmp_path / "tuned.toml"
    err = cli_error(capsys, ["tune", str(config), "--world-size", "2", "--out", str(out),
                             "--memory-per-rank", f"{at4 * 1.001 / GIB:.9f}", "--headroom", "0"])
    assert "no candidate fits at world size 2" in err and f"{tune.size(at2)} per rank" in err
    assert "more ranks: --world-size 4, with activation checkpointing" in err and "micro-batch" in err
    assert not out.exists()
    err = cli_error(capsys, ["tune", str(config), "--world-size", "3"])
    assert "train.global_batch_size=8 must be divisible by the world size 3" in err
    err = cli_error(capsys, ["tune", str(config), "--world-size", "2", "--parallel.mode=ddp"])
    assert "parallel.mode must be 'fsdp'" in err


def test_staged_search_candidates():
    """The 20m config at 2 ranks: the config's settings as base and one change at a time, no checkpointing
    where none is needed; with less memory the lightest checkpointing that fits; round 2 combines the
    fastest values."""
    cfg = load_config(str(ROOT / "configs" / "20m.toml"))
    roomy = Planner(cfg, 2, "cpu", 64 * GIB)
    rows = first_round(cfg, roomy, "staged")
    base = Candidate(True, 0, 0, "none", 4, "every_micro_batch")
    assert [r.cand for r in rows] == [
        base, base.with_value("reshard", False), base.with_value("prefetch", (1, 1)),
        base.with_value("prefetch", (2, 2)), *[base.with_value("batching", (m, s)) for m in (2, 1)
                                               for s in ("every_micro_batch", "last_micro_batch")],
        base.with_value("compile", True), base.with_value("grouping", 2), base.with_value("grouping", 4),
        base.with_value("tp", 2), base.with_value("cp", 2)]
    assert all(r.fits for r in rows)
    # the full grid: reshard x prefetch x AC x batching x compile x grouping (1, 2, all 4 blocks) x tp x ep
    # x cp
    assert [len(v) for v in space(cfg, 2).values()] == [2, 3, 4, 5, 2, 3, 2, 1, 2]
    # a group of 2 blocks prefetched holds 2 blocks more; one group of 4 more still than 2 groups of 2
    prefetched = base.with_value("prefetch", (1, 1))
    assert roomy.bytes(prefetched.with_value("grouping", 2)) > roomy.bytes(prefetched)
    assert roomy.bytes(base.with_value("grouping", 4)) > roomy.bytes(base.with_value("grouping", 2))
    tight = Planner(cfg, 2, "cpu", (roomy.bytes(base) + roomy.bytes(base.with_value("ac", "selective"))) / 2)
    rows = first_round(cfg, tight, "staged")
    assert rows[0].cand == base and not rows[0].fits  # the config's own row, shown as not fitting
    assert rows[1].cand == base.with_value("ac", "selective") and rows[1].fits
    # every other row checkpoints no more than it must: the next lighter mode does not fit (a smaller
    # micro-batch without checkpointing fits, except where last_micro_batch's unsharded gradients need it)
    lighter = {"selective": "none", "full": "selective"}
    for r in rows[1:]:  # a row that fits nowhere is shown at full checkpointing
        mode = r.cand.activation_checkpoint
        assert r.fits or mode == "full", r.cand
        assert mode == "none" or not tight.fits(r.cand.with_value("ac", lighter[mode])), r.cand
    assert any(r.cand.activation_checkpoint == "none" for r in rows if r.cand.micro_batch_size < 4)
    times = {base.with_value("reshard", False): 1.0,
             base.with_value("batching", (2, "last_micro_batch")): 1.1,
             base.with_value("prefetch", (1, 1)): 1.5, base: 1.3}
    measured = [Row(c, roomy.bytes(c), True, times=[t]) for c, t in times.items()]
    assert combine(measured, base, roomy) == Candidate(False, 0, 0, "none", 2, "last_micro_batch")


def test_prefetch_deeper_than_the_other_groups_is_measured_once():
    """Prefetch depth 2 with 2 block groups runs as depth 1: the config's own row says so, and no two rows of
    the first round (or of the full grid) are the same settings."""
    cfg = load_config(str(ROOT / "configs" / "20m.toml"), ["--parallel.blocks_per_group=2",
                                                           "--parallel.forward_prefetch=2"])
    own = config_candidate(cfg, 2)
    assert (own.forward_prefetch, own.backward_prefetch, own.blocks_per_group) == (1, 0, 2)
    roomy = Planner(cfg, 2, "cpu", 64 * GIB)
    for search in ("staged", "full"):
        cands = [r.cand for r in first_round(cfg, roomy, search)]
        assert len(cands) == len(set(cands)) and own in cands, search


def test_config_files_layer_in_order(tmp_path):
    """Several config files: later keys replace earlier ones, the run is named after the first file,
    command-line overrides come last; ``python -m shardlm.train`` takes --config more than once."""
    first, second = tmp_path / "base.toml", tmp_path / "tuned.toml"
    first.write_text("[train]\nmicro_batch_size = 4\nsteps = 7\n[parallel]\nreshard_after_forward = true\n")
    second.write_text("[train]\nmicro_batch_size = 2\n[parallel]\nreshard_after_forward = false\n")
    cfg = load_config([str(first), str(second)], ["--train.steps=9"])
    assert (cfg.train.micro_batch_size, cfg.train.steps, cfg.parallel.reshard_after_forward) == (2, 9, False)
    assert cfg.run.name == "base"
    paths, overrides = parse_args(["--config", str(first), "--config", str(second), "--train.steps=3"])
    assert paths == [str(first), str(second)] and overrides == ["--train.steps=3"]


def test_time_budget_measures_what_fits_in_it(tmp_path, capsys, monkeypatch):
    """``--time-budget 25``, each measurement 10 s (a fake clock; nothing is trained): the first two
    candidates are measured, the rest skipped and marked so, no confirming pass; the pick is the faster
    measured one and is written. Without a budget every fitting candidate is measured and the two fastest
    confirmed. A bad budget is one error line."""
    from shardlm.cli import tune_worker

    config = tmp_path / "tiny.toml"
    config.write_text(TINY.format(data=tmp_path / "none"))
    now = [0.0]
    step_s = iter(0.1 * (k % 7 + 1) for k in range(1000))  # each measurement's step time

    def fake_time_candidate(cfg, info):
        now[0] += 10.0
        return [next(step_s)] * cfg.train.steps, -1

    def in_process_launch(spec, world_size, workdir):
        assert world_size == 1
        now[0] = time.time()  # the fake clock starts at the launch
        tune_worker.measure({**spec, "out": str(workdir / "rows.json"), "workdir": str(workdir)})
        return [Row.from_dict(d) for d in json.loads((workdir / "rows.json").read_text())]

    monkeypatch.setattr(tune_worker, "time_candidate", fake_time_candidate)
    one_rank = SimpleNamespace(world_size=1, is_main=True, device=torch.device("cpu"))  # no process group
    monkeypatch.setattr(tune_worker, "init_distributed", lambda pcfg: one_rank)
    monkeypatch.setattr(tune_worker, "clock", lambda: now[0])
    monkeypatch.setattr(tune, "launch", in_process_launch)
    args = ["tune", str(config), "--world-size", "1", "--search", "full", "--memory-per-rank", "64",
            "--warmup", "1", "--steps", "2", "--train.global_batch_size=2", "--train.micro_batch_size=2"]
    results = {}
    for budget in ("25s", None):
        out = tmp_path / f"tuned-{budget}.toml"
        capsys.readouterr()
        assert shardlm_main(args + ["--out", str(out)] + (["--time-budget", budget] if budget else [])) == 0
        captured = capsys.readouterr()
        results[budget] = rows = table_rows(captured.out)
        assert ("that fit not measured (marked 'skipped')" in captured.out) == (budget is not None)
        measured = [r for r in rows if r["step s"] != "-"]
        picked = next(r for r in rows if "picked" in r["note"])
        assert picked in measured and float(picked["step s"]) == min(float(r["step s"]) for r in measured)
        assert config_candidate(load_config([str(config), str(out)]), 1) == as_candidate(picked)
    fitting = [r for r in results[None] if r["fits"] == "yes"]
    assert len(fitting) > 4 and all(r["step s"] != "-" for r in fitting)
    assert len([r for r in results[None] if "confirmed" in r["note"]]) == 2
    limited = results["25s"]
    assert [r["step s"] != "-" for r in limited if r["fits"] == "yes"] == [True, True] + [False] * (
        len(fitting) - 2
    )
    assert all(
        "skipped: time budget" in r["note"] for r in limited if r["fits"] == "yes" and r["step s"] == "-"
    )
    assert not any("confirmed" in r["note"] for r in limited)
    for bad in ("-3m", "0", "5x"):
        err = cli_error(capsys, ["tune", str(config), "--world-size", "1", f"--time-budget={bad}"])
        assert "--time-budget must be a positive duration" in err and f"{bad!r}" in err


def test_tensor_and_expert_parallel_candidates():
    """At 4 ranks tune offers each tp the trainer accepts (the 20m model: 1, 2, 4; 2 key/value heads: 1, 2;
    with LoRA: 1) and, for a mixture of experts, each ep dividing its experts and the ranks (8 experts: 1, 2,
    4; 6: 1, 2; no tp: tensor parallel on MoE is not built). Each such row's prediction is the planner's for
    that layout (a tp-way model's pieces, ep-way experts), a tp row checkpoints only as the planner models it
    (none or full), its micro-batches are tp times more (N / tp data-parallel ranks), and the full grid holds
    no other mode with tp."""
    from shardlm.config.layout import check_ep
    from shardlm.errors import ConfigError
    from shardlm.plan.memory import plan_memory
    from shardlm.plan.tune_candidates import apply

    dense = str(ROOT / "configs" / "20m.toml")
    cases = {(): ([1, 2, 4], [1]), ("--model.n_kv_heads=2",): ([1, 2], [1]),
             ("--lora.enabled=true",): ([1], [1]), ("--train.seq_len=254",): ([1, 2], [1])}
    for overrides, (tp, ep) in cases.items():
        dims = space(load_config(dense, list(overrides)), 4)
        assert (dims["tp"], dims["ep"]) == (tp, ep), overrides
    cfg = load_config(dense)
    # own: the staged search's base here
    roomy, own = Planner(cfg, 4, "cpu", 64 * GIB), config_candidate(cfg, 4)
    rows = {r.cand.tp: r for r in first_round(cfg, roomy, "staged") if r.cand.with_value("tp", 1) == own}
    assert sorted(rows) == [1, 2, 4]
    for r in rows.values():
        assert r.predicted_bytes == plan_memory(apply(cfg, r.cand), 4).peak
    assert rows[4].predicted_bytes < rows[2].predicted_bytes < rows[1].predicted_bytes
    tight = Planner(cfg, 4, "cpu", (roomy.bytes(own) + roomy.bytes(own.with_value("ac", "selective"))) / 2)
    under_tp = [r.cand for r in first_round(cfg, tight, "staged") if r.cand.tp > 1]
    assert under_tp and all(c.activation_checkpoint in ("none", "full") for c in under_tp)
    grid = [r.cand for r in first_round(cfg, roomy, "full")]
    assert {c.tp for c in grid} == {1, 2, 4}
    assert {c.activation_checkpoint for c in grid if c.tp > 1} == {"none", "full"}
    table = tune.format_table([rows[2]], cfg, 4, None)
    assert table_rows(table)[0]["micro-batch x accum"] == "2 x 2" and table_rows(table)[0]["tp"] == "2"

    moe = ["--model.family=qwen3_moe", "--model.n_experts=8", "--model.n_experts_per_token=2",
           "--model.moe_ffn_hidden=128", "--model.dim=128", "--model.vocab_size=512"]
    cfg = load_config(dense, moe)
    dims = space(cfg, 4)
    assert (dims["tp"], dims["ep"]) == ([1], [1, 2, 4])
    assert space(load_config(dense, moe + ["--model.n_experts=6"]), 4)["ep"] == [1, 2]
    # EP under HSDP is not built: refused by name
    hsdp = load_config(dense, moe + ["--parallel.dp_replicate=2"])
    assert space(hsdp, 4)["ep"] == [1]
    with pytest.raises(
        ConfigError, match=r"parallel.ep=2 with parallel.dp_replicate=2 \(HSDP\) is not built"
    ):
        check_ep(8, 2, 4, "fsdp", 2)
    roomy, own = Planner(cfg, 4, "cpu", 64 * GIB), config_candidate(cfg, 4)
    rows = {r.cand.ep: r for r in first_round(cfg, roomy, "staged") if r.cand.with_value("ep", 1) == own}
    assert sorted(rows) == [1, 2, 4]
    for r in rows.values():
        assert r.predicted_bytes == plan_memory(apply(cfg, r.cand), 4).peak
    # an ep rank all-gathers only its experts: less memory the more ranks split them
    assert rows[4].predicted_bytes < rows[2].predicted_bytes < rows[1].predicted_bytes


def test_tensor_parallel_candidates_under_context_parallel_count_the_cp_ranks():
    """Under CP 2 at 4 ranks a data-parallel rank is one of N / (cp·tp): 2 at tp 1, 1 at tp 2, so its batch is
    G·cp·tp / N sequences (8 of G = 8 at tp 2, twice the micro-batches of tp 1); tp 2 is offered (cp × tp = 4
    ranks), tp 4 is not (8 ranks), and each row's prediction is the planner's for that CP x TP layout."""
    from shardlm.errors import ConfigError
    from shardlm.plan.memory import plan_memory
    from shardlm.plan.tune_candidates import apply, local_batch

    cfg = load_config(str(ROOT / "configs" / "20m.toml"), ["--parallel.cp=2"])  # G = 8, micro-batch 4
    assert space(cfg, 4)["tp"] == [1, 2]
    assert [local_batch(cfg, 4, tp) for tp in (1, 2)] == [4, 8]
    roomy, own = Planner(cfg, 4, "cpu", 64 * GIB), config_candidate(cfg, 4)
    rows = {r.cand.tp: r for r in first_round(cfg, roomy, "staged") if r.cand.with_value("tp", 1) == own}
    assert sorted(rows) == [1, 2]
    for r in rows.values():
        assert r.predicted_bytes == plan_memory(apply(cfg, r.cand), 4).peak
    assert rows[2].predicted_bytes < rows[1].predicted_bytes
    assert table_rows(tune.format_table([rows[2]], cfg, 4, None))[0]["micro-batch x accum"] == "4 x 2"
    cfg.train.global_batch_size = 1  # one sequence cannot feed the 2 data-parallel ranks of CP 2 at 4 ranks
    with pytest.raises(ConfigError, match=r"train.global_batch_size=1 must be divisible by the world "
                                          r"size 4 / parallel.cp=2 = 2 \(the ranks of a CP group share"):
        local_batch(cfg, 4)


#: the 20m model at 4,096 tokens a sequence, 2 sequences a step (micro-batch 1): long enough that the
#: activations dominate and CP 2 halves them
LONG = ["--train.seq_len=4096", "--model.max_seq_len=4096", "--train.global_batch_size=2",
        "--train.micro_batch_size=1"]


def trainer_accepts_cp(overrides: list[str], world_size: int, cp: int) -> bool:
    """Whether training refuses ``parallel.cp = cp`` on the 20m config with ``overrides`` at ``world_size``
    ranks, by the trainer's own checks called directly: the config's (load_config), the mesh's
    (init_distributed's dp_mesh_shape), the model split's (build_model's check_tp on a CP rank's tokens),
    the batch over the N / (cp·tp) data-parallel ranks (the trainer's gradient_accumulation_steps; at
    micro-batch 1, so that any micro-batch that divides does)."""
    from shardlm.config import gradient_accumulation_steps
    from shardlm.config.layout import check_tp
    from shardlm.errors import ConfigError
    from shardlm.parallel.dist import dp_mesh_shape

    try:
        cfg = load_config(str(ROOT / "configs" / "20m.toml"),
                          [*overrides, f"--parallel.cp={cp}", "--train.micro_batch_size=1"])
        dp_mesh_shape(cfg.parallel, world_size, world_size)
        check_tp(cfg.model, cfg.parallel.tp, cfg.train.seq_len, cfg.lora.enabled, cp)
        gradient_accumulation_steps(cfg, world_size // (cp * cfg.parallel.tp))
    except ConfigError:
        return False
    return True


def test_context_parallel_candidates_are_those_the_trainer_accepts():
    """A long-context config at 2 and 4 ranks: tune's cp values are the config's, then each other divisor of
    N that the trainer's own checks accept (:func:`trainer_accepts_cp`), and the staged search's rows hold
    each of them and no other, each row's cp x tp accepted and its batch per data-parallel rank G·cp·tp / N;
    refused: cp 4 on a 3-token sequence, cp 1 when G = 2 sequences cannot feed 4 data-parallel ranks (the
    config's cp 2 comes first), cp 4 × tp 2 on 4 ranks, any cp with preference tuning. LoRA trains under CP
    (the trainer accepts it), so it is offered. Round 2 never combines a cp and a tp beyond the ranks."""
    g4 = "--train.global_batch_size=4"  # 4 sequences: one per data-parallel rank at 4 ranks without CP
    cases = {(2, ()): [1, 2], (4, (g4,)): [1, 2, 4], (4, ("--parallel.cp=2",)): [2, 4],
             (4, ("--parallel.cp=2", g4)): [2, 1, 4], (4, (g4, "--train.seq_len=3")): [1, 2],
             (4, (g4, "--parallel.tp=2")): [1, 2], (4, (g4, "--data.format=preference")): [1],
             (2, ("--lora.enabled=true",)): [1, 2]}
    for (n, extra), expected in cases.items():
        overrides = [*LONG, *extra]
        cfg = load_config(str(ROOT / "configs" / "20m.toml"), overrides)
        assert space(cfg, n)["cp"] == expected, (n, extra)
        assert sorted(expected) == [d for d in range(1, n + 1) if n % d == 0
                                    and trainer_accepts_cp(overrides, n, d)], (n, extra)
        if cfg.data.format == "preference":
            continue  # the planner plans preference rows apart (plan/preference.py); no search here
        rows = first_round(cfg, Planner(cfg, n, "cpu", 64 * GIB), "staged")
        assert {r.cand.cp for r in rows} == set(expected), (n, extra)
        for r in rows:  # every cp x tp of a row the trainer accepts, and its batch counts the row's cp
            assert trainer_accepts_cp([*overrides, f"--parallel.tp={r.cand.tp}"], n, r.cand.cp), r.cand
            g = cfg.train.global_batch_size
            assert tune_candidates.local_batch(cfg, n, r.cand.tp, r.cand.cp) == g * r.cand.cp * r.cand.tp // n
    # cp 2 x tp 2 needs 4 ranks: round 2 at 2 ranks combines the faster of the two only, never both
    cfg = load_config(str(ROOT / "configs" / "20m.toml"), LONG)
    two, own = Planner(cfg, 2, "cpu", 64 * GIB), config_candidate(cfg, 2)
    both = own.with_value("cp", 2).with_value("tp", 2)
    assert not two.allowed(both)
    assert Planner(load_config(str(ROOT / "configs" / "20m.toml"), [*LONG, g4]), 4, "cpu", 0).allowed(both)
    times = {own: 1.0, own.with_value("tp", 2): 0.5, own.with_value("cp", 2): 0.4}
    best = combine([Row(c, two.bytes(c), True, times=[t]) for c, t in times.items()], own, two)
    assert (best.tp, best.cp) == (2, 1)


def test_a_context_parallel_candidate_predicts_what_shardlm_plan_prints(capsys):
    """A cp 2 candidate's predicted peak is the planner's under CP: the bytes of plan_memory for the same
    settings (what ``shardlm plan`` calls) and the total ``shardlm plan`` prints for them; CP 2 plans less
    than CP 1 by more than the printed precision, so the comparison tells them apart."""
    from shardlm.plan.memory import plan_memory
    from shardlm.plan.tune_candidates import dotted

    config = str(ROOT / "configs" / "20m.toml")
    cfg = load_config(config, LONG)
    planner = Planner(cfg, 2, "cpu", 64 * GIB)
    own = config_candidate(cfg, 2)
    totals = {}
    for cp in (1, 2):
        cand = own.with_value("cp", cp)
        overrides = [*LONG, *dotted(cand).split()]
        assert planner.bytes(cand) == plan_memory(load_config(config, overrides), 2, "cpu").peak
        capsys.readouterr()
        assert shardlm_main(["plan", config, "--world-size", "2", "--device", "cpu", *overrides]) == 0
        out = capsys.readouterr().out
        assert (f"context parallel {cp}: each sequence split over {cp} ranks" in out) == (cp > 1)
        total = next(line for line in out.splitlines() if line.strip().startswith("total "))
        totals[cp] = float(total.split()[1])
        assert totals[cp] == round(planner.bytes(cand) / GIB, 3), cp
    assert totals[1] - totals[2] > 0.1


def measure_in_process(monkeypatch, time_candidate) -> None:
    """Make ``shardlm tune`` measure in this process at 2 ranks (no torchrun, no process group), each
    candidate's step times from ``time_candidate(run_cfg, info) -> (times, peak bytes)``."""
    from shardlm.cli import tune_worker

    def in_process_launch(spec, world_size, workdir):
        tune_worker.measure({**spec, "out": str(workdir / "rows.json"), "workdir": str(workdir)})
        return [Row.from_dict(d) for d in json.loads((workdir / "rows.json").read_text())]

    two_ranks = SimpleNamespace(world_size=2, is_main=True, device=torch.device("cpu"))
    monkeypatch.setattr(tune_worker, "time_candidate", time_candidate)
    monkeypatch.setattr(tune_worker, "init_distributed", lambda pcfg: two_ranks)
    monkeypatch.setattr(tune, "launch", in_process_launch)


def test_a_long_sequence_that_fits_only_split_is_tuned_at_cp_2(tmp_path, capsys, monkeypatch):
    """At 2 ranks a 4,096-token sequence does not fit a budget under any cp 1 candidate (not even full
    checkpointing at micro-batch 1) but does split over 2 ranks: tune starts from cp 2, shows the cp 1 rows
    as not fitting, measures only fitting cp 2 rows (the measuring is faked in process: nothing trains) and
    writes ``parallel.cp = 2``. No cp 2 row has tp 2 (4 ranks). Below cp 2's need nothing fits: the error says
    what cp 2 needs."""
    from shardlm.plan.tune_search import smallest_candidate

    config = tmp_path / "long.toml"
    config.write_text((ROOT / "configs" / "20m.toml").read_text())
    cfg = load_config(str(config), LONG)
    probe = Planner(cfg, 2, "cpu", 0)
    at_cp1 = probe.bytes(Candidate(True, 0, 0, "full", 1, "every_micro_batch"))
    at_cp2 = probe.bytes(Candidate(True, 0, 0, "full", 1, "every_micro_batch", cp=2))
    assert at_cp2 < at_cp1 and smallest_candidate(cfg, probe).cp == 2
    budget = (at_cp1 + at_cp2) / 2
    step_s = iter(0.1 * (k % 5 + 1) for k in range(1000))

    def fake_time_candidate(run_cfg, info):
        assert Planner(cfg, 2, "cpu", budget).fits(config_candidate(run_cfg, 2))  # only fitting ones run
        return [next(step_s)] * run_cfg.train.steps, -1

    measure_in_process(monkeypatch, fake_time_candidate)
    out = tmp_path / "tuned.toml"
    capsys.readouterr()
    assert shardlm_main(["tune", str(config), "--world-size", "2", "--out", str(out), "--warmup", "1",
                         "--steps", "1", "--memory-per-rank", f"{budget / GIB:.9f}", "--headroom", "0",
                         *LONG]) == 0
    captured = capsys.readouterr().out
    rows = table_rows(captured)
    assert "fsdp at world size 2, cp 1/2," in captured
    assert {r["cp"] for r in rows} == {"1", "2"} and {r["tp"] for r in rows if r["cp"] == "2"} == {"1"}
    assert all(r["fits"] == "no" and r["step s"] == "-" for r in rows if r["cp"] == "1")
    measured = [r for r in rows if r["step s"] != "-"]
    assert len(measured) > 3 and all(r["cp"] == "2" and r["fits"] == "yes" for r in measured)
    for r in rows:
        assert (float(r["predicted MiB/rank"].replace(",", "")) * 2**20 <= budget) == (r["fits"] == "yes")
    picked = next(r for r in rows if "picked" in r["note"])
    dotted_line = next(line for line in captured.splitlines() if line.startswith("dotted overrides: "))
    assert "--parallel.cp=2" in dotted_line and "\ncp = 2\n" in out.read_text()
    assert config_candidate(load_config([str(config), str(out)], LONG), 2) == as_candidate(picked)
    # below cp 2's smallest nothing fits: the error names cp 2's need (the least), and what more ranks need
    err = cli_error(capsys, ["tune", str(config), "--world-size", "2", "--memory-per-rank",
                             f"{at_cp2 * 0.99 / GIB:.9f}", "--headroom", "0", *LONG])
    assert (f"even activation checkpointing 'full' with micro-batch 1 at parallel.cp=2 needs "
            f"{tune.size(at_cp2)} per rank" in err), err
    assert "more ranks: --world-size 4 --train.global_batch_size=4, with parallel.cp=2, activation" in err


def test_the_printed_train_command_trains_the_pick_whatever_the_tune_overrides(tmp_path, capsys, monkeypatch):
    """``shardlm tune ... --parallel.cp=2 --train.micro_batch_size=4`` whose pick is cp 1 at another
    micro-batch: the ``train with:`` command (printed and in the file's header) layers the pick file after the
    config and leaves out the overrides of the settings the pick sets (an override applies after every
    ``--config``, so it would undo the pick); the others stay. The measuring is faked in process."""
    import shlex


    config = tmp_path / "tiny.toml"
    config.write_text(TINY.format(data=tmp_path / "none"))

    def fake_time_candidate(run_cfg, info):  # the less cp and micro-batch, the faster
        return [0.1 * run_cfg.parallel.cp * run_cfg.train.micro_batch_size] * run_cfg.train.steps, -1

    measure_in_process(monkeypatch, fake_time_candidate)
    out = tmp_path / "tuned.toml"
    given = ["--parallel.cp=2", "--train.micro_batch_size=4", "--train.lr=1e-3"]
    capsys.readouterr()
    assert shardlm_main(["tune", str(config), "--world-size", "2", "--out", str(out), "--warmup", "0",
                         "--steps", "1", "--confirm", "0", "--memory-per-rank", "8", *given]) == 0
    captured = capsys.readouterr().out
    picked = as_candidate(next(r for r in table_rows(captured) if "picked" in r["note"]))
    assert picked.cp == 1 and picked.micro_batch_size < 4
    printed = next(line for line in captured.splitlines() if line.startswith("wrote "))
    header = next(line for line in out.read_text().splitlines() if line.startswith("# train: "))
    for train in (printed.split("train with: ", 1)[1], header.split("# train: ", 1)[1]):
        argv = shlex.split(train)
        assert argv[:3] == ["torchrun", "--nproc_per_node=2", "-m"] and argv[3] == "shardlm.train"
        paths, overrides = parse_args(argv[4:])
        assert overrides == ["--train.lr=1e-3"], train
        trained = load_config(paths, overrides)
        assert config_candidate(trained, 2) == picked and trained.train.lr == 1e-3
