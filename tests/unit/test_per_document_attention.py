"""Block-causal attention per document (``model.attention_backend = "per_document"``, the CPU default): SDPA
on each document of a row alone equals the dense-mask reference (``sdpa``) within 1e-6, outputs and gradients,
with grouped heads, sliding windows and attention sinks; a model trains the same under both."""

from __future__ import annotations

import pytest
import torch

from shardlm.model import attention as doc_attention
from shardlm.model.config import ModelConfig
from shardlm.model.decoder import CausalLM
from tolerance import EPS, assert_close

#: 1e-6 relative to the largest value: 8 fp32 roundings (8 · 2^-23 = 9.5e-7)
RTOL = 8 * EPS
DOCS = [[0] * 9 + [1] * 17 + [2] * 5 + [-1] * 9, [0] * 30 + [1] * 10]  # two rows of 40, padding a run too


def qkv(seed: int, heads: int = 4, kv_heads: int = 2) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    shapes = [(2, heads, 40, 16), (2, kv_heads, 40, 16), (2, kv_heads, 40, 16)]
    return [torch.randn(s, generator=gen).requires_grad_() for s in shapes]


def run(mask, sinks: torch.Tensor | None, seed: int = 0) -> tuple[torch.Tensor, list[torch.Tensor]]:
    q, k, v = qkv(seed)
    leaves = [q, k, v] + ([sinks] if sinks is not None else [])
    out = doc_attention.attention(q, k, v, mask, scale=0.3, sinks=sinks)
    grads = torch.autograd.grad((out * torch.linspace(-1, 1, out.shape[-1])).sum(), leaves)
    return out.detach(), list(grads)


@pytest.mark.parametrize("window", [0, 4])
@pytest.mark.parametrize("with_sinks", [False, True])
def test_per_document_equals_the_dense_mask(window, with_sinks):
    documents = torch.tensor(DOCS)
    runs = doc_attention.document_masks(documents, {window}, "per_document")[window]
    assert runs.runs == (((0, 9), (9, 17), (26, 5), (31, 9)), ((0, 30), (30, 10)))
    dense = doc_attention.additive_mask(documents, window)
    sinks = torch.tensor([0.5, -1.0, 2.0, 0.0], requires_grad=True) if with_sinks else None
    out, grads = run(runs, sinks)
    ref, ref_grads = run(dense, sinks)
    assert_close(out, ref, rtol=RTOL, what="per-document vs dense attention output")
    for name, g, r in zip("qkvs", grads, ref_grads):
        assert_close(g, r, rtol=RTOL, what=f"gradient of {name}")
    # the test bites: causal attention over the whole row is not this
    causal, _ = run(None, sinks)
    assert (causal - ref).abs().max() > 1e-3


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_a_model_gives_the_same_logits_and_gradients_under_both(family):
    common = dict(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=48, vocab_size=64, max_seq_len=64,
                  attention="block_causal", family=family)
    if family == "gemma3":
        common.update(sliding_window=6, sliding_window_pattern=2, head_width=16)
    tokens = torch.randint(0, 64, (2, 40), generator=torch.Generator().manual_seed(3))
    documents = torch.tensor(DOCS)
    result = {}
    for backend in ("sdpa", "per_document"):
        torch.manual_seed(0)
        model = CausalLM(ModelConfig(**common, attention_backend=backend))
        model.init_weights(0)
        logits = model(tokens, documents=documents)
        logits.float().square().mean().backward()
        result[backend] = logits.detach(), {n: p.grad for n, p in model.named_parameters()}
    (a, ga), (b, gb) = result["per_document"], result["sdpa"]
    assert_close(a, b, rtol=RTOL, what="logits")
    for name in gb:
        assert_close(ga[name], gb[name], rtol=64 * EPS, what=f"gradient of {name}")


def test_auto_is_per_document_on_cpu_and_flex_on_cuda():
    assert doc_attention.resolve_backend("auto", "cpu", training=True) == "per_document"
    if doc_attention.flex_available():
        assert doc_attention.resolve_backend("auto", "cuda", training=True) == "flex"


def test_rows_cut_at_the_same_places_share_each_kernel_call(monkeypatch):
    """Rows 0-1 (two documents) go through two calls together, row 2 (one document) through one, row 3 (as
    rows 0-1 but not next to them) through two of its own: 5 SDPA calls instead of 7, equal to the dense
    mask."""
    two, one = [0] * 25 + [1] * 15, [0] * 40
    documents = torch.tensor([two, two, one, two])
    runs = doc_attention.document_masks(documents, {0}, "per_document")[0]
    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(4, h, 40, 16, generator=gen) for h in (4, 2, 2))
    calls = []
    sdpa = doc_attention.F.scaled_dot_product_attention

    def counted(*args, **kwargs):
        calls.append(args[0].shape[0])
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(doc_attention.F, "scaled_dot_product_attention", counted)
    out = doc_attention.attention(q, k, v, runs)
    assert calls == [2, 2, 1, 1, 1]  # the batch of each call
    monkeypatch.setattr(doc_attention.F, "scaled_dot_product_attention", sdpa)
    ref = doc_attention.attention(q, k, v, doc_attention.additive_mask(documents, 0))
    assert_close(out, ref, rtol=RTOL, what="grouped per-document vs dense attention output")


def documents_of(lengths: list[int]) -> torch.Tensor:
    """Two equal rows of documents of these lengths, back to back."""
    row = [i for i, n in enumerate(lengths) for _ in range(n)]
    return torch.tensor([row, row])


@pytest.mark.parametrize("traced", [False, True])
def test_a_compiled_block_is_not_compiled_again_for_each_document_layout(monkeypatch, traced):
    """``parallel.compile`` with the per-document backend: a new layout of documents in a batch does not
    compile the block again (the attention runs eagerly between the block's graphs); traced into the
    graph (``traced``), the lengths become guards and the same layouts compile it again."""
    from torch._dynamo.testing import CompileCounter

    if traced:  # the function as it would be without torch.compiler.disable
        monkeypatch.setattr(doc_attention, "per_document_attention",
                            doc_attention.per_document_attention.__wrapped__)
    torch._dynamo.reset()
    model = CausalLM(ModelConfig(dim=32, n_layers=1, n_heads=4, n_kv_heads=2, ffn_hidden=48, vocab_size=64,
                                 max_seq_len=64, attention="block_causal", attention_backend="per_document"))
    model.init_weights(0)
    counter = CompileCounter()
    model.model.layers[0].compile(backend=counter)
    tokens = torch.randint(0, 64, (2, 40), generator=torch.Generator().manual_seed(3))
    compiled = []
    for lengths in ([9, 17, 5, 9], [30, 10], [40], [3, 3, 3, 31], [20, 20]):
        model(tokens, documents=documents_of(lengths)).square().mean().backward()
        compiled.append(counter.frame_count)
    torch._dynamo.reset()
    if traced:
        assert compiled[-1] > compiled[0] + 1, compiled
    else:
        assert compiled[0] > 0 and compiled == [compiled[0]] * len(compiled), compiled
