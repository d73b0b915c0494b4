"""One federation group under fault tolerance (torchft), trained until told to stop; for tests/strategies/test_ft.py.

Usage: python -m tests.strategies.ft_worker CONFIG.json (from the repository root; Lightning spawns the group's
ranks). Each rank writes, atomically:

* ``<out>/g<G>_r<r>.progress``: its optimizer steps and pid after every step;
* ``<out>/g<G>_r<r>_start<pid>.pt``: its local shards before its first (joining) round;
* ``<out>/g<G>_r<r>_round<n>_groups<k>_<committed|dropped>_<pid>.pt``: every round it ran (torchft's round
  number, the groups in it, whether it was applied): its contribution (local shards, global copies and outer
  momentum after any healing) and its shards after the round;
* ``<out>/g<G>_r<r>_data<pid>.json``: every training batch it read (epoch, batch index, Lightning's global step
  before it, the dataset indices), after every step; ``<out>/g<G>_r<r>_end<pid>.json``: its global step,
  optimizer steps and learning rate when training ended.

It stops once Lightning's global step reaches ``at_step`` of ``<out>/stop.json``; with ``checkpoint`` in its config
it first saves a checkpoint there and its state as ``<out>/g<G>_r<r>_saved<pid>.pt``. With ``resume`` it resumes
from that checkpoint. With ``streaming`` (the strategy's streaming settings) the group runs streaming sync. With
``"fault_tolerance": false`` it is one job of ``num_groups`` groups without torchft (group label ``nf``), which
stops at ``max_steps``: the reference for what each rank reads.
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
from tests.strategies.worker import Regression, make_dataset

STEP_SLEEP_S = 0.05  # leaves the shared CPU to the other group
NUM_SAMPLES = 256  # 64 per rank of 2 groups × 2 ranks: 16 batches of 4 per epoch, so the runs cross epochs
LR, LR_DECAY = 0.01, 0.01


def lr_at(step: int) -> float:
    """The learning rate after ``step`` optimizer steps (a LambdaLR stepped every step)."""
    return LR / (1.0 + LR_DECAY * step)


class Indexed(torch.utils.data.Dataset):
    """The regression samples with their index, so that a run can say what it read."""

    def __init__(self) -> None:
        self.data = make_dataset(NUM_SAMPLES)

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, index: int):
        return (*self.data[index], index)


class IndexedRegression(Regression):
    """Shuffled data (a new order every epoch) and a learning rate that decays every step."""

    def __init__(self, cfg: dict) -> None:
        super().__init__(cfg)
        self.reads: list[dict] = []

    def train_dataloader(self):
        return torch.utils.data.DataLoader(Indexed(), batch_size=self.cfg["batch_size"], shuffle=True)

    def training_step(self, batch, batch_idx):
        x, y, index = batch
        trainer = self.trainer
        self.reads.append(
            {"epoch": trainer.current_epoch, "batch": batch_idx, "step": trainer.global_step, "index": index.tolist()}
        )
        return super().training_step((x, y), batch_idx)

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.parameters(), lr=LR)
        # a plain function: LambdaLR's state then holds the step count only
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1.0 + LR_DECAY * step))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


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
    """Records every round (under streaming sync every fragment's round: the fragment and its parameters' names
    with it); with ``fail_round`` k the group votes down the k-th round of this launch (its joining
    round is round 0) by reporting an error to its Manager after the average, as a failure inside it would."""

    def __init__(self, out: Path, group: int, fail_round: int | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.out, self.group, self.fail_round = out, group, fail_round
        self.rounds_run = 0

    def _join_federation(self):
        member = super()._join_federation()
        start_round, end_round = member.start_round, member.end_round
        record: dict[str, Any] = {}

        def recorded_start(start):
            def recorded():
                stream = self._streaming
                # the fragment this round averages: the one being sent, the peers' one when joining, else the model
                fragment = stream.sending if stream is not None and stream.sending is not None else None
                if fragment is None and stream is not None and self._joining:
                    fragment = self._peer_fragment
                averager = self._averager
                indices = range(len(averager.named_params)) if fragment is None else averager.fragments[fragment]
                record.clear()
                record.update(
                    round=member.manager.current_step(),
                    groups=member.manager.num_participants(),
                    optimizer_steps=self.optimizer_steps,
                    fragment=fragment,
                    names=[averager.named_params[i][0] for i in indices],
                    pre=local_state(self),
                )
                return start()

            return start_round(recorded)

        def recorded_end(started, apply, wait=None):
            if self.rounds_run == self.fail_round:
                member.manager.report_error(RuntimeError(f"round {self.rounds_run} failed on purpose"))
            self.rounds_run += 1
            record["committed"] = end_round(started, apply, wait)
            record["post"] = local_state(self)
            name = (
                f"g{self.group}_r{self.global_rank}_round{record['round']}_groups{record['groups']}"
                f"_{'committed' if record['committed'] else 'dropped'}_{os.getpid()}.pt"
            )
            _save(dict(record), self.out / name)
            return record["committed"]

        member.start_round, member.end_round = recorded_start, recorded_end
        return member


class ProgressAndStop(pl.Callback):
    def __init__(self, out: Path, group: int, checkpoint: str | None, sleep_s: float = STEP_SLEEP_S) -> None:
        self.out, self.group, self.checkpoint, self.sleep_s = out, group, checkpoint, sleep_s

    def on_train_start(self, trainer, pl_module) -> None:  # before the strategy's joining round
        start = {n: p.to_local().detach().clone() for n, p in trainer.strategy.model.named_parameters()}
        _save(start, self.out / f"g{self.group}_r{trainer.global_rank}_start{os.getpid()}.pt")

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        strategy = trainer.strategy
        prefix = f"g{self.group}_r{trainer.global_rank}"
        _write_json(self.out / f"{prefix}_data{os.getpid()}.json", pl_module.reads)
        _write_json(self.out / f"{prefix}.progress", {"optimizer_steps": strategy.optimizer_steps, "pid": os.getpid()})
        stop = self.out / "stop.json"
        if stop.exists() and trainer.global_step >= json.loads(stop.read_text())["at_step"]:
            if self.checkpoint:
                trainer.save_checkpoint(self.checkpoint)
                _save(local_state(strategy), self.out / f"g{self.group}_r{trainer.global_rank}_saved{os.getpid()}.pt")
            trainer.should_stop = True
        time.sleep(self.sleep_s)

    def on_train_end(self, trainer, pl_module) -> None:
        end = {
            "global_step": trainer.global_step,
            "optimizer_steps": trainer.strategy.optimizer_steps,
            "lr": trainer.optimizers[0].param_groups[0]["lr"],
        }
        _write_json(self.out / f"g{self.group}_r{trainer.global_rank}_end{os.getpid()}.json", end)


def _write_json(path: Path, obj: Any) -> None:
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps(obj))
    partial.rename(path)


def main(cfg: dict) -> None:
    out, group = Path(cfg["out"]), cfg["group"]
    num_groups = cfg.get("num_groups", 2)
    if cfg.get("fault_tolerance", True):
        ft = FaultTolerance(
            lighthouse=cfg["lighthouse"],
            group_id=group,
            num_groups=num_groups,
            min_groups=cfg.get("min_groups", 1),
            timeout=timedelta(seconds=cfg["ft_timeout_s"]),
            quorum_timeout=timedelta(seconds=cfg["quorum_timeout_s"]),
            connect_timeout=timedelta(seconds=30),
            heartbeat_interval=timedelta(milliseconds=100),
        )
        layout = {"shard_size": cfg["devices"], "fault_tolerance": ft}
    else:  # the same groups as one job: the reference for what each rank reads
        layout = {"num_groups": num_groups, "shard_size": cfg["devices"] // num_groups}
    strategy = Recording(
        out,
        group,
        cfg.get("fail_round") if group == cfg.get("fail_group") else None,
        sync_every=cfg["sync_every"],
        outer_optimizer=cfg["outer_optimizer"],
        **cfg.get("streaming", {}),
        timeout=timedelta(seconds=cfg["timeout_s"]),
        **layout,
    )
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=cfg["devices"],
        strategy=strategy,
        max_steps=cfg.get("max_steps", 100_000),
        limit_val_batches=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[ProgressAndStop(out, group, cfg.get("checkpoint"), cfg.get("step_sleep_s", STEP_SLEEP_S))],
        # DynamiQ-compressed rounds, every tensor through the codec however small
        plugins=[DynamiQ(bits=cfg["bits"], traffic=("fed",), min_numel=0)] if cfg.get("bits") else None,
    )
    module = IndexedRegression({"lr": LR, "batch_size": 4, "optimizer": "adamw"})
    torch.manual_seed(100 + (group if isinstance(group, int) else 0))  # groups start elsewhere: a joining group
    with torch.no_grad():  # must take the federation's state
        for p in module.parameters():
            p.normal_(0.0, 0.3)
    trainer.fit(module, ckpt_path=cfg.get("resume"))


if __name__ == "__main__":
    main(json.loads(Path(sys.argv[1]).read_text()))
