"""Real gradients to test gradient codecs on: a zoo of model families, each trained for a while on its task
(so the gradients are those of a model that is learning, not of its initialisation), then one gradient per
worker, each from its own batch. Deterministic for a given seed.

Families (``gradient_zoo``): the tiny Llama 3.1 at three points of one training run, the micro Llama, a
GPT-2-style model (tied embeddings, LayerNorm, GELU), a small ResNet on synthetic images, and the tiny Llama
trained and differentiated in bf16.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_fedshard.data.corpus import stdlib_corpus
from lightning_fedshard.data.packing import IGNORE_INDEX, pack_documents
from lightning_fedshard.data.tokenizer import ByteTokenizer
from lightning_fedshard.models import GPT2, GPT2Config, Llama, LlamaConfig

__all__ = ["gradient_zoo", "llama_gradients", "snapshots"]

Batch = tuple[Tensor, Tensor]


def llama_gradients(
    workers: int = 8, *, warmup_steps: int = 30, batch_size: int = 8, seq_len: int = 128, seed: int = 0
) -> list[Tensor]:
    """One flat fp32 gradient per worker of the tiny Llama after ``warmup_steps`` AdamW steps."""
    return snapshots(
        _llama("llama3.1-tiny"), _text_batches(batch_size, seq_len, seed), _lm_loss, (warmup_steps,), workers, seed
    )[warmup_steps]


def snapshots(
    build: Callable[[], nn.Module],
    batches: Iterator[Batch],
    loss: Callable[[nn.Module, Batch], Tensor],
    steps: Sequence[int],
    workers: int,
    seed: int = 0,
    lr: float = 3e-3,
) -> dict[int, list[Tensor]]:
    """Builds a model (seeded), trains it with AdamW and, at each of ``steps``, takes one flat gradient per worker
    (each from the next batch; the training run goes on from where it was, on its own batches)."""
    torch.manual_seed(seed)
    model = build()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)

    def gradient() -> Tensor:
        model.zero_grad(set_to_none=True)
        loss(model, next(batches)).backward()
        return torch.cat([p.grad.reshape(-1).float() for p in model.parameters()])

    taken: dict[int, list[Tensor]] = {}
    for step in range(max(steps) + 1):
        if step in steps:
            taken[step] = [gradient() for _ in range(workers)]
        if step < max(steps):
            gradient()
            optimizer.step()
    return taken


def gradient_zoo(workers: int = 16, seed: int = 0, quick: bool = False) -> dict[str, list[Tensor]]:
    """``{family: one flat fp32 gradient per worker}`` for every family of the module docstring."""
    steps = (5, 30) if quick else (5, 30, 150)
    text = _text_batches(8, 128, seed)
    zoo = {
        f"llama-tiny@{step}": grads
        for step, grads in snapshots(_llama("llama3.1-tiny"), text, _lm_loss, steps, workers, seed).items()
    }
    micro = _text_batches(8, 128, seed + 1)
    zoo["llama-micro@30"] = snapshots(_llama("llama3.1-micro"), micro, _lm_loss, (30,), workers, seed)[30]
    gpt2 = _text_batches(8, 128, seed + 2)
    zoo["gpt2-tiny@30"] = snapshots(
        lambda: GPT2(GPT2Config.from_name("gpt2-tiny")), gpt2, _lm_loss, (30,), workers, seed
    )[30]
    images = _image_batches(32, seed + 3)
    zoo["resnet@30"] = snapshots(_resnet, images, _classification_loss, (30,), workers, seed)[30]
    bf16 = _text_batches(8, 128, seed + 4)
    zoo["llama-tiny-bf16@30"] = snapshots(
        _llama("llama3.1-tiny", torch.bfloat16), bf16, _lm_loss, (30,), workers, seed
    )[30]
    return zoo


def _llama(preset: str, dtype: torch.dtype = torch.float32) -> Callable[[], nn.Module]:
    return lambda: Llama(LlamaConfig.from_name(preset)).to(dtype)


# ---------------------------------------------------------------------------------------------- tasks
def _text_batches(batch_size: int, seq_len: int, seed: int) -> Iterator[Batch]:
    tokenizer = ByteTokenizer()
    texts = stdlib_corpus("train")["text"]
    inputs, targets = pack_documents((tokenizer.encode(t) for t in texts), seq_len, tokenizer.eos_id)
    generator = torch.Generator().manual_seed(seed)
    while True:
        for rows in torch.randperm(inputs.shape[0], generator=generator).split(batch_size):
            if rows.numel() == batch_size:
                yield inputs[rows], targets[rows]


def _lm_loss(model: nn.Module, batch: Batch) -> Tensor:
    inputs, targets = batch
    logits = model(inputs)
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=IGNORE_INDEX)


def _image_batches(batch_size: int, seed: int, classes: int = 10) -> Iterator[Batch]:
    """Synthetic 3×32×32 images: a fixed random pattern per class, shifted and scaled at random, plus noise."""
    generator = torch.Generator().manual_seed(seed)
    patterns = torch.randn(classes, 3, 32, 32, generator=generator)
    while True:
        labels = torch.randint(0, classes, (batch_size,), generator=generator)
        shifts = torch.randint(-4, 5, (2,), generator=generator).tolist()
        gain = 0.5 + torch.rand(batch_size, 1, 1, 1, generator=generator)
        images = gain * torch.roll(patterns[labels], shifts, dims=(2, 3))
        yield images + torch.randn(images.shape, generator=generator), labels


def _classification_loss(model: nn.Module, batch: Batch) -> Tensor:
    images, labels = batch
    return F.cross_entropy(model(images), labels)


class _Residual(nn.Module):
    def __init__(self, channels: int, stride: int) -> None:
        super().__init__()
        out = channels * stride
        self.body = nn.Sequential(
            nn.Conv2d(channels, out, 3, stride, 1, bias=False),
            nn.BatchNorm2d(out),
            nn.ReLU(),
            nn.Conv2d(out, out, 3, 1, 1, bias=False),
            nn.BatchNorm2d(out),
        )
        self.skip = nn.Identity() if stride == 1 else nn.Conv2d(channels, out, 1, stride, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return F.relu(self.body(x) + self.skip(x))


def _resnet(width: int = 32, classes: int = 10) -> nn.Module:
    """A small ResNet (stem, three stages of one residual block each, 32→64→128 channels): ~0.7 M parameters."""
    return nn.Sequential(
        nn.Conv2d(3, width, 3, 1, 1, bias=False),
        nn.BatchNorm2d(width),
        nn.ReLU(),
        _Residual(width, 1),
        _Residual(width, 2),
        _Residual(2 * width, 2),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(4 * width, classes),
    )
