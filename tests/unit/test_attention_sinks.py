"""Attention sinks (gpt-oss) under every mask form: packed gpt-oss against transformers'
``GptOssForCausalLM`` on each document alone, flex against the dense path (logits and gradients), training
under ``model.attention = "auto"`` on text data with recorded document starts, and what a directly built
model does with ``documents=``. Context-parallel sinks: tests/dist/test_cp_parity.py
(tests/workers/cp_worker.py)."""

from __future__ import annotations

import json

import pytest
import torch

from shardlm.convert.hf_in import load_model_dir
from shardlm.model import attention as doc_attention
from shardlm.model.config import ModelConfig
from shardlm.model.decoder import CausalLM
from test_moe_families import RELEASED_YARN, hf_config
from test_packing import prepare_doc_data

transformers = pytest.importorskip("transformers")

#: two packed rows of documents (lengths), the second padded to the row's 40 tokens by a document of its own;
#: gpt-oss's window (8) is shorter than some documents and longer than others
ROWS = [(17, 9, 14), (6, 21, 8)]
ROW = 40


def packed(seed: int = 3) -> tuple[torch.Tensor, torch.Tensor, list[list[tuple[int, int]]]]:
    """tokens and documents (2, ROW) int64, and each row's documents as (start, length)."""
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 128, (len(ROWS), ROW), generator=gen)
    documents = torch.zeros(len(ROWS), ROW, dtype=torch.int64)
    spans = []
    for r, lengths in enumerate(ROWS):
        pos, row = 0, []
        for d, n in enumerate(lengths):
            documents[r, pos:pos + n] = d
            row.append((pos, n))
            pos += n
        documents[r, pos:] = len(lengths)
        spans.append(row)
    return tokens, documents, spans


@pytest.fixture(scope="module")
def gpt_oss_pair(tmp_path_factory):
    """transformers' gpt-oss (sinks, biases, window 8 on layer 0, the released YaRN over an original context
    of 32 tokens; every bias, norm weight and sink perturbed, the sinks to about the scores' size so that
    they take a real share) and shardlm's import of it, under block-causal attention."""
    yarn = {**RELEASED_YARN, "original_max_position_embeddings": 32, "rope_theta": 10000.0}
    cfg = transformers.GptOssConfig.from_dict({**hf_config("gpt_oss").to_dict(), "rope_parameters": yarn,
                                               "max_position_embeddings": 32 * 32})
    torch.manual_seed(4)
    hf = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith(("bias", "norm.weight")):
                p.add_(torch.randn_like(p) * 0.1)
            elif name.endswith("sinks"):
                p.copy_(torch.randn_like(p))
    path = tmp_path_factory.mktemp("gpt_oss")
    hf.save_pretrained(path)
    ours = load_model_dir(path)
    assert ours.cfg.rope_yarn_factor == 32.0 and ours.cfg.sliding_window == 8
    ours.cfg.attention = "block_causal"
    return hf, ours


def test_packed_gpt_oss_equals_transformers_on_each_document_alone(gpt_oss_pair):
    """Each document of a packed row (sinks + window + YaRN, positions from 0 per document) has transformers'
    logits for that document alone (within 1e-5 of the logits' largest magnitude; measured 3.9e-7); the sinks
    matter (the same model without them is far off)."""
    hf, ours = gpt_oss_pair
    tokens, documents, spans = packed()
    with torch.no_grad():
        logits = ours(tokens, documents=documents)
        worst, scale = 0.0, 0.0
        for r, row in enumerate(spans):
            for start, n in row:
                want = hf(tokens[r:r + 1, start:start + n]).logits[0]
                worst = max(worst, (logits[r, start:start + n] - want).abs().max().item())
                scale = max(scale, want.abs().max().item())
        assert worst <= 1e-5 * scale, (worst, scale)
        sinks = [layer.self_attn.sinks for layer in ours.model.layers]
        saved = [s.clone() for s in sinks]
        for s in sinks:
            s.fill_(-1e4)  # no mass to the sinks: a softmax over the keys alone
        try:
            without = ours(tokens, documents=documents)
        finally:
            for s, v in zip(sinks, saved):
                s.copy_(v)
        assert (without - logits).abs().max().item() > 100 * 1e-5 * scale


def test_a_packed_document_changes_no_other_documents_logits(gpt_oss_pair):
    """New tokens in one document of a packed row change its own logits and no other document's (the other
    row's, and the same row's before and after it, equal within 1e-6 of the logits' magnitude; measured: bit
    for bit)."""
    _, ours = gpt_oss_pair
    tokens, documents, spans = packed()
    start, n = spans[0][1]
    changed = tokens.clone()
    changed[0, start:start + n] = (tokens[0, start:start + n] + 1 + torch.arange(n)) % 128
    with torch.no_grad():
        before, after = ours(tokens, documents=documents), ours(changed, documents=documents)
    others = torch.ones(len(ROWS), ROW, dtype=torch.bool)
    others[0, start:start + n] = False
    scale = before.abs().max().item()
    assert (after - before)[others].abs().max().item() <= 1e-6 * scale
    assert (after - before)[~others].abs().max().item() > 1e-2 * scale


def test_gpt_oss_decoding_with_a_left_padded_cache_equals_transformers(gpt_oss_pair):
    """Sinks under the KV cache's masks (queries after the cached keys, left padding, the window): a prompt
    then one token at a time, each row's logits equal transformers' forward of that row alone (1e-5 of the
    logits' magnitude; measured 4e-7). A guard of the kernel path: main's eager path passed it too."""
    from shardlm.model.kv_cache import KVCache

    hf, ours = gpt_oss_pair
    gen = torch.Generator().manual_seed(6)
    rows = [torch.randint(0, 128, (n,), generator=gen) for n in (15, 11)]  # prompts of 10 and 6, 5 more each
    pad = torch.tensor([0, 4])
    tokens = torch.stack([torch.cat([torch.zeros(int(p), dtype=torch.int64), r]) for p, r in zip(pad, rows)])
    cache = KVCache(ours.cfg, pad, torch.float32, "cpu", capacity=20)
    with torch.no_grad():
        steps = [ours(tokens[:, :10], cache)] + [ours(tokens[:, i:i + 1], cache) for i in range(10, 15)]
        got = torch.cat(steps, dim=1)
        for r, (p, row) in enumerate(zip(pad.tolist(), rows)):
            want = hf(row[None]).logits[0]
            assert (got[r, p:] - want).abs().max().item() <= 1e-5 * want.abs().max().item(), r


def test_flex_sinks_equal_the_dense_path_in_logits_and_gradients(gpt_oss_pair, monkeypatch):
    """Sinks under flex attention (joined to flex's log-sum-exp) give the dense path's logits (within 1e-5 of
    their magnitude; measured 3.9e-7); their gradients, through PyTorch's reference flex backward (its CPU
    refusal lifted here: the CUDA kernel is the compiled one), equal the dense path's, sinks included
    (1e-5 of each gradient's magnitude; measured <= 3.9e-7)."""
    _, ours = gpt_oss_pair
    tokens, documents, _ = packed()
    ours.cfg.attention_backend = "flex"
    try:
        with torch.no_grad():
            flex = ours(tokens, documents=documents)
    finally:
        ours.cfg.attention_backend = "sdpa"
    with torch.no_grad():
        dense = ours(tokens, documents=documents)
    assert (flex - dense).abs().max().item() <= 1e-5 * dense.abs().max().item()

    import torch.nn.attention.flex_attention as flex_module
    monkeypatch.setattr(flex_module, "_validate_device", lambda *args: None)
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, n, ROW, 16, generator=gen) for n in (4, 2, 2))
    sinks = torch.randn(4, generator=gen)
    grads = {}
    for kind, mask in (("flex", doc_attention.block_mask(documents, 8)),
                       ("dense", doc_attention.additive_mask(documents, 8))):
        inputs = [x.clone().requires_grad_() for x in (q, k, v, sinks)]
        out = doc_attention.attention(*inputs[:3], mask, scale=0.25, sinks=inputs[3])
        (out * torch.linspace(-1, 1, out.numel()).view(out.shape)).sum().backward()
        grads[kind] = [x.grad for x in inputs]
    for name, a, b in zip("qkv", grads["flex"], grads["dense"]):
        assert (a - b).abs().max().item() <= 1e-5 * b.abs().max().item(), name
    assert (grads["flex"][3] - grads["dense"][3]).abs().max().item() <= 1e-5 * grads["dense"][3].abs().max()
    assert grads["dense"][3].abs().min().item() > 0  # every sink has a gradient


def test_dense_sinks_take_boolean_and_additive_masks_alike():
    """The mask forms the kernels take: boolean and additive masks, and None for causal, give the same sink
    attention (bit for bit)."""
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, n, 12, 8, generator=gen) for n in (4, 2, 2))
    sinks = torch.randn(4, generator=gen)
    docs = torch.tensor([[0] * 5 + [1] * 7, [0] * 12])
    for window in (0, 3):
        boolean = doc_attention.attention(q, k, v, doc_attention.dense_mask(docs, window), sinks=sinks)
        additive = doc_attention.attention(q, k, v, doc_attention.additive_mask(docs, window), sinks=sinks)
        assert torch.equal(boolean, additive)
    causal = doc_attention.attention(q, k, v, None, sinks=sinks)
    assert torch.equal(causal, doc_attention.attention(
        q, k, v, doc_attention.dense_mask(torch.zeros(2, 12, dtype=torch.int64)), sinks=sinks))
    with pytest.raises(ValueError, match=r"attention sinks of shape \(3,\) for 4 query heads"):
        doc_attention.attention(q, k, v, None, sinks=sinks[:3])


@pytest.mark.parametrize("form", ["causal", "cache", "boolean_2d", "boolean", "additive", "empty_row"])
def test_sinks_through_the_cpu_kernel_equal_the_eager_reference(form):
    """On CPU sink attention runs the flash kernel with a log-sum-exp and joins the sinks to it: outputs and
    gradients (q, k, v and the sinks) equal transformers' eager computation (``kernel=False``) within 1e-5
    of their magnitude, under every mask form: none (causal, and causal queries at the end of longer keys as
    with a KV cache), boolean (2-D and 4-D), additive, and a row that sees no key (output 0, no gradient);
    and it saves no (seq, seq) tensor for the backward."""
    gen = torch.Generator().manual_seed(5)
    n, m = (5, 12) if form == "cache" else (12, 12)
    q, k, v = (torch.randn(2, heads, t, 8, generator=gen) for heads, t in ((4, n), (2, m), (2, m)))
    sinks = torch.randn(4, generator=gen)
    docs = torch.tensor([[0] * 5 + [1] * 7, [0] * 9 + [1] * 3])
    mask = {"causal": None, "cache": None,
            "boolean_2d": doc_attention.dense_mask(docs[:1], 4)[0, 0],
            "boolean": doc_attention.dense_mask(docs, 4),
            "additive": doc_attention.additive_mask(docs, 0)}.get(form)
    if form == "empty_row":
        mask = doc_attention.dense_mask(docs, 0).clone()
        mask[1, 0, 3] = False  # query 3 of row 1 sees nothing: only its sink
    results = {}
    for kernel in (True, False):
        inputs = [x.clone().requires_grad_() for x in (q, k, v, sinks)]
        saved: list[torch.Tensor] = []
        with torch.autograd.graph.saved_tensors_hooks(lambda x, into=saved: into.append(x) or x, lambda x: x):
            out = doc_attention.sink_attention(*inputs[:3], mask, inputs[3], 0.3, kernel=kernel)
        (out * torch.linspace(-1, 1, out.numel()).view(out.shape)).sum().backward()
        results[kernel] = [out.detach()] + [x.grad for x in inputs]
        squares = [x for x in saved if x.dim() == 4 and x.shape[-2:] == (n, m + 1)]
        assert bool(squares) != kernel  # the eager path keeps the probabilities with the sink column
    for name, a, b in zip(("out", "dq", "dk", "dv", "dsinks"), results[True], results[False]):
        assert (a - b).abs().max().item() <= 1e-5 * b.abs().max().item(), (form, name)
    if form == "empty_row":
        assert results[True][0][1, :, 3].abs().max().item() == 0.0
        assert results[True][1][1, :, 3].abs().max().item() == 0.0


# ---- a model built directly: documents= is honoured or refused, never ignored ------------------------------
def direct_model(attention: str) -> CausalLM:
    cfg = ModelConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=96, vocab_size=128,
                      max_seq_len=64, attention=attention)
    model = CausalLM(cfg)
    model.init_weights(0)
    return model


def test_direct_build_auto_honours_documents_and_causal_refuses_them():
    """``attention = "auto"`` (the default) with ``documents=`` attends block-causally, as training resolves
    ``auto`` for samples that hold documents (bit for bit the ``block_causal`` model); ``causal`` cannot keep
    documents apart and says so."""
    tokens, documents, spans = packed()
    auto, block = direct_model("auto"), direct_model("block_causal")
    assert auto.cfg.attention == "auto"
    with torch.no_grad():
        got = auto(tokens, documents=documents)
        assert torch.equal(got, block(tokens, documents=documents))
        start, n = spans[0][1]
        alone = auto(tokens[:1, start:start + n])[0]
        assert (got[0, start:start + n] - alone).abs().max().item() <= 1e-5 * alone.abs().max().item()
        assert (auto(tokens)[0, start:start + n] - alone).abs().max().item() > 1e-3  # documents mattered
    with pytest.raises(ValueError, match="documents= given to a model with attention = 'causal'.*set "
                                         "attention = 'block_causal' \\(or 'auto'\\)"):
        direct_model("causal")(tokens, documents=documents)


# ---- training under model.attention = "auto" on text data with recorded document starts --------------------
def test_gpt_oss_trains_block_causal_under_auto_on_documents(small_data, tmp_path, capsys):
    """gpt-oss (sinks, window 8 < seq_len 32, YaRN) on pre-training text that records its document starts,
    ``model.attention`` left at ``auto``: the run resolves block-causal attention and trains (the loss falls,
    every step finite)."""
    from conftest import tiny_overrides
    from shardlm.cli.train import main as train_main

    data = prepare_doc_data(tmp_path, small_data / "tokenizer.json")
    run = tmp_path / "run"
    overrides = tiny_overrides(data, run, {
        "model.family": '"gpt_oss"', "model.n_experts": 4, "model.n_experts_per_token": 2,
        "model.sliding_window": 8, "model.sliding_window_pattern": 2, "model.rope_yarn_factor": 4.0,
        "model.rope_original_max_seq_len": 16, "train.steps": 6, "train.warmup_steps": 1,
        "train.eval_interval": 0})
    assert not any(o.startswith("--model.attention=") for o in overrides)  # auto, the default
    assert train_main(overrides) == 0
    losses = [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()
              if "loss" in json.loads(line)]
    assert len(losses) == 6 and all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < losses[0]
    summary = capsys.readouterr().out
    assert ("attention  block_causal (backend per_document, per-document positions); auto: pre-training data"
            in summary)
