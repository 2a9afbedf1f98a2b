"""The objectives the training step plugs in (:class:`Objective`): the token loss of pre-training and SFT
(``token.py``), preference tuning (``preference.py``), knowledge distillation (``distill.py``), online RL of
the GRPO family (``grpo.py``), and the
auxiliary terms any objective may carry (a mixture of experts' router losses, ``moe.py``).
:func:`build_objective` picks the run's from its config."""

from shardlm.train.objectives.objective import AuxiliaryTerm, Objective, ObjectiveContext, StepInputs
from shardlm.train.objectives.select import build_auxiliary_terms, build_objective

__all__ = ["AuxiliaryTerm", "Objective", "ObjectiveContext", "StepInputs", "build_auxiliary_terms",
           "build_objective"]
