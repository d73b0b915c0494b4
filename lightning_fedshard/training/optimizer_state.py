"""The bytes of optimizer state one rank holds, logged as a metric."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from torch import Tensor
from torch.optim import Optimizer

from lightning_fedshard.optim import local_shard

__all__ = ["OptimizerStateMonitor", "optimizer_state_bytes"]


def optimizer_state_bytes(optimizer: Optimizer) -> int:
    """Bytes of every state tensor ``optimizer`` holds on this rank (a DTensor counts its local shard)."""
    total = 0
    for state in optimizer.state.values():
        for value in state.values():
            if isinstance(value, Tensor):
                local = local_shard(value)
                total += local.numel() * local.element_size()
    return total


class OptimizerStateMonitor(Callback):
    """Logs ``optimizer/state_bytes``: this rank's optimizer state (all optimizers) after every training step.

    Example::

        trainer = Trainer(callbacks=[OptimizerStateMonitor()], log_every_n_steps=1)
    """

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        nbytes = sum(optimizer_state_bytes(o) for o in trainer.optimizers)
        pl_module.log("optimizer/state_bytes", float(nbytes), on_step=True, on_epoch=False, sync_dist=False)
