"""Short training runs with compressed communication; launched by the tests as a script (Lightning spawns
the other ranks). Usage: python train_worker.py CONFIG.json — each rank writes ``<out>/rank<r>.pt``; a config
with ``"runs": [cfg, ...]`` fits each in turn in the same processes (each with its own ``out``)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import StrategyRegistry
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState, powerSGD_hook
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, TensorDataset

import lightning_fedshard  # noqa: F401  (registers the strategy names)
from lightning_fedshard.dynamiq import DynamiQ
from lightning_fedshard.strategies.apply import reshard_all

FEATURES = 32


def dataset(num_samples: int = 2048) -> TensorDataset:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(num_samples, FEATURES, generator=gen)
    y = torch.sin(x[:, :8].sum(dim=1, keepdim=True)) + 0.05 * torch.randn(num_samples, 1, generator=gen)
    return TensorDataset(x, y)


class Regression(pl.LightningModule):
    """About 100K parameters in two large matrices, so gradient buckets are big enough to compress."""

    def __init__(self, cfg: dict) -> None:
        super().__init__()
        self.cfg = cfg
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(FEATURES, 512), nn.Tanh(), nn.Linear(512, 128), nn.Tanh(), nn.Linear(128, 1))
        self.losses: list[float] = []
        self.forward_dtypes: set[str] = set()

    def training_step(self, batch, batch_idx):
        x, y = batch
        output = self.net(x)
        self.forward_dtypes.add(str(output.dtype))
        loss = nn.functional.mse_loss(output.float(), y)
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.cfg["lr"])

    def train_dataloader(self):
        return DataLoader(dataset(), batch_size=16, shuffle=False)


class MetricRecorder(pl.Callback):
    def __init__(self) -> None:
        self.steps: list[dict[str, float]] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        m = trainer.callback_metrics
        self.steps.append({k: float(m[k]) for k in m if k.startswith(("dynamiq/", "comm/"))})


def full_params(module: nn.Module) -> dict[str, torch.Tensor]:
    reshard_all(module)
    return {
        name: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
        for name, p in module.named_parameters()
    }


def make_strategy(cfg: dict):
    entry = StrategyRegistry[cfg["strategy"]]
    kwargs = {**entry["init_params"], **cfg.get("strategy_kwargs", {})}
    if cfg.get("powersgd"):
        kwargs.update(
            ddp_comm_state=PowerSGDState(None, matrix_approximation_rank=2, start_powerSGD_iter=2),
            ddp_comm_hook=powerSGD_hook,
        )
    if cfg["strategy"] == "ddp":
        kwargs.setdefault("process_group_backend", "gloo")
    return entry["strategy"](**kwargs)


def main(config_path: str) -> None:
    cfg = json.loads(Path(config_path).read_text())
    for run in cfg.get("runs", [cfg]):  # the first fit spawns the other ranks; the later ones find them running
        fit(run)


def fit(cfg: dict) -> None:
    plugins = [DynamiQ(**cfg["plugin"])] if cfg.get("plugin") else None
    recorder = MetricRecorder()
    module = Regression(cfg)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=cfg["devices"],
        strategy=make_strategy(cfg),
        plugins=plugins,
        max_steps=cfg["max_steps"],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[recorder],
    )
    trainer.fit(module)
    strategy = trainer.strategy
    torch.save(
        {
            "losses": module.losses,
            "metrics": recorder.steps,
            "final": full_params(strategy.model),
            "ledger_mean": strategy.ledger.mean_per_step() if hasattr(strategy, "ledger") else None,
            "forward_dtypes": sorted(module.forward_dtypes),
        },
        Path(cfg["out"]) / f"rank{trainer.global_rank}.pt",
    )
    strategy.barrier()


if __name__ == "__main__":
    main(sys.argv[1])
