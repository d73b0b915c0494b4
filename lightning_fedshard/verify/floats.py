"""Directed rounding: float64 values cast to a working dtype on the safe side, for bounds that must hold in it."""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["HUGE", "round_down", "round_outwards", "round_up"]

#: An interval reaching past this magnitude (or infinite) is unbounded to a relaxation: its lines are the
#: constants ±inf, whatever the function (a float32 network's values there are beyond its precision anyway).
HUGE = 1e30


def round_down(value: Tensor, dtype: torch.dtype) -> Tensor:
    """``value`` (float64) in ``dtype``, never above it. The correction is detached, so gradients pass as if the
    cast were exact (α-CROWN optimises through rounded lines)."""
    cast = value.to(dtype)
    exact = cast.detach()
    below = torch.where(
        exact.double() > value.detach(), torch.nextafter(exact, torch.full_like(exact, -torch.inf)), exact
    )
    return cast + torch.where(torch.isfinite(exact), below - exact, 0)


def round_up(value: Tensor, dtype: torch.dtype) -> Tensor:
    """``value`` (float64) in ``dtype``, never below it (detached correction, as :func:`round_down`)."""
    cast = value.to(dtype)
    exact = cast.detach()
    above = torch.where(
        exact.double() < value.detach(), torch.nextafter(exact, torch.full_like(exact, torch.inf)), exact
    )
    return cast + torch.where(torch.isfinite(exact), above - exact, 0)


def round_outwards(lower: Tensor, upper: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """float64 bounds cast to ``dtype`` so that they still contain the float64 interval."""
    return round_down(lower, dtype), round_up(upper, dtype)
