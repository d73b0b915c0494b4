"""Real gradients to test gradient codecs on: the tiny Llama 3.1 preset on the embedded stdlib corpus."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from lightning_fedshard.data.corpus import stdlib_corpus
from lightning_fedshard.data.packing import IGNORE_INDEX, pack_documents
from lightning_fedshard.data.tokenizer import ByteTokenizer
from lightning_fedshard.models import Llama, LlamaConfig

__all__ = ["llama_gradients"]


def llama_gradients(
    workers: int = 8, *, warmup_steps: int = 30, batch_size: int = 8, seq_len: int = 128, seed: int = 0
) -> list[Tensor]:
    """One flat fp32 gradient per worker: the tiny Llama is trained for ``warmup_steps`` AdamW steps (so the
    gradients are those of a model that is learning, not of its initialisation), then each worker takes the
    gradient of its own batch. Deterministic for a given ``seed``."""
    torch.manual_seed(seed)
    tokenizer = ByteTokenizer()
    texts = stdlib_corpus("train")["text"]
    inputs, targets = pack_documents((tokenizer.encode(t) for t in texts), seq_len, tokenizer.eos_id)
    order = torch.randperm(inputs.shape[0], generator=torch.Generator().manual_seed(seed))
    model = Llama(LlamaConfig.from_name("llama3.1-tiny"))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)

    def gradient(step: int) -> Tensor:
        rows = order[step * batch_size : (step + 1) * batch_size]
        model.zero_grad(set_to_none=True)
        logits = model(inputs[rows])
        F.cross_entropy(logits.flatten(0, 1), targets[rows].flatten(), ignore_index=IGNORE_INDEX).backward()
        return torch.cat([p.grad.reshape(-1) for p in model.parameters()])

    for step in range(warmup_steps):
        gradient(step)
        optimizer.step()
    return [gradient(warmup_steps + worker) for worker in range(workers)]
