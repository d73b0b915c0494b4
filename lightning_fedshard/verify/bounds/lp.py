"""Pre-activation bounds from linear and mixed-integer programs over the network, solved with HiGHS.

CROWN-style bounds relax every ReLU separately along one backward pass; the LP over the *triangle relaxation* of all
ReLUs before a neuron is the tightest bound those relaxations allow, and the MILP that keeps each unstable ReLU
exact (a binary phase indicator with big-M rows) is the neuron's true range. :class:`NetworkProgram` writes the
network up to a node as such a program over given intermediate bounds: one column per input, per pre-activation
neuron (bounded by its current interval) and per unstable ReLU output; one equality row per pre-activation; the
triangle rows (``a ≥ 0``, ``a ≥ z``, ``(u − l)·a − u·z ≤ −u·l``) or the big-M rows (``a ≤ u·δ``,
``a ≤ z − l·(1 − δ)``) per unstable neuron. Chains of affine operators (Reshape, Gemm, element-wise maps, sums)
are composed into the rows, so only the nodes a ReLU reads or writes get columns.

:func:`refine_bounds` tightens the unstable neurons of chosen pre-activation layers, in order (each refined layer
then constrains the next): minimisations first, then maximisations (the sweep that keeps HiGHS's basis useful), each
solve capped in time, optionally spread over worker processes.

A bound is never the solver's objective value: HiGHS accepts a basis whose reduced costs are off by up to its dual
feasibility tolerance (1e-7), which over a column range of 10^6 moves the objective by 0.1, far past any relative
margin. Each bound is instead derived from the solver's row duals ``y`` by weak duality (Neumaier and Shcherbina,
"Safe bounds in linear and mixed-integer linear programming", Math. Program. 99, 2004): for every feasible ``x``,
``c·x = y·(A x) + r·x`` with ``r = c − Aᵀy``, so ``min c·x ≥ Σ_i min(y_i L_i, y_i U_i) + Σ_j min(r_j l_j, r_j u_j)``
over row bounds ``[L, U]`` and column bounds ``[l, u]`` (see :func:`safe_minimum`). That holds for *any* ``y``
once its signs are clipped to the rows' finite sides, so the solver's accuracy decides only how tight the bound is;
``r`` carries an explicit float64 error bound and the sums are rounded downwards. The program's own rows are
written so that they hold on the ReLU graph exactly (the triangle's right-hand side is rounded up). Not covered:
the float64 rounding where a chain of affine operators is composed into one row (none for Linear → ReLU nets,
whose rows are the float32 weights themselves).

A MILP's dual bound (``mip_dual_bound``) comes from a search over many LPs, cuts and presolve reductions, all with
the same tolerances, and HiGHS gives no certificate for it: no safe bound can be derived from it. A program with
binaries (``integer``) is instead searched here (:meth:`NetworkProgram.solve`): best-first branch-and-bound over
its binaries, every node an LP (the binaries fixed so far, the others in ``[0, 1]``) bounded safely as above, a
node whose LP is infeasible closed only by a Farkas certificate checked the same way (``safe_minimum`` of the zero
objective above 0 for the solver's dual ray), a node whose LP solution is integral closed with its bound. The
bound is the least over the open nodes — the relaxation's at least, the exact MILP minimum once the search ends —
and the search stops at the time limit or once the neuron's sign is decided. (The big-M rows relax to exactly the
triangle: without the search a MILP bound would be the LP's.) Each bound is intersected with the old one: a solver
failure or a timeout can only leave a bound as it was.

Example::

    bounds, stats = refine_bounds(graph, box, alpha.bounds, layers=["fc3", "fc4"], integer="all")
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import heapq
import itertools
import math
import multiprocessing
import os
import sys
import time
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from fractions import Fraction

import highspy
import numpy as np
import torch
from torch import Tensor

from lightning_fedshard.verify.budget import seconds_left
from lightning_fedshard.verify.floats import round_outwards
from lightning_fedshard.verify.graph import BoundGraph
from lightning_fedshard.verify.ops import Add, ElementwiseAffine, Interval, LeftLinear, Linear, LinearOp, ReLU, Reshape

__all__ = ["Constraints", "NetworkProgram", "RefineStats", "refine_bounds", "safe_minimum", "supports_programs"]

#: The unit roundoff of float64.
_UNIT = 2.0**-53
#: A binary's LP value this close to 0 or 1 counts as integral (the node is not split on it).
_INTEGRAL = 1e-6


def _triangle_side(width: float, l: float, u: float) -> float:
    """The right-hand side of the triangle row ``width·a − u·z ≤ side`` (``width`` is ``u − l`` rounded), rounded
    up so that the row holds on the ReLU graph: ``width·relu(z) − u·z`` is convex in ``z``, so its largest value over
    ``[l, u]`` is at an end, ``−u·l`` or ``(width − u)·u``, evaluated exactly in rationals."""
    exact = max(-Fraction(u) * Fraction(l), (Fraction(width) - Fraction(u)) * Fraction(u))
    side = float(exact)
    return side if Fraction(side) >= exact else math.nextafter(side, math.inf)


def _quiet_highs() -> highspy.Highs:
    """A solver that prints nothing (the first one of a process prints a banner before options can be set)."""
    sys.stdout.flush()
    saved = os.dup(1)
    try:
        with open(os.devnull, "w") as devnull:
            os.dup2(devnull.fileno(), 1)
            h = highspy.Highs()
    finally:
        os.dup2(saved, 1)
        os.close(saved)
    h.setOptionValue("output_flag", False)
    return h


@dataclass(frozen=True)
class Constraints:
    """``L ≤ A x ≤ U`` and ``l ≤ x ≤ u`` in float64, ``A`` as coordinates ``(row, column, value)``: the data
    :func:`safe_minimum` reads (exactly what the solver was given)."""

    row_lower: np.ndarray
    row_upper: np.ndarray
    row: np.ndarray
    column: np.ndarray
    value: np.ndarray
    column_lower: np.ndarray
    column_upper: np.ndarray

    @classmethod
    def from_rows(
        cls, rows: Sequence[tuple[float, float, np.ndarray, np.ndarray]], lower: np.ndarray, upper: np.ndarray
    ) -> Constraints:
        """From rows ``(L_i, U_i, column indices, coefficients)`` (±``kHighsInf`` for a missing side)."""
        sizes = [index.size for _, _, index, _ in rows]
        infinite = highspy.kHighsInf
        row_lower = np.array([-np.inf if lo <= -infinite else lo for lo, _, _, _ in rows], dtype=np.float64)
        row_upper = np.array([np.inf if hi >= infinite else hi for _, hi, _, _ in rows], dtype=np.float64)
        empty = np.zeros(0)
        return cls(
            row_lower,
            row_upper,
            np.repeat(np.arange(len(rows)), sizes),
            np.concatenate([index for _, _, index, _ in rows] or [empty]).astype(np.int64),
            np.concatenate([value for _, _, _, value in rows] or [empty]).astype(np.float64),
            np.asarray(lower, dtype=np.float64),
            np.asarray(upper, dtype=np.float64),
        )


def safe_minimum(cost: np.ndarray, constraints: Constraints, duals: np.ndarray) -> float:
    """A lower bound of ``min cost·x`` over ``constraints`` that holds in exact arithmetic for any row multipliers
    ``duals`` (a solver's row duals make it tight): weak duality with the residual ``r = cost − Aᵀy``,
    ``min cost·x ≥ Σ_i min(y_i L_i, y_i U_i) + Σ_j min over r_j, x_j of r_j x_j`` (Neumaier–Shcherbina).

    A multiplier of a row without the side its sign needs (``y_i > 0`` and ``L_i = −∞``, or ``y_i < 0`` and
    ``U_i = +∞``) is set to 0 first: that is the cone where the bound is valid. ``r`` is computed in float64 with
    an explicit bound on its rounding error (``γ_{k+2}`` times the sum of the absolute terms, ``k`` the column's
    non-zeros, doubled), and ``r_j`` ranges over that interval; the final sum is exact (``math.fsum``) and moved
    down by twice the unit roundoff times the terms' magnitude, then one more ulp. ``−inf`` where a column the
    residual pushes towards is unbounded."""
    c = constraints
    cost, duals = np.asarray(cost, dtype=np.float64), np.asarray(duals, dtype=np.float64)
    if cost.shape != c.column_lower.shape or duals.shape != c.row_lower.shape:
        raise ValueError(
            f"cost has {cost.shape} entries and duals {duals.shape} for {c.column_lower.size} columns and "
            f"{c.row_lower.size} rows"
        )
    usable = ((duals > 0) & np.isfinite(c.row_lower)) | ((duals < 0) & np.isfinite(c.row_upper))
    y = np.where(usable, duals, 0.0)
    products = c.value * y[c.row]
    n = cost.size
    residual = cost - np.bincount(c.column, products, minlength=n)
    count = np.bincount(c.column, minlength=n) + 2
    magnitude = np.abs(cost) + np.bincount(c.column, np.abs(products), minlength=n)
    error = 2 * count * _UNIT / (1 - count * _UNIT) * magnitude + count * np.finfo(np.float64).tiny
    low, high = residual - error, residual + error
    with np.errstate(invalid="ignore"):  # 0·inf: a residual end exactly 0 contributes 0 there
        corners = np.stack([low * c.column_lower, low * c.column_upper, high * c.column_lower, high * c.column_upper])
    column_terms = np.nan_to_num(corners, nan=0.0, posinf=np.inf, neginf=-np.inf).min(0)
    row_terms = np.where(y > 0, y * np.where(y > 0, c.row_lower, 0.0), y * np.where(y < 0, c.row_upper, 0.0))
    terms = np.concatenate([row_terms, column_terms])
    if not np.isfinite(terms).all():
        return -math.inf
    total = math.fsum(terms)
    size = math.fsum(np.abs(terms)) + abs(total)
    return math.nextafter(total - 2 * _UNIT * size, -math.inf)


#: The operators a program is written for: those of fully connected networks. (Convolutions and pooling are affine
#: too, but their composed dense matrices grow with the image: a program for them would not fit in memory.)
_PROGRAM_OPS = (Linear, LeftLinear, ElementwiseAffine, Reshape, Add, ReLU)


def supports_programs(graph: BoundGraph) -> bool:
    """Whether ``graph`` is a fully connected ReLU network :class:`NetworkProgram` can write out."""
    return all(isinstance(node.op, _PROGRAM_OPS) for node in graph.nodes[1:])


def _device(op: LinearOp) -> torch.device:
    return next((t.device for t in vars(op).values() if isinstance(t, Tensor)), torch.device("cpu"))


def _flat(rounding: Tensor | None, shape: tuple[int, ...]) -> np.ndarray | float:
    """A rounding bound broadcast to ``shape`` as a flat float64 array (0 for an exact op)."""
    if rounding is None:
        return 0.0
    return rounding.detach().double().expand(1, *shape).reshape(-1).cpu().numpy()


@dataclass
class _Affine:
    """A node's value as ``Σ_b blocks[b] @ columns(b) + constant ± error``: ``blocks`` maps a column offset to a
    dense ``[size, width]`` matrix over the consecutive columns starting there; ``error`` bounds, per element, how far
    the model's value (rounded by every op of the chain, :meth:`BoundOp.rounding`) is from the expression."""

    blocks: dict[int, np.ndarray]
    constant: np.ndarray
    error: np.ndarray

    def through(
        self, op: LinearOp, in_shape: tuple[int, ...], out_shape: tuple[int, ...], interval: Interval
    ) -> _Affine:
        """This expression mapped by ``op`` (whose input lies in ``interval``), composed in float64 (the weights are
        exact in it): the error so far goes through ``|L|``, and the op adds its own rounding."""
        rounding = op.rounding([interval.to(_device(op))])
        op = copy.copy(op).to(torch.float64, "cpu")  # the programs are written on the CPU, for HiGHS

        def apply(matrix: np.ndarray) -> np.ndarray:  # [in, width] -> [out, width]: op.linear on each column
            columns = torch.from_numpy(np.ascontiguousarray(matrix.T)).reshape(-1, *in_shape)
            mapped = op.linear(columns).expand(columns.shape[0], *out_shape)  # a broadcast constant widens
            return mapped.reshape(matrix.shape[1], -1).numpy().T

        blocks = {start: apply(matrix) for start, matrix in self.blocks.items()}
        constant = op.forward(torch.from_numpy(self.constant).reshape(1, *in_shape)).reshape(-1).numpy()
        carried = op.abs_linear(torch.from_numpy(self.error).reshape(1, *in_shape)).expand(1, *out_shape)
        error = carried.reshape(-1).numpy() + _flat(rounding, out_shape)
        return _Affine(blocks, constant, error * (1 + 1e-12))

    def plus(self, other: _Affine, sign: float, rounding: np.ndarray | float) -> _Affine:
        """This expression plus ``sign`` times ``other``, and the model's ``rounding`` of the sum."""
        blocks = dict(self.blocks)
        for start, matrix in other.blocks.items():
            blocks[start] = blocks[start] + sign * matrix if start in blocks else sign * matrix
        error = (self.error + other.error + rounding) * (1 + 1e-12)
        return _Affine(blocks, self.constant + sign * other.constant, error)

    def row(self, index: int) -> tuple[np.ndarray, np.ndarray, float]:
        """Column indices, coefficients (non-zero only) and constant of element ``index`` (its error apart)."""
        indices, values = [], []
        for start, matrix in self.blocks.items():
            coefficients = matrix[index]
            nonzero = np.flatnonzero(coefficients)
            indices.append(start + nonzero)
            values.append(coefficients[nonzero])
        return np.concatenate(indices).astype(np.int32), np.concatenate(values), float(self.constant[index])


@dataclass
class NetworkProgram:
    """The network up to node ``target`` over ``box``, with pre-activation ``bounds``, as a HiGHS program
    (columns, rows, integrality; see the module docs) and the affine expression of ``target`` over its columns.

    Example::

        program = NetworkProgram.build(graph, box, bounds, "fc3", integer=False)
        highs = program.highs()
        low = program.minimise(highs, neuron=7)
    """

    lower: np.ndarray
    upper: np.ndarray
    integrality: np.ndarray
    rows: list[tuple[float, float, np.ndarray, np.ndarray]] = field(repr=False)
    target: _Affine = field(repr=False)

    @classmethod
    def build(
        cls, graph: BoundGraph, box: Interval, bounds: dict[str, Interval], target: str, integer: Collection[str] = ()
    ) -> NetworkProgram:
        """``box`` and ``bounds`` for one box (batch 1); the unstable neurons of the ReLU nodes named in ``integer``
        are exact (a binary each), the others relaxed."""
        lower = [box.lower.double().flatten().numpy()]
        upper = [box.upper.double().flatten().numpy()]
        integrality: list[np.ndarray] = [np.zeros(lower[0].size, dtype=bool)]
        rows: list[tuple[float, float, np.ndarray, np.ndarray]] = []
        width = lower[0].size

        def new_columns(lo: np.ndarray, hi: np.ndarray, binary: bool = False) -> int:
            nonlocal width
            start = width
            lower.append(lo)
            upper.append(hi)
            integrality.append(np.full(lo.size, binary))
            width += lo.size
            return start

        affine = {graph.input.name: _Affine({0: np.eye(width)}, np.zeros(width), np.zeros(width))}
        intervals = graph.complete_bounds(box, bounds, target)
        for node in graph.ancestors(target)[1:]:
            sources = [affine[name] for name in node.inputs]
            if isinstance(node.op, LinearOp):
                in_shape = graph.by_name[node.inputs[0]].shape
                affine[node.name] = sources[0].through(node.op, in_shape, node.shape, intervals[node.inputs[0]])
            elif isinstance(node.op, Add):
                rounding = node.op.rounding([intervals[name] for name in node.inputs])
                sign = -1.0 if node.op.subtract else 1.0
                affine[node.name] = sources[0].plus(sources[1], sign, _flat(rounding, node.shape))
            elif isinstance(node.op, ReLU):
                pre = bounds[node.inputs[0]]
                l, u = pre.lower.double().flatten().numpy(), pre.upper.double().flatten().numpy()
                affine[node.name] = cls._relu(sources[0], l, u, node.name in integer, rows, new_columns)
            else:
                raise TypeError(f"{type(node.op).__name__} at {node.name!r} cannot be written into a program")
        return cls(np.concatenate(lower), np.concatenate(upper), np.concatenate(integrality), rows, affine[target])

    @staticmethod
    def _relu(pre: _Affine, l: np.ndarray, u: np.ndarray, integer: bool, rows: list, new_columns) -> _Affine:
        """Columns ``z`` for the pre-activation (within its bounds) and ``a`` for the unstable outputs; the ReLU's
        value as an affine expression over them (``z`` where active, 0 where inactive, ``a`` where unstable)."""
        n = l.size
        z = new_columns(l.copy(), u.copy())
        for j in range(n):  # z_j − expr_j = constant_j, up to the model's rounding
            index, value, constant = pre.row(j)
            low, high = (
                math.nextafter(constant - pre.error[j], -math.inf),
                math.nextafter(constant + pre.error[j], math.inf),
            )
            rows.append((low, high, np.append(index, z + j).astype(np.int32), np.append(-value, 1.0)))
        unstable = np.flatnonzero((l < 0) & (u > 0))
        active = np.flatnonzero(l >= 0)
        out = np.zeros((n, n))
        out[active, active] = 1.0
        blocks = {z: out}
        if unstable.size:
            lu, uu = l[unstable], u[unstable]
            a = new_columns(np.zeros(unstable.size), uu.copy())
            delta = new_columns(np.zeros(unstable.size), np.ones(unstable.size), binary=True) if integer else None
            for k, j in enumerate(unstable):
                zj, ak = np.int32(z + j), np.int32(a + k)
                rows.append((0.0, highspy.kHighsInf, np.array([ak, zj]), np.array([1.0, -1.0])))  # a ≥ z
                if delta is None:  # (u − l)·a − u·z ≤ −u·l
                    width = uu[k] - lu[k]
                    rows.append(
                        (
                            -highspy.kHighsInf,
                            _triangle_side(width, lu[k], uu[k]),
                            np.array([ak, zj]),
                            np.array([width, -uu[k]]),
                        )
                    )
                else:
                    dk = np.int32(delta + k)
                    rows.append((-highspy.kHighsInf, 0.0, np.array([ak, dk]), np.array([1.0, -uu[k]])))  # a ≤ u·δ
                    rows.append(  # a − z − l·δ ≤ −l
                        (-highspy.kHighsInf, -lu[k], np.array([ak, zj, dk]), np.array([1.0, -1.0, -lu[k]]))
                    )
            selector = np.zeros((n, unstable.size))
            selector[unstable, np.arange(unstable.size)] = 1.0
            blocks[a] = selector
        return _Affine(blocks, np.zeros(n), np.zeros(n))  # the ReLU is exact; z bounds the model's value

    @functools.cached_property
    def constraints(self) -> Constraints:
        """The rows and column bounds as :func:`safe_minimum` reads them."""
        return Constraints.from_rows(self.rows, self.lower, self.upper)

    def highs(self, threads: int = 1) -> highspy.Highs:
        """A fresh solver holding this program's LP relaxation (the binaries in ``[0, 1]``: :meth:`solve` searches
        over them); HiGHS objects cannot be pickled: build one per process."""
        h = _quiet_highs()
        h.setOptionValue("threads", threads)
        h.addVars(self.lower.size, self.lower, self.upper)
        for lo, hi, index, value in self.rows:
            h.addRow(lo, hi, index.size, index, value)
        return h

    def solve(self, h: highspy.Highs, neuron: int, sense: int, time_limit: float) -> float | None:
        """A bound of ``target[neuron]`` (``sense`` −1: lower, +1: upper) that holds in exact arithmetic, derived
        from the row duals HiGHS finds within ``time_limit`` seconds (:func:`safe_minimum`; with binaries, the
        search of the module docs), or ``None`` if it gives none (no dual solution, or an unbounded one)."""
        if sense not in (-1, 1):
            raise ValueError(f"sense must be -1 (lower bound) or +1 (upper bound), got {sense!r}")
        index, value, constant = self.target.row(neuron)
        cost = np.zeros(self.lower.size)
        cost[index] = -sense * value  # always a minimisation: an upper bound is −min(−target)
        h.changeColsCost(cost.size, np.arange(cost.size, dtype=np.int32), cost)
        h.changeObjectiveSense(highspy.ObjSense.kMinimize)
        deadline = time.monotonic() + time_limit
        if self.integrality.any():
            # The sign is decided once min(cost·x) > sense·constant (a lower bound above 0, an upper one below).
            minimum = self._search(h, cost, deadline, sense * constant)
        else:
            minimum = self._node(h, cost, self.lower, self.upper, deadline)[0]
        if not math.isfinite(minimum):
            return None
        # The model's value of the target is within its error of the expression the program minimised.
        return math.nextafter(constant - sense * minimum + sense * float(self.target.error[neuron]), sense * math.inf)

    def _node(
        self, h: highspy.Highs, cost: np.ndarray, lower: np.ndarray, upper: np.ndarray, deadline: float
    ) -> tuple[float, int | None]:
        """The safe lower bound of ``min cost·x`` with the columns in ``[lower, upper]`` (+inf where a Farkas
        certificate shows the LP infeasible, −inf where there is no bound), and the binary column whose LP value is
        farthest from integral (``None``: all integral)."""
        binaries = np.flatnonzero(self.integrality).astype(np.int32)
        if binaries.size:
            h.changeColsBounds(binaries.size, binaries, lower[binaries], upper[binaries])
        # HiGHS's time limit is on the solver's run time summed over all its runs, not on this run's.
        h.setOptionValue("time_limit", h.getRunTime() + max(deadline - time.monotonic(), 1e-3))
        h.run()
        constraints = dataclasses.replace(self.constraints, column_lower=lower, column_upper=upper)
        if h.getModelStatus() == highspy.HighsModelStatus.kInfeasible:
            _, has_ray, ray = h.getDualRay()
            if has_ray:  # any multipliers certify, so either sign of the ray may
                zero = np.zeros(cost.size)
                ray = np.asarray(ray)
                if max(safe_minimum(zero, constraints, ray), safe_minimum(zero, constraints, -ray)) > 0:
                    return math.inf, None
        solution = h.getSolution()
        if not solution.dual_valid:
            return -math.inf, None
        bound = safe_minimum(cost, constraints, np.asarray(solution.row_dual))
        if not binaries.size or not solution.value_valid:
            return bound, None
        values = np.asarray(solution.col_value)[binaries]
        distance = np.abs(values - np.round(values))
        worst = int(distance.argmax())
        return bound, (int(binaries[worst]) if distance[worst] > _INTEGRAL else None)

    def _search(self, h: highspy.Highs, cost: np.ndarray, deadline: float, decided: float) -> float:
        """A safe lower bound of ``min cost·x`` with the binaries integral: best-first branch-and-bound over them
        (see the module docs) until ``deadline`` or until the bound exceeds ``decided``; the solver's binaries are
        left in ``[0, 1]`` afterwards."""
        order = itertools.count()
        bound, branch = self._node(h, cost, self.lower, self.upper, deadline)
        heap = [(bound, next(order), branch, self.lower, self.upper)]
        try:
            while heap and time.monotonic() < deadline:
                bound, _, branch, lower, upper = heap[0]
                if branch is None or bound > decided or not math.isfinite(bound):
                    break  # integral (its bound is the minimum), decided, infeasible everywhere, or unboundable
                heapq.heappop(heap)
                for side in (0.0, 1.0):
                    lo, hi = lower.copy(), upper.copy()
                    lo[branch] = hi[branch] = side
                    child, child_branch = self._node(h, cost, lo, hi, deadline)
                    heapq.heappush(heap, (max(child, bound), next(order), child_branch, lo, hi))
        finally:
            binaries = np.flatnonzero(self.integrality).astype(np.int32)
            h.changeColsBounds(binaries.size, binaries, self.lower[binaries], self.upper[binaries])
        return heap[0][0] if heap else math.inf


@dataclass
class RefineStats:
    """What :func:`refine_bounds` did: solves run and those that tightened a bound, neurons made stable, seconds."""

    solves: int = 0
    tightened: int = 0
    stabilised: int = 0
    seconds: float = 0.0
    layers: list[str] = field(default_factory=list)


def _solve_many(
    program: NetworkProgram, jobs: Sequence[tuple[int, int]], time_limit: float, deadline: float
) -> list[float | None]:
    """Bounds for ``(neuron, sense)`` jobs in order on one solver; the jobs past the deadline are not run (and
    left out of the list)."""
    h = program.highs()
    results: list[float | None] = []
    for neuron, sense in jobs:
        left = deadline - time.monotonic()
        if left <= 0:
            break
        results.append(program.solve(h, neuron, sense, min(time_limit, left)))
    return results


#: What the fork workers of one :func:`_solve_parallel` call read (a HiGHS model cannot be pickled; each worker
#: builds its own from the program it inherits).
_SHARED: dict = {}


def _worker(args: tuple[int, float, float]) -> list[float | None]:
    part, time_limit, deadline = args
    return _solve_many(_SHARED["program"], _SHARED["parts"][part], time_limit, deadline)


def _solve_parallel(
    program: NetworkProgram, jobs: list[tuple[int, int]], time_limit: float, deadline: float, workers: int
) -> list[tuple[tuple[int, int], float | None]]:
    """The jobs that were run, with their bounds (``None``: the solver gave none)."""
    if workers <= 1 or len(jobs) < 2 * workers or os.name != "posix":
        return list(zip(jobs, _solve_many(program, jobs, time_limit, deadline), strict=False))
    # Worker w takes every w-th job: each part keeps the list's order (minimisations, then maximisations).
    parts = [jobs[w::workers] for w in range(workers)]
    _SHARED.update(program=program, parts=parts)
    try:
        with multiprocessing.get_context("fork").Pool(workers) as pool:
            done = pool.map(_worker, [(w, time_limit, deadline) for w in range(workers)])
    finally:
        _SHARED.clear()
    return [pair for part, values in zip(parts, done, strict=True) for pair in zip(part, values, strict=False)]


def refine_bounds(
    graph: BoundGraph,
    box: Interval,
    bounds: dict[str, Interval],
    layers: Sequence[str],
    integer: str = "none",
    time_limit: float = 10.0,
    workers: int = 1,
    order: dict[str, Tensor] | None = None,
    layer_budget: float = float("inf"),
) -> tuple[dict[str, Interval], RefineStats]:
    """``bounds`` (batch 1) with the unstable neurons of the pre-activation nodes ``layers`` tightened, in the order
    given, each layer's program built over the bounds refined before it: an LP (``integer="none"``), or a MILP with
    binaries for the ReLU layer just before it (``"last"``) or for every ReLU before it (``"all"``).

    ``time_limit`` caps one solve and ``layer_budget`` the seconds of one layer; at the run's deadline
    (:func:`~lightning_fedshard.verify.budget.seconds_left`) the remaining solves are skipped. ``order[layer]``, where given,
    ranks that layer's neurons (higher first): with a deadline the best-ranked ones are refined first. The side of
    a neuron nearer to zero is solved first, and the other skipped once the neuron is found stable (α,β-CROWN does
    the same).

    The programs are written and solved on the CPU (HiGHS); bounds on another device are copied there once and the
    refined ones returned on it.
    """
    device = box.lower.device
    box = box.to("cpu")
    bounds = {name: interval.to("cpu") for name, interval in bounds.items()}
    order = None if order is None else {name: rank.cpu() for name, rank in order.items()}
    start = time.monotonic()
    deadline = time.monotonic() + seconds_left()  # the solver processes are told the time, not the budget
    stats = RefineStats()
    for layer in layers:
        if time.monotonic() >= deadline:
            break
        until = min(deadline, time.monotonic() + layer_budget)
        current = bounds[layer]
        low, high = current.lower.flatten().double().clone(), current.upper.flatten().double().clone()
        unstable = ((low < 0) & (high > 0)).nonzero().flatten()
        if not unstable.numel():
            continue
        if order is not None and layer in order:
            unstable = unstable[order[layer].flatten()[unstable].argsort(descending=True)]
        relus = [relu.name for relu in graph.relus if relu.name in {n.name for n in graph.ancestors(layer)}]
        exact = {"none": [], "last": relus[-1:], "all": relus}[integer]
        program = NetworkProgram.build(graph, box, bounds, layer, exact)
        # First the sides nearer to zero (they decide whether a neuron is stable), as same-sense sweeps.
        near = [(int(j), -1 if -low[j] < high[j] else 1) for j in unstable]
        first = [job for job in near if job[1] < 0] + [job for job in near if job[1] > 0]
        second = []
        for (j, sense), value in _solve_parallel(program, first, time_limit, until, workers):
            stats.solves += 1
            if value is not None:
                _tighten(low, high, j, sense, value, stats)
            if low[j] < 0 < high[j]:
                second.append((j, -sense))
        second = [job for job in second if job[1] < 0] + [job for job in second if job[1] > 0]
        for (j, sense), value in _solve_parallel(program, second, time_limit, until, workers):
            stats.solves += 1
            if value is not None:
                _tighten(low, high, j, sense, value, stats)
        stats.stabilised += int(((low >= 0) | (high <= 0))[unstable].sum())
        low, high = round_outwards(low, high, current.lower.dtype)
        bounds[layer] = Interval(low.view(current.lower.shape), high.view(current.lower.shape))
        stats.layers.append(layer)
    stats.seconds = time.monotonic() - start
    return {name: interval.to(device) for name, interval in bounds.items()}, stats


def _tighten(low: Tensor, high: Tensor, j: int, sense: int, value: float, stats: RefineStats) -> None:
    if sense < 0 and value > low[j]:
        low[j] = min(value, float(high[j]))
        stats.tightened += 1
    elif sense > 0 and value < high[j]:
        high[j] = max(value, float(low[j]))
        stats.tightened += 1
