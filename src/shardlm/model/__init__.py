"""The model, with no distributed code: its shape (``config.py``: :class:`ModelConfig`), the Llama decoder
(``llama.py``), sampling with a KV cache (``generate.py``), and the CPU bf16 matmul kernel (``cpu_matmul.py``).

Import from the modules themselves (``from shardlm.model.llama import Llama``): this file imports nothing, so
reading a configuration does not import torch.
"""
