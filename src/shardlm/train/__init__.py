"""The training job: building the model (``build.py``), the token loss (``loss.py``), AdamW and the LR schedule
(``optim.py``), and the ``Trainer`` (``trainer.py``: set-up, the training step, evaluation, the loop)."""

from shardlm.train.trainer import Trainer, run_dir

__all__ = ["Trainer", "run_dir"]
