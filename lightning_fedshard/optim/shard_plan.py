"""Block-aligned shards on FSDP2: which dimension each parameter is sharded on, and the padding alignment costs.

FSDP2 (torch 2.13) shards a parameter with ``Shard(d)``: ``torch.chunk`` along ``d`` gives every rank
``ceil(N/W)`` slices (the last ones fewer, padded), and ``d > 0`` must divide evenly. In the shard dimension's
order (``t.movedim(d, 0).flatten()``) rank ``r``'s shard starts at ``r · ceil(N/W) · row`` coordinates, ``row`` being
the elements of one slice. A shard is *block-aligned* when every such start is a multiple of the block ``B``
(256 for DynamiQ's super-groups, 32 or 128 for quantised optimizer states): then per-shard blocks are exactly the
whole tensor's blocks, and nothing is re-chunked across ranks.

:func:`plan_param` picks, per parameter (:class:`BlockShardPlan` for a whole module), the dimension FSDP2 can
shard on that aligns (least padding first); where none does, FSDP2 2.13 cannot align it without a placement of its own (veScale's ``RaggedShard``) and the
plan says how many slices per rank an aligned layout needs and the padding that costs.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from torch import nn
from torch.distributed.tensor import Shard

__all__ = ["BlockShardPlan", "ParamBlockPlan", "chunk_sizes", "plan_param"]


def chunk_sizes(n: int, world: int) -> list[int]:
    """The slices each of ``world`` ranks holds of a dimension of ``n``: ``torch.chunk``'s split, which FSDP2 and
    DTensor's ``Shard`` use (``ceil(n/world)`` each, the last ranks fewer or none). Example::

        chunk_sizes(10, 4)  # [3, 3, 3, 1]
    """
    per_rank = math.ceil(n / world) if n else 0
    return [max(0, min(per_rank, n - r * per_rank)) for r in range(world)]


@dataclass(frozen=True)
class ParamBlockPlan:
    """One parameter's plan over ``world`` ranks with blocks of ``block`` coordinates."""

    name: str
    shape: tuple[int, ...]
    dim: int
    """The dimension FSDP2 shards (``Shard(dim)``)."""
    slices_per_rank: int
    """Slices of ``dim`` per rank in the aligned layout (FSDP2's own ``ceil(N/W)`` when ``fsdp_aligned``)."""
    fsdp_aligned: bool
    """FSDP2's own chunking on ``dim`` is already block-aligned: the plan needs nothing FSDP2 cannot do."""
    fsdp_padding: int
    """Elements FSDP2 pads this parameter with when sharded on dim 0 (its default)."""
    aligned_padding: int
    """Elements the block-aligned layout pads it with (equal to FSDP2's on ``dim`` when ``fsdp_aligned``)."""
    world: int
    block: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def row(self) -> int:
        """Elements of one slice of the shard dimension."""
        return self.numel // self.shape[self.dim] if self.shape[self.dim] else 0

    def shard_starts(self) -> list[int]:
        """Each rank's first coordinate in the shard dimension's order, in the aligned layout."""
        return [r * self.slices_per_rank * self.row for r in range(self.world)]

    def padding_bound(self) -> int:
        """What :func:`plan_param` promises: padding below ``W · (row + lcm(row, B))`` elements."""
        return self.world * (self.row + math.lcm(self.row, self.block)) if self.row else 0


def _is_aligned(slices: int, row: int, n: int, block: int) -> bool:
    # one rank holds everything (no interior boundary), or every interior start is a multiple of the block
    return slices >= n or (slices * row) % block == 0


def plan_param(name: str, shape: Sequence[int], world: int, block: int) -> ParamBlockPlan:
    """The shard dimension and aligned slices per rank for one parameter (see the module's docstring).

    Candidates are dim 0 and every dim ``d > 0`` that ``world`` divides (FSDP2 refuses uneven ``d > 0``); an
    FSDP2-aligned candidate with the least padding wins (dim 0 on ties). Otherwise dim 0 with the fewest slices
    per rank ``c' ≥ ceil(N/W)`` for which ``c' · row`` is a multiple of the block. Example::

        plan_param("norm.weight", (4096,), world=512, block=256).aligned_padding  # 126,976
    """
    if world < 1 or block < 1:
        raise ValueError(f"plan_param: world and block must be ≥ 1, got world={world}, block={block}.")
    shape = tuple(int(s) for s in shape) or (1,)
    numel = math.prod(shape)
    fsdp_padding = (math.ceil(shape[0] / world) * world - shape[0]) * (numel // shape[0] if shape[0] else 0)
    candidates = [0] + [d for d in range(1, len(shape)) if shape[d] % world == 0]
    best: tuple[int, int, int] | None = None  # (padding, dim, slices)
    for d in candidates:
        n = shape[d]
        row = numel // n if n else 0
        slices = math.ceil(n / world)
        if _is_aligned(slices, row, n, block):
            padding = (slices * world - n) * row
            if best is None or padding < best[0]:
                best = (padding, d, slices)
    if best is not None:
        padding, dim, slices = best
        return ParamBlockPlan(name, shape, dim, slices, True, fsdp_padding, padding, world, block)
    n, row = shape[0], numel // shape[0]
    step = block // math.gcd(row, block)  # slices · row is a multiple of the block iff slices is one of `step`
    slices = math.ceil(math.ceil(n / world) / step) * step
    return ParamBlockPlan(name, shape, 0, slices, False, fsdp_padding, (slices * world - n) * row, world, block)


@dataclass(frozen=True)
class BlockShardPlan:
    """Plans for every parameter of a model; :meth:`placement_fn` is FSDP2's ``shard_placement_fn``.

    Example::

        plan = BlockShardPlan.for_module(model, world=4, block=256)
        fully_shard(block, mesh=mesh, shard_placement_fn=plan.placement_fn)
        print(plan.report())
    """

    params: tuple[ParamBlockPlan, ...]
    world: int
    block: int

    @classmethod
    def for_module(cls, module: nn.Module, world: int, block: int) -> BlockShardPlan:
        """Plans every parameter of ``module`` (meta tensors are fine: only shapes are read)."""
        return cls.for_shapes(((n, tuple(p.shape)) for n, p in module.named_parameters()), world, block)

    @classmethod
    def for_shapes(cls, shapes: Iterable[tuple[str, Sequence[int]]], world: int, block: int) -> BlockShardPlan:
        return cls(tuple(plan_param(name, shape, world, block) for name, shape in shapes), world, block)

    def placement_fn(self, param: nn.Parameter) -> Shard:
        """``Shard(dim)`` for ``param``, looked up by shape (FSDP2 passes the parameter, not its name)."""
        # the plan depends on the shape only, so parameters of one shape share it
        dims = [p.dim for p in self.params if p.shape == tuple(param.shape)]
        return Shard(dims[0] if dims else 0)

    @property
    def unaligned(self) -> list[ParamBlockPlan]:
        """Parameters FSDP2 2.13 cannot shard block-aligned (their shapes would need padding it cannot add)."""
        return [p for p in self.params if not p.fsdp_aligned]

    def totals(self) -> dict[str, int]:
        return {
            "numel": sum(p.numel for p in self.params),
            "fsdp_padding": sum(p.fsdp_padding for p in self.params),
            "aligned_padding": sum(p.aligned_padding for p in self.params),
            "aligned_by_fsdp2": sum(p.fsdp_aligned for p in self.params),
            "params": len(self.params),
        }

    def report(self) -> str:
        """A table per distinct (shape, plan): count, dim, FSDP2's padding, the aligned layout's padding."""
        rows: dict[tuple, list[ParamBlockPlan]] = {}
        for p in self.params:
            rows.setdefault((p.shape, p.dim, p.fsdp_aligned, p.slices_per_rank), []).append(p)
        lines = [
            f"shard plan: {self.world} ranks, blocks of {self.block}",
            f"{'shape':>16} {'count':>5} {'dim':>3} {'FSDP2 aligns':>12} {'slices/rank':>11}"
            f" {'FSDP2 pad':>12} {'aligned pad':>12}  example",
        ]
        for (shape, dim, ok, slices), group in rows.items():
            lines.append(
                f"{'×'.join(map(str, shape)):>16} {len(group):>5} {dim:>3} {'yes' if ok else 'no':>12} {slices:>11}"
                f" {sum(p.fsdp_padding for p in group):>12,} {sum(p.aligned_padding for p in group):>12,}"
                f"  {group[0].name}"
            )
        t = self.totals()
        lines.append(
            f"total: {t['params']} parameters, {t['numel']:,} elements; FSDP2 pads {t['fsdp_padding']:,}"
            f" ({t['fsdp_padding'] / t['numel']:.4%}), the block-aligned layout {t['aligned_padding']:,}"
            f" ({t['aligned_padding'] / t['numel']:.4%}); {t['aligned_by_fsdp2']}/{t['params']} aligned by FSDP2"
            " itself"
        )
        return "\n".join(lines)

