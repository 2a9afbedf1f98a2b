"""Online reinforcement learning (the GRPO family): the prompts' rewards, group-relative advantages, the
policy-gradient losses as TRL defines them, and the rollout sampled by the policy itself. Nothing here knows
the training step: :mod:`shardlm.train.objectives` plugs these into it."""
