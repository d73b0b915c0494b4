"""Which rank orthogonalises which matrix: a greedy balance of the Newton–Schulz work."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["assign_owners", "ns_cost"]


def ns_cost(shape: Sequence[int]) -> int:
    """Multiply-adds of one Newton–Schulz iteration on an ``m × n`` matrix (``k = min, l = max``): the Gram matrix
    ``k²l``, its square ``k³`` and the product with ``X`` ``k²l``."""
    k, l = sorted(shape[:2])
    return 2 * k * k * l + k**3


def assign_owners(costs: Sequence[int], num_ranks: int) -> list[int]:
    """The owner rank of each item: largest first, each to the least-loaded rank (ties: the lowest rank).

    Longest-processing-time scheduling: the busiest rank does at most 4/3 of the optimum. Deterministic, so
    every rank computes the same owners without communicating. Example::

        assign_owners([9, 4, 4, 1], 2)  # [0, 1, 1, 0]
    """
    if num_ranks < 1:
        raise ValueError(f"assign_owners: need at least one rank, got {num_ranks}.")
    loads = [0] * num_ranks
    owners = [0] * len(costs)
    for item in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        rank = min(range(num_ranks), key=lambda r: (loads[r], r))
        owners[item] = rank
        loads[rank] += costs[item]
    return owners
