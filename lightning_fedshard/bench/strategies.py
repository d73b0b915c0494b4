"""Same model, same data, four strategies: throughput, validation perplexity and bytes per tier per step.

``python -m lightning_fedshard.bench strategies`` (or ``fedshard bench strategies``) launches one
training run per strategy on ``--devices`` CPU processes (gloo) and prints them side by side, with
ratios to the ``hsdp`` baseline of the same invocation.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import lightning.pytorch as pl
from lightning.pytorch.strategies import StrategyRegistry
import torch
from torch.nn import functional as F
from torch.utils.data import DataLoader

from lightning_fedshard.data import StdlibBytes
from lightning_fedshard.models import ByteMLPLM
from lightning_fedshard.strategies import FLHSDPStrategy
from lightning_fedshard.strategies.ledger import TIERS

__all__ = ["RunConfig", "layouts", "main"]

BASELINE = "hsdp"


@dataclass(frozen=True)
class RunConfig:
    strategy: str
    devices: int = 4
    steps: int = 48
    sync_every: int = 8
    batch_size: int = 8
    seq_len: int = 64
    lr: float = 3e-3
    val_batches: int = 16
    dim: int = 128
    depth: int = 4


def layouts(devices: int) -> dict[str, dict]:
    """Mesh sizes for each strategy on ``devices`` ranks of one node: groups of two for the FL variants."""
    half = devices // 2
    return {
        "fsdp2": {},  # the preset's one group over all ranks
        "hsdp": {"shard_size": half},
        "fl_fsdp": {"num_groups": 2, "shard_size": half},
        "fl_hsdp": {"num_groups": 2, "replicate_size": 2, "shard_size": max(half // 2, 1)},
    }


def build_strategy(cfg: RunConfig) -> FLHSDPStrategy:
    """The registered strategy ``cfg.strategy`` with its preset, sized by :func:`layouts`."""
    entry = StrategyRegistry[cfg.strategy]
    return entry["strategy"](
        **entry["init_params"],
        **layouts(cfg.devices)[cfg.strategy],
        sync_every=cfg.sync_every,
        auto_wrap=["lightning_fedshard.models.ResidualMLPBlock"],
    )


class ByteLMTask(pl.LightningModule):
    def __init__(self, cfg: RunConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.model = ByteMLPLM(dim=cfg.dim, depth=cfg.depth)

    def configure_model(self) -> None:  # the strategy shards per `auto_wrap`
        pass

    def _loss(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self.model(x).flatten(0, 1), y.flatten())

    def training_step(self, batch, batch_idx):
        loss = self._loss(batch)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self._loss(batch), sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.cfg.lr, weight_decay=0.1)

    def train_dataloader(self):
        return DataLoader(StdlibBytes("train", self.cfg.seq_len), batch_size=self.cfg.batch_size, shuffle=True)

    def val_dataloader(self):
        return DataLoader(StdlibBytes("val", self.cfg.seq_len), batch_size=self.cfg.batch_size)


class _TrainTimer(pl.Callback):
    """Wall time of training steps only; the first step (lazy init, warm-up) is left out."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.timed_steps = 0
        self._start = 0.0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._start = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if batch_idx > 0:
            self.seconds += time.perf_counter() - self._start
            self.timed_steps += 1


def run_one(cfg: RunConfig, out: Path) -> None:
    """One training run; Lightning starts the other ranks. Rank 0 writes the summary to ``out``."""
    torch.manual_seed(0)
    timer = _TrainTimer()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=cfg.devices,
        strategy=build_strategy(cfg),
        max_steps=cfg.steps,
        limit_val_batches=cfg.val_batches,
        val_check_interval=cfg.steps,
        num_sanity_val_steps=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[timer],
    )
    task = ByteLMTask(cfg)
    trainer.fit(task)
    # validate the model fit() returns: after the closing sync, the federation's consensus
    val_loss = trainer.validate(task, verbose=False)[0]["val_loss"]
    strategy = trainer.strategy
    if trainer.global_rank == 0:
        tokens_per_step = cfg.devices * cfg.batch_size * cfg.seq_len
        summary = {
            "config": asdict(cfg),
            "mesh": list(strategy.device_mesh.shape),
            "tokens_per_s": tokens_per_step * timer.timed_steps / timer.seconds,
            "val_loss": val_loss,
            "val_perplexity": math.exp(val_loss),
            "bytes_per_step": strategy.ledger.mean_per_step(),
            "syncs": strategy.syncs,
        }
        out.write_text(json.dumps(summary, indent=2))


def launch(cfg: RunConfig, out: Path) -> dict:
    command = [
        sys.executable,
        "-m",
        "lightning_fedshard.bench.strategies",
        "--run-one",
        json.dumps(asdict(cfg)),
        str(out),
    ]
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0 or not out.is_file():
        raise RuntimeError(f"The {cfg.strategy} run failed (exit {result.returncode}):\n{result.stderr[-4000:]}")
    return json.loads(out.read_text())


def format_table(results: dict[str, dict]) -> str:
    base = results.get(BASELINE)
    header = f"{'strategy':<9} {'mesh F×R×S':<11} {'tokens/s':>9} {'val ppl':>8} " + " ".join(
        f"{tier + ' B/step':>16}" for tier in TIERS
    )
    lines = [
        "B/step: bytes rank 0 sends per optimizer step (ring algorithms); fed = FedAvg traffic across groups",
        header,
        "-" * len(header),
    ]
    for name, r in results.items():
        mesh = "×".join(str(s) for s in r["mesh"])
        row = f"{name:<9} {mesh:<11} {r['tokens_per_s']:>9.0f} {r['val_perplexity']:>8.3f} " + " ".join(
            f"{r['bytes_per_step'][tier]:>16,.0f}" for tier in TIERS
        )
        lines.append(row)
    if base:
        lines.append("")
        lines.append(f"ratios to {BASELINE} (same run):")
        for name, r in results.items():
            total, base_total = sum(r["bytes_per_step"].values()), sum(base["bytes_per_step"].values())
            lines.append(
                f"  {name:<9} tokens/s ×{r['tokens_per_s'] / base['tokens_per_s']:.2f}"
                f"   val ppl ×{r['val_perplexity'] / base['val_perplexity']:.3f}"
                f"   bytes/step, all tiers ×{total / base_total:.3f}"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="fedshard bench strategies", description=__doc__.splitlines()[0])
    parser.add_argument("--strategies", nargs="+", default=list(layouts(4)), choices=list(layouts(4)))
    parser.add_argument("--devices", type=int, default=RunConfig.devices)
    parser.add_argument("--steps", type=int, default=RunConfig.steps)
    parser.add_argument("--sync-every", type=int, default=RunConfig.sync_every)
    parser.add_argument("--json", type=Path, help="also write all results to this file")
    parser.add_argument("--run-one", nargs=2, metavar=("CONFIG", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.run_one:
        run_one(RunConfig(**json.loads(args.run_one[0])), Path(args.run_one[1]))
        return
    if args.devices < 4 or args.devices % 4:
        parser.error("--devices must be a multiple of 4 (two groups, two replicas, two shards at least)")
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.strategies:
            cfg = RunConfig(strategy=name, devices=args.devices, steps=args.steps, sync_every=args.sync_every)
            print(f"running {name} on {args.devices} processes ...", flush=True)
            results[name] = launch(cfg, Path(tmp) / f"{name}.json")
    print(format_table(results))
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
