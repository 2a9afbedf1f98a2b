"""Launchers other than torchrun that start the same training: Ray Train (:mod:`shardlm.integrations.ray`).

SkyPilot and Kubeflow Trainer need no code here: they start torchrun (examples/skypilot/, examples/kubeflow/).
"""
