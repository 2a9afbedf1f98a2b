"""``shardlm plan``'s search for what fits, its model presets and ``--model-config`` (single process,
no torchrun).

Parameter counts are checked against transformers' own models built on the meta device from the same
``config.json`` values; each suggested combination is passed back to ``shardlm plan`` and must fit there.
"""

from __future__ import annotations

import re

import pytest
import torch

from conftest import ROOT, cli_error
from shardlm.cli.main import main as shardlm_main
from shardlm.config import ConfigError, load_config
from shardlm.plan.devices import get_device
from shardlm.plan.memory import plan_memory
from shardlm.plan.presets import PRESETS, preset_config
from shardlm.plan.search import choices, search, step_seconds, variant

transformers = pytest.importorskip("transformers")

LLAMA3_8B = str(ROOT / "configs" / "llama3-8b.toml")
GIB = 1024**3


def plan_out(capsys, argv: list[str]) -> str:
    capsys.readouterr()
    assert shardlm_main(["plan", *argv]) == 0
    return capsys.readouterr().out


def suggested(out: str) -> list[tuple[list[str], float]]:
    """(flags, printed peak in GiB) of each combination ``shardlm plan`` lists under "fits with"."""
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("  fits with"))
    found = []
    for flag_line, cost_line in zip(lines[start + 1::2], lines[start + 2::2]):
        if not flag_line.startswith("    --"):
            break
        found.append((flag_line.split(), float(re.search(r"peak ([\d.]+) GiB", cost_line).group(1))))
    return found


def test_the_plan_names_what_it_plans_shows_the_rows_that_apply_and_ends_with_the_verdict(capsys):
    """The first line names the preset planned; the breakdown has no row for what the run does not have (a
    reference without preference tuning, all-gather and reduce-scatter buffers in one process); the last
    line is the verdict, its only line."""
    tiny = str(ROOT / "configs" / "shakespeare-tiny.toml")
    for argv, absent, present in [
        (["--world-size", "2", "--model-preset", "smollm2-135m"], ["preference reference"],
         ["all-gather buffers", "reduce-scatter buffers", "gradients"]),
        (["--world-size", "1", "--parallel.mode=single"],
         ["preference reference", "all-gather buffers", "reduce-scatter buffers"], ["gradients"]),
    ]:
        out = plan_out(capsys, [tiny, "--device", "cpu", *argv])
        lines = out.splitlines()
        name = "smollm2-135m (--model-preset) with the settings of " if "--model-preset" in argv else ""
        assert lines[0].startswith(f"plan | {name}shakespeare-tiny: "), lines[0]
        rows = [line.strip() for line in lines if line.endswith(" GiB") and line.startswith("    ")]
        assert rows[-1].startswith("total") and len(rows) == 10 - len(absent), rows
        assert not [r for r in rows if any(r.startswith(a) for a in absent)], rows
        assert all(any(r.startswith(p) for r in rows) for p in present), rows
        verdicts = [line for line in lines if line.startswith(("  fits:", "  does not fit:"))]
        assert verdicts == [lines[-1]] and lines[-1].startswith("  fits: "), out


def hf_param_count(config) -> int:
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())  # shared (tied) parameters once


def test_70b_preset_on_8_h100_lists_combinations_that_fit_when_passed_back(capsys):
    argv = [LLAMA3_8B, "--world-size", "8", "--device", "h100", "--model-preset", "llama3.1-70b"]
    out = plan_out(capsys, argv)
    assert "70,553,706,496 parameters" in out and "  does not fit:" in out
    lines = out.splitlines()  # the preset's name over its parameters (it printed the config's, llama3-8b)
    assert lines[0].startswith("plan | llama3.1-70b (--model-preset) with the settings of llama3-8b: "
                               "70,553,706,496 parameters"), lines[0]
    # the verdict once, after the step time, then what fits (it sat between the breakdown and the rest)
    verdict = [i for i, line in enumerate(lines) if line.startswith(("  fits:", "  does not fit:"))]
    step = next(i for i, line in enumerate(lines) if line.startswith("  step time:"))
    assert len(verdict) == 1 and verdict[0] > step + 1 and lines[verdict[0] + 1].startswith("  fits with")
    fits = suggested(out)
    assert fits, out
    sizes = [int(flags[flags.index("--world-size") + 1]) for flags, _ in fits]
    assert sizes[0] == 8 and sizes == sorted(sizes), out  # one fits on the 8 GPUs asked for
    assert (
        "--parallel.activation_checkpoint=full" in fits[0][0] and "--parallel.cpu_offload=true" in fits[0][0]
    )
    assert "~33% more compute for full AC" in out and "CPU offload ~" in out
    steps = [float(s) for s in re.findall(r"step >= ([\d.e+]+) s", out)]
    # more GPUs only when faster
    assert steps == sorted(steps, reverse=True) and len(set(steps)) == len(steps)
    _passed_back_they_fit(capsys, argv, fits)


def _passed_back_they_fit(capsys, argv: list[str], fits: list[tuple[list[str], float]]) -> None:
    for flags, peak in fits:
        again = plan_out(capsys, argv + flags)
        line = next(
            ln for ln in again.splitlines() if ln.startswith("  fits:") or ln.startswith("  does not fit:")
        )
        assert line.startswith(f"  fits: {peak:.1f} GiB of 75.7 GiB"), (flags, line)


def test_every_kind_of_flag_passed_back_fits(capsys):
    """Suggestions that change the dtype, micro-batch, resharding and gradient sync, passed back, fit
    as printed."""
    argv = [LLAMA3_8B, "--world-size", "8", "--device", "h100", "--train.micro_batch_size=2",
            "--train.global_batch_size=16", "--parallel.param_dtype=float32",
            "--parallel.activation_checkpoint=none", "--parallel.grad_sync=last_micro_batch",
            "--parallel.reshard_after_forward=false"]
    fits = suggested(plan_out(capsys, argv))
    given = {f.split("=")[0] for flags, _ in fits for f in flags if f.startswith("--")}
    assert {"--parallel.param_dtype", "--parallel.reduce_dtype", "--parallel.activation_checkpoint",
            "--train.micro_batch_size", "--parallel.reshard_after_forward"} <= given, fits
    _passed_back_they_fit(capsys, argv, fits)


def test_search_finds_what_an_exhaustive_search_finds():
    """On a small shape with a tight budget: the smallest world size where anything fits, and the fastest step
    there, are those of planning every combination."""
    cfg = load_config(None,
                      ["--model.dim=256", "--model.n_layers=4", "--model.vocab_size=8192",
                       "--train.seq_len=1024",
                             "--model.max_seq_len=1024", "--train.micro_batch_size=8",
                       "--train.global_batch_size=32",
                             "--parallel.grad_sync=last_micro_batch"])
    budget = 0.3 * plan_memory(cfg, 2, "h100").peak
    device = get_device("h100")
    params = plan_memory(cfg, 1, "h100").params
    best: dict[int, float] = {}
    for c in choices(cfg, 2, "h100"):
        try:
            var = variant(cfg, c)
            peak = plan_memory(var, c.world_size, "h100").peak
        except ConfigError:
            continue
        if peak <= budget:
            t = step_seconds(var, c.world_size, device, params)
            best[c.world_size] = min(best.get(c.world_size, t), t)
    fits = search(cfg, 2, "h100", budget)
    assert best and fits
    first = min(best)
    assert fits[0].choice.world_size == first and fits[0].step_s == pytest.approx(best[first])
    for f in fits:
        assert f.peak <= budget and f.step_s >= best[f.choice.world_size] * (1 - 1e-9)
        assert plan_memory(variant(cfg, f.choice), f.choice.world_size, "h100").peak == f.peak


def _saved(tmp_path, config, name: str):
    path = tmp_path / name
    config.save_pretrained(path)
    return path / "config.json"


def test_model_config_gives_the_parameter_count_of_transformers(tmp_path, capsys):
    """``--model-config`` on config.json files written by transformers: the plan's parameter count equals that
    of transformers' model built from the same file on the meta device."""
    cases = {
        "llama": transformers.LlamaConfig(hidden_size=1536, intermediate_size=5120, num_hidden_layers=6,
                                          num_attention_heads=12, num_key_value_heads=4, vocab_size=50000,
                                          max_position_embeddings=4096, tie_word_embeddings=False,
                                          rope_scaling={"rope_type": "llama3", "factor": 8.0,
                                                        "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                        "original_max_position_embeddings": 2048}),
        "qwen2": transformers.Qwen2Config(hidden_size=896, intermediate_size=4864, num_hidden_layers=4,
                                          num_attention_heads=14, num_key_value_heads=2, vocab_size=151936,
                                          max_position_embeddings=4096, tie_word_embeddings=True),
        "qwen3": transformers.Qwen3Config(hidden_size=1024, intermediate_size=3072, num_hidden_layers=5,
                                          num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                                          vocab_size=151936, max_position_embeddings=4096),
        "mistral": transformers.MistralConfig(hidden_size=1024, intermediate_size=3584, num_hidden_layers=3,
                                              num_attention_heads=8, num_key_value_heads=2, vocab_size=32768,
                                              max_position_embeddings=4096, sliding_window=1024),
        "gemma3_text": transformers.Gemma3TextConfig(hidden_size=640, intermediate_size=2048,
                                                     num_hidden_layers=7, num_attention_heads=4,
                                                     num_key_value_heads=1, head_dim=256, vocab_size=262144,
                                                     max_position_embeddings=4096),
    }
    for name, config in cases.items():
        file = _saved(tmp_path, config, name)
        expected = hf_param_count(transformers.AutoConfig.from_pretrained(file.parent))
        out = plan_out(capsys, [LLAMA3_8B, "--world-size", "8", "--model-config", str(file),
                                "--train.seq_len=2048"])
        assert f": {expected:,} parameters," in out.splitlines()[0], (name, out.splitlines()[0])
    # a directory works too, and the multimodal Gemma 3 config gives its language model
    file = _saved(tmp_path, transformers.Gemma3Config(text_config={"num_hidden_layers": 3}), "gemma3")
    text = transformers.AutoConfig.from_pretrained(file.parent).text_config
    with torch.device("meta"):
        expected = sum(p.numel() for p in transformers.Gemma3ForCausalLM(text).parameters())
    out = plan_out(capsys,
                   [LLAMA3_8B, "--world-size", "8", "--model-config", str(file.parent),
                    "--train.seq_len=2048"])
    assert f": {expected:,} parameters," in out.splitlines()[0]


def test_presets_have_the_parameter_count_of_transformers():
    """Every preset's shape, read by shardlm and by transformers from the same config.json values, has the
    same parameter count; three against Meta's published totals."""
    from shardlm.plan.memory import param_groups

    classes = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config,
               "qwen3": transformers.Qwen3Config, "mistral": transformers.MistralConfig,
               "gemma3_text": transformers.Gemma3TextConfig}
    counts = {}
    for name, (_, values) in PRESETS.items():
        cfg = load_config(None, ["--train.seq_len=256"])
        cfg.model = preset_config(name)
        counts[name] = param_groups(cfg, 1)[1]
        config = classes[values["model_type"]](**{k: v for k, v in values.items() if k != "model_type"})
        assert counts[name] == hf_param_count(config), name
    assert counts["llama3.1-8b"] == 8_030_261_248 and counts["llama3.1-70b"] == 70_553_706_496
    assert counts["llama3.1-405b"] == 405_853_388_800


def test_plan_presets_refuse_bad_input(tmp_path, capsys):
    argv = [LLAMA3_8B, "--world-size", "8"]
    assert "unknown model preset 'llama9'" in cli_error(capsys, ["plan", *argv, "--model-preset", "llama9"])
    err = cli_error(capsys, ["plan", *argv, "--model-preset", "qwen3-8b", "--model.n_layers=4"])
    assert "--model.n_layers and --model-preset both set the model's shape" in err
    assert "no such file" in cli_error(capsys, ["plan", *argv, "--model-config", str(tmp_path / "none.json")])
    (tmp_path / "config.json").write_text('{"model_type": "deepseek_v3", "architectures": '
                                          '["DeepseekV3ForCausalLM"]}')
    assert "model_type='deepseek_v3': not built" in cli_error(
        capsys, ["plan", *argv, "--model-config", str(tmp_path)]
    )
    err = cli_error(capsys, ["plan", *argv, "--model-preset", "smollm2-135m", "--train.seq_len=16384"])
    assert "exceeds the model's maximum model.max_seq_len=8192" in err  # checked against the preset's shape
    assert "needs a config and --world-size N" in cli_error(capsys, ["plan", LLAMA3_8B])
    listed = plan_out(capsys, ["--model-preset", "list"])
    assert len(listed.splitlines()) == len(PRESETS) and "meta-llama/Llama-3.1-405B" in listed


def test_search_under_cp_x_tp_tries_the_checkpointing_tp_models_and_counts_its_data_parallel_ranks(capsys):
    """Llama 3 8B at 128k with CP 4 x TP 2 and no checkpointing does not fit 8 H100s; the search tries only
    the modes the planner models under TP (no selective) and counts N / (cp·tp) data-parallel ranks: at 16
    GPUs two of them take the 2 sequences, so micro-batch 1 needs no accumulation. Passed back, each fits as
    printed."""
    argv = [LLAMA3_8B, "--world-size", "8", "--device", "h100", "--train.seq_len=131072",
            "--model.max_seq_len=131072", "--train.global_batch_size=2", "--train.micro_batch_size=2",
            "--parallel.cp=4", "--parallel.tp=2", "--parallel.activation_checkpoint=none"]
    out = plan_out(capsys, argv)
    assert "  does not fit:" in out
    fits = suggested(out)
    assert fits and all("--parallel.activation_checkpoint=full" in flags for flags, _ in fits), out
    assert "selective" not in out
    assert "micro-batch 1 (smaller matmuls run further below peak); 2x the GPUs" in out  # k = 2 / (2 · 1) = 1
    _passed_back_they_fit(capsys, argv, fits)
