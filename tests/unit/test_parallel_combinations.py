"""Combinations of the parallelisms and objectives that are not built together yet: each is refused with one
message naming both settings, before any process group starts (``config.validate``, ``parallel/dist.py``)."""

from __future__ import annotations

import pytest

from shardlm.config import ParallelConfig, load_config
from shardlm.errors import ConfigError
from shardlm.parallel.dist import dp_mesh_shape

MOE = ["--model.family=qwen3_moe", "--model.n_experts=4", "--model.n_experts_per_token=2"]


def test_context_and_tensor_parallel_together_are_refused():
    with pytest.raises(ConfigError, match=r"parallel.cp=2 with parallel.tp=2: context and tensor parallelism "
                                          r"together are not built yet"):
        dp_mesh_shape(ParallelConfig(cp=2, tp=2), 8, 8)
    assert dp_mesh_shape(ParallelConfig(cp=2), 8, 8) == (1, 4)  # the control: each alone builds
    assert dp_mesh_shape(ParallelConfig(tp=2), 8, 8) == (1, 4)


@pytest.mark.parametrize("split", ["--parallel.tp=2", "--parallel.cp=2"])
def test_tensor_or_context_parallel_on_a_mixture_of_experts_is_refused(split):
    with pytest.raises(ConfigError, match=rf"{split[2:]} on a mixture-of-experts model \(model.n_experts=4\) is not "
                                          "built yet"):
        load_config(None, [*MOE, split])
    load_config(None, MOE)  # the control: the MoE model alone loads


@pytest.mark.parametrize("extra,what", [(["--parallel.tp=2"], "parallel.tp=2"), (["--parallel.cp=2"], "parallel.cp=2"),
                                        (MOE, r"a mixture-of-experts model \(model.n_experts=4\)")])
def test_preference_tuning_with_tp_cp_or_moe_is_refused(extra, what):
    with pytest.raises(ConfigError, match=rf"preference tuning \(data.format = 'preference'\) with {what} is not "
                                          "built yet"):
        load_config(None, ["--data.format=preference", *extra])
