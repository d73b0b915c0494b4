"""How one verification run is spread over the ranks of a process group: a small description, in the manner of
torchtitan's parallel dimensions, from which every sharded piece takes what it needs."""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from enum import Enum

import torch.distributed as dist

from lightning_fedshard.verify.graph import BoundGraph
from lightning_fedshard.verify.shard.fsdp import fsdp_shard, weights_held
from lightning_fedshard.verify.shard.rows import RowPartition
from lightning_fedshard.verify.shard.zones import megatron_zones

__all__ = ["ShardPlan", "Strategy", "TensorParallelMode"]


class Strategy(str, Enum):
    """``single``: one rank does everything (ranks, if any, take different instances). ``fsdp``: weights are
    sharded, results bitwise identical to ``single``. ``tp``: tensor parallel, see :class:`TensorParallelMode`.
    ``fsdp+rows``: both at once over the same ranks, weights sharded as ``fsdp`` and the rows of every backward
    pass (with α-CROWN's slopes and branch-and-bound's domains) split as ``tp`` rows; the results are those of
    ``tp`` rows, bit for bit."""

    SINGLE = "single"
    FSDP = "fsdp"
    TP = "tp"
    FSDP_ROWS = "fsdp+rows"


class TensorParallelMode(str, Enum):
    """``rows``: the rows of every backward pass (and α-CROWN's slopes) are split over the ranks, and
    branch-and-bound deals its domains out (exact up to rounding). ``zones``: Megatron column/row zones shard
    weights and coefficients along the hidden dimension (sound, looser: interval bounds inside zones)."""

    ROWS = "rows"
    ZONES = "zones"


@dataclass(frozen=True)
class ShardPlan:
    """The sharding of one verification run over ``group`` (every rank of it runs the same instance).

    Example::

        plan = ShardPlan(Strategy.FSDP, dist.group.WORLD)        # FSDP_ROWS: shards + split rows
        result = verify(plan.shard(graph), prop, config, plan)
    """

    strategy: Strategy = Strategy.SINGLE
    group: dist.ProcessGroup | None = None
    tp_mode: TensorParallelMode = TensorParallelMode.ROWS
    #: Zones mode: at most this many zones, from the input onwards (``None``: as many as the network has).
    max_zones: int | None = None
    #: FSDP: gather the next layer's weights while the current one computes.
    prefetch: bool = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "strategy", Strategy(self.strategy))
        object.__setattr__(self, "tp_mode", TensorParallelMode(self.tp_mode))
        if self.strategy is not Strategy.SINGLE and self.group is None:
            raise ValueError(f"strategy {self.strategy.value!r} needs a process group to shard over")
        if self.max_zones is not None and self.max_zones < 1:
            raise ValueError(f"max_zones must be ≥ 1 (or None for all), got {self.max_zones}")

    @property
    def sharded(self) -> bool:
        return self.strategy is not Strategy.SINGLE

    @property
    def row_parallel(self) -> bool:
        return self.strategy is Strategy.FSDP_ROWS or (
            self.strategy is Strategy.TP and self.tp_mode is TensorParallelMode.ROWS
        )

    @property
    def weights_sharded(self) -> bool:
        """Whether every bound step all-gathers its layer's weights (``fsdp``, ``fsdp+rows``)."""
        return self.strategy in (Strategy.FSDP, Strategy.FSDP_ROWS)

    @property
    def lockstep_group(self) -> dist.ProcessGroup | None:
        """The group whose ranks must take every decision together (``None``: none)."""
        return self.group if self.sharded else None

    @property
    def partition(self) -> RowPartition | None:
        return RowPartition(self.group) if self.row_parallel else None

    @property
    def domain_group(self) -> dist.ProcessGroup | None:
        """The group branch-and-bound deals its domains over (``None``: one search, replicated if sharded)."""
        return self.group if self.row_parallel else None

    def domain_search(self, graph: BoundGraph) -> AbstractContextManager[None]:
        """Where branch-and-bound runs: a domain-parallel rank bounds its own domains without waiting for the
        others, so sharded weights are gathered once on entry (every rank together) and held whole inside."""
        return weights_held(graph) if self.domain_group is not None else nullcontext()

    def shard(self, graph: BoundGraph) -> BoundGraph:
        """This rank's part of ``graph``: the graph itself where weights stay replicated."""
        if self.weights_sharded:
            return fsdp_shard(graph, self.group, self.prefetch)
        if self.strategy is Strategy.TP and self.tp_mode is TensorParallelMode.ZONES:
            return megatron_zones(graph, self.group, self.max_zones)
        return graph
