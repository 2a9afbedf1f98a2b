"""The ``[rl]`` section: read from TOML / overrides, and each refusal's one message naming the key."""

from __future__ import annotations

import pytest

from shardlm.config import load_config
from shardlm.data.attention_choice import choose_attention
from shardlm.errors import ConfigError

BASE = ["--data.format=prompts", "--train.seq_len=64", "--train.global_batch_size=8",
        "--rl.num_generations=4", "--rl.max_prompt_length=32", "--rl.max_completion_length=32"]


def test_rl_section_read(tmp_path):
    toml = tmp_path / "rl.toml"
    toml.write_text('[data]\nformat = "prompts"\n[train]\nseq_len = 64\n[rl]\nnum_generations = 4\n'
                    'max_prompt_length = 16\nmax_completion_length = 48\nloss_type = "grpo"\n'
                    'importance_sampling_level = "sequence"\nrewards = ["shardlm.rl.rewards:accuracy", '
                    '"shardlm.rl.rewards:format"]\nreward_weights = [1.0, 0.2]\nepsilon_high = 0.28\n')
    cfg = load_config(str(toml))
    assert cfg.rl.loss_type == "grpo" and cfg.rl.importance_sampling_level == "sequence"
    assert cfg.rl.rewards == ("shardlm.rl.rewards:accuracy", "shardlm.rl.rewards:format")
    assert cfg.rl.reward_weights == (1.0, 0.2) and cfg.rl.epsilon_high == 0.28
    assert cfg.to_dict()["rl"]["num_generations"] == 4


def test_defaults_are_trls():
    cfg = load_config(None, BASE)
    assert (cfg.rl.loss_type, cfg.rl.scale_rewards, cfg.rl.importance_sampling_level) == ("dapo", "group",
                                                                                          "token")
    assert (cfg.rl.epsilon, cfg.rl.beta, cfg.rl.temperature, cfg.rl.num_iterations) == (0.2, 0.0, 1.0, 1)


@pytest.mark.parametrize(("extra", "message"), [
    (["--rl.loss_type=bnpo"],
     "rl.loss_type: 'bnpo' is not one of ['grpo', 'dr_grpo', 'dapo', 'cispo', 'sapo'] (TRL's bnpo normalises "
     "over each process's local batch; over the global batch, as shardlm normalises, it is 'dapo': set "
     "rl.loss_type = 'dapo')"),
    (["--rl.loss_type=ppo"], "rl.loss_type: 'ppo' is not one of"),
    (["--rl.num_generations=1"], "rl.num_generations = 1 with rl.scale_rewards = 'group'"),
    (["--rl.num_generations=1", "--rl.scale_rewards=batch"], "standard deviation of a group of one"),
    (["--rl.max_completion_length=34"], "32 + 34 tokens cannot fit train.seq_len + 1 = 65"),
    (["--rl.temperature=0"], "rl.temperature must be positive"),
    (["--rl.top_p=0"], "rl.top_p must be in (0, 1]"),
    (["--rl.generation_batch_size=12"], "rl.generation_batch_size = 12, must be a multiple"),
    (["--rl.generation_batch_size=16", "--rl.steps_per_generation=2"], "not both"),
    (["--rl.num_generations=3"],
     "rl.generation_batch_size = 8 (train.global_batch_size 8 × rl.steps_per_generation 1), must be a "
     "multiple of train.global_batch_size = 8 and of rl.num_generations = 3 (whole groups)"),
    (["--rl.rewards=shardlm.rl.rewards:accuracy"],
     "rl.rewards: expected a list, got 'shardlm.rl.rewards:accuracy'; on the command line a list is written "
     "in TOML, quoted: --rl.rewards='[\"shardlm.rl.rewards:accuracy\"]'"),
    (["--rl.delta=1.5", "--rl.loss_type=cispo"], "rl.delta = 1.5 caps the ratio"),
    (["--rl.reference=lora_base", "--rl.beta=0.1"], "rl.reference = 'lora_base' needs lora.enabled"),
    (["--rl.reward_weights=[1.0, 2.0]"], "rl.reward_weights has 2 weights for 1 rl.rewards"),
    (["--rl.rewards=[]"], "rl.rewards is empty"),
    (["--rl.format_pattern=(unclosed"], "rl.format_pattern is not a regular expression"),
    (["--rl.rewards=['shardlm.rl.rewards:overlong']"], "rl.overlong_cache between 1 and"),
    (["--data.pack=true"], "data.pack does not apply to data.format = 'prompts'"),
    (["--rl.rollout=vllm"], "rl.rollout: 'vllm' is not one of"),
    (["--rl.rollout=exact", "--parallel.compile=true"], "which parallel.compile (the compiled training"),
    (["--rl.rollout=exact", "--lora.enabled=true", "--lora.dropout=0.1"], "which LoRA dropout"),
    (["--rl.rollout=exact", "--train.float8=tensorwise"], "which train.float8 = 'tensorwise' (one"),
    (["--rl.rollout=exact", "--model.family=qwen3_moe", "--model.n_experts=4",
      "--model.n_experts_per_token=2"], "which a mixture of experts"),
    (["--parallel.tp=2", "--parallel.mode=fsdp"], "reinforcement learning (data.format = 'prompts') with "
                                                  "parallel.tp=2 is not built yet"),
])
def test_refusals(extra, message):
    with pytest.raises(ConfigError) as err:
        load_config(None, BASE + extra)
    assert message in str(err.value)


def test_any_checkpoint_interval_inside_a_cycle():
    """A checkpoint inside a generation cycle holds its buffer: an interval that saves inside cycles of 2 and
    of 6 steps is taken (it was refused before the buffer was saved)."""
    cfg = load_config(None, BASE + ["--rl.num_iterations=2", "--checkpoint.interval=3"])
    assert (cfg.checkpoint.interval, cfg.rl.num_iterations) == (3, 2)
    cfg = load_config(None, BASE + ["--rl.generation_batch_size=24", "--rl.num_iterations=2"])
    assert cfg.rl.generation_batch_size == 24 and cfg.checkpoint.interval % 6


def test_rl_settings_need_prompts():
    with pytest.raises(ConfigError, match="rl.num_generations applies to data.format = 'prompts'"):
        load_config(None, ["--rl.num_generations=4"])
    one = load_config(None, BASE + ["--rl.num_generations=1", "--rl.scale_rewards=none"])
    assert one.rl.num_generations == 1


def test_auto_attention_is_causal_for_prompts():
    choice = choose_attention(load_config(None, BASE))
    assert choice.attention == "causal" and "prompt and completion" in choice.why


def test_a_resume_may_name_the_generation_batch_either_way():
    """``rl.generation_batch_size = 16`` at a global batch of 8 is ``rl.steps_per_generation = 2``: a resume
    that switches between the two is no change; another number of steps per generation is refused."""
    from shardlm.checkpoint.resume_config import REFUSED, config_changes

    by_size = load_config(None, BASE + ["--rl.generation_batch_size=16"]).to_dict()
    by_steps = load_config(None, BASE + ["--rl.steps_per_generation=2"]).to_dict()
    assert config_changes(by_size, by_steps) == [] and config_changes(by_steps, by_size) == []
    other = load_config(None, BASE + ["--rl.steps_per_generation=3"]).to_dict()
    changes = config_changes(by_size, other)
    assert {c.key for c in changes} == {"rl.generation_batch_size", "rl.steps_per_generation"}
    assert all(c.rule == REFUSED for c in changes)
    # the same generation batch at another global batch is another number of steps: refused
    bigger = load_config(None, BASE[:2] + ["--train.global_batch_size=16"] + BASE[3:]
                         + ["--rl.generation_batch_size=16"]).to_dict()
    refused = {c.key for c in config_changes(by_steps, bigger) if c.rule == REFUSED}
    assert {"train.global_batch_size", "rl.generation_batch_size"} <= refused
