"""Branch-and-bound domains, stored batched: each field holds one row per domain."""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch
from torch import Tensor

from lightning_fedshard.verify.ops import Interval

__all__ = ["DomainBatch"]


@dataclass
class DomainBatch:
    """N sub-problems of one verification case, each a set of fixed ReLU phases.

    Per pre-activation node (dicts keyed by node name): ``lower``/``upper`` ``[N, *shape]`` are its bounds,
    clamped by the splits; ``splits`` ``[N, *shape]`` is ``+1`` where ``z ≥ 0`` was assumed, ``-1`` where
    ``z ≤ 0``, 0 where free; ``betas`` ``[S, N, *shape]`` are β-CROWN's multipliers of those assumptions.
    ``alphas`` (keyed by ReLU node) ``[S, N, *shape]`` are the output pass's lower slopes, inherited from the
    parent. ``margins [N, S]`` are the best lower bounds of the spec rows, and ``branch_layer``/``branch_neuron``
    ``[N]`` the split chosen for each domain (index into the pre-activation list, flat neuron index).

    Example::

        pool = DomainBatch.concat([pool, children.take(alive)])
        worst = pool.take(pool_value.argsort()[:64])
    """

    lower: dict[str, Tensor]
    upper: dict[str, Tensor]
    splits: dict[str, Tensor]
    betas: dict[str, Tensor]
    alphas: dict[str, Tensor]
    margins: Tensor
    depth: Tensor
    branch_layer: Tensor
    branch_neuron: Tensor

    def __len__(self) -> int:
        return self.margins.shape[0]

    def bounds(self) -> dict[str, Interval]:
        return {name: Interval(self.lower[name], self.upper[name]) for name in self.lower}

    def _map(self, per_domain, per_spec) -> DomainBatch:
        """A new batch with ``per_domain`` applied to ``[N, …]`` tensors and ``per_spec`` to ``[S, N, …]``."""
        values = {}
        for f in fields(self):
            value = getattr(self, f.name)
            spec_major = f.name in ("betas", "alphas")
            apply = per_spec if spec_major else per_domain
            values[f.name] = {k: apply(v) for k, v in value.items()} if isinstance(value, dict) else apply(value)
        return DomainBatch(**values)

    def take(self, index: Tensor) -> DomainBatch:
        return self._map(lambda t: t[index], lambda t: t[:, index])

    def repeat(self, times: int) -> DomainBatch:
        """``times`` copies one after another (domain ``i`` of copy ``c`` is row ``c·N + i``)."""
        return self._map(
            lambda t: t.repeat(times, *([1] * (t.dim() - 1))), lambda t: t.repeat(1, times, *([1] * (t.dim() - 2)))
        )

    @staticmethod
    def concat(batches: list[DomainBatch]) -> DomainBatch:
        first = batches[0]
        values = {}
        for f in fields(first):
            parts = [getattr(b, f.name) for b in batches]
            dim = 1 if f.name in ("betas", "alphas") else 0
            if isinstance(parts[0], dict):
                values[f.name] = {k: torch.cat([p[k] for p in parts], dim) for k in parts[0]}
            else:
                values[f.name] = torch.cat(parts, dim)
        return DomainBatch(**values)

    def split(self, pre_activations: list[str], layer: Tensor, neuron: Tensor) -> DomainBatch:
        """The two children of every domain for the splits ``(layer, neuron) [N]``: rows ``0..N-1`` assume the
        neuron active (``z ≥ 0``), rows ``N..2N-1`` inactive (``z ≤ 0``)."""
        children = self.repeat(2)
        n = len(self)
        rows = torch.arange(n)
        for index, name in enumerate(pre_activations):
            chosen = (layer == index).nonzero().flatten()
            if not chosen.numel():
                continue
            which = neuron[chosen]
            lower, upper, splits = (t[name].flatten(1) for t in (children.lower, children.upper, children.splits))
            active, inactive = rows[chosen], rows[chosen] + n
            lower[active, which] = lower[active, which].clamp(min=0)
            upper[inactive, which] = upper[inactive, which].clamp(max=0)
            splits[active, which] = 1
            splits[inactive, which] = -1
        children.depth = children.depth + 1
        return children
