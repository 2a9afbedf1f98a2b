"""An objective plugged into the step from one file: a toy objective defined here, handed to the Trainer as a
factory, trains with the step's one all-reduce and reports its own metric; the step itself is untouched."""

from __future__ import annotations

import torch

from conftest import tiny_overrides
from shardlm.config import load_config
from shardlm.parallel import init_distributed
from shardlm.parallel.dist import to_device
from shardlm.train.objectives import Objective, ObjectiveContext, StepInputs
from shardlm.train.objectives.token import TokenObjective
from shardlm.train.trainer import Trainer
from tolerance import EPS, assert_close


class SequenceMeanLoss(Objective):
    """The token loss normalised per sequence instead of per token (each window's summed loss, averaged over
    the global batch's windows), with one statistic: the sequences it saw."""

    name = "toy"
    stat_names = ("sequences",)

    def __init__(self, ctx: ObjectiveContext) -> None:
        self.tokens = TokenObjective.build(ctx)
        self.data, self.device = ctx.train_data, ctx.info.device

    def prepare_step(self, step: int, micro_ids: list[list[int]], step_ids: list[int]) -> StepInputs:
        return StepInputs([to_device(self.data.get(ids), self.device) for ids in micro_ids], len(step_ids))

    def loss(self, model, batch, ids, inputs):
        numerator, _ = self.tokens.loss_sum(model, batch)
        return numerator, torch.tensor([float(len(ids))], dtype=torch.float64, device=batch.device)

    def metrics(self, sums, inputs):
        return {"toy/sequences": sums[0]}

    def describe(self) -> str:
        return "summed token loss per sequence"


def first_step(cfg, objective=None) -> tuple[dict, str]:
    """The first step's record and the run summary of a one-rank trainer with ``objective``."""
    started = torch.distributed.is_initialized()
    try:
        trainer = Trainer(cfg, init_distributed(cfg.parallel), objective=objective)
        return trainer.train_step(), trainer.summary()
    finally:
        if not started and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def test_a_toy_objective_trains_from_one_file(small_data, tmp_path):
    overrides = {"parallel.mode": '"single"', "train.global_batch_size": 8, "train.micro_batch_size": 4}
    toy, summary = first_step(load_config(None, tiny_overrides(small_data, tmp_path / "toy", overrides)),
                              SequenceMeanLoss)
    cfg = load_config(None, tiny_overrides(small_data, tmp_path / "token", overrides))
    token, _ = first_step(cfg)
    assert toy["toy/sequences"] == 8.0  # 2 micro-batches of 4, summed in the step's all-reduce
    # same start, same batch: the per-sequence mean is the per-token mean times the window's targets
    assert_close(toy["loss"], token["loss"] * cfg.train.seq_len, rtol=64 * EPS, what="per-sequence loss")
    assert "toy/sequences" not in token and toy["loss"] > 10 * token["loss"]
    assert "  toy        summed token loss per sequence" in summary.splitlines()
