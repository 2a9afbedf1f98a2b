"""Our own training checkpoints: sharded DCP save/load (``dcp.py``: the ``Checkpointer``, built from
``preemption.py``, ``saving.py`` and ``resume.py``; ``state.py``: what a checkpoint holds, verified), the
manifest with checksums and retention (``manifest.py``), loading that never unpickles code (``safe_load.py``),
and ``shardlm inspect`` (``inspect.py``).

Conversion to and from other formats (Hugging Face directories, GGUF, export) lives in :mod:`shardlm.convert`.
"""
