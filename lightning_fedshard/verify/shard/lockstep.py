"""Keeping the ranks of a sharded verification run in step.

Sharded bound propagation issues a collective inside every sharded op, so every rank must make the same
decisions in the same order: stop an optimisation early, leave a loop at the deadline, take a branch. Decisions
computed from replicated values agree by construction; those from a rank's own clock do not, so they go through
:func:`agree`, an ``all_reduce(MAX)`` over the group that :func:`lockstep` made current.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist

__all__ = [
    "DeadlineExceeded",
    "agree",
    "agree_least",
    "alone",
    "collective_device",
    "lockstep",
    "past",
]

_group: list[dist.ProcessGroup | None] = [None]


@contextmanager
def lockstep(group: dist.ProcessGroup | None) -> Iterator[None]:
    """Make ``group`` the one that :func:`agree` decides over inside the block (``None``: this rank alone, for
    work that is local to a rank)."""
    _group.append(group)
    try:
        yield
    finally:
        _group.pop()


def agree(flag: bool) -> bool:
    """``flag`` of any rank of the current group: true on every rank if it is true on one."""
    group = _group[-1]
    if group is None:
        return flag
    value = torch.tensor([int(flag)], dtype=torch.int32, device=collective_device(group))
    dist.all_reduce(value, op=dist.ReduceOp.MAX, group=group)
    return bool(value.item())


def agree_least(count: int) -> int:
    """The least ``count`` of any rank of the current group (a batch size paced by a rank's own clock)."""
    group = _group[-1]
    if group is None:
        return count
    value = torch.tensor([count], dtype=torch.int64, device=collective_device(group))
    dist.all_reduce(value, op=dist.ReduceOp.MIN, group=group)
    return int(value.item())


def collective_device(group: dist.ProcessGroup | None) -> torch.device:
    """Where small tensors for collectives over ``group`` must live: the current GPU under NCCL, else the CPU."""
    if group is not None and dist.get_backend(group) == dist.Backend.NCCL:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def past(deadline: float | None) -> bool:
    """Whether the deadline (a ``time.monotonic()`` value) has passed on any rank of the current group."""
    return agree(deadline is not None and time.monotonic() > deadline)


class DeadlineExceeded(Exception):
    """Raised inside a bound computation whose deadline passed (on every rank of the group at once), so that a
    long pass ends at its next step instead of after the whole pass."""


def alone() -> bool:
    """Whether this rank takes its decisions alone (no group is current)."""
    return _group[-1] is None
