"""The contract every bound operator follows, and the interval type they exchange.

Shapes: a node's tensors are ``[B, *shape]`` (B = points, boxes or BaB domains; ``shape`` is the ONNX shape
without its leading batch dimension). Linear bounds are carried backwards as coefficient tensors
``A: [S, B, *shape]`` (S = rows of the specification being bounded), always for a *lower* bound: an upper
bound of ``c·y`` is minus the lower bound of ``-c·y``, so one propagation rule per operator serves both. Rows that
are positions of a convolutional node may instead travel as :class:`~lightning_fedshard.verify.ops.patches.Patches`
(their local windows) through the ops that declare ``accepts_patches``.

Every bound holds in floating point (:mod:`~lightning_fedshard.verify.floats`): an op's intervals contain every
value the *model* computes (onnxruntime, rounding included) for inputs in its input intervals, and its backward step
gives coefficients and a constant whose linear bound holds exactly for those values, whatever the rounding of our
own float32 arithmetic. Each op bounds both roundings per output element (:meth:`BoundOp.rounding`).
"""

from __future__ import annotations

import math
import weakref
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from lightning_fedshard.verify.floats import (
    FLOAT64_EPSILON,
    gamma,
    overflow,
    round_down,
    round_up,
    smallest_normal,
    unit_roundoff,
)
from lightning_fedshard.verify.ops.chunks import row_chunks
from lightning_fedshard.verify.ops.patches import Patches

__all__ = [
    "FLOAT32_SUMS",
    "BoundOp",
    "Interval",
    "LinearOp",
    "contract",
    "contract_abs",
    "contract_error",
    "enclose",
    "flat",
]


def flat(t: Tensor, start: int) -> Tensor:
    """``t`` with its dimensions from ``start`` on as one: ``x [B, *shape]`` → ``[B, size]``, ``A [S, B, *shape]`` →
    ``[S, B, size]``, a rank-0 node's ``[B]`` → ``[B, 1]`` (``Tensor.flatten`` rejects that one)."""
    return t.reshape(*t.shape[:start], math.prod(t.shape[start:]))


@dataclass(frozen=True)
class Interval:
    """Element-wise bounds ``lower <= v <= upper`` of a node's values, each ``[B, *shape]``.

    Example::

        box = Interval(torch.zeros(1, 784), torch.full((1, 784), 0.03))
        box.center, box.magnitude
    """

    lower: Tensor
    upper: Tensor

    @property
    def center(self) -> Tensor:
        """A point of the interval near its middle (rounded: not an exact centre, see :meth:`radius_around`)."""
        return (self.upper + self.lower) / 2

    def radius_around(self, center: Tensor) -> Tensor:
        """The smallest radius, rounded up, with ``[center − r, center + r] ⊇ [lower, upper]`` (the differences
        of two float32 numbers are exact in float64)."""
        lower, upper, middle = self.lower.double(), self.upper.double(), center.double()
        return round_up(torch.maximum(upper - middle, middle - lower), self.lower.dtype)

    @property
    def magnitude(self) -> Tensor:
        """``max(|lower|, |upper|)``: a bound on ``|v|``, exact in the dtype."""
        return torch.maximum(self.lower.abs(), self.upper.abs())

    def to(self, device: torch.device | str) -> Interval:
        """These bounds on ``device`` (tensors already there are not copied)."""
        return Interval(self.lower.to(device), self.upper.to(device))


#: Nodes of at most this many elements have the products of :func:`contract` summed in their dtype (error
#: ``γ_{65} = 3.9e-6`` of the terms' magnitudes in float32, and 2-4x faster); larger ones in float64. At 256 the
#: charge compounded through six layers of 256 ReLUs to CROWN bounds 3 % looser (mnist 256x6, ε = 0.05).
FLOAT32_SUMS = 64


def contract_error(size: int, dtype: torch.dtype) -> float:
    """How far :func:`contract` over a node of ``size`` elements can be from ``Σ A·value``, relative to ``Σ
    |A·value|``: the op that forms the term charges this times its constant's magnitude."""
    return gamma(size + 1, dtype) if size <= FLOAT32_SUMS else unit_roundoff(dtype) + FLOAT64_EPSILON


def _joined(parts: list[Tensor]) -> Tensor:
    """The row chunks' results as one tensor (the one part itself where there was one chunk: no copy)."""
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def contract(A: Tensor | Patches, value: Tensor) -> Tensor:
    """``Σ A·value`` over the node dimensions, as float64: ``A [S, B, *shape]`` (or :class:`Patches`) with ``value``
    broadcastable to ``[B, *shape]`` (or to ``shape``), or one per row ``[S, B, *shape]`` (the intercepts of per-row
    relaxations), gives ``[S, B]``. Within :func:`contract_error` of the exact sum: small nodes sum in ``A``'s dtype,
    large ones in float64."""
    if isinstance(A, Patches):
        return A.contract(value, exact=math.prod(A.node_shape) > FLOAT32_SUMS)
    size = math.prod(A.shape[2:])
    dtype = torch.float64 if size > FLOAT32_SUMS else None
    per_row = value.dim() == A.dim() and value.shape[0] > 1
    row_shape = torch.broadcast_shapes(A.shape[1:], value.shape[1:] if per_row else value.shape)
    parts = [
        flat(A[rows] * (value[rows] if per_row else value), 2).sum(-1, dtype=dtype)
        for rows in row_chunks(A.shape[0], 8 * math.prod(row_shape))
    ]
    return _joined(parts).double()


def contract_abs(A: Tensor | Patches, weights: Tensor) -> Tensor:
    """An upper bound (float64 ``[S, B]``) of ``Σ |A|·weights`` for non-negative ``weights`` broadcastable to
    ``[B, *shape]``: a float32 matrix product, whose terms are all non-negative, so that its result is within
    ``γ_N`` below the exact sum, and is scaled up by that. Differentiable (the concretisation's ``Σ |A|·radius``
    is a term α-CROWN optimises)."""
    if isinstance(A, Patches):
        total, terms = A.contract(weights, magnitudes=True), math.prod(A.values.shape[2:])
    else:
        S, B, N = *A.shape[:2], math.prod(A.shape[2:])
        # An infinite weight (an unbounded input) must make the bound infinite, not 0·inf = NaN where A is 0.
        weights = weights.to(A.dtype).nan_to_num(torch.finfo(A.dtype).max)
        weights = weights.expand(B, *A.shape[2:]).reshape(B, N)

        def part(rows: slice) -> Tensor:
            magnitudes = A[rows].abs().reshape(-1, B, N)
            if B == 1:  # one box (a root pass over many rows): a matrix-vector product
                return (magnitudes.reshape(-1, N) @ weights.reshape(N)).unsqueeze(1)
            # many boxes or domains: a product and a sum (measured 1.5-4x faster than batched products)
            return (magnitudes * weights).sum(-1)

        total = _joined([part(rows) for rows in row_chunks(S, 2 * B * N * A.element_size())]).double()
        terms = N
    return total * (1 + 2 * gamma(terms + 1, A.dtype if isinstance(A, Tensor) else A.values.dtype))


def enclose(
    lower: Tensor, upper: Tensor, error: Tensor | float, dtype: torch.dtype, precision: torch.dtype | None = None
) -> Interval:
    """``[lower − error, upper + error]`` (float64 arithmetic, then rounded outwards to ``dtype``): an interval
    computed with a bounded ``error``. An end reaching past the overflow threshold of the model's ``precision`` is
    ``±inf``: the model's value there may be an infinity."""
    low, high = lower.double() - error, upper.double() + error
    # ∞ − ∞ (an unbounded input through an affine map) bounds nothing: that end is unbounded.
    low, high = torch.where(low.isnan(), -torch.inf, low), torch.where(high.isnan(), torch.inf, high)
    if precision is not None and precision.itemsize < dtype.itemsize:
        limit = overflow(precision)
        low = torch.where(low <= -limit, -torch.inf, low)
        high = torch.where(high >= limit, torch.inf, high)
    return Interval(round_down(low, dtype), round_up(high, dtype))


class BoundOp(ABC):
    """One operator of a verification graph: its forward function, interval bounds (IBP) and the backward step
    of linear bound propagation (CROWN).

    Subclasses hold their constants (weights, biases, strides) as attributes; inputs arrive as tensors or
    :class:`Interval` in the order of the node's inputs. Example (a subclass)::

        op = Linear(weight, bias)
        y = op.forward(x)
        out = op.ibp(Interval(xl, xu))
        (A_x,), bias = op.backward(A, [Interval(xl, xu)])
    """

    #: ONNX operator names this class is built from, for error messages and documentation.
    onnx_types: tuple[str, ...] = ()
    #: Whether :meth:`backward` takes :class:`Patches` coefficients; other ops are handed dense ones.
    accepts_patches: bool = False
    #: Whether :meth:`backward` needs the intervals of its inputs (relaxations of non-linear ops do, and so does
    #: every op whose rounding grows with its inputs' magnitudes).
    needs_input_bounds: bool = False
    #: The inputs whose intervals the relaxation is built on: the graph tightens their bounds by CROWN before this
    #: op is crossed, and branch-and-bound keeps them per domain.
    relaxed_inputs: tuple[int, ...] = ()
    #: The inputs branch-and-bound may split (a subset of ``relaxed_inputs``); such an op also provides
    #: ``split_mask``, ``split_point`` and ``branch_gain`` (see :class:`~.activation.Activation`).
    split_inputs: tuple[int, ...] = ()
    #: The float type the model computes this node in (the ONNX type of its output, set by the loader), which its
    #: rounding is charged in; ``None``: the dtype of the values it is applied to.
    precision: torch.dtype | None = None

    @abstractmethod
    def forward(self, *inputs: Tensor) -> Tensor: ...

    @abstractmethod
    def ibp(self, *inputs: Interval) -> Interval:
        """Bounds of every value the model computes for inputs in these intervals, rounding included."""

    @abstractmethod
    def backward(
        self, A: Tensor | Patches, inputs: Sequence[Interval | None], alpha: Tensor | None = None
    ) -> tuple[list[Tensor | Patches | None], Tensor | None]:
        """Push a lower bound ``Σ A·out + c`` back to one in terms of the inputs.

        Returns one coefficient tensor per input (``None`` where the bound does not depend on it) and the
        constant added on the way (float64 ``[S, B]``, or ``None`` for zero), the rounding of the model and of
        this step already charged to it. ``inputs`` are the intervals of the input nodes where the op needs them
        (:attr:`needs_input_bounds`), ``alpha`` its α-CROWN parameters ``[S, B, *alpha_shape]`` (``None``:
        CROWN's choice).
        """

    def rounding(self, inputs: Sequence[Interval | None]) -> Tensor | None:
        """``[B, *shape]`` (or broadcastable), per output element: a bound on the rounding error of the model's
        value (onnxruntime's, against the exact operation on the same inputs) plus that of this op's own float
        arithmetic in :meth:`ibp` and :meth:`backward` per unit of coefficient on the element. ``None``: exact."""
        return None

    def model_precision(self, dtype: torch.dtype) -> torch.dtype:
        """The dtype this node's model rounding is charged in: :attr:`precision`, else ``dtype``."""
        return self.precision if self.precision is not None else dtype

    def alpha_shape(self, shape: tuple[int, ...]) -> tuple[int, ...] | None:
        """The shape of this op's α per (row, batch element) for an output of ``shape``; ``None``: no α."""
        return None

    def initial_alpha(self, inputs: Sequence[Interval]) -> Tensor | None:
        """α ``[B, *alpha_shape]`` that reproduces CROWN's relaxation on these input intervals."""
        return None

    def refine_mask(self, inputs: Sequence[Interval | None], index: int) -> Tensor:
        """``[B, *input shape]``: the neurons of relaxed input ``index`` whose tighter bounds would tighten this
        relaxation (those whose interval has width, by default)."""
        pre = inputs[index]
        return pre.upper > pre.lower

    def to(self, dtype: torch.dtype | None = None, device: torch.device | str | None = None) -> BoundOp:
        """This op with its floating-point constants in ``dtype`` (the graph computes in one dtype) and all its
        constants (integer indices too) on ``device``; ``None`` keeps either as it is."""
        for name, value in vars(self).items():
            if isinstance(value, Tensor) and value.device.type != "meta":  # a sharded-away placeholder stays
                cast = dtype if dtype is not None and value.is_floating_point() else None
                setattr(self, name, value.to(device=device, dtype=cast))
        _MEMOS.pop(self, None)
        return self

    def __repr__(self) -> str:
        return type(self).__name__


class _Memo:
    """The last rounding bound an op computed, with the interval tensors it was computed from: a bound pass that
    crosses an op again over the same intervals (the iterations of β-CROWN, the intermediate passes of CROWN)
    reuses it instead of another product with ``|W|``."""

    def __init__(self, inputs: Sequence[Interval], mapped: bool, value: Tensor | None) -> None:
        self.keys = [(weakref.ref(x.lower), x.lower._version, weakref.ref(x.upper), x.upper._version) for x in inputs]
        self.mapped, self.value = mapped, value

    def matches(self, inputs: Sequence[Interval], mapped: bool) -> bool:
        return (
            mapped == self.mapped
            and len(inputs) == len(self.keys)
            and all(
                lower() is x.lower and upper() is x.upper and (low, high) == (x.lower._version, x.upper._version)
                for x, (lower, low, upper, high) in zip(inputs, self.keys, strict=True)
            )
        )


#: Per op, its last rounding bound (held beside the op rather than on it: ops are copied and sharded).
_MEMOS: weakref.WeakKeyDictionary[BoundOp, _Memo] = weakref.WeakKeyDictionary()


class LinearOp(BoundOp):
    """An affine operator ``y = L(x) + c``: CROWN's backward step is its transpose, and interval bounds follow from
    the centre and radius of the input (``L(mid) + c ± |L|(rad)``).

    Its rounding, per output: ``γ·(|L|(|x|) + |c|)`` with ``γ`` from the number of terms of the model's sum
    (``n_in``, :meth:`terms`) in the model's precision, and from those of the forward map and of the transpose
    (``n_out``) in the working dtype — for the backward step, ``|Σ (A·L − fl(A·L))·x| ≤ γ_{n_out}·Σ|A|·|L|(|x|)``.
    An op that only copies values rounds nothing but the sums of its transpose and the products with its constant.
    """

    #: Where the model computes the constant term from larger terms than the folded one (batch normalisation's
    #: ``β − mean·scale``, a bias added after a MatMul), their magnitudes, which its rounding scales with.
    constant_magnitude: Tensor | None = None

    @abstractmethod
    def linear(self, x: Tensor) -> Tensor:
        """``L(x)`` without the constant term."""

    @abstractmethod
    def abs_linear(self, x: Tensor) -> Tensor:
        """``|L|(x)``: the operator with every coefficient replaced by its absolute value."""

    @abstractmethod
    def transpose(self, A: Tensor | Patches) -> Tensor | Patches:
        """``Lᵀ`` applied to coefficients ``A [S, B, *out_shape]`` → ``[S, B, *in_shape]`` (Patches only where the op
        ``accepts_patches``)."""

    @abstractmethod
    def terms(self) -> tuple[int, int]:
        """``(n_in, n_out)``: the most products one output sums in ``L(x)`` and one input in ``Lᵀ(A)``; ``n_in = 0``
        for an op whose every output is a copy of one input (or a constant), ``(0, 1)`` when it also reads every
        input at most once (an exact op)."""

    def constant(self) -> Tensor | None:
        """The constant term ``c`` (broadcastable to the output), or ``None``."""
        return None

    def constant_reach(self) -> Tensor | None:
        """The magnitude the model's rounding of the constant term scales with: :attr:`constant_magnitude`, else
        ``|c|``."""
        if self.constant_magnitude is not None:
            return self.constant_magnitude
        c = self.constant()
        return None if c is None else c.abs()

    @property
    def needs_input_bounds(self) -> bool:
        return self.terms() != (0, 1)

    def forward(self, x: Tensor) -> Tensor:
        c = self.constant()
        y = self.linear(x)
        return y if c is None else y + c

    def _error(self, reach: Tensor | None, dtype: torch.dtype, mapped: bool) -> Tensor | None:
        """The rounding bound per output for ``reach = |L|(|x|)`` (unused by exact ops), or ``None``.

        The model's sum of ``n_in`` products (and its constant) in the model's precision, and ours in the working
        dtype: ``mapped``, the forward map of a centre and a radius (:meth:`map_rounding`: ``L(mid) + c`` rounds by
        ``γ_{n_in+1}·(|L|(|mid|) + |c|)``, the non-negative sum ``|L|(rad)`` by ``γ_{n_in}·|L|(rad)``, together within
        ``γ_{n_in+2}·(|L|(|mid| + rad) + |c|)``; two more ``u`` for forward-mode functions, whose centre and radius
        are rounded themselves), else the backward step's transpose (``n_out``); both with the products of the
        constant summed in float64. A last factor covers the rounding of ``reach`` itself (a sum of non-negative
        terms, low by at most ``γ_{n_in}``). Copies round nothing but the transpose's sums (``n_out > 1``) and the
        constant's products."""
        n_in, n_out = self.terms()
        constant = self.constant_reach()
        size = reach[0].numel() if reach is not None else constant.numel()  # the output's elements
        summed = contract_error(size, dtype)  # the backward step's Σ A·c
        if n_in == 0:
            error = None if constant is None else summed * constant
            if n_out > 1:
                copies = (gamma(n_out + 1, dtype) + FLOAT64_EPSILON) * reach
                error = copies if error is None else copies + error
            return error
        model = self.model_precision(dtype)
        ours = gamma(n_in + 4, dtype) if mapped else gamma(n_out + 2, dtype)
        factor = (gamma(n_in + 4, model) + ours + FLOAT64_EPSILON) * (1 + 2 * gamma(n_in + 2, dtype))
        error = reach * factor if constant is None else reach * factor + constant * (factor + summed)
        return error + (n_in + 4) * smallest_normal(model)

    def _rounding(self, inputs: Sequence[Interval | None], mapped: bool) -> Tensor | None:
        if not self.needs_input_bounds:
            constant = self.constant()
            return None if constant is None else self._error(None, constant.dtype, mapped)
        memo = _MEMOS.get(self)
        if memo is not None and memo.matches(inputs, mapped):
            return memo.value
        (x,) = inputs
        with torch.no_grad():
            value = self._error(self.abs_linear(x.magnitude), x.lower.dtype, mapped)
        _MEMOS[self] = _Memo(inputs, mapped, value)
        return value

    def rounding(self, inputs: Sequence[Interval | None]) -> Tensor | None:
        return self._rounding(inputs, mapped=False)

    def map_rounding(self, inputs: Sequence[Interval | None]) -> Tensor | None:
        """As :meth:`rounding`, for mapping a centre and a radius forwards (interval bounds, forward-mode linear
        bounds) instead of a backward step."""
        return self._rounding(inputs, mapped=True)

    def ibp(self, x: Interval) -> Interval:
        if self.terms()[0] == 0:  # copies (and a padding constant added to zeros): exact
            return Interval(self.forward(x.lower), self.forward(x.upper))
        mid = x.center
        y = self.forward(mid)
        rad = x.radius_around(mid)
        spread, reach = self.abs_linear(torch.cat([rad, mid.abs() + rad])).chunk(2)
        low, high = y.double() - spread.double(), y.double() + spread.double()
        return enclose(low, high, self._error(reach, y.dtype, mapped=True), y.dtype, self.precision)

    def backward(self, A, inputs, alpha=None):
        c = self.constant()
        term = None if c is None else contract(A, c)
        error = self.rounding(inputs)
        if error is not None:
            slack = contract_abs(A, error)
            term = -slack if term is None else term - slack
        return [self.transpose(A)], term
