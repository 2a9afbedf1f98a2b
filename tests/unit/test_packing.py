"""Packed samples with document masking (block-causal attention): exactness per family and backend, the
packing of instruction examples, and bad input, in one process.

The model cases are small random decoders of every family (2 layers, every parameter perturbed so that norms
and biases matter); shardlm's model equals transformers' for each (tests/unit/test_families.py), so "each
example alone from position 0" is the transformers result too. Packed training under FSDP is in
tests/dist/test_packed_training.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from conftest import cli_error
from shardlm.config import load_config
from shardlm.data.instruct import PADDING_DOCUMENT, InstructionExamples, prepare_instructions, split_batch
from shardlm.data.loader import TokenWindows
from shardlm.data.packing import DocumentWindows, PackedExamples, best_fit_decreasing
from shardlm.data.prepare import load_meta, prepare_corpus
from shardlm.errors import DataError
from shardlm.model import attention as doc_attention
from shardlm.model.config import ModelConfig
from shardlm.model.decoder import CausalLM
from shardlm.train.loss import token_loss_sum
from tolerance import EPS, assert_close, assert_norm_close

ROOT = Path(__file__).resolve().parents[2]

COMMON = dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=96, vocab_size=128, max_seq_len=64,
              norm_eps=1e-6)
FAMILY_CASES = {
    "llama": ModelConfig(family="llama", rope_theta=500000.0, rope_scaling_factor=8.0,
                         rope_original_max_seq_len=16, **COMMON),
    "qwen2": ModelConfig(family="qwen2", rope_theta=1e6, tie_embeddings=True, **COMMON),
    "qwen3": ModelConfig(family="qwen3", head_width=24, **COMMON),
    "mistral": ModelConfig(family="mistral", sliding_window=8, **COMMON),  # shorter than every example
    "gemma3": ModelConfig(family="gemma3", head_width=32, sliding_window=8, sliding_window_pattern=2,
                          rope_theta=1e6, rope_local_theta=10000.0, query_pre_attn_scalar=24,
                          rope_linear_factor=2.0, final_logit_softcap=30.0, **COMMON),
}
BACKENDS = ["sdpa", "per_document", "flex"]
LENGTHS = [(11, 14, 9), (16, 5, 12)]  # two rows of three examples each, then padding to ROW tokens
ROW = 40


def random_model(name: str, attention: str = "block_causal", backend: str = "sdpa") -> CausalLM:
    """Family ``name``'s small model, fp32, every parameter perturbed (seeded)."""
    cfg = FAMILY_CASES[name]
    cfg = ModelConfig(**{**cfg.__dict__, "attention": attention, "attention_backend": backend})
    model = CausalLM(cfg)
    model.init_weights(0)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.05)
    return model


def packed_rows() -> tuple[torch.Tensor, torch.Tensor, list[list[torch.Tensor]]]:
    """(tokens, documents) of shape (2, ROW) and each row's examples: three examples per row, then padding (a
    document of its own)."""
    gen = torch.Generator().manual_seed(2)
    tokens = torch.zeros(len(LENGTHS), ROW, dtype=torch.int64)
    documents = torch.zeros(len(LENGTHS), ROW, dtype=torch.int64)
    examples = []
    for r, lengths in enumerate(LENGTHS):
        row, pos = [], 0
        for d, n in enumerate(lengths):
            ex = torch.randint(0, 128, (n,), generator=gen)
            tokens[r, pos:pos + n], documents[r, pos:pos + n] = ex, d
            row.append(ex)
            pos += n
        documents[r, pos:] = len(lengths)
        examples.append(row)
    return tokens, documents, examples


def summed_loss_grads(model: CausalLM, logits: torch.Tensor,
                      targets: torch.Tensor) -> dict[str, torch.Tensor]:
    """Gradients of the summed next-token loss (targets -100 where nothing is trained)."""
    model.zero_grad(set_to_none=True)
    F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100, reduction="sum").backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", list(FAMILY_CASES))
def test_packed_row_equals_each_example_alone(name, backend):
    """Logits of a packed row = each example alone from position 0 (64 fp32 roundings of the largest logit:
    the attention's sums run over another length); gradients of the summed loss agree (||g - g_alone|| /
    ||g_alone|| < 32 fp32 roundings over all parameters, < 1e-5 per tensor: fp32 summation order); the same
    row under ``causal`` differs (the test bites)."""
    model = random_model(name, backend=backend)
    tokens, documents, examples = packed_rows()
    with torch.no_grad():  # flex has no backward on CPU: its logits are compared, its gradients cannot be
        logits = model(tokens, documents=documents)
    # targets: next token inside each example only (padding and the boundary are not trained)
    targets = torch.full_like(tokens, -100)
    alone_targets = []
    for r, row in enumerate(examples):
        pos = 0
        for ex in row:
            n = len(ex)
            with torch.no_grad():
                ref = model(ex[None])[0]  # alone, positions 0..n-1, plain causal
            assert_close(logits[r, pos:pos + n], ref, rtol=64 * EPS, what=f"{name} {backend} {r}:{pos}")
            targets[r, pos:pos + n - 1] = ex[1:]
            alone_targets.append(torch.cat([ex[1:], torch.tensor([-100])]))
            pos += n
    # control: the same row under causal attention (no documents) differs from the examples alone
    causal = random_model(name, attention="causal", backend=backend)
    with torch.no_grad():
        leaked = causal(tokens)
        second = examples[0][1]
        start = len(examples[0][0])
        assert (leaked[0, start:start + len(second)] - causal(second[None])[0]).abs().max().item() > 1e-3
    if backend == "flex":
        return
    packed_grads = summed_loss_grads(model, model(tokens, documents=documents), targets)
    model.zero_grad(set_to_none=True)
    total = sum(F.cross_entropy(model(ex[None])[0], t, ignore_index=-100, reduction="sum")
                for ex, t in zip([ex for row in examples for ex in row], alone_targets))
    total.backward()
    # the whole gradient (measured: 3e-7 .. 6e-7 of its norm; the bound, 32 fp32 roundings, is 3.8e-6)
    assert_norm_close(packed_grads, {n: p.grad for n, p in model.named_parameters()}, rtol=32 * EPS,
                      what="whole gradient")
    for n, p in model.named_parameters():  # and each tensor (worst measured: 1.2e-6, a Gemma 3 k_norm weight)
        assert_norm_close(packed_grads[n], p.grad, rtol=1e-5, what=f"{name} {n}")


@pytest.mark.parametrize("name", ["mistral", "gemma3"])
def test_backends_agree_and_causal_is_unchanged(name):
    """sdpa and flex give the same logits (64 fp32 roundings of the largest); ``block_causal`` without
    documents is bit for bit the causal forward, and ``causal`` with documents (which it cannot keep apart)
    is refused."""
    tokens, documents, _ = packed_rows()
    with torch.no_grad():
        dense = random_model(name, backend="sdpa")(tokens, documents=documents)
        flex = random_model(name, backend="flex")(tokens, documents=documents)
        assert_close(flex, dense, rtol=64 * EPS, what="flex vs sdpa")
        plain = random_model(name, attention="causal")(tokens)
        with pytest.raises(ValueError, match="documents= given to a model with attention = 'causal'"):
            random_model(name, attention="causal")(tokens, documents=documents)
        assert torch.equal(random_model(name)(tokens), plain)


def test_document_positions_and_mask():
    """Positions restart at 0 per document; the dense mask is block-causal, and windowed within a document."""
    documents = torch.tensor([[0, 0, 0, 1, 1, 2, 2, 2, 2]])
    assert doc_attention.document_positions(documents).tolist() == [[0, 1, 2, 0, 1, 0, 1, 2, 3]]
    mask = doc_attention.dense_mask(documents, window=2)[0, 0]
    assert mask[4].tolist() == [False, False, False, True, True, False, False, False, False]
    assert mask[8].tolist() == [False] * 7 + [True, True]


@pytest.mark.parametrize("name", ["llama", "gemma3"])
def test_dense_mask_is_saved_once_per_window_and_equals_the_boolean_mask(name, monkeypatch):
    """The sdpa backend's additive mask is made once per forward: backward keeps one (batch, 1, seq, seq) mask
    per distinct window (Gemma 3: local and global), not one per layer (SDPA's own copy of a boolean mask, as
    before), and the logits and gradients are bit for bit those of the boolean mask."""
    tokens, documents, _ = packed_rows()
    model = random_model(name)
    masks = {}

    def keep(t):
        if t.shape[-2:] == (ROW, ROW):
            masks[t.untyped_storage().data_ptr()] = t.dtype
        return t
    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        logits = model(tokens, documents=documents)
    assert list(masks.values()) == [torch.float32] * (2 if name == "gemma3" else 1)  # 2 layers each
    grads = summed_loss_grads(model, logits, tokens)
    monkeypatch.setattr(doc_attention, "document_masks", lambda d, windows, backend, dtype: {
        w: doc_attention.dense_mask(d, w) for w in windows})  # the boolean mask, converted by SDPA per layer
    boolean = model(tokens, documents=documents)
    assert torch.equal(boolean, logits)
    boolean_grads = summed_loss_grads(model, boolean, tokens)
    assert all(torch.equal(g, boolean_grads[n]) for n, g in grads.items())


def test_missing_flex_backend_is_one_clear_error(monkeypatch):
    """A backend this PyTorch lacks, or shardlm has not built (varlen): one message naming it and the
    alternative."""
    monkeypatch.setattr(doc_attention, "flex_attention", None)
    with pytest.raises(ValueError, match="flex_attention.*use 'sdpa'"):
        doc_attention.resolve_backend("flex", "cpu")
    assert doc_attention.resolve_backend("auto", "cpu") == "per_document"
    tokens, documents, _ = packed_rows()
    with pytest.raises(ValueError, match="flex"):
        random_model("llama", backend="flex")(tokens, documents=documents)
    monkeypatch.undo()
    for device in ("cpu", "cuda"):  # varlen flash attention: refused by name everywhere (CUDA only, untested)
        with pytest.raises(ValueError,
                           match=r"'varlen' \(variable-length flash attention over cu_seqlens.*not "
                                             r"built.*only on CUDA.*use 'flex'"):
            doc_attention.resolve_backend("varlen", device)
    with pytest.raises(ValueError, match="cannot train on CPU.*no backward.*use 'sdpa'"):
        random_model("llama", backend="flex")(tokens, documents=documents)  # gradients enabled


# ---- packing instruction examples --------------------------------------------------------------------------
WORDS = ("thou art more lovely and more temperate rough winds do shake the darling buds of may and summer's "
         "lease hath all too short a date sometime too hot the eye of heaven shines").split()


def write_chat_corpus(path: Path, n: int, seed: int, mean_words: float = 3.0) -> Path:
    """``n`` prompt/response examples with log-normal word counts (deterministic for ``seed``), then one with
    a long response (truncated, still trained) and one with a long prompt (no response token left within SEQ
    + 1)."""
    rng = np.random.default_rng(seed)
    with path.open("w") as f:
        for i in range(n):
            p, r = (max(1, int(x)) for x in rng.lognormal(np.log(mean_words), 0.6, size=2))
            if i in (3, 7):
                p, r = (1, 60) if i == 3 else (60, 1)
            f.write(json.dumps({"prompt": " ".join(rng.choice(WORDS, p)),
                                "response": " ".join(rng.choice(WORDS, r))})
                    + "\n")
    return path


SEQ = 64


def prepare_chat_data(d: Path, tokenizer: Path) -> Path:
    """40 chat examples (``d/chat.jsonl``) prepared as instruction data in ``d/data`` (two longer
    than SEQ)."""
    corpus = write_chat_corpus(d / "chat.jsonl", 40, 0)
    prepare_instructions(str(corpus), str(d / "data"), str(tokenizer), 512, 0.1)
    return d / "data"


def prepare_doc_data(d: Path, tokenizer: Path) -> Path:
    """60 short documents (``d/docs.jsonl``, log-normal word counts, mean ~25 words) prepared as a text stream
    in ``d/data``: ``BOS doc0 EOD doc1 EOD ...``."""
    rng = np.random.default_rng(5)
    with (d / "docs.jsonl").open("w") as f:
        for _ in range(60):
            f.write(json.dumps({"text": " ".join(rng.choice(WORDS,
                                                            max(2, int(rng.lognormal(np.log(25), 0.5)))))})
                    + "\n")
    prepare_corpus(str(d / "docs.jsonl"), str(d / "data"), str(tokenizer), 512, 0.1)
    return d / "data"


def prepare_mixture_data(d: Path, docs: Path, tokenizer: Path) -> Path:
    """The documents of ``docs`` (a JSONL file) as a mixture in ``d/data`` of two sources (``d/a.jsonl``: the
    first 30, ``d/b.jsonl``: the rest; weights 0.7 / 0.3)."""
    from shardlm.config import DataSource
    from shardlm.data.mixture import prepare_mixture

    lines = docs.read_text().splitlines(keepends=True)
    (d / "a.jsonl").write_text("".join(lines[:30]))
    (d / "b.jsonl").write_text("".join(lines[30:]))
    prepare_mixture([DataSource(str(d / "a.jsonl"), 0.7, "a"), DataSource(str(d / "b.jsonl"), 0.3, "b")],
                    str(d / "data"), str(tokenizer), 512, 0.2)
    return d / "data"


@pytest.fixture(scope="module")
def packed_data(small_data, tmp_path_factory) -> Path:
    """:func:`prepare_chat_data` with the small corpus' tokenizer."""
    return prepare_chat_data(tmp_path_factory.mktemp("packed"), small_data / "tokenizer.json")


def test_best_fit_decreasing():
    """Each item placed once, no bin over capacity, the best fit chosen, and the same bins for the
    same seed."""
    lengths = np.array([5, 7, 3, 3, 2, 9, 1, 4])
    bins = best_fit_decreasing(lengths, 10, seed=0)
    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
    assert all(lengths[b].sum() <= 10 for b in bins)
    # decreasing: 9 -> A(1 left), 7 -> B(3), 5 -> C(5), 4 -> C(1), 3 -> B(0), 3 -> new D(7), 2 -> D(5), 1 -> A
    assert [sorted(lengths[b].tolist()) for b in bins] == [[1, 9], [3, 7], [4, 5], [2, 3]]
    assert best_fit_decreasing(lengths, 10, seed=0) == bins
    with pytest.raises(ValueError, match="1..10"):
        best_fit_decreasing(np.array([11]), 10, seed=0)


def test_packed_rows_hold_the_examples(packed_data):
    """Every trainable example lands in one row with its own tokens and labels; its first token is not a
    target; documents count up per example; padding is document -1; the target counts equal the unpacked
    ones; truncations are counted; the rows depend on the seed only."""
    plain = InstructionExamples(str(packed_data), "train", SEQ, skip_untrainable=True)
    packed = PackedExamples(plain, seed=3)
    assert sorted(e for r in packed.rows for e in r) == [
        i for i in range(len(plain)) if i not in packed.dropped
    ]
    lengths = np.diff(plain.offsets)
    assert packed.truncated == [
        i for i in range(len(plain)) if lengths[i] > SEQ + 1 and i not in packed.dropped
    ]
    assert len(packed.truncated) == 1 and len(packed.dropped) == 1 and len(packed) < len(plain) / 2
    assert packed.fill == pytest.approx(
        sum(min(n, SEQ + 1) for n in lengths[[e for r in packed.rows for e in r]]) / (len(packed) * (SEQ + 1))
    )
    rows = packed.get(list(range(len(packed))))
    assert rows.shape == (len(packed), 3, SEQ + 1)
    for r, members in enumerate(packed.rows):
        alone = plain.get(members)
        pos = 0
        for d, e in enumerate(members):
            n = min(int(lengths[e]), SEQ + 1)
            assert torch.equal(rows[r, 0, pos:pos + n], alone[d, 0, :n])
            assert rows[r, 1, pos] == -100 and torch.equal(rows[r, 1, pos + 1:pos + n], alone[d, 1, 1:n])
            assert (rows[r, 2, pos:pos + n] == d).all()
            pos += n
        assert (rows[r, 1, pos:] == -100).all() and (rows[r, 2, pos:] == PADDING_DOCUMENT).all()
    assert packed.num_targets(list(range(len(packed)))) == plain.num_targets(
        [e for r in packed.rows for e in r]
    )
    assert int((rows[:, 1, 1:] != -100).sum()) == packed.num_targets(list(range(len(packed))))
    assert PackedExamples(plain, seed=3).rows == packed.rows
    assert "1 truncated to 65 tokens (lines 4); 1 left out" in packed.summary() and packed.fill > 0.9
    placed = sum(min(int(lengths[e]), SEQ + 1) for r in packed.rows for e in r)
    assert packed.padding == int((rows[:, 2] == PADDING_DOCUMENT).sum())
    assert packed.unpacked_padding == (len(plain) - len(packed.dropped)) * (SEQ + 1) - placed


def test_packed_batch_loss_equals_examples_one_by_one(packed_data):
    """The loss of a packed global batch, split into micro-batches as the trainer does (summed loss / the
    batch's response targets), equals the mean over the same examples' response tokens computed one by
    one (1e-6)."""
    plain = InstructionExamples(str(packed_data), "train", SEQ, skip_untrainable=True)
    packed = PackedExamples(plain, seed=0)
    cfg = ModelConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=128, vocab_size=512,
                      max_seq_len=64, attention="block_causal")
    model = CausalLM(cfg)
    model.init_weights(0)
    ids = list(range(len(packed)))
    with torch.no_grad():
        total = torch.zeros((), dtype=torch.float64)
        for micro in (ids[:2], ids[2:]):  # gradient accumulation: two micro-batches of rows
            batch = packed.get(micro)
            inputs, targets = split_batch(batch)
            total += token_loss_sum(model(inputs, documents=batch[:, 2, :-1]), targets).double()
        packed_loss = total / packed.num_targets(ids)
        examples = [e for r in packed.rows for e in r]
        alone = sum(
            token_loss_sum(model(split_batch(plain.get([e]))[0]), split_batch(plain.get([e]))[1]).double()
            for e in examples
        ) / plain.num_targets(examples)
        assert_close(packed_loss, alone, rtol=16 * EPS, what="packed loss")  # fp32 sums of ~100 tokens
        model.cfg.attention = "causal"  # control: the same rows without document masking give another loss
        leaked = sum(
            token_loss_sum(model(split_batch(packed.get([i]))[0]), split_batch(packed.get([i]))[1]).double()
            for i in ids
        ) / packed.num_targets(ids)
        # (measured 8.7e-4 at this init; the tolerance is 16 fp32 roundings of the loss, 1.2e-5)
        assert abs(leaked.item() - alone.item()) > 1e-4


def test_packing_bad_input(packed_data, small_data, tmp_path, capsys):
    """data.pack on text data, data.pack under causal attention set explicitly (``auto``, the default, is
    accepted), and examples that all lose their response to truncation: one clear message each, exit 2."""
    base = ["prepare", "--config", str(ROOT / "configs/shakespeare-tiny.toml"),
            f"--data.dir={tmp_path / 'd'}"]
    err = cli_error(capsys, base + ["--data.pack=true", "--model.attention=block_causal"])
    assert "data.pack packs instruction examples: it needs data.format = 'instruct'" in err
    err = cli_error(capsys, base + ["--data.pack=true", "--data.format=instruct", "--model.attention=causal"])
    assert "data.pack needs model.attention = 'block_causal' (or 'auto', the default)" in err
    assert load_config(None, ["--data.pack=true", "--data.format=instruct"]).model.attention == "auto"
    assert not (tmp_path / "d").exists()
    plain = InstructionExamples(str(packed_data), "train", 4, skip_untrainable=True)  # responses start later
    with pytest.raises(DataError,
                       match=r"no instruction example to train: all \d+ have no response token within "
                                        r"their first 5 tokens \(train.seq_len=4\); raise train.seq_len"):
        PackedExamples(plain, seed=0)
    with pytest.raises(DataError, match="no response token within the first 5 tokens"):  # unpacked: as before
        InstructionExamples(str(packed_data), "train", 4)


# ---- pre-training windows over document boundaries ---------------------------------------------------------
@pytest.fixture(scope="module")
def doc_data(small_data, tmp_path_factory) -> Path:
    """:func:`prepare_doc_data` with the small corpus' tokenizer."""
    return prepare_doc_data(tmp_path_factory.mktemp("docs"), small_data / "tokenizer.json")


def test_window_across_documents_gives_the_second_its_own_logits(doc_data):
    """A window holding the end of one document and the start of the next: under block-causal attention the
    next document's logits equal those it has alone (64 fp32 roundings of the largest), the first token of the
    next document is not a target of the separator, and the target count is the labels'; under causal
    attention the logits differ."""
    eod = load_meta(str(doc_data))["special_ids"]["eod"]
    windows = DocumentWindows(TokenWindows(str(doc_data), "train", SEQ), eod)
    batch = windows.get(list(range(len(windows))))
    inputs, targets = split_batch(batch)
    # a window whose separator leaves at least 8 tokens of the next document inside it
    w, p = next((w, int(i)) for w in range(len(windows)) for i in torch.nonzero(inputs[w] == eod).flatten()
                if 0 < i < SEQ - 8)
    nxt = torch.nonzero(inputs[w, p + 1:] == eod).flatten()
    # the second document, its separator included
    end = p + 1 + (int(nxt[0]) + 1 if len(nxt) else SEQ - p - 1)
    # only the boundary is dropped
    assert targets[w, p] == -100 and (targets[w, :p] == inputs[w, 1:p + 1]).all()
    assert batch[w, 2, :p + 1].eq(0).all() and batch[w, 2, p + 1:end].eq(1).all()
    assert windows.num_targets(list(range(len(windows)))) == int((targets != -100).sum())
    cfg = ModelConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=128, vocab_size=512,
                      max_seq_len=64, attention="block_causal")
    model = CausalLM(cfg)
    model.init_weights(0)
    with torch.no_grad():
        logits = model(inputs[w:w + 1], documents=batch[w:w + 1, 2, :-1])[0]
        alone = model(inputs[w:w + 1, p + 1:end])[0]
        first = model(inputs[w:w + 1, :p + 1])[0]
        assert_close(logits[p + 1:end], alone, rtol=64 * EPS, what="second document")
        assert_close(logits[:p + 1], first, rtol=64 * EPS, what="first document")
        model.cfg.attention = "causal"
        assert (model(inputs[w:w + 1])[0, p + 1:end] - alone).abs().max().item() > 1e-4
