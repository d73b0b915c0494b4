"""Tensor parallelism over the rows of a backward pass: each rank propagates its share of the spec rows.

A CROWN pass bounds ``S`` linear functions at once and its coefficients ``A [S, B, …]`` (and α-CROWN's slopes
``[S, B, …]``) grow with ``S``. Rows are independent, so rank ``r`` of ``P`` takes a contiguous chunk of them and
the ranks exchange only the resulting bounds ``[S_r, B]``. The arithmetic per row is the same as unsharded,
but BLAS may round a ``[S/P, n]`` product differently from the ``[S, n]`` one, hence equal within float
tolerance rather than bitwise.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["RowPartition"]


class _GatherRows(torch.autograd.Function):
    """All-gather of row chunks along dim 0 whose backward hands each rank the gradient of its own chunk,
    summed over the ranks (every rank's loss depends on every chunk)."""

    @staticmethod
    def forward(ctx, local: Tensor, counts: list[int], rank: int, group: dist.ProcessGroup) -> Tensor:
        ctx.counts, ctx.rank, ctx.group = counts, rank, group
        width = max(counts)
        padded = local.new_zeros(width, *local.shape[1:])
        padded[: local.shape[0]] = local
        chunks = [torch.empty_like(padded) for _ in counts]
        dist.all_gather(chunks, padded.contiguous(), group=group)
        return torch.cat([chunk[:count] for chunk, count in zip(chunks, counts, strict=True)])

    @staticmethod
    def backward(ctx, grad: Tensor):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        start = sum(ctx.counts[: ctx.rank])
        return grad[start : start + ctx.counts[ctx.rank]], None, None, None


class RowPartition:
    """Contiguous chunks of ``n`` rows over the ranks of ``group``: ranks ``< n % P`` take one row more.

    Example::

        rows = RowPartition(dist.group.WORLD)
        mine = rows.chunk(C)                     # this rank's rows of C [S, B, ...]
        lower = rows.gather(bound(mine), len(C)) # [S, B] on every rank, differentiable
    """

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)

    def counts(self, n: int) -> list[int]:
        base, extra = divmod(n, self.world)
        return [base + (r < extra) for r in range(self.world)]

    def span(self, n: int) -> slice:
        """This rank's rows of ``n``."""
        counts = self.counts(n)
        start = sum(counts[: self.rank])
        return slice(start, start + counts[self.rank])

    def chunk(self, rows: Tensor) -> Tensor:
        return rows[self.span(rows.shape[0])]

    def gather(self, local: Tensor, n: int) -> Tensor:
        """Every rank's chunk of an ``n``-row tensor, concatenated in rank order (gradients flow back)."""
        return _GatherRows.apply(local, self.counts(n), self.rank, self.group)
