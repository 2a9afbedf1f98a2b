"""Tensor parallel against one process, every family in one launch: logits, losses and gradients.

Usage (from tests/dist/test_tp_parity.py): ``torchrun --nproc_per_node=T tests/workers/tp_worker.py
OUT.json``. Each rank builds, per family, a small model whole (the reference) and split over a T-rank
tensor-parallel mesh by ``apply_tp`` (meta -> ``to_empty`` -> ``init_weights``, as training does), then
compares in fp32:

- the logits of ``model(tokens)`` (gathered from their vocabulary shards);
- the vocabulary-parallel loss (chunked, and in one chunk) against ``token_loss_sum`` on the whole logits, and
  against PyTorch's ``loss_parallel`` cross-entropy on the split logits;
- the gradient of the chunked loss (every parameter, together) against the reference's of the plain loss.

Rank 0 writes ``{family: {figure: max difference}}`` to OUT.json.
"""

from __future__ import annotations

import json
import sys

import torch
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from shardlm.data.instruct import IGNORE_INDEX
from shardlm.model.config import ModelConfig
from shardlm.model.decoder import CausalLM
from shardlm.parallel import exit_process
from shardlm.parallel.tp import apply_tp
from shardlm.train.loss import model_loss_sum, token_loss_sum

#: one small shape per family, each with what sets it apart switched on (GQA everywhere: 4 query / 2 kv heads)
FAMILIES = {
    "llama": dict(family="llama"),
    "llama_tied": dict(family="llama", tie_embeddings=True),
    "qwen2": dict(family="qwen2"),
    "qwen3": dict(family="qwen3", head_width=24),
    "mistral": dict(family="mistral", sliding_window=5),
    "gemma3": dict(family="gemma3", sliding_window=5, sliding_window_pattern=2, rope_local_theta=10000.0,
                   query_pre_attn_scalar=16.0, final_logit_softcap=3.0, tie_embeddings=True),
    # packed rows: document masking and per-document positions (model/attention.py), with a window
    "mistral_block_causal": dict(family="mistral", sliding_window=5, attention="block_causal"),
}


def compare(name: str, overrides: dict, mesh, seed: int = 0) -> dict[str, float]:
    cfg = ModelConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=64, vocab_size=96,
                      max_seq_len=32, **overrides)
    ref = CausalLM(cfg)
    ref.init_weights(seed)
    with torch.device("meta"):
        model = CausalLM(cfg)
    apply_tp(model, mesh)
    model.to_empty(device="cpu")
    model.init_weights(seed)
    with torch.no_grad():  # biases start at zero: make Qwen2's matter
        for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
            if n.endswith(".bias"):
                full = torch.randn(p.shape, generator=torch.Generator().manual_seed(len(n)))
                q.copy_(full)
                p.to_local().copy_(
                    torch.distributed.tensor.distribute_tensor(full, mesh, p.placements).to_local()
                )
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, cfg.vocab_size, (2, 16), generator=gen)
    targets = torch.randint(0, cfg.vocab_size, (2, 16), generator=gen)
    targets[0, :3] = IGNORE_INDEX
    docs = (
        torch.tensor([[0] * 5 + [1] * 6 + [2] * 5, [0] * 9 + [1] * 7])
        if cfg.attention == "block_causal"
        else None
    )
    out: dict[str, float] = {}
    with torch.no_grad():
        logits = model(tokens, documents=docs)
        want = ref(tokens, documents=docs)
        out["logits"] = (logits.full_tensor() - want).abs().max().item()
        out["logits_scale"] = want.abs().max().item()  # the magnitude the difference is relative to
        out["logits_are_split"] = float(isinstance(logits, DTensor) and logits.placements[0].is_shard(2))
        with loss_parallel():
            lp = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX,
                                 reduction="sum")
    plain = token_loss_sum(ref(tokens, documents=docs), targets)
    plain.backward()
    ref_grads = {n: p.grad for n, p in ref.named_parameters()}
    out["loss_parallel_rel"] = abs(lp.full_tensor().item() - plain.item()) / plain.item()
    with torch.no_grad():
        one_chunk = model_loss_sum(model, tokens, targets, 0, docs)
    out["one_chunk_rel"] = abs(one_chunk.item() - plain.item()) / plain.item()
    loss = model_loss_sum(model, tokens, targets, 7, docs)  # chunks of 7 of the 29 scored tokens
    loss.backward()
    out["chunked_rel"] = abs(loss.item() - plain.item()) / plain.item()
    diff = sum(
        (p.grad.full_tensor() - ref_grads[n]).double().square().sum() for n, p in model.named_parameters()
    )
    norm = sum(g.double().square().sum() for g in ref_grads.values())
    out["grad_rel"] = (diff / norm).sqrt().item()  # |g - g_ref| / |g_ref| over all parameters together
    out["grad_max_abs"] = max((p.grad.full_tensor() - ref_grads[n]).abs().max().item()
                              for n, p in model.named_parameters())
    out["tied_one_tensor"] = float(model.lm_head.weight is model.model.embed_tokens.weight)
    out["local_heads"] = model.model.layers[0].self_attn.q_proj.weight.to_local().shape[0] // cfg.head_dim
    return out


def main() -> None:
    torch.distributed.init_process_group("gloo")
    world = torch.distributed.get_world_size()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    results = {name: compare(name, overrides, mesh) for name, overrides in FAMILIES.items()}
    if torch.distributed.get_rank() == 0:
        with open(sys.argv[1], "w") as f:
            json.dump(results, f)
    torch.distributed.barrier()


if __name__ == "__main__":
    main()
    exit_process(0)
