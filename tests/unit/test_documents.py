"""Document boundaries beyond the model: where prepared data records them, what ``shardlm prepare`` prints,
what the planner counts (packing, block-causal FLOPs, the mask), block-causal evaluation, resume of older
checkpoints, and mixtures. The data fixtures and helpers are tests/unit/test_packing.py's."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from conftest import cli_error
from shardlm.config import load_config
from shardlm.data.instruct import InstructionExamples
from shardlm.data.loader import TokenWindows
from shardlm.data.packing import DocumentWindows, PackedExamples
from shardlm.data.prepare import load_meta, prepare_corpus
from shardlm.errors import ConfigError, DataError
from shardlm.model import attention as doc_attention
from shardlm.model.config import ModelConfig
from shardlm.model.decoder import CausalLM
from test_packing import ROOT, SEQ, WORDS, prepare_chat_data, prepare_doc_data, prepare_mixture_data
from tolerance import assert_close


@pytest.fixture(scope="module")
def packed_data(small_data, tmp_path_factory):
    """tests/unit/test_packing.py's chat examples, prepared as instruction data."""
    return prepare_chat_data(tmp_path_factory.mktemp("packed"), small_data / "tokenizer.json")


@pytest.fixture(scope="module")
def doc_data(small_data, tmp_path_factory):
    """tests/unit/test_packing.py's 60 documents, prepared as a text stream."""
    return prepare_doc_data(tmp_path_factory.mktemp("docs"), small_data / "tokenizer.json")


@pytest.fixture(scope="module")
def mixture_data(doc_data, small_data, tmp_path_factory):
    """The same documents as a mixture of two sources."""
    return prepare_mixture_data(tmp_path_factory.mktemp("mix"), doc_data.parent / "docs.jsonl",
                                small_data / "tokenizer.json")


def test_prepare_prints_the_packing_and_the_documents(packed_data, doc_data, small_data, tmp_path, capsys):
    """``shardlm prepare`` with data.pack prints the packing at train.seq_len (rows, fill, padding saved); on
    text data it prints the recorded documents."""
    from shardlm.cli.main import main as shardlm_main

    base = ["prepare", "--config", str(ROOT / "configs/shakespeare-tiny.toml"), f"--train.seq_len={SEQ}",
            f"--data.tokenizer={small_data / 'tokenizer.json'}", "--data.val_fraction=0.1",
            "--model.vocab_size=512"]
    capsys.readouterr()
    assert shardlm_main(base + ["--data.format=instruct", "--data.pack=true",
                                "--model.attention=block_causal",
                                f"--data.corpus={packed_data.parent / 'chat.jsonl'}",
                                f"--data.dir={tmp_path / 'i'}"]) == 0
    out = capsys.readouterr().out
    packed = PackedExamples(InstructionExamples(str(tmp_path / "i"), "train", SEQ, skip_untrainable=True), 0)
    assert f"  packing   {packed.summary()}" in out.splitlines()
    assert f"padding {packed.padding:,} tokens instead of {packed.unpacked_padding:,} unpacked" in out
    assert shardlm_main(base + [f"--data.corpus={doc_data.parent / 'docs.jsonl'}",
                                f"--data.dir={tmp_path / 't'}"]) == 0
    meta = load_meta(str(tmp_path / "t"))
    mean = (meta["train_tokens"] + meta["val_tokens"]) / 60
    assert (
        f"  documents 60 (mean {mean:,.1f} tokens; their starts recorded in document_starts.bin"
        in capsys.readouterr().out
    )


def test_prepared_data_records_where_documents_start(doc_data, small_data, tmp_path):
    """meta.json records one start per document; they are the positions after each separator; a document whose
    text holds the separator's own string stays one document (the separator rule would cut it: the control);
    data without the record (prepared before it) falls back to the separator."""
    meta = load_meta(str(doc_data))
    starts = np.fromfile(doc_data / meta["document_starts"]["file"], dtype="<i8")
    assert meta["document_starts"]["count"] == meta["documents"] == 60 == len(starts)
    stream = np.concatenate([np.fromfile(doc_data / s["file"], dtype=meta["dtype"]) for s in meta["shards"]])
    eod = meta["special_ids"]["eod"]
    assert starts.tolist() == [0] + (np.flatnonzero(stream == eod) + 1).tolist()[:-1]
    # a document holding the separator's string: one document for the record, two for the separator rule
    texts = [" ".join(WORDS[i:i + 12]) for i in range(0, 36, 12)]
    texts[1] = texts[1][:20] + " <|end_of_document|> " + texts[1][20:]
    (tmp_path / "c.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    prepare_corpus(str(tmp_path / "c.jsonl"), str(tmp_path / "d"), str(small_data / "tokenizer.json"), 512,
                   0.05)
    windows = TokenWindows(str(tmp_path / "d"), "train", 80)
    recorded, by_eod = DocumentWindows(windows, eod), DocumentWindows(windows, eod)
    by_eod.source = "eod"  # the rule data without a record falls back to
    assert recorded.source == "recorded"
    tokens = windows.get([0])[0]
    assert int((tokens == eod).sum()) >= 3  # the literal string became the separator's id
    assert recorded.get([0])[0, 2].max() < by_eod.get([0])[0, 2].max()
    assert recorded.num_targets([0]) == by_eod.num_targets([0]) + 1
    meta = load_meta(str(tmp_path / "d"))
    del meta["document_starts"]
    (tmp_path / "d" / "meta.json").write_text(json.dumps(meta))
    old = DocumentWindows(TokenWindows(str(tmp_path / "d"), "train", 80), eod)
    assert old.source == "eod" and torch.equal(old.get([0]), by_eod.get([0]))
    with pytest.raises(DataError, match="records no document starts and has no end-of-document token"):
        DocumentWindows(TokenWindows(str(tmp_path / "d"), "train", 80), None)


def test_planner_counts_packing_block_causal_flops_and_the_mask(packed_data, doc_data):
    """The planner reads the prepared data: the attention context Σ n² / T of the samples equals the documents
    the training batches carry (pre-training windows and packed rows); FLOPs per token drop by 12·L·H·Q·(T -
    context); the planned peak grows by the dense mask, which is the bytes the model's sdpa masks hold; the
    report states fill, trained tokens, context and mask. Causal attention is unchanged."""
    from shardlm.data.packing import batch_documents
    from shardlm.plan import plan_memory
    from shardlm.plan.documents import document_mask_bytes, document_shape, window_context
    from shardlm.plan.report import format_plan
    from shardlm.plan.time import flops_per_token

    assert window_context(np.array([0, 4, 12, 13]), 2, 9) == pytest.approx((16 + 25 + 4 + 1 + 36) / 18)

    def context_of(batch):  # Σ n² / T of the documents the model gets
        docs = batch_documents(batch)
        return float(
            sum((torch.unique_consecutive(r, return_counts=True)[1].double() ** 2).sum() for r in docs)
            / docs.numel()
        )
    base = [f"--train.seq_len={SEQ}", "--model.attention=block_causal", "--train.micro_batch_size=2",
            "--train.global_batch_size=4", "--parallel.mode=single",
            "--model.attention_backend=sdpa"]  # the dense mask the planner counts (per_document holds none)
    text = load_config(str(ROOT / "configs/shakespeare-tiny.toml"), base + [f"--data.dir={doc_data}"])
    windows = DocumentWindows(TokenWindows(str(doc_data), "train", SEQ),
                              load_meta(str(doc_data))["special_ids"]["eod"])
    shape = document_shape(text)
    every = list(range(len(windows)))
    assert shape.samples == len(windows) and shape.context == pytest.approx(context_of(windows.get(every)))
    assert (
        shape.targets == pytest.approx(windows.num_targets(every) / len(windows))
        and shape.context < 0.8 * SEQ
    )
    packed_cfg = load_config(str(ROOT / "configs/shakespeare-tiny.toml"), base + [
        f"--data.dir={packed_data}", "--data.format=instruct", "--data.pack=true"])
    packed = PackedExamples(InstructionExamples(str(packed_data), "train", SEQ, skip_untrainable=True),
                            packed_cfg.train.seed)
    pshape = document_shape(packed_cfg)
    rows = packed.get(list(range(len(packed))))
    assert pshape.context == pytest.approx(context_of(rows)) and pshape.fill == packed.fill
    assert pshape.targets == pytest.approx(packed.num_targets(list(range(len(packed)))) / len(packed))
    causal = load_config(str(ROOT / "configs/shakespeare-tiny.toml"), base + [f"--data.dir={doc_data}",
                                                                             "--model.attention=causal"])
    m = text.model
    assert flops_per_token(causal) - flops_per_token(text) == pytest.approx(
        12 * m.n_layers * m.n_heads * m.head_dim * (SEQ - shape.context))
    assert document_shape(causal).context == SEQ
    mask = document_mask_bytes(text, 4, "cpu")
    real = doc_attention.document_masks(batch_documents(windows.get([0, 1])), {0}, "sdpa")
    assert mask == sum(t.nbytes for t in real.values()) == 2 * SEQ * SEQ * 4
    assert plan_memory(text, 1).peak - plan_memory(causal, 1).peak == mask
    report = format_plan(text, 1, "cpu", 0.05)
    assert f"block-causal attention: context {shape.context:,.1f} of {SEQ} tokens per sequence" in report, (
        report
    )
    assert f"fill {100 * pshape.fill:.1f}%" in format_plan(packed_cfg, 1, "cpu", 0.05)
    unpacked = load_config(str(ROOT / "configs/shakespeare-tiny.toml"), base + [
        f"--data.dir={packed_data}", "--data.format=instruct"])
    # as training says
    assert "no response token within the first 65 tokens" in document_shape(unpacked).source
    unpacked = load_config(str(ROOT / "configs/shakespeare-tiny.toml"), base + [
        f"--data.dir={packed_data}", "--data.format=instruct", "--train.seq_len=256",
        "--model.max_seq_len=256"])
    ushape = document_shape(unpacked)
    plain = InstructionExamples(str(packed_data), "train", 256)
    assert ushape.samples == len(plain) and ushape.context == 256
    lengths = np.minimum(np.diff(plain.offsets), 257)
    assert ushape.fill == pytest.approx(lengths.sum() / (len(plain) * 257)) and ushape.fill < pshape.fill
    assert "data.pack = true would put several examples in a row" in format_plan(unpacked, 1, "cpu", 0.05)
    assert "block-causal" not in format_plan(causal, 1, "cpu", 0.05)


def test_block_causal_eval_equals_each_document_alone(doc_data, small_data, tmp_path, monkeypatch, capsys):
    """``evaluate_tokens`` with document starts (windows of several documents packed into one row,
    block-causal) equals evaluating each document alone (loss 1e-6 relative, the same token count) in fewer
    forward rows; the whole stream under causal attention differs (the control); ``shardlm eval --attention
    block_causal`` on an exported model gives the same figures from text, and on the prepared data's
    validation split (its recorded document starts); prepared data of another tokenizer is refused."""
    from shardlm.convert.hf_out import save_model_dir
    from shardlm.data import load_tokenizer, read_documents, special_token_ids
    from shardlm.eval import perplexity
    from shardlm.parallel import DistInfo

    monkeypatch.setattr(perplexity, "all_reduce_sum", lambda t: t)  # one process, no process group
    info = DistInfo(0, 0, 1, torch.device("cpu"), "gloo")
    cfg = ModelConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=128, vocab_size=512,
                      max_seq_len=64)
    model = CausalLM(cfg)
    model.init_weights(0)
    tok = load_tokenizer(str(small_data / "tokenizer.json"))
    corpus = doc_data.parent / "docs.jsonl"
    stream, starts = perplexity.document_stream(read_documents(str(corpus)), tok, special_token_ids(tok))
    assert starts == np.fromfile(doc_data / "document_starts.bin", dtype="<i8").tolist()  # as prepared
    for context, stride in ((64, 32), (24, 10)):  # documents shorter and longer than the context
        packed = perplexity.evaluate_tokens(model, stream, info, 4, context, False, stride, starts)
        assert model.cfg.attention == cfg.attention == "auto"  # the caller's model is left as it was
        bounds = [*starts, len(stream)]
        alone = [perplexity.evaluate_tokens(model, stream[s:t], info, 4, context, False, stride)
                 for s, t in zip(bounds[:-1], bounds[1:])]
        assert packed.tokens == sum(a.tokens for a in alone) == len(stream) - len(starts)
        assert_close(packed.loss_sum, sum(a.loss_sum for a in alone), rtol=1e-6,
                     what=f"loss sum, context {context} stride {stride}")
        assert packed.windows == sum(a.windows for a in alone)
        whole = perplexity.evaluate_tokens(model, stream, info, 4, context, False, stride)
        # (measured 5.9e-4 at 64 / 32; the tolerance is 1e-6)
        assert abs(whole.mean_loss - packed.mean_loss) > 1e-4
    windows = perplexity.document_windows(starts, len(stream), 64, 32)
    # short ones share a row (measured 99 rows, 104)
    assert len(perplexity._rows(windows, 64, True)) < len(windows)
    model_dir = save_model_dir(model.state_dict(), cfg, tmp_path / "m", small_data / "tokenizer.json")
    from shardlm.cli.main import main as shardlm_main

    capsys.readouterr()
    assert shardlm_main(["eval", "--model", str(model_dir), "--data", str(corpus), "--context", "64",
                         "--json", "--attention", "block_causal"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    ref = perplexity.evaluate_tokens(model, stream, info, 8, 64, False, 32, starts)
    assert out["attention"] == "block_causal" and out["tokens"] == ref.tokens
    assert_close(out["mean_loss"], ref.mean_loss, rtol=1e-6, what="mean loss")
    # on the prepared data: its validation split, cut at the recorded document starts
    val = TokenWindows(str(doc_data), "val", 1).stream
    tokens = val.read(0, val.num_tokens).tolist()
    val_starts = [0] + [int(i) for i in val.starts_in(0, val.num_tokens) if i > 0]
    assert shardlm_main(["eval", "--model", str(model_dir), "--data", str(doc_data), "--context", "64",
                         "--json", "--attention", "block_causal"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    ref = perplexity.evaluate_tokens(model, tokens, info, 8, 64, False, 32, val_starts)
    assert out["tokens"] == ref.tokens == len(tokens) - len(val_starts) and len(val_starts) > 3
    assert_close(out["mean_loss"], ref.mean_loss, rtol=1e-6, what="mean loss, prepared data")
    (model_dir / "tokenizer.json").write_text((model_dir / "tokenizer.json").read_text() + "\n")
    err = cli_error(capsys, ["eval", "--model", str(model_dir), "--data", str(doc_data)])
    assert "was prepared with another tokenizer.json than the model's" in err


def test_a_checkpoint_without_the_attention_field_resumes_only_as_causal():
    """A checkpoint written before ``model.attention`` existed trained with causal attention: resuming it
    under block-causal (or packed) is refused with the field named, under causal it is no change; a prepared
    data record without document starts (older) is not a data difference; other document starts are."""
    from shardlm.checkpoint.resume_config import REFUSED, config_changes, data_problems

    old = load_config(None, []).to_dict()
    del old["model"]["attention"], old["data"]["pack"]
    assert config_changes(old, load_config(None, ["--model.attention=causal"]).to_dict()) == []
    (change,) = config_changes(old, load_config(None, ["--model.attention=block_causal"]).to_dict())
    assert (change.key, change.old, change.new, change.rule) == ("model.attention", "causal", "block_causal",
                                                                 REFUSED)
    assert (
        'model.attention: "causal" -> "block_causal" (refused: a run continues with the attention'
        in change.line()
    )
    meta = {"content_sha256": "ab", "document_starts": {"file": "document_starts.bin", "count": 3}}
    assert data_problems({"data": {"content_sha256": "ab"}}, meta, None) == []
    other = {**meta, "document_starts": {"file": "document_starts.bin", "count": 4}}
    assert data_problems({"data": meta}, other, None) != []


def test_mixture_windows_keep_each_sources_documents(mixture_data):
    """Block-causal windows over a mixture (train and interleaved validation): each window's tokens, labels
    and document index are those of its source's own window, from that source's recorded document starts."""
    from shardlm.data.mixture import MixtureWindows

    eod = load_meta(str(mixture_data / "a"))["special_ids"]["eod"]
    for split, interleave in (("train", False), ("val", True)):
        sources = [TokenWindows(str(mixture_data / n), split, SEQ) for n in ("a", "b")]
        mixed = DocumentWindows(MixtureWindows(sources, interleave=interleave), eod)
        assert mixed.source == "recorded"
        ids = list(range(len(mixed)))
        batch = mixed.get(ids)
        for j in ids:
            src, w = mixed.windows._locate(j)
            assert torch.equal(batch[j], DocumentWindows(sources[src], eod).get([w])[0]), (split, j)
        assert batch[:, 2].max() > 0  # windows cross documents
        assert mixed.num_targets(ids) == int((batch[:, 1, 1:] != -100).sum())


@pytest.mark.parametrize("attention", ["causal", "block_causal"])
def test_documents_longer_than_a_window_continue_in_the_next_windows(doc_data, attention):
    """The rule for pre-training documents longer than ``train.seq_len`` (windows of L + 1 tokens, L = 8 here,
    through the trainer's own ``build_datasets``): window i is stream tokens [i(L+1), (i+1)(L+1)), so every
    token of the split is in exactly one window (only a partial last window is dropped) and a long document's
    pieces sit in consecutive windows. In each window every token but the first is a target, once: the first
    token of each window is never a target (its predecessor ends the previous window, as torchtitan's
    non-overlapping windows) and, under block-causal attention, neither is a document's first token. A piece
    continuing a document is its window's document 0: rotary positions restart at 0 at the window's first
    token and it attends only within the window. Under causal attention windows carry no documents: positions
    are 0 .. L-1 and attention crosses the documents inside a window."""
    from shardlm.config import Config
    from shardlm.data.instruct import split_batch
    from shardlm.data.packing import batch_documents
    from shardlm.train.datasets import build_datasets

    seq = 8
    cfg = Config()
    cfg.data.dir, cfg.train.seq_len, cfg.model.attention = str(doc_data), seq, attention
    meta = load_meta(str(doc_data))
    data = build_datasets(cfg, meta, attention == "block_causal").train
    n, window = len(data), seq + 1
    stream = data.windows.stream if attention == "block_causal" else data.stream
    tokens = torch.from_numpy(stream.read(0, stream.num_tokens).astype(np.int64))
    batch = data.get(list(range(n)))  # every window, in stream order
    inputs, targets = split_batch(batch)
    assert 0 <= stream.num_tokens - n * window < window  # nothing lost but a partial last window
    assert torch.equal(torch.cat([inputs, (batch[:, 0] if batch.dim() == 3 else batch)[:, -1:]], 1).flatten(),
                       tokens[:n * window])  # each token once, in order
    # the trained pairs (input j -> target j + 1 of the stream): all but the window-crossing ones (and,
    # block-causal, those whose target starts a document); none twice
    starts = torch.zeros(stream.num_tokens, dtype=torch.bool)
    starts[torch.from_numpy(stream.starts_in(0, stream.num_tokens))] = True
    position = torch.arange(n * window).view(n, window)
    scored = targets != -100
    expected = torch.ones(n, seq, dtype=torch.bool)
    if attention == "block_causal":
        expected &= ~starts[position[:, 1:]]
    assert torch.equal(scored, expected) and torch.equal(targets[scored], tokens[position[:, 1:]][scored])
    assert data.num_targets(list(range(n))) == int(scored.sum())
    # documents longer than two windows: their pieces in consecutive windows, each piece after the first its
    # window's document 0 with positions from 0 at the window's first token
    doc_starts = stream.starts_in(0, stream.num_tokens).tolist() + [stream.num_tokens]
    long = [(a, b) for a, b in zip(doc_starts, doc_starts[1:]) if b - a > 2 * window and b <= n * window]
    assert len(long) >= 3
    documents = batch_documents(batch)
    assert (documents is None) == (attention == "causal")
    for a, b in long:
        first, last = a // window, (b - 1) // window
        assert last - first >= 2
        for w in range(first + 1, last + 1):  # the windows the document continues into
            piece = min(b, (w + 1) * window) - w * window  # its tokens in window w, from the window's first
            assert torch.equal(batch[w, 0, :piece] if batch.dim() == 3 else batch[w, :piece],
                               tokens[w * window:w * window + piece])
            if attention == "block_causal":
                inputs_of_piece = min(piece, seq)
                assert documents[w, :inputs_of_piece].eq(0).all()
                positions = doc_attention.document_positions(documents[w:w + 1])[0, :inputs_of_piece]
                assert torch.equal(positions, torch.arange(inputs_of_piece))


def _trainer_steps(overrides: list[str], steps: int):
    """A one-process Trainer of ``overrides`` (its process group of one rank) and the records of
    ``steps`` steps."""
    from shardlm.parallel import init_distributed
    from shardlm.train.trainer import Trainer

    cfg = load_config(None, overrides)
    started = torch.distributed.is_initialized()
    try:
        trainer = Trainer(cfg, init_distributed(cfg.parallel))
        summary = trainer.summary()
        records = [trainer.train_step() for _ in range(steps)]
        if steps and cfg.checkpoint.enabled:
            trainer.checkpointer.save(trainer.model, trainer.optimizer, trainer.scheduler, trainer.step)
            trainer.checkpointer.close()
    finally:
        if not started and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    return trainer, summary, records


def test_new_runs_train_block_causal_by_their_data_and_resumed_runs_keep_theirs(
        doc_data, packed_data, small_data, tmp_path, capsys):
    """``model.attention = "auto"`` (the default): a new run on pre-training data that records its document
    starts trains block-causal (the summary says so; its losses equal an explicit block_causal run's bit for
    bit and differ from causal's, the batch crossing documents); packed instruction data (``data.pack`` alone)
    trains block-causal, unpacked instruction data causal; data whose preparation recorded no starts falls
    back to causal with one warning naming the missing file and the fix, and ``shardlm prepare`` then records
    them; resuming a causal checkpoint without the setting continues causal bit for bit; windows within one
    document (the small corpus is one document) train exactly as explicit causal; the planner resolves
    ``auto`` the same."""
    import shutil

    from conftest import tiny_overrides
    from shardlm.cli.main import main as shardlm_main
    from shardlm.data.attention_choice import choose_attention
    from shardlm.plan.documents import planned_attention
    from shardlm.train.datasets import resolve_attention

    common = {"train.seq_len": SEQ, "train.global_batch_size": 4, "train.micro_batch_size": 2,
              "train.eval_interval": 0, "parallel.mode": '"single"', "checkpoint.interval": 0}
    runs = tmp_path / "runs"

    def overrides(data, name, **extra):
        return tiny_overrides(data, runs / name, {**common, **extra})

    auto, summary, a = _trainer_steps(overrides(doc_data, "auto"), 2)
    assert auto.cfg.model.attention == "block_causal" and planned_attention(load_config(None, overrides(
        doc_data, "x"))) == "block_causal"
    assert ("attention  block_causal (backend per_document, per-document positions); auto: pre-training data "
            "with recorded document starts; documents from the recorded starts") in summary, summary
    assert auto.train_data.get(auto.sampler.step_ids(0))[:, 2].max() > 0  # step 1's windows cross documents
    _, _, b = _trainer_steps(overrides(doc_data, "block", **{"model.attention": '"block_causal"'}), 2)
    causal, summary, c = _trainer_steps(overrides(doc_data, "causal", **{"model.attention": '"causal"'}), 2)
    assert [r["loss"] for r in a] == [r["loss"] for r in b]
    assert abs(a[0]["loss"] - c[0]["loss"]) > 1e-4 and "attention  causal; set in model.attention" in summary
    # explicit causal: today's plain windows, no document channel
    assert type(causal.train_data) is TokenWindows
    # resuming the causal run's checkpoint without the setting: causal, bit for bit as its own next step
    _, _, c3 = _trainer_steps(overrides(doc_data, "causal3", **{"model.attention": '"causal"'}), 3)
    step2 = runs / "causal" / "checkpoints" / "step-2"
    resumed, summary, r = _trainer_steps(overrides(doc_data, "causal", **{"checkpoint.resume": f'"{step2}"'}),
                                         1)
    assert resumed.step == 3 and resumed.cfg.model.attention == "causal" and r[0]["loss"] == c3[2]["loss"]
    assert "auto: the resumed checkpoint's" in summary
    auto_ckpt = runs / "auto" / "checkpoints" / "step-2"  # the resolved value is what the run records
    assert (
        json.loads((auto_ckpt / "manifest.json").read_text())["config"]["model"]["attention"]
        == "block_causal"
    )
    assert json.loads((runs / "auto" / "config.json").read_text())["model"]["attention"] == "block_causal"
    with pytest.raises(ConfigError, match='model.attention changed "block_causal" -> "causal"'):
        _trainer_steps(overrides(doc_data, "auto", **{"checkpoint.resume": f'"{auto_ckpt}"',
                                                      "model.attention": '"causal"'}), 0)
    # a checkpoint from before the field
    assert resolve_attention(load_config(None, []), {}).attention == "causal"
    pairs = load_config(None, [])
    pairs.data.format = "preference"
    assert choose_attention(pairs).attention == "causal" and planned_attention(pairs) == "causal"
    # instruction data: packed -> block-causal (data.pack alone), one example per sample -> causal
    chat = {"data.format": '"instruct"', "data.corpus": f'"{packed_data.parent / "chat.jsonl"}"',
            "data.val_fraction": 0.1, "checkpoint.enabled": "false"}
    packed, summary, _ = _trainer_steps(overrides(packed_data, "packed", **chat, **{"data.pack": "true"}), 0)
    assert packed.cfg.model.attention == "block_causal" and "auto: packed instruction examples" in summary
    unpacked, summary, _ = _trainer_steps(overrides(packed_data, "unpacked", **chat, **{
        "train.seq_len": 256, "model.max_seq_len": 256}), 0)
    assert unpacked.cfg.model.attention == "causal" and "auto: one instruction example per sample" in summary
    # data prepared before document starts were recorded: causal, with the warning; `shardlm prepare` fixes it
    old = tmp_path / "old"
    shutil.copytree(doc_data, old)
    meta = json.loads((old / "meta.json").read_text())
    del meta["document_starts"]
    (old / "meta.json").write_text(json.dumps(meta))
    (old / "document_starts.bin").unlink()
    capsys.readouterr()
    fallback, summary, f = _trainer_steps(overrides(old, "old", **{"checkpoint.enabled": "false"}), 1)
    err = capsys.readouterr().err
    warnings = [line for line in err.splitlines() if "document_starts.bin missing" in line]
    assert warnings == [f"warning: {old / 'document_starts.bin'} missing (the data was prepared before "
                        "shardlm recorded where documents start): training with causal attention across "
                        "documents; run `shardlm prepare` with this config again to train block-causal (or "
                        "set model.attention)"]
    # the same tokens, causal
    assert fallback.cfg.model.attention == "causal" and f[0]["loss"] == c[0]["loss"]
    assert planned_attention(load_config(None, overrides(old, "x"))) == "causal"
    assert shardlm_main(["prepare", "--config", str(ROOT / "configs/shakespeare-tiny.toml"),
                         *overrides(old, "x")]) == 0
    assert "records no document starts; preparing it again" in capsys.readouterr().err
    assert (old / "document_starts.bin").is_file()
    assert planned_attention(load_config(None, overrides(old, "x"))) == "block_causal"
    # one document per window (the small corpus is one text): block-causal windows are causal's, bit for bit
    one, _, o = _trainer_steps(overrides(small_data, "one", **{"checkpoint.enabled": "false"}), 2)
    _, _, oc = _trainer_steps(overrides(small_data, "onec", **{"checkpoint.enabled": "false",
                                                               "model.attention": '"causal"'}), 2)
    assert one.cfg.model.attention == "block_causal" and [x["loss"] for x in o] == [x["loss"] for x in oc]
    assert [x["flops_per_step_per_rank"] for x in o] == [x["flops_per_step_per_rank"] for x in oc]


def test_logged_flops_count_the_attention_of_each_document(packed_data, doc_data, tmp_path):
    """The trainer's FLOPs (and so its MFU) count block-causal attention per document: a batch of known
    document lengths gives exactly 6·N·tokens + 12·L·H·Q·Σ n² computed by hand; a logged packed step and a
    block-causal window step equal that formula on their rows' documents exactly; causal's figure is the old
    6N + 12·L·H·Q·T per token bit for bit; the planner's FLOPs per step equal the trainer's on the same
    (whole) data."""
    from conftest import tiny_overrides
    from shardlm.metrics.flops import model_flops, model_flops_per_token, squared_document_lengths
    from shardlm.plan.time import flops_per_token
    from shardlm.train.step_metrics import step_model_flops

    cfg = ModelConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=96, vocab_size=128,
                      max_seq_len=64)
    n = sum(p.numel() for name, p in CausalLM(cfg).named_parameters() if name != "model.embed_tokens.weight")
    documents = torch.tensor([[0, 0, 0, 1, 1, 2, 2, 2], [0] * 8])  # lengths 3, 2, 3 and 8
    assert squared_document_lengths(documents) == 9 + 4 + 9 + 64
    assert model_flops(cfg, 16, 86) == 6 * n * 16 + 12 * 2 * 4 * 16 * 86
    # causal: Σ n² = T² per sequence
    assert model_flops(cfg, 16, 2 * 64) == model_flops_per_token(cfg, 8) * 16

    common = {"train.seq_len": SEQ, "train.global_batch_size": 4, "train.micro_batch_size": 2,
              "train.eval_interval": 0, "parallel.mode": '"single"', "checkpoint.enabled": "false"}
    chat = {"data.format": '"instruct"', "data.corpus": f'"{packed_data.parent / "chat.jsonl"}"',
            "data.val_fraction": 0.1, "data.pack": "true"}

    def hand(model, squares):  # the formula, written out: 6·N·tokens + 12·L·H·Q·Σ n²
        return (
            6
            * (
                sum(
                    p.numel()
                    for name, p in CausalLM(model).named_parameters()
                    if name != "model.embed_tokens.weight"
                )
            )
            * 4
            * SEQ
            + 12 * model.n_layers * model.n_heads * model.head_dim * squares
        )

    packed, _, (p,) = _trainer_steps(tiny_overrides(packed_data, tmp_path / "p", {**common, **chat}), 1)
    rows, lengths = packed.train_data.rows, np.diff(packed.train_data.examples.offsets)
    squares = 0
    for r in packed.sampler.step_ids(0):
        placed = [min(int(lengths[e]), SEQ + 1) for e in rows[r]]
        placed = [x for x in placed + [SEQ + 1 - sum(placed)] if x]  # the padding: a document of its own
        placed[-1] -= 1  # the inputs are the row's first SEQ tokens
        squares += sum(x * x for x in placed)
    assert squares < 4 * SEQ * SEQ and p["flops_per_step_per_rank"] == hand(packed.cfg.model, squares)
    assert p["mfu"] == p["flops_per_step_per_rank"] / (p["step_time_s"] * p["peak_flops_per_rank"])
    windows, _, (w,) = _trainer_steps(tiny_overrides(doc_data, tmp_path / "w", common), 1)
    docs = windows.train_data.get(windows.sampler.step_ids(0))[:, 2, :-1]
    squares = sum(int((torch.unique_consecutive(row, return_counts=True)[1] ** 2).sum()) for row in docs)
    assert squares < 4 * SEQ * SEQ and w["flops_per_step_per_rank"] == hand(windows.cfg.model, squares)
    causal, _, (c,) = _trainer_steps(tiny_overrides(doc_data, tmp_path / "c", {
        **common, "model.attention": '"causal"'}), 1)
    assert c["flops_per_step_per_rank"] == model_flops_per_token(causal.cfg.model, SEQ) * 4 * SEQ / 1
    # the planner and the trainer on the same batch: every training sample at once
    for trainer in (packed, windows, causal):
        every = list(range(len(trainer.train_data)))
        planned = flops_per_token(trainer.cfg) * len(every) * SEQ
        assert planned == pytest.approx(step_model_flops(trainer.cfg, trainer.train_data, every, len(every)),
                                        rel=1e-12)


def test_auto_attention_reads_every_mixture_source(mixture_data, tmp_path):
    """``auto`` on a mixture: block-causal when every source records its document starts; causal, naming the
    one source that does not, otherwise."""
    import shutil

    from shardlm.data.attention_choice import choose_attention

    assert choose_attention(load_config(None, [f"--data.dir={mixture_data}"])).attention == "block_causal"
    copy = tmp_path / "mix"
    shutil.copytree(mixture_data, copy)
    meta = json.loads((copy / "b" / "meta.json").read_text())
    del meta["document_starts"]
    (copy / "b" / "meta.json").write_text(json.dumps(meta))
    choice = choose_attention(load_config(None, [f"--data.dir={copy}"]))
    assert choice.attention == "causal" and choice.warning.startswith("warning: "
                                                                      f"{copy / 'b' / 'document_starts.bin'} "
                                                                      "missing (the data was prepared before")
    assert str(copy / "a") not in choice.warning
