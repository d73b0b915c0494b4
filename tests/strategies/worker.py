"""One training run under a registered strategy; launched by the tests as a script (Lightning spawns the ranks).

Usage: python worker.py CONFIG.json — every rank writes ``<out>/rank<r>.pt`` with what it observed. A config with
``"runs": [cfg, ...]`` fits each of them in turn in the same processes (each with its own ``out``), so that the
interpreters start once: their imports are most of a small run's time.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import StrategyRegistry
from torch import nn
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, TensorDataset

import lightning_fedshard  # noqa: F401  (registers the strategy names)
from lightning_fedshard.optim import AdamW8bit, Muon, muon_param_groups
from lightning_fedshard.strategies.apply import reshard_all

IN_FEATURES = 8
NUM_SAMPLES = 4096


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.linear = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.linear(x))


def random_model() -> nn.Module:
    return nn.Sequential(nn.Linear(IN_FEATURES, 16), Block(16), Block(16), nn.Linear(16, 1))


def make_dataset(num_samples: int = NUM_SAMPLES) -> TensorDataset:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(num_samples, IN_FEATURES, generator=gen)
    y = torch.sin(x.sum(dim=1, keepdim=True)) + 0.1 * torch.randn(num_samples, 1, generator=gen)
    return TensorDataset(x, y)


class Regression(pl.LightningModule):
    def __init__(self, cfg: dict) -> None:
        super().__init__()
        self.cfg = cfg
        # Each rank starts from different weights: the strategy must make them identical.
        torch.manual_seed(1000 + int(os.environ.get("LOCAL_RANK", 0)))
        self.net = random_model()
        self.losses: list[float] = []

    def configure_model(self) -> None:
        """Shards like a user would when ``shard_in_configure_model``; otherwise the strategy's ``auto_wrap``."""
        if not self.cfg.get("shard_in_configure_model") or isinstance(self.net, FSDPModule):
            return
        for block in self.net:
            if isinstance(block, Block):
                fully_shard(block, mesh=self.device_mesh)
        fully_shard(self.net, mesh=self.device_mesh)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.losses.append(loss.item())
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self.net(x), y), sync_dist=True)

    def configure_optimizers(self):
        return make_optimizer(self.cfg.get("optimizer", "sgd"), self.net, self.cfg["lr"])

    def train_dataloader(self):
        dataset = make_dataset(self.cfg.get("num_samples", NUM_SAMPLES))
        return DataLoader(dataset, batch_size=self.cfg["batch_size"], shuffle=False)

    def val_dataloader(self):
        return DataLoader(make_dataset(), batch_size=64, shuffle=False)


def make_optimizer(name: str, net: nn.Module, lr: float) -> torch.optim.Optimizer:
    """The run's optimizer; the tests build their single-process references with it too."""
    if name == "adamw":
        return torch.optim.AdamW(net.parameters(), lr=lr)
    if name == "muon":
        return Muon(muon_param_groups(net), lr=lr)
    if name == "adamw8bit":
        # blocks of 32 and 8-bit moments for the weights of 128 and 256 elements: on 2 or 4 shards each rank holds
        # whole blocks of the whole tensor's (biases and the 1×16 head keep fp32 moments)
        return AdamW8bit(net.parameters(), lr=lr, block_size=32, min_8bit_numel=64)
    return torch.optim.SGD(net.parameters(), lr=lr)


def full_params(module: nn.Module) -> dict[str, torch.Tensor]:
    reshard_all(module)
    return {
        name: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
        for name, p in module.named_parameters()
    }


def recording(strategy_cls: type, cfg: dict) -> type:
    class Recording(strategy_cls):
        records: list[dict] = []

        def fed_sync(self) -> None:
            poison = cfg.get("poison")  # {"rank", "step", "param"}: NaN into one local shard before that sync
            if poison and self.optimizer_steps == poison["step"] and self.global_rank == poison["rank"]:
                reshard_all(self.model)
                with torch.no_grad():
                    dict(self.model.named_parameters())[poison["param"]].to_local().view(-1)[0] = float("nan")
            pre = full_params(self.model)
            try:
                super().fed_sync()
            except FloatingPointError as err:
                refused = {"error": str(err), "pre": pre, "post": full_params(self.model)}
                torch.save(refused, Path(cfg["out"]) / f"refused_rank{self.global_rank}.pt")
                raise
            self.records.append({"step": self.optimizer_steps, "pre": pre, "post": full_params(self.model)})

        def stream_sync(self) -> None:
            step, schedule = self.optimizer_steps, self.options.schedule
            if self._streaming is None:
                return super().stream_sync()
            pre = full_params(self.model)
            super().stream_sync()
            started, finished = schedule.starting(step), schedule.finishing(step)
            record = {"step": step, "pre": pre, "post": full_params(self.model), "started": started}
            self.records.append({**record, "finished": finished})

    return Recording


def kill_during_save(save: int) -> None:
    """SIGKILLs this rank in its ``save``-th checkpoint save, right after it wrote its own shard files."""
    from torch.distributed.checkpoint.filesystem import FileSystemWriter

    write_data = FileSystemWriter.write_data
    saves = 0

    def write_then_die(self, plan, planner):
        nonlocal saves
        written = write_data(self, plan, planner)
        written.wait()
        saves += 1
        if saves == save:
            os.kill(os.getpid(), signal.SIGKILL)
        return written

    FileSystemWriter.write_data = write_then_die


class StepRecorder(pl.Callback):
    def __init__(self, cfg: dict) -> None:
        self.cfg = cfg
        self.initial: dict[str, torch.Tensor] = {}
        self.params: list[dict[str, torch.Tensor]] = []
        self.ledger: list[dict[str, float]] = []

    def on_train_start(self, trainer, pl_module) -> None:
        self.initial = full_params(trainer.strategy.model)
        if self.cfg.get("record_start"):  # for runs that do not reach the end
            start = {"initial": self.initial, "optimizer_steps": trainer.strategy.optimizer_steps}
            torch.save(start, Path(self.cfg["out"]) / f"start_rank{trainer.global_rank}.pt")

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.params.append(full_params(trainer.strategy.model))
        m = trainer.callback_metrics
        self.ledger.append({k: float(m[k]) for k in m if k.startswith(("comm/", "fed/"))})


def checkpoint_callbacks(cfg: dict) -> list[pl.Callback]:
    if not cfg.get("checkpoint_every"):
        return []
    checkpoint = ModelCheckpoint(
        dirpath=cfg["checkpoint_dir"],
        every_n_train_steps=cfg["checkpoint_every"],
        save_top_k=-1,
        save_last=cfg.get("save_last"),
    )
    return [checkpoint]


def main(config_path: str) -> None:
    cfg = json.loads(Path(config_path).read_text())
    if cfg.get("kill_in_save") and cfg["kill_in_save"]["rank"] == int(os.environ.get("LOCAL_RANK", "0")):
        kill_during_save(cfg["kill_in_save"]["save"])
    # the first fit spawns the other ranks (Lightning's launcher); the later ones find them running
    for run in cfg.get("runs", [cfg]):
        fit(run)


def fit(cfg: dict) -> None:
    entry = StrategyRegistry[cfg["strategy"]]
    strategy = recording(entry["strategy"], cfg)(**{**entry["init_params"], **cfg.get("strategy_kwargs", {})})
    recorder = StepRecorder(cfg)
    module = Regression(cfg)
    trainer = pl.Trainer(
        accelerator=cfg.get("accelerator", "cpu"),
        devices=cfg["devices"],
        strategy=strategy,
        max_steps=cfg["max_steps"],
        precision=cfg.get("precision", "32-true"),
        accumulate_grad_batches=cfg.get("accumulate", 1),
        limit_val_batches=cfg.get("limit_val_batches", 0),
        val_check_interval=cfg.get("val_check_interval"),
        num_sanity_val_steps=0,
        logger=False,
        enable_checkpointing=bool(cfg.get("checkpoint_every")),
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[recorder, *checkpoint_callbacks(cfg)],
    )
    trainer.fit(module, ckpt_path=cfg.get("resume_from"))
    validated = trainer.validate(module, verbose=False) if cfg.get("validate_after_fit") else None
    if cfg.get("save_to"):
        trainer.save_checkpoint(cfg["save_to"])
    out = Path(cfg["out"])
    mesh = trainer.strategy.device_mesh
    names = [name for name, _ in trainer.strategy.model.named_parameters()]
    torch.save(
        {
            "losses": module.losses,
            "validated": validated,
            "syncs": strategy.records,
            "initial": recorder.initial,
            "params": recorder.params,
            "final": full_params(trainer.strategy.model),
            "ledger_steps": recorder.ledger,
            "ledger_mean": trainer.strategy.ledger.mean_per_step(),
            "mesh": mesh.mesh.tolist(),
            "mesh_dim_names": mesh.mesh_dim_names,
            "coordinate": mesh.get_coordinate(),
            "fsdp_mesh_dims": trainer.strategy.fsdp_mesh.mesh_dim_names,
            "fed_group_ranks": torch.distributed.get_process_group_ranks(trainer.strategy.fed_group),
            "sampler": trainer.strategy.distributed_sampler_kwargs,
            "optimizer_steps": trainer.strategy.optimizer_steps,
            "syncs_count": trainer.strategy.syncs,
            "fragments": [[names[i] for i in f] for f in strategy._averager.fragments] if strategy._averager else None,
            "fragment_bytes": dict(trainer.strategy.ledger.fragment_totals),
            "optimizer_state_dtypes": sorted({
                f"{key}:{value.dtype}"
                for state in trainer.optimizers[0].state.values()
                for key, value in state.items()
                if isinstance(value, torch.Tensor)
            }),
        },
        out / f"rank{trainer.global_rank}.pt",
    )
    trainer.strategy.barrier()  # rank 0 (the launcher) must not exit before every rank wrote its file


if __name__ == "__main__":
    main(sys.argv[1])
