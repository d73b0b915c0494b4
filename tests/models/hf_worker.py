"""Two gloo processes (Lightning's launcher starts the second): a 2-step fl_fsdp fit of the micro Llama in two
federation groups, checkpointed by ModelCheckpoint after step 1, between syncs, when the groups differ (the fit ends
on their consensus); rank 0 exports group 1 of that checkpoint to Hugging Face; then an fsdp2 fit over both ranks
starts from that export (``init_from``) and records its whole parameters.

Usage: ``python tests/models/hf_worker.py OUT``.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

from lightning_fedshard import FLFSDPStrategy, LlamaPretraining, export_hf
from lightning_fedshard.data import ByteTokenizer
from lightning_fedshard.models import TransformerBlock

SEQ_LEN = 16


class Tokens(pl.LightningDataModule):
    """Random byte-token windows; has the attributes LlamaPretraining reads off a data module."""

    tokenizer = ByteTokenizer()
    vocab_size = ByteTokenizer.vocab_size

    def train_dataloader(self) -> DataLoader:
        tokens = torch.randint(0, 256, (64, SEQ_LEN + 1), generator=torch.Generator().manual_seed(0))
        return DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=4)


class RecordStart(pl.Callback):
    """Saves the whole parameters as training starts (after the strategy materialised and sharded them)."""

    def __init__(self, file: Path) -> None:
        self.file = file

    def on_train_start(self, trainer: pl.Trainer, pl_module: LlamaPretraining) -> None:
        whole = {name: p.full_tensor() for name, p in pl_module.model.named_parameters()}
        if trainer.global_rank == 0:
            torch.save({"whole": whole, "sharded": [type(p).__name__ for p in pl_module.model.parameters()]}, self.file)


def trainer(strategy: FLFSDPStrategy, max_steps: int, callbacks: list[pl.Callback]) -> pl.Trainer:
    return pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        max_steps=max_steps,
        logger=False,
        enable_checkpointing=any(isinstance(c, ModelCheckpoint) for c in callbacks),  # no default one in the cwd
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
    )


def main(out: Path) -> None:
    pl.seed_everything(0)
    groups = FLFSDPStrategy(num_groups=2, shard_size=1, sync_every=2, auto_wrap=[TransformerBlock])
    checkpoints = ModelCheckpoint(dirpath=out, filename="{step}", every_n_train_steps=1, save_top_k=-1)
    fit = trainer(groups, max_steps=2, callbacks=[checkpoints])
    fit.fit(LlamaPretraining("llama3.1-micro", seq_len=SEQ_LEN, lr=1e-2), datamodule=Tokens())
    exported = out / "group1-hf"
    if fit.global_rank == 0:
        try:
            export_hf(out / "step=1.ckpt", exported, group=1)
        finally:  # on failure too: rank 1 then fails to find the export instead of waiting for ever
            (out / "exported").touch()
    while not (out / "exported").exists():  # the other rank waits for rank 0's export
        time.sleep(0.1)
    sharded = FLFSDPStrategy(num_groups=1, shard_size=2, auto_wrap=[TransformerBlock])
    resumed = trainer(sharded, max_steps=1, callbacks=[RecordStart(out / "init.pt")])
    resumed.fit(LlamaPretraining(init_from=exported, seq_len=SEQ_LEN), datamodule=Tokens())


if __name__ == "__main__":
    main(Path(sys.argv[1]))
