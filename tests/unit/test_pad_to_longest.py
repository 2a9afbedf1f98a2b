"""Unpacked instruction examples and preference pairs padded to the longest row of each micro-batch
(``data.pad_multiple``): the rows are today's rows cut after the longest, the loss follows within rounding
(bit-identical where the width equals ``seq_len + 1``), and the step's token count and FLOPs count the
positions computed."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import prepare_chat_examples, tiny_overrides
from shardlm.config import load_config
from shardlm.data.instruct import IGNORE_INDEX, PADDING_DOCUMENT, InstructionExamples, row_width
from shardlm.model.decoder import CausalLM
from shardlm.parallel import init_distributed
from shardlm.train.datasets import row_multiple
from shardlm.train.loss import model_loss_sum
from shardlm.train.trainer import Trainer
from tolerance import EPS, assert_close

#: the chat examples are 17-40 tokens: rows of 64 + 1 are mostly padding
SEQ = 64


@pytest.fixture(scope="module")
def chat(tmp_path_factory, small_data):
    return prepare_chat_examples(tmp_path_factory.mktemp("pad"), small_data)


def test_row_width_rounds_up_and_caps_at_seq_len():
    assert row_width(10, 64, 8) == 17  # 9 inputs -> 16 positions, + 1
    assert row_width(17, 64, 8) == 17  # 16 inputs: already a multiple
    assert row_width(65, 64, 8) == 65  # the full sample
    assert row_width(60, 60, 64) == 61  # rounding past seq_len keeps seq_len
    assert row_width(5, 64, 0) == 65  # 0: always seq_len + 1
    assert row_width(1, 64, 8) == 9  # one token still computes a multiple


def test_row_multiple_follows_context_and_tensor_parallel():
    cfg = load_config(None, [])
    assert row_multiple(cfg) == 8
    cfg.parallel.cp, cfg.parallel.tp = 4, 1
    assert row_multiple(cfg) == 8  # 2 · cp = 8
    cfg.parallel.cp, cfg.parallel.tp = 3, 2
    assert row_multiple(cfg) == 24  # lcm(8, 2 · 3 · 2)
    cfg.data.pad_multiple = 0
    assert row_multiple(cfg) == 0


def test_trimmed_rows_are_full_rows_cut_after_the_longest(chat):
    full = InstructionExamples(str(chat), "train", SEQ)
    trimmed = InstructionExamples(str(chat), "train", SEQ, pad_multiple=8)
    for ids in ([0, 1, 2, 3], [5], list(range(len(full)))):
        a, b = full.get(ids), trimmed.get(ids)
        longest = int(full.lengths[ids].max())
        assert b.shape[2] == trimmed.width(ids) == row_width(longest, SEQ, 8)
        assert b.shape[2] >= longest and (b.shape[2] - 1) % 8 == 0 or b.shape[2] == SEQ + 1
        assert torch.equal(a[:, :, :b.shape[2]], b)
        rest = a[:, :, b.shape[2]:]
        assert (rest[:, 1] == IGNORE_INDEX).all() and (rest[:, 2] == PADDING_DOCUMENT).all()
    assert trimmed.width([0, 1, 2, 3]) < SEQ + 1  # the chats are short: something is trimmed


def test_loss_of_trimmed_rows_equals_full_rows(chat):
    """Causal attention: a real position sees nothing after it, so padding after the longest row changes only
    the reduction's shape (within rounding); at the full width the rows and the loss are bit-identical."""
    from shardlm.model.config import ModelConfig
    torch.manual_seed(0)
    model = CausalLM(ModelConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=64, vocab_size=512,
                                 max_seq_len=64))
    full = InstructionExamples(str(chat), "train", SEQ)
    trimmed = InstructionExamples(str(chat), "train", SEQ, pad_multiple=8)
    ids = [0, 1, 2, 3]
    losses = []
    for data in (full, trimmed):
        batch = data.get(ids)
        losses.append(model_loss_sum(model, batch[:, 0, :-1], batch[:, 1, 1:], 16))
    assert trimmed.get(ids).shape[2] < SEQ + 1
    assert_close(losses[1], losses[0], rtol=64 * EPS, what="summed token loss, trimmed vs full rows")
    wide = InstructionExamples(str(chat), "train", SEQ, pad_multiple=SEQ)  # always the full width
    assert torch.equal(wide.get(ids), full.get(ids))


def first_record(cfg) -> dict:
    started = torch.distributed.is_initialized()
    try:
        trainer = Trainer(cfg, init_distributed(cfg.parallel))
        records = [trainer.train_step() for _ in range(2)]
        return {"records": records, "summary": trainer.summary(), "widths": [
            trainer.train_data.width(ids) for ids in trainer.sampler.micro_batches(0, 0, 1, 4)]}
    finally:
        if not started and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def test_training_on_trimmed_rows_counts_computed_positions(chat, tmp_path):
    base = {"parallel.mode": '"single"', "data.format": '"instruct"', "train.global_batch_size": 8,
            "train.micro_batch_size": 4, "train.loss_chunk_tokens": 16, "train.seq_len": SEQ}
    out = {}
    for m in (0, 8):
        cfg = load_config(None, tiny_overrides(chat, tmp_path / f"m{m}", {**base, "data.pad_multiple": m}))
        out[m] = first_record(cfg)
    for a, b in zip(out[0]["records"], out[8]["records"]):
        assert_close(b["loss"], a["loss"], rtol=64 * EPS, what="step loss, trimmed vs full rows")
        assert_close(b["grad_norm"], a["grad_norm"], rtol=4096 * EPS, what="grad norm, trimmed vs full")
    full, trimmed = out[0]["records"][0], out[8]["records"][0]
    positions = 4 * sum(w - 1 for w in out[8]["widths"])
    assert positions < 8 * SEQ
    ratio = trimmed["tokens_per_s"] * trimmed["step_time_s"] / (full["tokens_per_s"] * full["step_time_s"])
    assert_close(ratio, positions / (8 * SEQ), rtol=16 * EPS, what="computed positions / full positions")
    assert trimmed["flops_per_step_per_rank"] < full["flops_per_step_per_rank"]
    assert "each micro-batch padded to its longest, a multiple of 8" in out[8]["summary"]
    assert "padded to its longest" not in out[0]["summary"]
    assert np.all(np.asarray(out[8]["widths"]) <= SEQ + 1)
