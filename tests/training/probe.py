"""A callback the distributed CLI tests add with ``--trainer.callbacks+=tests.training.probe.Probe``.

Every rank writes ``<out>/rank<r>.pt`` (tensors, lists and numbers only) with what it saw: the layout
of its parameter shards right after set-up, the loss and first tokens of each batch, and its local
shards after ``fit``.
"""

from __future__ import annotations

from itertools import islice
from pathlib import Path

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.nn import functional as F

from lightning_fedshard.data import IGNORE_INDEX

PROBED_WEIGHT = "model.layers.0.attention.wq.weight"


class Probe(pl.Callback):
    def __init__(self, out: str) -> None:
        self.out = Path(out)
        self.record: dict = {"losses": [], "batch_heads": [], "steps": []}

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        params = dict(pl_module.named_parameters())
        self.record["all_dtensor"] = all(isinstance(p, DTensor) for p in params.values())
        self.record["local_numel"] = sum(p.to_local().numel() for p in params.values())
        self.record["global_numel"] = sum(p.numel() for p in params.values())
        self.record["param_dtypes"] = sorted({str(p.dtype) for p in params.values()})
        self.record["mesh"] = list(trainer.strategy.device_mesh.shape)
        self.record["coords"] = [trainer.strategy.device_mesh.get_local_rank(d) for d in ("fed", "replicate", "shard")]
        self.record["probed_full"] = params[PROBED_WEIGHT].full_tensor().clone()  # collective: every rank calls it
        self.record["inv_freq"] = pl_module.model.rope.inv_freq.clone()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.record["losses"].append(float(outputs["loss"]))
        self.record["batch_heads"].append(batch[0][:, :8].clone())
        self.record["steps"].append(trainer.global_step)

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.record["final_shards"] = {n: p.to_local().detach().clone() for n, p in pl_module.named_parameters()}
        self.record["val_loss_recomputed"] = self._validation_loss(trainer, pl_module)
        self.out.mkdir(parents=True, exist_ok=True)
        torch.save(self.record, self.out / f"rank{trainer.global_rank}.pt")

    @torch.no_grad()
    def _validation_loss(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> float:
        """Mean next-token loss over the batches the last validation saw, summed by hand across ranks."""
        totals = torch.zeros(2, dtype=torch.float64)
        for inputs, targets in islice(trainer.datamodule.val_dataloader(), int(trainer.limit_val_batches)):
            keep = targets != IGNORE_INDEX
            totals[0] += F.cross_entropy(pl_module(inputs)[keep].float(), targets[keep], reduction="sum").double()
            totals[1] += keep.sum()
        dist.all_reduce(totals)
        return (totals[0] / totals[1]).item()
