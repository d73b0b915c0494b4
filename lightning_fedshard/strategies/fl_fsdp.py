"""FL+FSDP: federation groups that train with FSDP2 and average their parameter shards every few steps."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta
from typing import Literal

import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from torch import nn

from lightning_fedshard.strategies.fault_tolerance import FaultTolerance
from lightning_fedshard.strategies.fl_hsdp import FLHSDPStrategy

__all__ = ["FLFSDPStrategy"]


class FLFSDPStrategy(FLHSDPStrategy):
    """FL+HSDP with one replica per group: each group is a plain FSDP2 ring over ``shard_size`` ranks.

    ``num_groups=1`` is plain FSDP2 over the world (registered as ``"fsdp2"``). The arguments are
    those of :class:`FLHSDPStrategy` without ``replicate_size`` and ``sync_mode``.

    Example::

        import lightning_fedshard  # registers the strategy names
        trainer = Trainer(accelerator="cpu", devices=4, strategy="fl_fsdp")  # 2 groups × 2 shards
        trainer = Trainer(accelerator="cpu", devices=4, strategy=FLFSDPStrategy(num_groups=2, sync_every=4))
    """

    _min_replicate_size = 1

    def __init__(
        self,
        num_groups: int | None = None,
        shard_size: int | None = None,
        sync_every: int = 8,
        outer_optimizer: Literal["avg", "nesterov"] = "avg",
        outer_lr: float = 0.7,
        outer_momentum: float = 0.9,
        sync_dtype: str | torch.dtype = "float32",
        sync_schedule: Literal["blocking", "streaming"] = "blocking",
        fragments: int = 1,
        fragment_sync_delay: int = 0,
        fragment_update_alpha: float = 0.0,
        auto_wrap: Sequence[str | type[nn.Module]] | None = None,
        activation_checkpointing: Sequence[str | type[nn.Module]] | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        shard_block: int | None = None,
        fault_tolerance: FaultTolerance | None = None,
        compile: Sequence[str | type[nn.Module]] | None = None,
    ) -> None:
        super().__init__(
            num_groups=num_groups,
            shard_size=shard_size,
            replicate_size=1,
            sync_every=sync_every,
            outer_optimizer=outer_optimizer,
            outer_lr=outer_lr,
            outer_momentum=outer_momentum,
            sync_dtype=sync_dtype,
            sync_schedule=sync_schedule,
            fragments=fragments,
            fragment_sync_delay=fragment_sync_delay,
            fragment_update_alpha=fragment_update_alpha,
            auto_wrap=auto_wrap,
            activation_checkpointing=activation_checkpointing,
            process_group_backend=process_group_backend,
            timeout=timeout,
            shard_block=shard_block,
            fault_tolerance=fault_tolerance,
            compile=compile,
        )
