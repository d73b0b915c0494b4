"""One validated description of "compress this traffic with that codec", shared by the hook, the FSDP2
reduce-scatter, the FedAvg averager and the Lightning plugin."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor
from torch.distributed import ProcessGroup

from lightning_fedshard.dynamiq.codec import CODECS, Codec, make_codec
from lightning_fedshard.dynamiq.collective import DEFAULT_MIN_NUMEL, TOPOLOGIES, all_reduce, reduce_scatter, warm_up
from lightning_fedshard.dynamiq.telemetry import CompressionStats

__all__ = ["Compression"]


@dataclass(frozen=True)
class Compression:
    """Codec, rate and topology of a compressed collective; checked on construction, before any process starts.

    Arguments:
        codec: A registered codec name (``lightning_fedshard.dynamiq.CODECS``).
        bits: Wire bits per coordinate for the rate-adaptive codecs (``dynamiq``, ``thc``).
        topology: ``"ring"`` or ``"butterfly"`` (power-of-two groups).
        min_numel: Tensors smaller than this use a plain all-reduce.
        debug: Also run an exact all-reduce to measure the vNMSE (one more collective per call).

    Example::

        Compression(codec="dynamiq", bits=5.0).make_codec()
    """

    codec: str = "dynamiq"
    bits: float = 5.0
    topology: str = "ring"
    min_numel: int = DEFAULT_MIN_NUMEL
    debug: bool = False

    def __post_init__(self) -> None:
        if self.codec not in CODECS:
            raise ValueError(f"Unknown codec {self.codec!r}; expected one of {sorted(CODECS)}.")
        if self.topology not in TOPOLOGIES:
            raise ValueError(f"Unknown topology {self.topology!r}; expected one of {TOPOLOGIES}.")
        if not 0 < self.bits < math.inf:  # NaN too
            raise ValueError(f"bits must be a positive, finite number of bits per coordinate, got {self.bits}.")
        if self.min_numel < 0:
            raise ValueError(f"min_numel must be ≥ 0, got {self.min_numel}.")
        self.make_codec()  # a budget the codec cannot meet fails here, not on the first step

    def make_codec(self) -> Codec:
        """A fresh codec instance; keep it across calls so stateful codecs (seeds) advance."""
        return make_codec(self.codec, self.bits)

    def warm_up(self, codec: Codec, numel: int, world_size: int, device: torch.device | str = "cpu") -> None:
        """Readies ``codec`` for the collectives of ``numel`` coordinates over ``world_size`` ranks that these
        settings compress (smaller tensors take the plain all-reduce)."""
        if numel >= self.min_numel and world_size > 1:
            warm_up(codec, numel, world_size, device)

    def all_reduce(self, tensor: Tensor, codec: Codec, group: ProcessGroup | None, stats: CompressionStats) -> Tensor:
        """``dynamiq.all_reduce`` (in-place sum) with these settings and ``codec`` (from ``make_codec``)."""
        return all_reduce(
            tensor,
            codec=codec,
            group=group,
            topology=self.topology,
            min_numel=self.min_numel,
            stats=stats,
            debug=self.debug,
        )

    def reduce_scatter(
        self, output: Tensor, input: Tensor, codec: Codec, group: ProcessGroup | None, stats: CompressionStats
    ) -> Tensor:
        """``dynamiq.reduce_scatter`` (sum) with these settings and ``codec``."""
        return reduce_scatter(
            output, input, codec=codec, group=group, topology=self.topology, min_numel=self.min_numel, stats=stats
        )
