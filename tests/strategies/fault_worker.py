"""A training run that goes on until it is signalled, for the tests that stop, freeze or fail one of its ranks.

Usage: python -m tests.strategies.fault_worker CONFIG.json (from the repository root; Lightning spawns the ranks).
Each rank writes ``<out>/rank<r>.json`` once it has trained a step (its pid, mesh shape and the timeout of each of
the strategy's process groups), and ``<out>/rank<r>.exit`` with how its ``main`` ended (``exit <code>`` or
``raised <type>``); a rank killed by a signal writes no ``.exit``.
"""

from __future__ import annotations

import json
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.strategies import StrategyRegistry

import lightning_fedshard  # noqa: F401  (registers the strategy names)
from tests.strategies.worker import Regression

STEP_SLEEP_S = 0.05  # keeps the run going (and the CPU free) until the test signals it
START_DEADLINE_S = 120


class AnnounceAndPace(pl.Callback):
    def __init__(self, out: Path) -> None:
        self.out = out

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if batch_idx == 0:
            strategy = trainer.strategy
            groups = {name: strategy.device_mesh.get_group(name) for name in strategy.device_mesh.mesh_dim_names}
            if strategy._group_pg is not None:
                groups["checkpoint"] = strategy._group_pg
            record = {
                "pid": os.getpid(),
                "mesh": list(strategy.device_mesh.shape),
                "timeouts_s": {name: group_timeout_s(group) for name, group in groups.items()},
            }
            partial = self.out / f"rank{trainer.global_rank}.json.partial"
            partial.write_text(json.dumps(record))
            partial.rename(partial.with_suffix(""))  # the test reads a record whole or not at all
        time.sleep(STEP_SLEEP_S)


def group_timeout_s(group: dist.ProcessGroup) -> float:
    return group._get_backend(torch.device("cpu")).options._timeout.total_seconds()


def starting_together(strategy_cls: type, out: Path, world_size: int) -> type:
    """The strategy, whose ranks first wait for each other: the short timeout then measures a stall, not the
    seconds a loaded machine takes to start the other interpreters."""

    class StartingTogether(strategy_cls):
        def setup_environment(self) -> None:
            (out / f"rank{os.environ.get('LOCAL_RANK', '0')}.ready").touch()
            deadline = time.monotonic() + START_DEADLINE_S
            while len(list(out.glob("rank*.ready"))) < world_size and time.monotonic() < deadline:
                time.sleep(0.1)
            super().setup_environment()

    return StartingTogether


def main(cfg: dict) -> None:
    entry = StrategyRegistry[cfg["strategy"]]
    kwargs = {**entry["init_params"], **cfg.get("strategy_kwargs", {}), "timeout": timedelta(seconds=cfg["timeout_s"])}
    out = Path(cfg["out"])
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=cfg["devices"],
        strategy=starting_together(entry["strategy"], out, cfg["devices"])(**kwargs),
        max_steps=100_000,
        limit_val_batches=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[AnnounceAndPace(out)],
    )
    trainer.fit(Regression({"lr": 0.01, "batch_size": 4}))


if __name__ == "__main__":
    config = json.loads(Path(sys.argv[1]).read_text())
    exit_file = Path(config["out"]) / f"rank{os.environ.get('LOCAL_RANK', '0')}.exit"
    try:
        main(config)
    except SystemExit as stop:
        exit_file.write_text(f"exit {stop.code}")
        raise
    except BaseException as error:
        exit_file.write_text(f"raised {type(error).__name__}")
        raise
    exit_file.write_text("exit 0")
