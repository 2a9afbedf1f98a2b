"""The training job: building the model (``build.py``), the token loss (``loss.py``), AdamW and the LR
schedule (``optim.py``), and the ``Trainer`` (``trainer.py``: set-up, the training step, evaluation, the loop)
with the parts it calls on: the run directory (``run_dir.py``), the data per format (``datasets.py``), the
start-up summary (``summary.py``), the record entries of MoE and mixture runs (``step_metrics.py``) and the
final export (``final_export.py``).

The package imports nothing itself (``from shardlm.train.trainer import Trainer``): ``python -m
shardlm.train`` reaches its ``__main__``, which takes a Ctrl-C that arrives while torch is still being
imported, before anything heavy is imported."""
