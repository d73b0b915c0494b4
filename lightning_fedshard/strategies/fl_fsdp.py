"""FL+FSDP: federation groups that train with FSDP2 and average their parameter shards every few steps."""

from __future__ import annotations

from typing import Any

from lightning_fedshard.strategies.fl_hsdp import FLHSDPStrategy

__all__ = ["FLFSDPStrategy"]


class FLFSDPStrategy(FLHSDPStrategy):
    """FL+HSDP with one replica per group: each group is a plain FSDP2 ring over ``shard_size`` ranks.

    ``num_groups=1`` is plain FSDP2 over the world (registered as ``"fsdp2"``). The arguments are
    those of :class:`FLHSDPStrategy` without ``replicate_size`` and ``sync_mode`` (LightningCLI reads them from
    there, following ``**kwargs``).

    Example::

        import lightning_fedshard  # registers the strategy names
        trainer = Trainer(accelerator="cpu", devices=4, strategy="fl_fsdp")  # 2 groups × 2 shards
        trainer = Trainer(accelerator="cpu", devices=4, strategy=FLFSDPStrategy(num_groups=2, sync_every=4))
    """

    _min_replicate_size = 1

    def __init__(self, **kwargs: Any) -> None:
        if fixed := sorted({"replicate_size", "sync_mode"} & kwargs.keys()):
            raise TypeError(
                f"{type(self).__name__} has one replica per group and takes no {fixed}; see FLHSDPStrategy."
            )
        super().__init__(replicate_size=1, sync_mode="all_replicas", **kwargs)
