"""Peak memory of one fault-tolerant round: ``fedshard bench ft-memory [--width W] [--layers L] [--rounds N]``.

One federation group of one CPU rank (``fl_fsdp`` with ``fault_tolerance``, a torchft Lighthouse in this process)
trains an MLP of ``L`` square ``W × W`` layers with DiLoCo's outer optimizer and plain SGD inside (no inner
optimizer state, so the round dominates). Around every round after the joining one, a thread samples the process's
resident memory every 0.2 ms; the report is the round's peak above the memory before it, in MiB and in shards
(one shard: the fp32 parameters of this rank). Large tensors are allocated with ``mmap`` and returned to the system
when freed, so the resident size follows what the round holds. A round that copies the parameters, the global copy
and the momentum before averaging holds three shards more than one that votes before it applies.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import threading
import time
from datetime import timedelta

import lightning.pytorch as pl
import torch
from torch import nn
from typing_extensions import Self

from lightning_fedshard.strategies import FLFSDPStrategy
from lightning_fedshard.strategies.fault_tolerance import FaultTolerance

SAMPLE_S = 0.0002
PAGE = os.sysconf("SC_PAGE_SIZE")


def resident_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * PAGE


class _PeakSampler:
    """The highest resident size seen while the ``with`` block runs."""

    def __enter__(self) -> Self:
        self.peak = resident_bytes()
        self._running = True
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while self._running:
            self.peak = max(self.peak, resident_bytes())
            time.sleep(SAMPLE_S)

    def __exit__(self, *exc: object) -> None:
        self._running = False
        self._thread.join()
        self.peak = max(self.peak, resident_bytes())


class _MeasuredRounds(FLFSDPStrategy):
    """The strategy, with each round's peak resident memory above the memory before it."""

    def __init__(self, **kwargs: object) -> None:
        super().__init__(**kwargs)
        self.extra_bytes: list[int] = []

    def fed_sync(self) -> None:
        gc.collect()
        before = resident_bytes()
        with _PeakSampler() as sampler:
            super().fed_sync()
        if self.syncs > 1:  # the first is the joining round
            self.extra_bytes.append(sampler.peak - before)


class _MLP(pl.LightningModule):
    def __init__(self, width: int, layers: int) -> None:
        super().__init__()
        self.net = nn.Sequential(*(nn.Linear(width, width) for _ in range(layers)))
        self.width = width

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return self.net(batch).square().mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=1e-6)

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        return torch.utils.data.DataLoader(torch.randn(64, self.width), batch_size=2)


def measure(width: int, layers: int, rounds: int, sync_every: int = 2) -> dict[str, float]:
    """Trains ``rounds`` rounds after the joining one; the median and largest extra memory of a round."""
    from torchft._torchft import LighthouseServer

    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=100, quorum_tick_ms=50)
    os.environ["NUM_REPLICA_GROUPS"] = "1"  # the federation's size (one group here)
    try:
        ft = FaultTolerance(lighthouse=lighthouse.address(), group_id=0, min_groups=1, timeout=timedelta(seconds=60))
        strategy = _MeasuredRounds(sync_every=sync_every, outer_optimizer="nesterov", fault_tolerance=ft)
        module = _MLP(width, layers)
        shard_bytes = sum(p.numel() * p.element_size() for p in module.parameters())
        trainer = pl.Trainer(
            accelerator="cpu",
            devices=1,
            strategy=strategy,
            max_steps=rounds * sync_every,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            limit_val_batches=0,
        )
        trainer.fit(module)
    finally:
        lighthouse.shutdown()
    extra = strategy.extra_bytes
    mib = 2**20
    return {
        "shard_mib": shard_bytes / mib,
        "rounds": len(extra),
        "median_extra_mib": statistics.median(extra) / mib,
        "max_extra_mib": max(extra) / mib,
        "median_extra_shards": statistics.median(extra) / shard_bytes,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="fedshard bench ft-memory", description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    result = measure(args.width, args.layers, args.rounds)
    print(
        f"one rank, {result['shard_mib']:.0f} MiB of fp32 parameters, DiLoCo: a fault-tolerant round holds"
        f" {result['median_extra_mib']:.0f} MiB more than before it (median of {result['rounds']} rounds, max"
        f" {result['max_extra_mib']:.0f} MiB) = {result['median_extra_shards']:.2f} shards"
    )


if __name__ == "__main__":
    main()
