"""An objective added in one file (issue 41): a subclass of :class:`~shardlm.train.objectives.Objective`
defined here, handed to the trainer as ``Trainer(cfg, objective=LogitSquares.build)``, trains with the step's
own loop (its denominator, its statistic sums through the step's all-reduce, its metrics in the record)."""

from __future__ import annotations

import pytest
import torch

from conftest import tiny_overrides
from shardlm.config import load_config
from shardlm.parallel.dist import to_device
from shardlm.train.objectives import Objective, ObjectiveContext, StepInputs
from shardlm.train.trainer import Trainer
from tolerance import EPS, assert_close


class LogitSquares(Objective):
    """The mean square of every logit of the input windows (drives the logits to 0)."""

    name = "logit squares"
    stat_names = ("squares", "rows")

    def __init__(self, ctx: ObjectiveContext) -> None:
        self.data, self.device, self.vocab = ctx.train_data, ctx.info.device, ctx.cfg.model.vocab_size

    @classmethod
    def build(cls, ctx: ObjectiveContext) -> LogitSquares:
        return cls(ctx)

    def prepare_step(self, step, micro_ids, step_ids):
        batches = [to_device(self.data.get(ids), self.device)[:, :-1] for ids in micro_ids]
        return StepInputs(batches, float(len(step_ids) * batches[0].shape[1] * self.vocab))

    def loss(self, model, batch, ids, inputs):
        squares = model(batch).float().pow(2).sum()
        return squares, torch.stack([squares.detach(), torch.tensor(float(len(ids)))]).double()

    def metrics(self, sums, inputs):
        return {"logit_squares": sums[0] / inputs.denominator, "rows": sums[1]}


@pytest.fixture
def one_rank_group():
    yield
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def test_an_objective_in_one_file_trains(small_data, tmp_path, one_rank_group):
    cfg = load_config(None, tiny_overrides(small_data, tmp_path / "run", {
        "train.steps": 2, "train.eval_interval": 0, "checkpoint.enabled": "false", "train.warmup_steps": 0,
        "train.micro_batch_size": 4}))
    trainer = Trainer(cfg, keep_history=True, objective=LogitSquares.build)
    assert isinstance(trainer.objective, LogitSquares)
    history = trainer.train()
    assert [r["step"] for r in history] == [1, 2]
    for r in history:  # the step's loss is Σ numerators / denominator, the metric the same sum read back
        assert r["rows"] == 8.0
        assert_close(r["loss"], r["logit_squares"], rtol=16 * EPS, what="loss vs metric")
    assert history[1]["loss"] < history[0]["loss"]
