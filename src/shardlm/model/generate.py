"""Sampling text from a trained model (one process, no distributed code)."""

from __future__ import annotations

import torch

from shardlm.model.llama import Llama


@torch.no_grad()
def sample(model: Llama, prompt_ids: list[int], max_new_tokens: int, temperature: float = 0.8,
           top_k: int = 0, eos_id: int | None = None, seed: int = 0) -> list[int]:
    """Autoregressively extend ``prompt_ids`` by up to ``max_new_tokens`` token ids.

    Temperature 0 is greedy decoding; ``top_k`` > 0 keeps the k most likely tokens. The context is
    cropped to the model's ``max_seq_len``. Stops early at ``eos_id``. Returns only the new ids.

    Raises:
        ValueError: empty prompt or negative temperature.
    """
    if not prompt_ids:
        raise ValueError("the prompt is empty")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    device = next(model.parameters()).device
    gen = torch.Generator(device=device).manual_seed(seed)
    ids = torch.tensor([prompt_ids], dtype=torch.long, device=device)
    new: list[int] = []
    for _ in range(max_new_tokens):
        logits = model(ids[:, -model.cfg.max_seq_len:])[0, -1].float()
        if temperature == 0:
            nxt = int(logits.argmax())
        else:
            logits = logits / temperature
            if top_k > 0:
                kth = torch.topk(logits, min(top_k, logits.numel())).values[-1]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            nxt = int(torch.multinomial(torch.softmax(logits, -1), 1, generator=gen))
        if eos_id is not None and nxt == eos_id:
            break
        new.append(nxt)
        ids = torch.cat([ids, torch.tensor([[nxt]], device=device)], dim=1)
    return new
