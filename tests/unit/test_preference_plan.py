"""``shardlm plan`` of a preference config: both rows planned and the reference model named. The step itself
is tests/dist/test_preference_step.py."""

from __future__ import annotations

import pytest

from test_preference import ROOT

pytest.importorskip("transformers", reason="pip install -e '.[test]'")


def test_plan_of_a_preference_config_plans_both_rows_and_names_the_reference(capsys):
    from shardlm.cli.main import main as shardlm_main
    from shardlm.config import Config, load_config
    from shardlm.plan.memory import meta_model

    argv = [str(ROOT / "configs" / "smollm2-135m-dpo.toml"), "--world-size", "2", "--device", "cpu",
            '--model.init_from=""']
    assert shardlm_main(["plan", *argv]) == 0
    out = capsys.readouterr().out
    assert (
        "micro-batch 4 x 96 tokens" in out
        and "planned as 4 rows per micro-batch (chosen and rejected of 2 pairs)" in out
    )
    assert "reference: model, a frozen copy in the peak" in out
    lines = out.splitlines()  # the note before the verdict, the verdict last
    assert lines[-2].startswith("  preference: planned as") and lines[-1].startswith("  fits: "), out
    cfg = load_config(argv[0], argv[5:])
    n = sum(p.numel() for p in meta_model(Config(model=cfg.model)).parameters())
    row = next(line for line in out.splitlines() if "preference reference" in line)
    assert float(row.split()[-2]) >= 4 * n / 2 / 2**30  # at least the fp32 shards per rank, in the peak
    pre = ["plan", *argv, "--preference.precompute_reference=true"]
    assert shardlm_main(pre) == 0
    out_pre = capsys.readouterr().out
    total = [float(next(line for line in o.splitlines() if line.strip().startswith("total")).split()[-2])
             for o in (out, out_pre)]
    assert total[0] - total[1] >= 4 * n / 2 / 2**30 - 1e-3  # without the frozen copy: its shards less
    from shardlm.plan import plan_memory
    from shardlm.plan.preference import preference_rows

    on_gpu = plan_memory(preference_rows(cfg), 2, "h100")
    # the reference is built with the policy's offload: its shards in host memory
    cfg.parallel.cpu_offload = True
    offloaded = plan_memory(preference_rows(cfg), 2, "h100")
    shards = on_gpu.breakdown["reference"] - offloaded.breakdown["reference"]
    assert abs(shards - 4 * n / 2) < 0.01 * 4 * n / 2 and offloaded.host_bytes > shards
