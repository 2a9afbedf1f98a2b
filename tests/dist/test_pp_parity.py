"""Pipeline parallel (``parallel.pp``) equals one process: every schedule that runs here, at 2 and 4 ranks,
with FSDP over each stage's data-parallel ranks; its checkpoints resume in one process and at PP 2.

Three torchrun launches on the tiny model with 4 blocks (fp32, gloo, block-causal attention by the data):
PP 2 under ``gpipe``, ``1f1b`` (checkpoints at steps 2 and 3), ``interleaved_1f1b``, ``zbv`` and ``dualpipev``
(the last three: 4 stages of one block, two per rank; the V schedules split each backward into input and
weight); then FSDP 2, PP 2 resuming FSDP 2's step-2 checkpoint and PP 2 resuming its own; FSDP 2 x PP 2
(``1f1b``), PP 4 (``1f1b``, one block per stage, ``1f1b`` and ``gpipe``; 8 blocks under ``interleaved_1f1b``,
``zbv`` and ``dualpipev``) and TP 2 x PP 2 (``1f1b``, and ``zbv``: the vocabulary-parallel loss under a split
backward) at 4 ranks; one process: the references and a resume of PP 2's step-2 checkpoint. The small corpus
is one document (no micro-batch holds a document start); PP 4 and TP 2 x PP 2 under ``zbv`` run on it cut into
short documents (:data:`ON_DOCUMENTS`: every stage masks by them).
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import load_file
from torch.distributed.checkpoint import FileSystemReader

from conftest import run_scenarios, scenario, tiny_overrides, torchrun
from shardlm.convert.hf_in import load_model_dir
from shardlm.data import prepare_corpus
from tolerance import EPS, assert_all_close, assert_close

STEPS = 3
FEW = {"train.steps": STEPS, "train.eval_interval": STEPS, "checkpoint.interval": 2, "checkpoint.keep": 0,
       "model.n_layers": 4, "train.micro_batch_size": 2}
#: name -> (ranks, overrides); every PP run against ``single``
PIPELINES = {
    "pp2_gpipe": (2, {"parallel.pp": 2, "parallel.pp_schedule": '"gpipe"'}),
    "pp2_1f1b": (2, {"parallel.pp": 2, "parallel.pp_schedule": '"1f1b"'}),
    "pp2_interleaved": (2, {"parallel.pp": 2, "parallel.pp_schedule": '"interleaved_1f1b"'}),
    "pp2_zbv": (2, {"parallel.pp": 2, "parallel.pp_schedule": '"zbv"'}),
    "pp2_dualpipev": (2, {"parallel.pp": 2, "parallel.pp_schedule": '"dualpipev"'}),
    "fsdp2_pp2": (4, {"parallel.pp": 2, "parallel.pp_schedule": '"1f1b"'}),
    "pp4_1f1b": (4, {"parallel.pp": 4, "parallel.pp_schedule": '"1f1b"'}),
    "tp2_pp2_1f1b": (4, {"parallel.pp": 2, "parallel.tp": 2, "parallel.pp_schedule": '"1f1b"'}),
    "tp2_pp2_zbv": (4, {"parallel.pp": 2, "parallel.tp": 2, "parallel.pp_schedule": '"zbv"'}),
    "pp4_gpipe": (4, {"parallel.pp": 4, "parallel.pp_schedule": '"gpipe"'}),
    # two stages per rank at PP 4: 8 stages of one block; dualpipev needs as many micro-batches as stages
    "pp4_interleaved": (4, {**(DEEP := {"model.n_layers": 8, "train.global_batch_size": 16}),
                            "parallel.pp": 4, "parallel.pp_schedule": '"interleaved_1f1b"'}),
    "pp4_zbv": (4, {**DEEP, "parallel.pp": 4, "parallel.pp_schedule": '"zbv"'}),
    "pp4_dualpipev": (4, {**DEEP, "parallel.pp": 4, "parallel.pp_schedule": '"dualpipev"'}),
}
#: the runs on short documents (block-causal attention; a micro-batch without a document start comes plain),
#: against ``single_docs``
ON_DOCUMENTS = ("pp4_1f1b", "tp2_pp2_zbv")


@pytest.fixture(scope="module")
def docs_data(small_corpus, tmp_path_factory):
    """The small corpus cut into documents of 4 lines (about 50 tokens: most 32-token windows hold a
    document start, some none), tokenized with a 512-token BPE."""
    pieces = tmp_path_factory.mktemp("docs")
    lines = small_corpus.read_text().splitlines()
    for i in range(0, len(lines), 4):
        (pieces / f"{i:06d}.txt").write_text("\n".join(lines[i:i + 4]))
    out = tmp_path_factory.mktemp("docs_data") / "docs"
    prepare_corpus(str(pieces), str(out), None, 512, 0.1)
    return out


@pytest.fixture(scope="module")
def runs(small_data, docs_data, tmp_path_factory):
    """Every launch of this file: {name: [rank reports]} and the run root."""
    root = tmp_path_factory.mktemp("pp")
    d, out = small_data, root / "out"
    reports = {}
    for ranks in (2, 4):
        scenarios = [scenario(name, docs_data if name in ON_DOCUMENTS else d, root, {**FEW, **extra})
                     for name, (n, extra) in PIPELINES.items() if n == ranks]
        if ranks == 2:  # FSDP 2's and PP 2's step-2 checkpoints resumed at PP 2 (after both ran, this launch)
            scenarios.append(scenario("fsdp2", d, root, FEW))
            for writer in ("fsdp2", "pp2_1f1b"):
                resume = f'"{root / writer / "checkpoints" / "step-2"}"'
                scenarios.append(scenario(f"{writer.split('_')[0]}_to_pp2", d, root, {
                    **FEW, **PIPELINES["pp2_1f1b"][1], "checkpoint.resume": resume}))
        reports.update(run_scenarios(ranks, scenarios, out))
    pp2_step2 = f'"{root / "pp2_1f1b" / "checkpoints" / "step-2"}"'
    reports.update(run_scenarios(1, [
        scenario("single", d, root, {**FEW, "parallel.mode": '"single"'}),
        scenario("single_docs", docs_data, root, {**FEW, "parallel.mode": '"single"'}),
        scenario("single_deep", d, root, {**FEW, **DEEP, "parallel.mode": '"single"'}),
        scenario("pp2_to_single", d, root, {**FEW, "parallel.mode": '"single"',
                                            "checkpoint.resume": pp2_step2}),
    ], out))
    return reports, root


def history(report: list[dict]) -> dict[int, dict]:
    return {rec["step"]: rec for rec in report[0]["history"]}


@pytest.mark.dist
@pytest.mark.parametrize("name", list(PIPELINES))
def test_pipeline_equals_one_process(runs, name):
    """Each schedule at PP 2, FSDP 2 x PP 2 and PP 4 against one process over 3 steps: losses, gradient norms
    and the validation loss within 1e-6 relative, final weights within 1e-6 of the largest (measured: equal
    bit for bit at PP 2 and PP 4, the same sums in the same order), the same samples; the mesh has ``pp``
    outermost and each rank holds only its stages' parameters.

    TP 2 x PP 2 with tests/dist/test_tp_parity.py's bounds for tensor parallel (the split multiplies and
    the vocabulary-parallel loss sum in another order): losses and the validation loss within 1e-5 relative,
    gradient norms within 1e-6 relative, weights within 1e-4 of the largest (measured: losses equal; weights
    4.9e-6 under ``1f1b``, 1.7e-6 under ``zbv`` on short documents; gradient norms 5e-9 relative under
    ``1f1b``, up to 3e-7 on documents in a manual run)."""
    reports, root = runs
    single = "single_docs" if name in ON_DOCUMENTS else "single_deep" if "model.n_layers" in \
        PIPELINES[name][1] else "single"
    got, ref = history(reports[name]), history(reports[single])
    assert sorted(got) == sorted(ref) == list(range(1, STEPS + 1))
    p, q = (load_file(str(root / n / "final" / "model.safetensors")) for n in (name, single))
    loss = max(abs(got[s]["loss"] - ref[s]["loss"]) for s in ref)
    params = max((p[k] - q[k]).abs().max().item() for k in q)
    print(f"{name} vs one process: loss {loss:.1e}, params {params:.1e}")
    ranks, extra = PIPELINES[name]
    pp, tp = extra["parallel.pp"], extra.get("parallel.tp", 1)
    loose = 1e-5 if tp > 1 else 1e-6  # tensor parallel: test_tp_parity.py's bounds
    assert_close([got[s]["loss"] for s in ref], [ref[s]["loss"] for s in ref], rtol=loose, what="loss")
    assert_close([got[s]["grad_norm"] for s in ref], [ref[s]["grad_norm"] for s in ref], rtol=1e-6,
                 what="grad norm")
    assert_close(got[STEPS]["val_loss"], ref[STEPS]["val_loss"], rtol=loose, what="val loss")
    assert p.keys() == q.keys()
    assert_all_close(p, q, rtol=1e-4 if tp > 1 else 1e-6, what="params")
    assert reports[name][0]["mesh"] == ["pp", "dp_shard"] + (["tp"] if tp > 1 else [])
    # the samples of a step: those of one stage's data-parallel ranks (one per tensor-parallel group), in
    # rank order
    per_stage = ranks // pp
    ids = {s: [i for r in reports[name][:per_stage:tp] for i in r["sample_ids"][s]]
           for s in reports[name][0]["sample_ids"]}
    assert ids == reports[single][0]["sample_ids"]
    last = 0 if name.endswith(("zbv", "dualpipev")) else pp - 1  # a V: the last stage on the first rank
    for rank, report in enumerate(reports[name]):  # a stage's ranks hold its names only; all stages all names
        held = set(report["params"])
        assert ("model.embed_tokens.weight" in held) == (rank // per_stage == 0), rank
        assert ("lm_head.weight" in held) == (rank // per_stage == last), rank
    assert set().union(*(r["params"] for r in reports[name])) == set(q)


@pytest.mark.dist
def test_fsdp_checkpoint_resumes_at_pp2(runs):
    """FSDP 2's step-2 checkpoint resumes at PP 2: step 3's loss within 16 fp32 roundings of FSDP 2's own step
    3, the final weights within 1e-6 of the largest of one process's."""
    reports, root = runs
    got, writer = history(reports["fsdp2_to_pp2"]), history(reports["fsdp2"])
    assert sorted(got) == [STEPS]
    print(f"FSDP 2 -> PP 2: step {STEPS} loss {got[STEPS]['loss']:.7f} vs {writer[STEPS]['loss']:.7f}")
    assert_close(got[STEPS]["loss"], writer[STEPS]["loss"], rtol=16 * EPS, what="step-3 loss")
    p, q = (load_file(str(root / n / "final" / "model.safetensors")) for n in ("fsdp2_to_pp2", "single"))
    assert_all_close(p, q, rtol=1e-6, what="params after the resume")


@pytest.mark.dist
def test_pipeline_checkpoint_resumes_at_pp2(runs):
    """PP 2's step-2 checkpoint resumes at PP 2 and continues bit for bit: step 3's loss and gradient norm and
    the final weights equal the uninterrupted run's. (Each stage's list of parameter names in the optimizer's
    groups is saved under the same key and only one is kept; a stage that loaded another's list lost its
    AdamW settings and failed at its first step.)"""
    reports, root = runs
    got, writer = history(reports["pp2_to_pp2"]), history(reports["pp2_1f1b"])
    assert sorted(got) == [STEPS]
    for key in ("loss", "grad_norm"):
        assert got[STEPS][key] == writer[STEPS][key], key
    p, q = (load_file(str(root / n / "final" / "model.safetensors")) for n in ("pp2_to_pp2", "pp2_1f1b"))
    assert p.keys() == q.keys()
    assert all(torch.equal(p[k], q[k]) for k in q)


@pytest.mark.dist
def test_pipeline_checkpoint_resumes_in_one_process(runs):
    """PP 2's step-2 checkpoint holds the names of one process's (each stage saved its own) and resumes in one
    process: step 3's loss within 16 fp32 roundings of PP 2's own step 3, and the final weights within 1e-6 of
    the largest of one process's."""
    reports, root = runs
    keys = {name: set(FileSystemReader(str(root / name / "checkpoints" / "step-2")).read_metadata()
                      .state_dict_metadata) for name in ("pp2_1f1b", "single")}
    assert keys["pp2_1f1b"] == keys["single"]
    got, writer = history(reports["pp2_to_single"]), history(reports["pp2_1f1b"])
    assert sorted(got) == [STEPS]
    print(f"PP 2 -> one process: step {STEPS} loss {got[STEPS]['loss']:.7f} vs {writer[STEPS]['loss']:.7f}")
    assert_close(got[STEPS]["loss"], writer[STEPS]["loss"], rtol=16 * EPS, what="step-3 loss")
    p, q = (load_file(str(root / n / "final" / "model.safetensors")) for n in ("pp2_to_single", "single"))
    assert_all_close(p, q, rtol=1e-6, what="params after the resume")


@pytest.mark.dist
def test_a_non_finite_step_stops_every_stage(small_data, tmp_path):
    """PP 2 with an absurd learning rate: the loss (last stage) and the gradient norm (summed over the stages)
    turn NaN at step 2; every rank stops with one error line, no rank hangs, and the log holds only finite
    steps."""
    run = tmp_path / "run"
    proc = torchrun(2, ["-m", "shardlm.train", *tiny_overrides(small_data, run, {
        **FEW, "train.steps": 20, "train.eval_interval": 0, "checkpoint.enabled": "false", "train.lr": 1e30,
        "train.min_lr": 1e30, "train.warmup_steps": 0, "train.grad_clip": 0.0, "parallel.pp": 2})],
        check=False)
    err = proc.stdout + proc.stderr
    assert proc.returncode != 0
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "is not finite" in errors[0], err[-3000:]
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert 1 <= len(records) < 20
    assert all(math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]) for r in records)


@pytest.mark.dist
@pytest.mark.parametrize("name", ["pp2_1f1b", "pp2_zbv", "pp4_1f1b", "fsdp2_pp2", "tp2_pp2_1f1b"])
def test_export_of_a_pipeline_run_loads_in_transformers(runs, name):
    """The final export of a PP run (every stage's parameters gathered onto rank 0; under ``zbv`` the first
    and the last stage on one rank) loads in transformers with no key missing or unexpected, and its logits
    equal shardlm's model read from the same directory within 64 fp32 roundings."""
    transformers = pytest.importorskip("transformers", reason="pip install -e '.[test]'")
    _, root = runs
    final = root / name / "final"
    hf, info = transformers.AutoModelForCausalLM.from_pretrained(final, output_loading_info=True,
                                                                 dtype=torch.float32)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    tokens = torch.randint(0, 512, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got = hf.eval()(tokens).logits
        assert_close(load_model_dir(final)(tokens), got, rtol=64 * EPS, what=f"{name} logits")
    assert got.shape == (2, 32, 512)
