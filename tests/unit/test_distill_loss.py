"""The distillation loss (shardlm/train/distill_loss.py) against TRL 1.16's definitions, called directly:
``GKDTrainer.generalized_jsd_loss`` for the full-vocabulary divergences and the server-distillation trainer's
``_add_tail_bucket`` + ``_jsd_divergence`` for the top-k form; and the chunked form against the whole-logits
one."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from shardlm.train.distill_loss import (
    DistillSpec,
    Head,
    distill_hidden_sum,
    distill_logits_sum,
    divergence_rows,
)
from tolerance import EPS, assert_close, assert_norm_close

trl = pytest.importorskip("trl", reason="pip install -e '.[test]' (trl==1.16.0)")
from trl.experimental.gkd import GKDTrainer  # noqa: E402
from trl.experimental.server_distillation import server_distillation_trainer as server  # noqa: E402

B, T, V = 2, 7, 13
#: 1e-6 relative: eight roundings of fp32 (the sums here are over at most 14 rows of 13 terms)
RTOL = 8 * EPS


def fixed_logits(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(B, T, V) student and teacher logits, (B, T) targets with prompt positions ignored (-100)."""
    g = torch.Generator().manual_seed(seed)
    student = torch.randn(B, T, V, generator=g) * 2
    teacher = torch.randn(B, T, V, generator=g) * 3
    targets = torch.randint(0, V, (B, T), generator=g)
    targets[0, :3] = -100
    targets[1, :1] = -100
    targets[1, -1] = -100
    return student, teacher, targets


@pytest.mark.parametrize("temperature", [1.0, 2.0])
@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0, 0.3])  # 0.3: the JSD is symmetric in its sides at 0.5
def test_divergence_and_its_gradient_equal_trls_generalized_jsd(beta, temperature):
    student, teacher, targets = fixed_logits()
    n = int((targets != -100).sum())
    ours_in = student.clone().requires_grad_()
    loss, stats = distill_logits_sum(ours_in, teacher, targets, DistillSpec(beta, temperature, alpha=1.0))
    loss.backward()
    theirs_in = student.clone().requires_grad_()
    # TRL's default reduction "batchmean" divides the masked sum by the count of scored positions
    theirs = GKDTrainer.generalized_jsd_loss(theirs_in, teacher, labels=targets, beta=beta,
                                             temperature=temperature)
    theirs.backward()
    assert theirs.item() > 1e-3  # a divergence that could be wrong
    assert_close(loss / n, theirs, rtol=RTOL, what="loss")
    assert_close(stats[0] / n, theirs, rtol=RTOL, what="divergence stat")
    assert_norm_close(ours_in.grad / n, theirs_in.grad, rtol=RTOL, what="d loss / d student logits")
    assert float(ours_in.grad[0, :3].abs().max()) == 0.0  # the prompt gets no gradient

    # the chunked form from hidden states: with an identity head the hidden states are the logits
    h = student.clone().requires_grad_()
    eye = torch.eye(V)
    chunked, _ = distill_hidden_sum(h, Head(eye), teacher, Head(eye), targets,
                                    DistillSpec(beta, temperature), chunk_tokens=3)
    chunked.backward()
    assert_close(chunked / n, theirs, rtol=RTOL, what="chunked loss")
    assert_norm_close(h.grad / n, theirs_in.grad, rtol=RTOL, what="d loss / d student hidden")


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_top_k_equals_trls_tail_bucket_form(beta):
    student, teacher, targets = fixed_logits(1)
    k, temperature = 4, 2.0
    mask = targets != -100
    s = F.log_softmax(student[mask] / temperature, -1)
    t = F.log_softmax(teacher[mask] / temperature, -1)
    ids = t.topk(k, -1).indices
    valid = torch.ones_like(ids, dtype=torch.bool)
    s_sparse, support = server._add_tail_bucket(s.gather(-1, ids), valid)
    t_sparse, _ = server._add_tail_bucket(t.gather(-1, ids), valid)
    expected = server._jsd_divergence(s_sparse, t_sparse, beta=beta, support_mask=support).sum(-1)
    ours = divergence_rows(student[mask], teacher[mask], beta, temperature, top_k=k)
    assert float(expected.min()) > 1e-3
    assert_close(ours, expected, rtol=RTOL, what="top-k divergence per row")
    full = divergence_rows(student[mask], teacher[mask], beta, temperature)
    assert float((full - ours).abs().max()) > 1e-3  # the top-k form is another number than the full one


@pytest.mark.parametrize("spec", [DistillSpec(0.0), DistillSpec(0.3, 2.0, alpha=0.6),
                                  DistillSpec(1.0, 1.0, alpha=0.2, top_k=5)])
@pytest.mark.parametrize("softcap", [0.0, 4.0])
def test_chunked_equals_whole_logits_in_loss_and_gradients(spec, softcap):
    g = torch.Generator().manual_seed(2)
    ds, dt = 6, 10
    hs = torch.randn(B, T, ds, generator=g).requires_grad_()
    ws = (torch.randn(V, ds, generator=g) / 2).requires_grad_()
    ht, wt = torch.randn(B, T, dt, generator=g), torch.randn(V, dt, generator=g) / 2
    targets = fixed_logits()[2]

    def cap(z):
        return softcap * torch.tanh(z / softcap) if softcap else z

    whole, whole_stats = distill_logits_sum(cap(hs @ ws.T), cap(ht @ wt.T), targets, spec)
    dh_whole, dw_whole = torch.autograd.grad(whole, (hs, ws))
    for chunk in (1, 4, 1000):
        loss, stats = distill_hidden_sum(hs, Head(ws, softcap), ht, Head(wt, softcap), targets, spec, chunk)
        dh, dw = torch.autograd.grad(loss, (hs, ws))
        assert_close(loss, whole, rtol=RTOL, what=f"loss, chunk {chunk}")
        assert_close(stats, whole_stats, rtol=RTOL, what=f"stats, chunk {chunk}")
        assert_norm_close(dh, dh_whole, rtol=RTOL, what=f"d/dh, chunk {chunk}")
        assert_norm_close(dw, dw_whole, rtol=RTOL, what=f"d/dW, chunk {chunk}")


def test_alpha_mixes_divergence_and_cross_entropy_and_stats_hold_both_models_ce():
    student, teacher, targets = fixed_logits(3)
    mask = targets != -100
    loss, stats = distill_logits_sum(student, teacher, targets, DistillSpec(0.5, 1.0, alpha=0.25))
    ce = F.cross_entropy(student[mask], targets[mask], reduction="sum")
    teacher_ce = F.cross_entropy(teacher[mask], targets[mask], reduction="sum")
    div = divergence_rows(student[mask], teacher[mask], 0.5).sum()
    assert_close(loss, 0.25 * div + 0.75 * ce, rtol=RTOL, what="mixed loss")
    assert_close(stats, torch.stack([div, ce, teacher_ce]), rtol=RTOL, what="stats")


def test_bad_arguments_are_refused():
    student, teacher, targets = fixed_logits()
    eye = torch.eye(V)
    with pytest.raises(ValueError, match="chunk_tokens must be >= 1"):
        distill_hidden_sum(student, Head(eye), teacher, Head(eye), targets, DistillSpec(0.0), 0)
    with pytest.raises(ValueError, match="do not fit"):
        distill_hidden_sum(student, Head(eye), teacher, Head(torch.eye(V + 1)[:, :V]), targets,
                           DistillSpec(0.0), 4)
    with pytest.raises(ValueError, match="distill.loss 'kl'"):
        DistillSpec.of("kl", 0.5, 1.0, 1.0, 0)
    assert DistillSpec.of("reverse_kl", 0.5, 2.0, 1.0, 0) == DistillSpec(1.0, 2.0, 1.0, 0)
    h = student.clone().requires_grad_()
    loss, _ = distill_hidden_sum(h, Head(eye), teacher, Head(eye), targets, DistillSpec(0.0), 4)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="backward ran twice"):
        loss.backward()
