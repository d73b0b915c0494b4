"""Branch-and-bound domains, stored batched: each field holds one row per domain."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from lightning_fedshard.verify.ops import Interval, flat

if TYPE_CHECKING:
    from lightning_fedshard.verify.bounds.alpha import AlphaResult
    from lightning_fedshard.verify.graph import BoundGraph
    from lightning_fedshard.verify.objective import OutputSpec

__all__ = ["DomainBatch", "DomainPool"]

_SPEC_MAJOR = ("betas", "alphas")


@dataclass
class DomainBatch:
    """N sub-problems of one verification case, each a set of split assumptions on neurons.

    Per bounded node (``graph.bounded``, dicts keyed by node name): ``lower``/``upper`` ``[N, *shape]`` are its
    bounds, tightened by the splits. Per split node (``graph.split_nodes``): ``splits`` ``[N, *shape]`` is ``+1``
    where the last split there assumed ``z ≥ p``, ``-1`` where it assumed ``z ≤ p``, 0 where the neuron is unsplit,
    with ``points`` ``[N, *shape]`` the split points ``p`` (0 for ReLUs); ``betas`` ``[S, N, *shape]`` are
    β-CROWN's multipliers of those assumptions. ``alphas`` (keyed by non-linear node) ``[S, N, *alpha shape]`` are
    the output pass's parameters, inherited from the parent. ``margins [N, S]`` are the best lower bounds of the
    spec rows, and ``branch_layer``/``branch_neuron``/``branch_point`` ``[N]`` the split chosen for each domain
    (index into ``graph.split_nodes``, flat neuron index, split point).

    Example::

        children = parents.split(graph.split_nodes, parents.branch_layer, parents.branch_neuron, parents.branch_point)
        alive = children.take(open_index)
    """

    lower: dict[str, Tensor]
    upper: dict[str, Tensor]
    splits: dict[str, Tensor]
    points: dict[str, Tensor]
    betas: dict[str, Tensor]
    alphas: dict[str, Tensor]
    margins: Tensor
    depth: Tensor
    branch_layer: Tensor
    branch_neuron: Tensor
    branch_point: Tensor

    @classmethod
    def unsplit(
        cls,
        graph: BoundGraph,
        spec: OutputSpec,
        bounds: dict[str, Interval],
        alphas: dict[str, Tensor],
        lower: Tensor,
    ) -> DomainBatch:
        """``N`` domains with nothing split: the bounded nodes' ``bounds [N, *shape]``, output parameters
        ``alphas [S, N, *alpha shape]`` and the spec rows' lower bounds ``lower [S, N]``; β zero."""
        low = {name: bounds[name].lower for name in graph.bounded}
        n, device = lower.shape[1], lower.device
        return cls(
            lower=low,
            upper={name: bounds[name].upper for name in graph.bounded},
            splits={name: torch.zeros_like(low[name], dtype=torch.int8) for name in graph.split_nodes},
            points={name: torch.zeros_like(low[name]) for name in graph.split_nodes},
            betas={name: low[name].new_zeros(spec.num_rows, *low[name].shape) for name in graph.split_nodes},
            alphas={name: alpha.clone() for name, alpha in alphas.items()},
            margins=spec.margins(lower),
            depth=torch.zeros(n, dtype=torch.long, device=device),
            branch_layer=torch.zeros(n, dtype=torch.long, device=device),
            branch_neuron=torch.zeros(n, dtype=torch.long, device=device),
            branch_point=lower.new_zeros(n),
        )

    @classmethod
    def at_root(cls, graph: BoundGraph, spec: OutputSpec, root: AlphaResult) -> DomainBatch:
        """The one domain with nothing split: α-CROWN's bounds and output slopes at the root, β zero."""
        return cls.unsplit(graph, spec, root.bounds, root.alphas, root.lower)

    @staticmethod
    def cat(batches: list[DomainBatch]) -> DomainBatch:
        """The domains of ``batches`` one after another (all of the same layout)."""
        columns = zip(*(batch._leaves() for batch in batches), strict=True)
        return batches[0]._rebuild([torch.cat([t for t, _ in column], column[0][1]) for column in columns])

    def __len__(self) -> int:
        return self.margins.shape[0]

    @property
    def device(self) -> torch.device:
        """Where every tensor of the batch lives (the graph's device)."""
        return self.margins.device

    def bounds(self) -> dict[str, Interval]:
        return {name: Interval(self.lower[name], self.upper[name]) for name in self.lower}

    def beta_terms(self, betas: dict[str, Tensor] | None = None) -> dict[str, tuple[Tensor, Tensor]]:
        """β-CROWN's terms ``(β·s, p)`` per split node (of ``betas``, else the batch's own multipliers)."""
        betas = self.betas if betas is None else betas
        return {name: (beta * self.splits[name], self.points[name]) for name, beta in betas.items()}

    def _leaves(self) -> list[tuple[Tensor, int]]:
        """Every tensor with its domain dimension (1 for the spec-major ``alphas``/``betas``), in field order."""
        leaves = []
        for f in fields(self):
            value, dim = getattr(self, f.name), 1 if f.name in _SPEC_MAJOR else 0
            leaves += [(v, dim) for v in value.values()] if isinstance(value, dict) else [(value, dim)]
        return leaves

    def _rebuild(self, tensors: list[Tensor]) -> DomainBatch:
        """A batch of the same layout as this one holding ``tensors`` (in :meth:`_leaves` order)."""
        values, position = {}, iter(tensors)
        for f in fields(self):
            value = getattr(self, f.name)
            values[f.name] = {k: next(position) for k in value} if isinstance(value, dict) else next(position)
        return DomainBatch(**values)

    def take(self, index: Tensor) -> DomainBatch:
        return self._rebuild([t.index_select(dim, index) for t, dim in self._leaves()])

    def narrow(self, count: int) -> DomainBatch:
        """The first ``count`` domains, as views."""
        return self._rebuild([t.narrow(dim, 0, count) for t, dim in self._leaves()])

    def repeat(self, times: int) -> DomainBatch:
        """``times`` copies one after another (domain ``i`` of copy ``c`` is row ``c·N + i``)."""
        return self._rebuild(
            [t.repeat(*[times if d == dim else 1 for d in range(t.dim())]) for t, dim in self._leaves()]
        )

    def assign(self, index: Tensor, source: DomainBatch) -> None:
        """Overwrite domains ``index`` with those of ``source`` (in place)."""
        for (t, dim), (s, _) in zip(self._leaves(), source._leaves(), strict=True):
            t.index_copy_(dim, index, s)

    def split(self, split_nodes: list[str], layer: Tensor, neuron: Tensor, point: Tensor) -> DomainBatch:
        """The two children of every domain for the splits ``(layer, neuron, point) [N]``: rows ``0..N-1`` assume
        the neuron at least the point (``z ≥ p``; a ReLU active), rows ``N..2N-1`` at most (``z ≤ p``)."""
        children = self.repeat(2)
        n = len(self)
        above = torch.arange(n, device=self.device)
        below = above + n
        # Every domain's row is written at every node, its own value kept where the split is elsewhere: no host sync
        # to find which domains split which node (one per node and round on a GPU), for O(N) more writes per node.
        for index, name in enumerate(split_nodes):
            here = layer == index
            which, at = torch.where(here, neuron, 0), point.to(self.lower[name].dtype)
            lower, upper, splits, points = (
                flat(t[name], 1) for t in (children.lower, children.upper, children.splits, children.points)
            )
            lower[above, which] = torch.where(here, torch.maximum(lower[above, which], at), lower[above, which])
            upper[below, which] = torch.where(here, torch.minimum(upper[below, which], at), upper[below, which])
            splits[above, which] = torch.where(here, 1, splits[above, which])
            splits[below, which] = torch.where(here, -1, splits[below, which])
            points[above, which] = torch.where(here, at, points[above, which])
            points[below, which] = torch.where(here, at, points[below, which])
        children.depth = children.depth + 1
        return children


class DomainPool:
    """The open domains of a branch-and-bound run, stored in preallocated tensors that grow by doubling, so that
    taking the worst domains and adding children cost O(batch) copies, not O(pool).

    Example::

        pool = DomainPool(root)
        worst = pool.pop_worst(256, spec.value)
        pool.push(open_children)
    """

    def __init__(self, first: DomainBatch) -> None:
        self._storage = first.repeat(1)
        self._size = len(first)

    def __len__(self) -> int:
        return self._size

    def view(self) -> DomainBatch:
        return self._storage.narrow(self._size)

    def push(self, domains: DomainBatch) -> None:
        count, capacity = len(domains), len(self._storage)
        if self._size + count > capacity:
            grown = max(2 * capacity, self._size + count)
            self._storage = self._storage._rebuild(
                [
                    torch.cat([t, t.new_zeros(*t.shape[:dim], grown - capacity, *t.shape[dim + 1 :])], dim)
                    for t, dim in self._storage._leaves()
                ]
            )
        self._storage.assign(torch.arange(self._size, self._size + count, device=domains.device), domains)
        self._size += count

    def pop_worst(self, count: int, value: Callable[[Tensor], Tensor]) -> DomainBatch:
        """Remove and return the ``count`` domains of lowest ``value(margins)``; the last open domains move into
        the rows that frees."""
        n = self._size
        picked = value(self.view().margins).argsort()[:count]
        taken, count = self._storage.take(picked), picked.numel()
        is_picked = torch.zeros(n, dtype=torch.bool, device=picked.device)
        is_picked[picked] = True
        holes = picked[picked < n - count]
        tail = (n - count) + (~is_picked[n - count :]).nonzero().flatten()
        if holes.numel():
            self._storage.assign(holes, self._storage.take(tail))
        self._size = n - count
        return taken
