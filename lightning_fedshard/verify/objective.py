"""The unsafe output set of one VNN-LIB case as spec rows: what every bound and every attack measures."""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from lightning_fedshard.verify.floats import round_down, round_outwards, round_up
from lightning_fedshard.verify.graph import BoundGraph
from lightning_fedshard.verify.ops import Interval, flat
from lightning_fedshard.verify.spec import Case
from lightning_fedshard.verify.spec.counterexample import REPLAY_TOLERANCE

__all__ = ["CONFIRMATIONS", "OutputSpec", "box_tensor", "first_counterexample", "free_coordinates"]

#: An input whose box is narrower than this (relative to its magnitude) is fixed: a VNN-LIB point value rounded
#: outwards to float32 leaves a box one or two ulps wide.
_FIXED_WIDTH = 1e-6


def free_coordinates(box: Interval) -> Tensor:
    """``[size]`` booleans: the flat inputs that vary in some box of the batch (wider than rounding)."""
    lower, upper = flat(box.lower, 1), flat(box.upper, 1)
    return ((upper - lower) > _FIXED_WIDTH * (1 + lower.abs() + upper.abs())).any(0)


def box_tensor(
    lower: np.ndarray,
    upper: np.ndarray,
    shape: tuple[int, ...],
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
    precision: torch.dtype | None = None,
) -> Interval:
    """The input box as ``[1, *shape]`` tensors in ``dtype`` on ``device``, rounded outwards so it contains the
    float64 box — or, for a model that takes a narrower float ``precision``, every value of that type a point of
    the box rounds to (rounding to nearest is monotone: those between the ends' own)."""
    lo, hi = (
        torch.from_numpy(np.asarray(lower, dtype=np.float64)).to(device),
        torch.from_numpy(np.asarray(upper, dtype=np.float64)).to(device),
    )
    if precision is not None and precision.itemsize < dtype.itemsize:  # what the model's input cast makes of it
        lo, hi = lo.to(precision).double(), hi.to(precision).double()
    lo, hi = round_outwards(lo, hi, dtype)
    return Interval(lo.view(1, *shape), hi.view(1, *shape))


class OutputSpec:
    """The disjunction of unsafe polytopes ``{y : M_d y ≤ b_d}`` of one case, stacked into rows.

    A row's *margin* is ``(M y − b)_r``: a disjunct is ruled out where one of its rows has a positive margin,
    and the property holds on a domain when every disjunct is ruled out, i.e. when
    ``value = min_d max_{r ∈ d} margin_r > 0``. A point with ``value ≤ 0`` is a counterexample.

    Bounds are carried for the rows ``matrix`` as rounded to the working dtype; :meth:`margins` turns their lower
    bounds into margins of the property's own rows ``exact`` (float64, as read): the right-hand sides are subtracted in
    float64, and where a coefficient is not a number of the working dtype its rounding is charged against the
    magnitude of the outputs (:meth:`bound_outputs`; until then such a row proves nothing). ``threshold`` is the
    bound a row must exceed to be proven.

    Example::

        spec = OutputSpec.from_case(prop.cases[0], graph.output.shape, torch.float32)
        C = spec.rows(batch=1)                  # [S, 1, *output shape] for backward_bound
        value = spec.value(spec.margins(lower)) # [B]
    """

    def __init__(
        self,
        matrix: Tensor,
        rhs: Tensor,
        disjunct: Tensor,
        output_shape: tuple[int, ...],
        exact: tuple[Tensor, Tensor] | None = None,
        row_slack: Tensor | None = None,
    ) -> None:
        self.matrix, self.rhs, self.disjunct = matrix, rhs, disjunct
        self.exact = exact if exact is not None else (matrix.double(), rhs.double())
        self.output_shape = tuple(output_shape)
        self.num_disjuncts = int(disjunct.max()) + 1 if disjunct.numel() else 0
        self._rounded = (self.exact[0] - matrix.double()).abs()  # [S, outputs]
        if row_slack is None:
            inexact = self._rounded.sum(1) > 0
            row_slack = torch.where(inexact, torch.inf, torch.zeros_like(self.exact[1]))
        self.row_slack = row_slack

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

    def bound_outputs(self, outputs: Interval) -> None:
        """Charge the rows' coefficient rounding against ``outputs``, bounds of the outputs over the whole case
        (every domain of it lies inside): ``|M − fl(M)|·|y|`` per row."""
        reach = flat(torch.maximum(outputs.lower.abs(), outputs.upper.abs()).double(), 1).amax(0)
        charged = (self._rounded * reach).nan_to_num(nan=0.0, posinf=torch.inf)  # an exact coefficient costs 0
        self.row_slack = charged.sum(1) * (1 + 1e-12)

    @property
    def threshold(self) -> Tensor:
        """``[S]`` in the working dtype: a row whose lower bound exceeds this has a positive margin."""
        return round_up(self.exact[1] + self.row_slack, self.matrix.dtype)

    def margins(self, lower: Tensor) -> Tensor:
        """The margins ``[B, S]`` of the property's rows from lower bounds ``lower [S, B]`` of the working rows,
        rounded down to ``lower``'s dtype (NaN stays NaN: it proves nothing)."""
        return round_down(lower.T.double() - self.exact[1] - self.row_slack, lower.dtype)

    def only(self, disjunct: int) -> OutputSpec:
        """The spec of one disjunct alone (its rows, renumbered as disjunct 0)."""
        rows = self.rows_of(disjunct)
        return OutputSpec(
            self.matrix[rows],
            self.rhs[rows],
            torch.zeros(len(rows), dtype=torch.long, device=rows.device),
            self.output_shape,
            (self.exact[0][rows], self.exact[1][rows]),
            self.row_slack[rows],
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
        return self.value(flat(outputs, 1) @ self.matrix.T - self.rhs)


#: At most this many of a batch's candidate counterexamples are run through the model (``BoundGraph.model``) to
#: confirm one: where our float32 forward pass and the model's round apart, the first few usually decide.
CONFIRMATIONS = 8


def first_counterexample(
    graph: BoundGraph, spec: OutputSpec, points: Tensor, value: Tensor | None = None
) -> Tensor | None:
    """The first of ``points [P, *input shape]`` whose outputs lie in the unsafe set, or ``None``: by ``graph``'s
    forward pass (``value``, the spec value ``[P]`` of its outputs, where already computed), and — where the graph
    knows its model (onnxruntime) — on the model too, as the VNN-COMP scorer judges it (every row of a disjunct
    within :data:`REPLAY_TOLERANCE`): a point our rounding puts in the unsafe set and the model's does not is no
    counterexample, and the search goes on."""
    if value is None:
        with torch.no_grad():
            value = spec.point_value(graph(points))
    # The first CONFIRMATIONS hits in one read of the host (a nonzero and a read of its result would be two): the
    # misses' positions are replaced by P, which sorts after every point.
    count = value.shape[0]
    positions = torch.arange(count, device=value.device)
    first = torch.where(value <= 0, positions, count).topk(min(CONFIRMATIONS, count), largest=False).values
    hits = [index for index in first.tolist() if index < count]
    if graph.model is None:
        return points[hits[0]].detach().clone() if hits else None
    matrix, rhs = (t.cpu().numpy() for t in spec.exact)
    disjuncts = spec.disjunct.cpu().numpy()
    for index in hits:
        x = points[index].detach().double().flatten().cpu().numpy()
        margins = matrix @ graph.model(x) - rhs
        if any(bool(np.all(margins[disjuncts == d] <= REPLAY_TOLERANCE)) for d in range(spec.num_disjuncts)):
            return points[index].detach().clone()
    return None
