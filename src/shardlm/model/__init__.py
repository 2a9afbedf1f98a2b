"""The model, with no distributed code: its shape (``config.py``: :class:`ModelConfig`), the model families
and their registry (``families/``), HF ``config.json`` both ways (``hf_config.py``), one decoder for all of
them (``decoder.py``: ``CausalLM``; ``llama.py`` is its old name), rotary tables (``rope.py``), the KV cache
(``kv_cache.py``) and sampling with it (``generate.py``), and the CPU bf16 matmul kernel (``cpu_matmul.py``).

Import from the modules themselves (``from shardlm.model.decoder import CausalLM``): this file imports
nothing, so reading a configuration does not import torch.
"""
