"""Conversion to and from other formats, each file named by its direction.

- ``hf_config.py``: the old import path of :mod:`shardlm.model.hf_config` (HF ``config.json`` <->
  :class:`shardlm.model.config.ModelConfig`, below the configuration that reads it);
- ``hf_in.py``: reading HF model directories, whole or each rank only its shard's rows;
- ``hf_out.py``: writing HF model directories (a run's ``final/``, exports) and checked copies of them;
- ``gguf_in.py``: GGUF (llama.cpp) files in, dequantised;
- ``export.py``: one of our DCP checkpoints out, as an HF directory.
"""
