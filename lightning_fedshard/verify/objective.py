"""The unsafe output set of one VNN-LIB case as spec rows: what every bound and every attack measures."""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from lightning_fedshard.verify.floats import round_outwards
from lightning_fedshard.verify.ops import Interval
from lightning_fedshard.verify.spec import Case

__all__ = ["OutputSpec", "box_tensor", "free_coordinates"]

#: An input whose box is narrower than this (relative to its magnitude) is fixed: a VNN-LIB point value rounded
#: outwards to float32 leaves a box one or two ulps wide.
_FIXED_WIDTH = 1e-6


def free_coordinates(box: Interval) -> Tensor:
    """``[size]`` booleans: the flat inputs that vary in some box of the batch (wider than rounding)."""
    lower, upper = box.lower.flatten(1), box.upper.flatten(1)
    return ((upper - lower) > _FIXED_WIDTH * (1 + lower.abs() + upper.abs())).any(0)


def box_tensor(
    lower: np.ndarray,
    upper: np.ndarray,
    shape: tuple[int, ...],
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
) -> Interval:
    """The input box as ``[1, *shape]`` tensors in ``dtype`` on ``device``, rounded outwards so it contains the
    float64 box."""
    lo, hi = round_outwards(
        torch.from_numpy(np.asarray(lower, dtype=np.float64)).to(device),
        torch.from_numpy(np.asarray(upper, dtype=np.float64)).to(device),
        dtype,
    )
    return Interval(lo.view(1, *shape), hi.view(1, *shape))


class OutputSpec:
    """The disjunction of unsafe polytopes ``{y : M_d y ≤ b_d}`` of one case, stacked into rows.

    A row's *margin* is ``(M y − b)_r``: a disjunct is ruled out where one of its rows has a positive margin,
    and the property holds on a domain when every disjunct is ruled out, i.e. when
    ``value = min_d max_{r ∈ d} margin_r > 0``. A point with ``value ≤ 0`` is a counterexample. ``exact`` holds
    the rows as read from the property, in float64 (``matrix``, ``rhs``: the working dtype, rounded to nearest), for
    the float64 re-check of a proof (:mod:`~lightning_fedshard.verify.bounds.recheck`).

    Example::

        spec = OutputSpec.from_case(prop.cases[0], graph.output.shape, torch.float32)
        C = spec.rows(batch=1)                  # [S, 1, *output shape] for backward_bound
        value = spec.value(lower.T - spec.rhs)  # [B]
    """

    def __init__(
        self,
        matrix: Tensor,
        rhs: Tensor,
        disjunct: Tensor,
        output_shape: tuple[int, ...],
        exact: tuple[Tensor, Tensor] | None = None,
    ) -> None:
        self.matrix, self.rhs, self.disjunct = matrix, rhs, disjunct
        self.exact = exact if exact is not None else (matrix.double(), rhs.double())
        self.output_shape = tuple(output_shape)
        self.num_disjuncts = int(disjunct.max()) + 1 if disjunct.numel() else 0

    @classmethod
    def from_case(
        cls, case: Case, output_shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str = "cpu"
    ) -> OutputSpec:
        matrix = torch.tensor(np.vstack([d.matrix for d in case.disjuncts]), dtype=torch.float64, device=device)
        rhs = torch.tensor(np.concatenate([d.rhs for d in case.disjuncts]), dtype=torch.float64, device=device)
        disjunct = torch.cat(
            [torch.full((len(d.rhs),), i, dtype=torch.long, device=device) for i, d in enumerate(case.disjuncts)]
        )
        return cls(matrix.to(dtype), rhs.to(dtype), disjunct, output_shape, (matrix, rhs))

    def only(self, disjunct: int) -> OutputSpec:
        """The spec of one disjunct alone (its rows, renumbered as disjunct 0)."""
        rows = self.rows_of(disjunct)
        return OutputSpec(
            self.matrix[rows],
            self.rhs[rows],
            torch.zeros(len(rows), dtype=torch.long, device=rows.device),
            self.output_shape,
            (self.exact[0][rows], self.exact[1][rows]),
        )

    def rows_of(self, disjunct: int) -> Tensor:
        return (self.disjunct == disjunct).nonzero().flatten()

    @property
    def num_rows(self) -> int:
        return self.matrix.shape[0]

    def rows(self, batch: int) -> Tensor:
        """Spec rows as backward-pass coefficients ``[S, batch, *output shape]`` (a broadcast view)."""
        return self.matrix.view(self.num_rows, 1, *self.output_shape).expand(-1, batch, *self.output_shape)

    def value(self, margins: Tensor) -> Tensor:
        """``min_d max_{r ∈ d} margins[..., r]`` for ``margins [B, S]`` → ``[B]``."""
        per_disjunct = torch.full(
            (margins.shape[0], self.num_disjuncts), -torch.inf, dtype=margins.dtype, device=margins.device
        )
        index = self.disjunct.expand(margins.shape[0], -1)
        return per_disjunct.scatter_reduce(1, index, margins, "amax").min(1).values

    def point_value(self, outputs: Tensor) -> Tensor:
        """The value of concrete outputs ``[B, *output shape]``: ``≤ 0`` exactly where ``y`` is unsafe."""
        return self.value(outputs.flatten(1) @ self.matrix.T - self.rhs)
