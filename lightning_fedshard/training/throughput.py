"""Tokens per second per rank and globally, and model FLOPs utilisation where the device peak is known."""

from __future__ import annotations

from typing import Any

from lightning.pytorch.callbacks import ThroughputMonitor

__all__ = ["TokenThroughputMonitor"]


def _sequences(batch: Any) -> int:
    return batch[0].shape[0]


def _tokens(batch: Any) -> int:
    return batch[0].numel()


class TokenThroughputMonitor(ThroughputMonitor):
    """Lightning's :class:`~lightning.pytorch.callbacks.ThroughputMonitor` for ``(inputs, targets)`` token
    batches.

    Logs, averaged over the last ``window_size`` steps: ``train/device/items_per_sec`` (tokens/s of one
    rank), ``train/items_per_sec`` (all ranks), ``train/device/mfu`` when Lightning knows the accelerator's
    peak FLOPs (CUDA data-centre GPUs; not CPUs), and the running totals ``train/time`` (training seconds,
    validation excluded) and ``train/lengths`` (tokens one rank has seen). Model FLOPs come from the
    LightningModule's ``flops_per_batch`` attribute.

    Example::

        trainer = Trainer(callbacks=[TokenThroughputMonitor(window_size=20)], log_every_n_steps=1)
    """

    def __init__(self, window_size: int = 20) -> None:
        super().__init__(batch_size_fn=_sequences, length_fn=_tokens, window_size=window_size, separator="/")
