"""One federation group under fault tolerance (torchft), trained until told to stop; for tests/strategies/test_ft.py.

Usage: python -m tests.strategies.ft_worker CONFIG.json (from the repository root; Lightning spawns the group's
ranks). Each rank writes, atomically:

* ``<out>/g<G>_r<r>.progress``: its optimizer steps and pid after every step;
* ``<out>/g<G>_r<r>_start<pid>.pt``: its local shards before its first (joining) round;
* ``<out>/g<G>_r<r>_round<n>_groups<k>_<committed|dropped>_<pid>.pt``: every round it ran (torchft's round
  number, the groups in it, whether it was applied): its contribution (local shards, global copies and outer
  momentum after any healing) and its shards after the round.

It stops once its optimizer steps reach ``at_step`` of ``<out>/stop.json``; with ``checkpoint`` in its config it
first saves a checkpoint there and its state as ``<out>/g<G>_r<r>_saved<pid>.pt``. With ``resume`` it resumes from
that checkpoint.
"""

from __future__ import annotations

import json
import os
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch

import lightning_fedshard  # noqa: F401  (registers the strategy names)
from lightning_fedshard.dynamiq import DynamiQ
from lightning_fedshard.strategies import FLFSDPStrategy
from lightning_fedshard.strategies.fault_tolerance import FaultTolerance
from tests.strategies.worker import Regression

STEP_SLEEP_S = 0.05  # leaves the shared CPU to the other group


def _save(obj: Any, path: Path) -> None:
    partial = path.with_name(path.name + ".partial")
    torch.save(obj, partial)
    partial.rename(path)  # the test reads a record whole or not at all


def local_state(strategy: FLFSDPStrategy) -> dict[str, dict[str, torch.Tensor]]:
    state = {"local": {name: p.to_local().detach().clone() for name, p in strategy.model.named_parameters()}}
    for part, tensors in strategy._averager.state_dict().items():
        state[part] = {name: t.to_local().detach().clone() for name, t in tensors.items()}
    return state


class Recording(FLFSDPStrategy):
    def __init__(self, out: Path, group: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.out, self.group = out, group

    def _join_federation(self):
        member = super()._join_federation()
        run_round = member.run_round

        def recorded_round(average):
            record: dict[str, Any] = {}

            def recorded_average() -> None:
                record.update(
                    round=member.manager.current_step(),
                    groups=member.manager.num_participants(),
                    optimizer_steps=self.optimizer_steps,
                    pre=local_state(self),
                )
                average()
                record["post"] = local_state(self)

            record["committed"] = run_round(recorded_average)
            name = (
                f"g{self.group}_r{self.global_rank}_round{record['round']}_groups{record['groups']}"
                f"_{'committed' if record['committed'] else 'dropped'}_{os.getpid()}.pt"
            )
            _save(record, self.out / name)
            return record["committed"]

        member.run_round = recorded_round
        return member


class ProgressAndStop(pl.Callback):
    def __init__(self, out: Path, group: int, checkpoint: str | None) -> None:
        self.out, self.group, self.checkpoint = out, group, checkpoint

    def on_train_start(self, trainer, pl_module) -> None:  # before the strategy's joining round
        start = {n: p.to_local().detach().clone() for n, p in trainer.strategy.model.named_parameters()}
        _save(start, self.out / f"g{self.group}_r{trainer.global_rank}_start{os.getpid()}.pt")

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        strategy = trainer.strategy
        progress = self.out / f"g{self.group}_r{trainer.global_rank}.progress"
        partial = progress.with_name(progress.name + ".partial")
        partial.write_text(json.dumps({"optimizer_steps": strategy.optimizer_steps, "pid": os.getpid()}))
        partial.rename(progress)
        stop = self.out / "stop.json"
        if stop.exists() and strategy.optimizer_steps >= json.loads(stop.read_text())["at_step"]:
            if self.checkpoint:
                trainer.save_checkpoint(self.checkpoint)
                _save(local_state(strategy), self.out / f"g{self.group}_r{trainer.global_rank}_saved{os.getpid()}.pt")
            trainer.should_stop = True
        time.sleep(STEP_SLEEP_S)


def main(cfg: dict) -> None:
    out, group = Path(cfg["out"]), cfg["group"]
    ft = FaultTolerance(
        lighthouse=cfg["lighthouse"],
        group_id=group,
        min_groups=cfg.get("min_groups", 1),
        timeout=timedelta(seconds=cfg["ft_timeout_s"]),
        quorum_timeout=timedelta(seconds=cfg["quorum_timeout_s"]),
        connect_timeout=timedelta(seconds=30),
        heartbeat_interval=timedelta(milliseconds=100),
    )
    strategy = Recording(
        out,
        group,
        shard_size=cfg["devices"],
        sync_every=cfg["sync_every"],
        outer_optimizer=cfg["outer_optimizer"],
        timeout=timedelta(seconds=cfg["timeout_s"]),
        fault_tolerance=ft,
    )
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=cfg["devices"],
        strategy=strategy,
        max_steps=100_000,
        limit_val_batches=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[ProgressAndStop(out, group, cfg.get("checkpoint"))],
        # DynamiQ-compressed rounds, every tensor through the codec however small
        plugins=[DynamiQ(bits=cfg["bits"], traffic=("fed",), min_numel=0)] if cfg.get("bits") else None,
    )
    module = Regression({"lr": 0.01, "batch_size": 4, "optimizer": "adamw"})
    torch.manual_seed(100 + group)  # every group starts elsewhere: a joining group must take the federation's state
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(0.0, 0.3)
    trainer.fit(module, ckpt_path=cfg.get("resume"))


if __name__ == "__main__":
    main(json.loads(Path(sys.argv[1]).read_text()))
