"""Bytes a mixture-of-experts layer keeps beyond its experts' SwiGLU, derived op by op from ``model/moe.py``
and ``parallel/ep.py`` (the planner's :mod:`shardlm.plan.activations` counts the experts as a SwiGLU of width
f = k · expert width per token).

Notation as in :mod:`shardlm.plan.activations` (B tokens of the micro-batch, d ``dim``, c the compute dtype's
bytes) and E experts, k experts per token, N = B·k (token, expert) assignments; under expert parallelism R the
assignments this rank's experts receive, taken as N (a balanced routing: each of the ``ep`` ranks sends N / ep
to each; a routing that favours one rank's experts moves R, and these bytes, on it).

Saved for backward by one MoE layer, beyond the experts' 4·c·N·h (PyTorch's derivative formulas):

- router: the fp32 softmax over all experts (4·B·E) and the fp32 logits logsumexp saves for the z statistic
  (4·B·E), its result (4·B); top-k's indices (8·B·k) and, renormalised, the top-k probabilities and their sum
  (4·B·k + 4·B);
- the sort by expert: the stable order and the token of each assignment (int64, 2·8·N), the routing weights
  gathered into that order (c·N);
- the experts' input rows (c·N·d: the sorted copy ``x[token_of]``; under EP the received rows regrouped by
  local expert, c·R·d, while the sorted copy only passes through the all-to-all), the experts' output combined
  back (c·N·d, saved by the weighting) and the weighted output (c·N·d, saved by ``index_add_``);
- under EP the dispatch's and the combine's reordering indices (int64, 2·8·R).

These were checked with ``torch.autograd.graph.saved_tensors_hooks`` on a layer of 256 tokens, 8 experts, top
2 (952,320 bytes, equal). Transient under EP, in the forward: the all-to-all's receive buffer (c·R·d) beside
the sorted copy (c·N·d) before the regrouped copy is made. Not modelled: gpt-oss's expert biases and clamps
(its experts are counted as SwiGLU), the statistics the load-balancing loss keeps (a few E-sized vectors).
"""

from __future__ import annotations

from shardlm.config import ModelConfig
from shardlm.plan.activations import Shape


def moe_layer_saved(s: Shape, mcfg: ModelConfig, ep: int = 1) -> int:
    """Bytes one MoE layer saves for backward beyond its experts' SwiGLU (see the module docstring), for the
    micro-batch of shape ``s`` (its ``tokens`` and compute bytes ``c``) and ``ep`` expert-parallel ranks."""
    b, e, k, c, d = s.tokens, mcfg.n_experts, mcfg.n_experts_per_token, s.c, s.d
    n = b * k
    r = n  # the assignments this rank's experts receive under EP, balanced
    router = 2 * 4 * b * e + 4 * b + 8 * b * k + 4 * b * k + 4 * b
    sort = 2 * 8 * n + c * n
    rows = c * (r if ep > 1 else n) * d + 2 * c * n * d
    return router + sort + rows + (2 * 8 * r if ep > 1 else 0)


def all_to_all_transient(s: Shape, mcfg: ModelConfig, ep: int) -> int:
    """Bytes alive for a moment in a MoE layer's forward under expert parallelism beyond what it saves: the
    all-to-all's receive buffer (c·R·d) and the sorted copy it was sent from (c·N·d); 0 without EP."""
    if ep <= 1:
        return 0
    n = s.tokens * mcfg.n_experts_per_token
    return 2 * s.c * n * s.d
