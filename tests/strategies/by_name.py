"""Lightning's demo Transformer, trained two steps with a strategy given only by its registered name.

Usage: python -m tests.strategies.by_name NAME DEVICES OUT (from the repository root; Lightning spawns the ranks).
Every rank writes ``<OUT>/rank<r>.json``: the mesh shape, its coordinate in it, and its losses.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.pytorch.demos import LightningTransformer
from torch.utils.data import DataLoader, TensorDataset

import lightning_fedshard  # noqa: F401  (registers the strategy names)

VOCAB = 64


class RandomTokensTransformer(LightningTransformer):
    """The demo as it is, on random tokens instead of WikiText-2 (no download)."""

    def prepare_data(self) -> None:
        pass

    def train_dataloader(self) -> DataLoader:
        tokens = torch.randint(VOCAB, (64, 2, 16), generator=torch.Generator().manual_seed(0))
        return DataLoader(TensorDataset(tokens[:, 0], tokens[:, 1]), batch_size=4)


class Record(pl.Callback):
    def __init__(self, out: Path) -> None:
        self.out = out
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses.append(float(outputs["loss"]))

    def on_train_end(self, trainer, pl_module) -> None:
        mesh = trainer.strategy.device_mesh
        record = {"shape": list(mesh.shape), "coordinate": mesh.get_coordinate(), "losses": self.losses}
        (self.out / f"rank{trainer.global_rank}.json").write_text(json.dumps(record))


if __name__ == "__main__":
    name, devices, out = sys.argv[1], int(sys.argv[2]), Path(sys.argv[3])
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=name,
        max_steps=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[Record(out)],
    )
    trainer.fit(RandomTokensTransformer(vocab_size=VOCAB))
