"""The metrics logger's sinks in one process: without TensorBoard, a rewind that drops the later steps from
every sink, and the memory figure's own axis for shard bytes."""

from __future__ import annotations

import sys

from conftest import tensorboard_scalars
from shardlm.metrics import MetricsLogger, read_metrics
from shardlm.metrics.report import make_figures


def test_metrics_logger_without_tensorboard(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # import now raises ImportError
    logger = MetricsLogger(tmp_path / "metrics.jsonl")
    logger.log({"step": 1, "loss": 2.5, "shard_bytes": [10, 10]})
    logger.close()
    assert read_metrics(tmp_path / "metrics.jsonl") == [{"step": 1, "loss": 2.5, "shard_bytes": [10, 10]}]
    assert not logger.tensorboard.enabled and not (tmp_path / "tensorboard").exists()


def test_metrics_rewind_drops_later_steps_from_every_sink(tmp_path):
    logger = MetricsLogger(tmp_path / "metrics.jsonl")
    for step in range(1, 6):
        logger.log({"step": step, "loss": float(step)})
    logger.rewind(3)  # resume from step 3: steps 4 and 5 will be logged again
    for step in (4, 5):
        logger.log({"step": step, "loss": 10.0 * step})
    logger.close()
    expect = [(1, 1), (2, 2), (3, 3), (4, 40), (5, 50)]
    assert [(r["step"], r["loss"]) for r in read_metrics(tmp_path / "metrics.jsonl")] == expect
    # the files hold each step once
    assert tensorboard_scalars(tmp_path / "tensorboard", "train/loss") == expect


def test_memory_figure_gives_shard_bytes_their_own_axis(tmp_path):
    """memory.png: process memory (hundreds of MiB) on the left axis, shard bytes (about 1 MiB, constant) on
    the right one, each line inside its own axis's range rather than flat on the bottom of a shared one."""
    from shardlm.metrics.report import Run

    records = [{"step": s, "loss": 1.0, "rss_bytes_per_rank": [(500 + s) * 2**20, (520 + s) * 2**20],
                "shard_bytes_per_rank": [1.2 * 2**20, 1.1 * 2**20]} for s in range(1, 6)]
    fig = make_figures([Run("r", tmp_path, records)])["memory"]
    process, shards = fig.axes
    assert {ln.get_label() for ln in process.lines} == {"r rss rank0", "r rss rank1"}
    assert {ln.get_label() for ln in shards.lines} == {"r shard rank0", "r shard rank1"}
    assert shards.get_ylabel() == "shard MiB (dashed)" and all(
        ln.get_linestyle() == "--" for ln in shards.lines
    )
    for ax in (process, shards):
        lo, hi = ax.get_ylim()
        for ln in ax.lines:
            y = ln.get_xydata()[:, 1]
            assert 0.02 < (y.min() - lo) / (hi - lo) and (y.max() - lo) / (hi - lo) < 0.98, (
                ln.get_label(),
                lo,
                hi,
            )
    assert len(shards.get_legend().get_texts()) == 4  # one legend names the lines of both axes
