"""The MoE layer (shardlm/model/moe.py) against transformers' sparse MoE blocks, and its grouped matmul."""

from __future__ import annotations

import pytest
import torch

from shardlm.model.moe import MoE, grouped_linear, route
from tolerance import EPS, assert_close

transformers = pytest.importorskip("transformers")


def _hf_block(family: str, norm_topk_prob: bool = False):
    if family == "qwen3_moe":
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock
        cfg = transformers.Qwen3MoeConfig(hidden_size=32, moe_intermediate_size=24, num_experts=8,
                                          num_experts_per_tok=2, norm_topk_prob=norm_topk_prob)
        return Qwen3MoeSparseMoeBlock(cfg)
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
    cfg = transformers.MixtralConfig(hidden_size=32, intermediate_size=24, num_local_experts=8,
                                     num_experts_per_tok=2)
    return MixtralSparseMoeBlock(cfg)


@pytest.mark.parametrize("family,norm", [("qwen3_moe", False), ("qwen3_moe", True), ("mixtral", True)])
def test_moe_block_equals_transformers(family, norm):
    torch.manual_seed(0)
    hf = _hf_block(family, norm)
    for p in hf.parameters():
        torch.nn.init.normal_(p, std=0.3)
    ours = MoE(32, 8, 24, 2, "softmax_topk", norm_topk_prob=norm)
    with torch.no_grad():
        ours.gate.weight.copy_(hf.gate.weight)
        ours.experts.gate_up_proj.copy_(hf.experts.gate_up_proj)
        ours.experts.down_proj.copy_(hf.experts.down_proj)
    x = torch.randn(2, 40, 32, requires_grad=True)
    x_hf = x.detach().clone().requires_grad_(True)
    y, y_hf = ours(x), hf(x_hf)
    assert_close(y, y_hf, rtol=64 * EPS, what=f"{family} output")
    g = torch.randn_like(y)
    (y * g).sum().backward()
    (y_hf * g).sum().backward()
    for a, b in [(x.grad, x_hf.grad), (ours.experts.gate_up_proj.grad, hf.experts.gate_up_proj.grad),
                 (ours.experts.down_proj.grad, hf.experts.down_proj.grad), (ours.gate.weight.grad,
                                                                            hf.gate.weight.grad)]:
        assert_close(a, b, rtol=64 * EPS, what=f"{family} gradient")
    stats = ours.stats
    assert stats.tokens == 80 and stats.counts.sum() == 160
    assert (
        stats.counts.tolist()
        == torch.bincount(hf.gate(x.reshape(-1, 32))[2].reshape(-1), minlength=8).tolist()
    )


def test_padding_left_out_of_the_router_statistics_gives_transformers_masked_aux_loss():
    """``real_tokens`` (per row): the output is unchanged, the statistics are those of the real tokens only,
    and the aux loss is transformers' ``load_balancing_loss_func`` under the same ``attention_mask``; an
    all-True mask gives the unmasked statistics bit for bit; a mask of another shape is refused."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    from shardlm.train.moe_loss import moe_loss_term
    torch.manual_seed(0)
    layer = MoE(32, 8, 24, 2, "softmax_topk", norm_topk_prob=True)
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.3)
    x = torch.randn(3, 7, 32)
    mask = torch.arange(7).expand(3, 7) < torch.tensor([[7], [5], [2]])  # 7, 5 and 2 real tokens
    y_all = layer(x)
    full = moe_loss_term(layer, 1.0, 1.0)
    y = layer(x, mask)
    torch.testing.assert_close(y, y_all, atol=0, rtol=0)
    assert layer.stats.tokens == 14 and layer.stats.counts.sum() == 28
    logits = layer.gate(x.reshape(-1, 32)).detach()
    want = load_balancing_loss_func((logits,), 8, 2, mask)
    got = moe_loss_term(layer, 1.0, 1.0)
    assert_close(got.aux, want, rtol=16 * EPS, what="masked aux")
    assert abs(full.aux.item() - want.item()) > 1e-4
    z = torch.logsumexp(logits[mask.reshape(-1)], -1).pow(2).mean()
    torch.testing.assert_close(got.z, z)
    chosen = layer.gate(x[mask]).topk(2).indices.reshape(-1)
    assert got.counts.tolist() == [torch.bincount(chosen, minlength=8).float().tolist()]
    layer(x, torch.ones(3, 7, dtype=torch.bool))
    every = moe_loss_term(layer, 1.0, 1.0)
    for a, b in ((every.aux, full.aux), (every.z, full.z), (every.counts, full.counts),
                 (every.term, full.term)):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match=r"real_tokens \(3, 7\) must have the input's shape"):
        layer(torch.randn(3, 8, 32), mask)


def test_topk_softmax_routing_is_softmax_over_the_top_k_logits():
    logits = torch.tensor([[1.0, 3.0, 2.0, -1.0]])
    weights, experts, probs = route(logits, 2, "topk_softmax", False)
    assert experts.tolist() == [[1, 2]]
    torch.testing.assert_close(weights, torch.softmax(torch.tensor([[3.0, 2.0]]), -1))
    torch.testing.assert_close(probs, torch.softmax(logits, -1))
    with pytest.raises(ValueError, match="routing 'group_limited' is not built"):
        route(logits, 2, "group_limited", False)


def test_grouped_linear_loop_equals_grouped_mm_and_an_empty_expert_gets_zero_grads():
    torch.manual_seed(0)
    x = torch.randn(10, 16)
    w = torch.randn(3, 8, 16, requires_grad=True)
    counts = torch.tensor([3, 0, 7])
    y = grouped_linear(x, w, counts)
    ref = torch.cat([x[:3] @ w[0].T, x[3:] @ w[2].T])
    torch.testing.assert_close(y, ref)
    # torch._grouped_mm (the CUDA kernel) runs its forward on CPU too: the same values
    mm = torch._grouped_mm(x, w.detach().transpose(-2, -1), offs=torch.cumsum(counts, 0, dtype=torch.int32))
    assert_close(y.detach(), mm, rtol=16 * EPS, what="grouped_mm")
    y.sum().backward()
    assert w.grad is not None and w.grad[1].abs().max() == 0 and w.grad[0].abs().max() > 0


def test_lora_on_experts_is_refused_by_name():
    from shardlm.errors import ConfigError
    from shardlm.model.lora import LoRASpec, apply_lora
    model = torch.nn.Module()
    model.mlp = MoE(16, 4, 8, 2)
    with pytest.raises(ConfigError,
                       match="lora.targets gate_proj,down_proj: LoRA on the experts of a mixture of "
                                          "experts is not built"):
        apply_lora(model, LoRASpec(4, 8.0, 0.0, "q_proj,gate_proj,down_proj", "float32"))


@pytest.mark.parametrize("n_experts,ep,world,mode,message", [
    (8, 3, 6, "fsdp", "parallel.ep=3 must divide model.n_experts=8"),
    (8, 4, 6, "fsdp", "parallel.ep=4 must divide the data-parallel ranks \\(6\\)"),
    (8, 2, 2, "ddp", "parallel.ep=2 needs parallel.mode='fsdp' \\(got 'ddp'\\)"),
    (0, 2, 2, "fsdp", "parallel.ep=2 needs a mixture of experts"),
])
def test_bad_expert_parallel_layouts_are_refused_by_name(n_experts, ep, world, mode, message):
    from shardlm.config.layout import check_ep
    from shardlm.errors import ConfigError
    with pytest.raises(ConfigError, match=message):
        check_ep(n_experts, ep, world, mode)
    check_ep(n_experts or 8, 2, 4, "fsdp")  # a layout that is built passes


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_activation_checkpointing_keeps_moe_gradients_and_aux_loss(mode):
    from shardlm.model.config import ModelConfig
    from shardlm.model.decoder import CausalLM
    from shardlm.parallel.ac import apply_ac
    from shardlm.train.moe_loss import moe_loss_term
    cfg = ModelConfig(family="qwen3_moe", dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=64,
                      vocab_size=64, max_seq_len=32, n_experts=4, n_experts_per_token=2, moe_ffn_hidden=16)
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    grads = []
    for ac in ("none", mode):
        model = CausalLM(cfg)
        model.init_weights(0)
        apply_ac(model.model.layers, ac, 1)
        logits = model(tokens[:, :-1])
        term = moe_loss_term(model, 0.1, 0.01)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()) + term.term
        loss.backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    assert grads[0].keys() == grads[1].keys() and any("experts.gate_up_proj" in n for n in grads[0])
    for name in grads[0]:
        assert_close(grads[1][name], grads[0][name], rtol=64 * EPS, what=name)


def test_expert_parallel_refusal_is_one_line_and_exit_2(small_data, tmp_path, capsys):
    from conftest import cli_error, tiny_overrides
    moe = {"model.family": '"qwen3_moe"', "model.n_experts": 4, "model.head_width": 16, "parallel.ep": 3,
           "train.steps": 1}
    err = cli_error(capsys, ["train", *tiny_overrides(small_data, tmp_path / "run", moe)])
    assert err == ("error: parallel.ep=3 must divide model.n_experts=4 (each ep rank holds n_experts / ep "
                   "whole experts)")


def test_a_rank_reads_only_its_experts_tensors():
    from shardlm.convert.hf_experts import disk_shapes, read_rows, to_disk
    from shardlm.model.config import ModelConfig
    cfg = ModelConfig(family="mixtral", dim=8, n_layers=1, n_heads=2, ffn_hidden=4, n_experts=4)
    name, shape = "model.layers.0.mlp.experts.gate_up_proj", (4, 8, 8)
    full = torch.arange(4 * 8 * 8, dtype=torch.float32).reshape(shape)
    disk = to_disk(cfg, {name: full, "model.layers.0.mlp.gate.weight": torch.zeros(4, 8)})
    assert set(disk) == set(disk_shapes(cfg, name, shape)) | {"model.layers.0.block_sparse_moe.gate.weight"}
    assert torch.equal(disk["model.layers.0.block_sparse_moe.experts.2.w3.weight"], full[2, 4:])  # up rows
    read = []
    # a shard holding experts 1, 2
    rows = read_rows(cfg, name, shape, 1, 3, lambda n: read.append(n) or disk[n])
    assert torch.equal(rows, full[1:3])
    assert read == [
        f"model.layers.0.block_sparse_moe.experts.{e}.{w}.weight" for e in (1, 2) for w in ("w1", "w3")
    ]


def test_the_logged_aux_loss_under_accumulation_is_the_mean_of_transformers_per_forward(small_data, tmp_path):
    """With gradient accumulation the load-balancing statistics are pooled per micro-step (one forward per
    rank), not over the global batch: one process, 2 micro-batches of 2. The step's ``moe_aux_loss`` is the
    mean over the micro-batches of transformers' ``aux_loss`` of each forward (on the step's starting
    weights), and differs from the ``aux_loss`` of the whole batch in one forward (what gradient accumulation
    does not give)."""
    from conftest import tiny_overrides
    from shardlm.config import load_config
    from shardlm.convert.hf_out import save_model_dir
    from shardlm.parallel import init_distributed
    from shardlm.train.trainer import Trainer
    cfg = load_config(None, tiny_overrides(small_data, tmp_path / "run", {
        "model.family": '"qwen3_moe"', "model.n_experts": 8, "model.n_experts_per_token": 2,
        "model.head_width": 16, "model.moe_ffn_hidden": 32, "model.norm_topk_prob": "true",
        "model.router_aux_loss_coef": 0.05, "parallel.mode": '"single"', "train.seq_len": 16,
        "train.global_batch_size": 4, "train.micro_batch_size": 2}))
    started = torch.distributed.is_initialized()
    try:
        trainer = Trainer(cfg, init_distributed(cfg.parallel))  # a process group of one rank
        inputs = []
        hook = trainer.model.register_forward_pre_hook(
            lambda _m, args: inputs.append(args[0].detach().clone())
        )
        start = save_model_dir({k: v.detach().clone() for k, v in trainer.model.state_dict().items()},
                               cfg.model, tmp_path / "start")
        record = trainer.train_step()
        hook.remove()
    finally:
        if not started and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    assert len(inputs) == 2 and inputs[0].shape == (2, 16)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(start), dtype=torch.float32).eval()
    with torch.no_grad():
        per_forward = [hf(ids, output_router_logits=True).aux_loss.item() for ids in inputs]
        whole = hf(torch.cat(inputs), output_router_logits=True).aux_loss.item()
    print(f"\naux loss: logged {record['moe_aux_loss']:.8f}, transformers per forward {per_forward}, "
          f"whole batch {whole:.8f}")
    assert_close(record["moe_aux_loss"], sum(per_forward) / 2, rtol=16 * EPS, what="logged aux")
    assert abs(whole - sum(per_forward) / 2) > 1e-5  # the pooling unit matters: the test can tell them apart


def test_start_up_summary_names_the_experts_and_the_active_parameters():
    """The summary's model line: experts, top-k, MoE layers and the active count, which equals the total less
    the (E - k) / E share of each MoE layer's expert weights (computed here from the shapes)."""
    from shardlm.config import load_config
    from shardlm.model.decoder import CausalLM, num_params
    from shardlm.train.summary import model_experts

    cfg = load_config(None,
                      ["--model.family=qwen3_moe", "--model.n_experts=8", "--model.n_experts_per_token=2",
                             "--model.moe_ffn_hidden=32", "--model.dim=64", "--model.n_layers=3",
                       "--model.n_heads=4",
                             "--model.vocab_size=256", "--model.dense_layers=[1]"])
    with torch.device("meta"):
        model = CausalLM(cfg.model)
    experts = 3 * 64 * 32  # gate, up and down of one expert
    active = num_params(model) - 2 * experts * (8 - 2)  # two MoE layers, 6 of 8 experts idle per token
    assert model_experts(cfg, model) == ("; mixture of experts: 8 experts, top-2, in 2 of 3 layers, "
                                         f"{active:,} parameters active per token")
    dense = load_config(None, [])
    assert model_experts(dense, model) == ""
