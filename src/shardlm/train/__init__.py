"""The training job: building the model (``build.py``), the token loss (``loss.py``), AdamW and the LR
schedule (``optim.py``), and the ``Trainer`` (``trainer.py``: set-up, the training step, evaluation, the loop)
with the parts it calls on: the run directory (``run_dir.py``), the data per format (``datasets.py``), the
start-up summary (``summary.py``), the record entries of MoE and mixture runs (``step_metrics.py``) and the
final export (``final_export.py``)."""

__all__ = ["Trainer", "run_dir"]


def __getattr__(name: str):
    """``Trainer`` and ``run_dir`` from ``trainer.py``, imported on first use (PEP 562), so that
    ``python -m shardlm.train`` reaches ``__main__`` (which takes a Ctrl-C during the imports) before torch
    is imported."""
    if name in __all__:
        from shardlm.train import trainer

        return getattr(trainer, name)
    raise AttributeError(f"module 'shardlm.train' has no attribute {name!r}")
