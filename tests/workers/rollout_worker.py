"""The rollout on an FSDP2-sharded tiny model against one process, in one torchrun launch.

Usage (from tests/dist/test_rollout_ranks.py): ``torchrun --nproc_per_node=N
tests/workers/rollout_worker.py OUT.json``. Each rank builds the model as training does (meta ->
``apply_fsdp`` -> ``to_empty`` -> ``init_weights``) and also the same model whole (the one-process
reference). Rank r samples the prompts r, r + N, ... (uneven counts and lengths, its own generation batch
size: its decode stops at its own step, no collective in between); rank 0 compares every completion with
the one-process rollout of all prompts. Then each rank scores its rollout in two micro-batches inside
``gathered`` (no gradient) and runs the same micro-batches through the sharded model with gradients and
per-group all-gathers, as a training step does: the log-probs must be the same bits. Rank 0 writes a JSON
report to OUT.json. With a second argument, ``SPEC.json`` (tests/workers/grpo_worker.py's spec), the same
launch then trains its online-RL scenarios on the process group already open and writes their reports.
"""

from __future__ import annotations

import json
import sys

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from grpo_worker import run_grpo_scenarios
from shardlm.model.config import ModelConfig
from shardlm.model.decoder import CausalLM
from shardlm.parallel import exit_process
from shardlm.parallel.fsdp import apply_fsdp, gathered
from shardlm.rl.logps import score_rollout, token_logps, trainer_batch
from shardlm.rl.rollout import rollout

CFG = ModelConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=64, vocab_size=48, max_seq_len=96)
KW = dict(max_completion_length=24, stop_ids=[1, 2, 3], seed=7, step=3, temperature=0.9, top_p=0.95, top_k=30)
G = 3


@torch.no_grad()
def sharpen(model: CausalLM) -> None:
    """Scale the weight matrices (sharded or not) by 8: next-token distributions far from uniform, so the
    completions have many lengths (as tests/unit/test_rollout.py's tiny model)."""
    for p in model.parameters():
        if p.dim() == 2:
            p.mul_(8)


def prompts_of(n: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(1)
    lengths = torch.randint(2, 15, (n,), generator=gen).tolist()
    return [torch.randint(4, CFG.vocab_size, (k,), generator=gen).tolist() for k in lengths]


def main() -> None:
    torch.distributed.init_process_group("gloo")
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    with torch.device("meta"):
        model = CausalLM(CFG)
    apply_fsdp(model, mesh)
    model.to_empty(device="cpu")
    model.init_weights(0)
    sharpen(model)
    prompts = prompts_of(7)
    mine = list(range(rank, len(prompts), world))
    ro = rollout(model, [prompts[i] for i in mine], [100 + i for i in mine], G, batch_size=2 + 3 * rank, **KW)
    q = model.model.layers[0].self_attn.q_proj
    sharded_after = isinstance(q.weight, DTensor)
    with gathered(model):
        gathered_inside = not isinstance(q.weight, DTensor)
    # trainer side: the same two micro-batches scored inside gathered, then by a training forward + backward
    rows = list(range(ro.completion_ids.shape[0]))
    micro = [rows[: len(rows) // 2], rows[len(rows) // 2:]]
    scored = score_rollout(model, ro, micro, KW["temperature"], chunk_tokens=8)
    model.train()
    step_equal = True
    for part in micro:
        batch = trainer_batch(ro, part)
        logps, _ = token_logps(model, batch, KW["temperature"], chunk_tokens=8)
        step_equal &= torch.equal(logps.detach(), scored[batch.rows])
        logps.sum().backward()
    keyed = {f"{p},{g}": c for p, g, c in zip(ro.prompt_index.tolist(), ro.generation_index.tolist(),
                                               ro.completions())}
    everything = [None] * world
    torch.distributed.all_gather_object(everything, {"completions": keyed, "step_equal": bool(step_equal),
                                                      "sharded_after": sharded_after,
                                                      "gathered_inside": gathered_inside,
                                                      "rows": len(rows)})
    if rank == 0:
        ref_model = CausalLM(CFG)
        ref_model.init_weights(0)
        sharpen(ref_model)
        ref = rollout(ref_model, prompts, [100 + i for i in range(len(prompts))], G, **KW)
        want = {f"{p},{g}": c for p, g, c in zip(ref.prompt_index.tolist(), ref.generation_index.tolist(),
                                                  ref.completions())}
        got = {k: v for part in everything for k, v in part["completions"].items()}
        report = {
            "world": world,
            "rows_per_rank": [part["rows"] for part in everything],
            "keys_equal": sorted(got) == sorted(want),
            "completions_equal": got == want,
            "tokens_differing": sum(a != b for k in want for a, b in zip(want[k], got.get(k, []))),
            "lengths": sorted(len(c) for c in want.values()),
            "step_equal": [part["step_equal"] for part in everything],
            "sharded_after": [part["sharded_after"] for part in everything],
            "gathered_inside": [part["gathered_inside"] for part in everything],
        }
        with open(sys.argv[1], "w") as f:
            json.dump(report, f)
    torch.distributed.barrier()
    if len(sys.argv) > 2:
        run_grpo_scenarios(sys.argv[2])


if __name__ == "__main__":
    main()
    exit_process(0)
