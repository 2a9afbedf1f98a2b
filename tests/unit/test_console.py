"""Console and report wording (issue 34 item 7): one progress line per step count, a resumed run's wall time
summed over its attempts."""

from __future__ import annotations

import io

from shardlm.metrics.progress import PlainProgress
from shardlm.metrics.report import Run, attempt_seconds, summary_markdown


def test_plain_progress_prints_each_step_count_once():
    out = io.StringIO()
    bar = PlainProgress(8, "train", "step", interval_s=0.0, file=out)
    for step in range(1, 9):
        bar.set_postfix(loss=f"{10 - step:.3f}")  # as the trainer does: the step's values, then the step
        bar.update(1)
    bar.close()
    lines = out.getvalue().splitlines()
    assert [line.split(" step ")[0] for line in lines] == [f"train {s}/8" for s in range(1, 9)]
    assert "loss=2.000" in lines[-1]
    # a final line still comes when the last one printed is older than the position
    out = io.StringIO()
    bar = PlainProgress(8, "train", "step", interval_s=3600.0, file=out)
    bar.update(8)
    bar.close()
    assert out.getvalue().startswith("train 8/8 step (100%)") and out.getvalue().count("\n") == 1


def test_report_sums_the_wall_time_of_every_attempt(tmp_path):
    # a fresh start logged steps 1-4 (resumed from step 4's checkpoint: its later records were dropped), then
    # a resume logged 5-8, then another 9-10
    times = [1.0, 2.0, 3.0, 4.0, 0.5, 1.5, 2.5, 3.5, 0.7, 1.2]
    records = [{"step": 0, "val_loss": 5.0}] + [{"step": i + 1, "loss": 1.0, "elapsed_s": t}
                                                 for i, t in enumerate(times)]
    run = Run("r", tmp_path, records, {})
    assert attempt_seconds(run) == [4.0, 3.5, 1.2]
    assert "| 8.7 (3 attempts: 4.0 + 3.5 + 1.2) |" in summary_markdown([run])
    once = Run("s", tmp_path, records[:5], {})
    assert summary_markdown([once]).splitlines()[4].endswith("| 4.0 |")
