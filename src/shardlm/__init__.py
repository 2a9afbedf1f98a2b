"""shardlm: train and fine-tune Llama-style models with PyTorch FSDP2."""

__version__ = "0.1.0"
