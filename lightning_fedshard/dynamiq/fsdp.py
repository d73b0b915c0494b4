"""DynamiQ as FSDP2's gradient reduce-scatter."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup
from torch.distributed.fsdp import FSDPModule

from lightning_fedshard.compat import ReduceScatter
from lightning_fedshard.dynamiq.settings import Compression
from lightning_fedshard.dynamiq.telemetry import CompressionStats

__all__ = ["DynamiQReduceScatter", "install_dynamiq_reduce_scatter"]


class DynamiQReduceScatter(ReduceScatter):
    """An FSDP2 custom reduce-scatter that sends compressed partial sums around a ring.

    FSDP2 hands it the padded, flattened gradients of one FSDP unit laid out as ``world_size`` equal
    shards; rank ``r`` receives the sum (``SUM``) or mean (``AVG``) of shard ``r``. ``on_sent(bytes)``
    reports the wire bytes of each call, e.g. to a communication ledger.

    Example::

        comm = DynamiQReduceScatter(Compression(bits=5.0))
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_custom_reduce_scatter(comm)
    """

    def __init__(
        self,
        compression: Compression,
        stats: CompressionStats | None = None,
        on_sent: Callable[[float], None] | None = None,
    ) -> None:
        self.compression = compression
        self.codec = compression.make_codec()
        self.stats = stats if stats is not None else CompressionStats()
        self._on_sent = on_sent

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(
        self, output_tensor: Tensor, input_tensor: Tensor, group: ProcessGroup, op: object, async_op: bool = False
    ) -> None:
        if op not in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):
            raise ValueError(f"DynamiQReduceScatter supports SUM and AVG reductions, got {op}.")
        sent_before = self.stats.wire_bytes
        self.compression.reduce_scatter(output_tensor, input_tensor, self.codec, group, self.stats)
        if op == dist.ReduceOp.AVG:
            output_tensor.div_(dist.get_world_size(group))
        if self._on_sent is not None:
            self._on_sent(self.stats.wire_bytes - sent_before)


def install_dynamiq_reduce_scatter(module: torch.nn.Module, comm: DynamiQReduceScatter) -> int:
    """Routes every FSDP2 unit's gradient reduce-scatter in ``module`` through ``comm``; returns how many."""
    units = [m for m in module.modules() if isinstance(m, FSDPModule)]
    for unit in units:
        unit.set_custom_reduce_scatter(comm)
    return len(units)
