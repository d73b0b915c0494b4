"""Smooth element-wise functions: sigmoid, tanh, exp, log, square root, reciprocal, powers, sine and cosine.

Each is twice differentiable on its domain, and its domain splits into pieces of constant curvature (convex or
concave) at known inflection points. On ``[l, u]`` the extreme of ``g(x) = f(x) − a·x`` therefore lies at an
endpoint, at an inflection point, or at a point where ``f'(x) = a`` inside a piece (a minimum only in a convex
piece, a maximum only in a concave one): :meth:`SmoothActivation.offset` evaluates ``g`` at all of them. Those
stationary points come from closed forms in float64, so they are only close to exact; each is charged
``|g'(p)|·(u − l)``, which bounds what the true extreme of its piece can differ by (``g`` is convex on a convex
piece, so ``g(x*) ≥ g(p) + g'(p)(x* − p)``). Any extra candidate point can only move a minimum down (a maximum
up), so the candidates need not be selected carefully, only complete.

Outside its domain (log or a fractional power of a negative number, the reciprocal across zero) a function has no
lines: the relaxation is unbounded there (``±inf``), and the bound that needs it is useless rather than wrong.
"""

from __future__ import annotations

import math
from abc import abstractmethod

import torch
from torch import Tensor

from lightning_fedshard.verify.ops.activation import Activation

__all__ = ["Cos", "Exp", "Log", "Pow", "Reciprocal", "Sigmoid", "Sin", "SmoothActivation", "Sqrt", "Tanh"]

#: Slopes are kept within ±this (``f'`` of sqrt and fractional powers is unbounded at 0; any slope is valid).
_SLOPE_LIMIT = 1e12
#: Closest approach to a pole or a domain edge when a function is evaluated at a candidate point.
_TINY = 1e-300


class SmoothActivation(Activation):
    """A smooth ``f`` with known pieces of constant curvature (see the module docs).

    Subclasses give ``f``, ``f'`` (:meth:`value`, :meth:`derivative`, both on float64 inputs inside the domain),
    the inflection points an interval contains, the stationary points of ``f(x) − a·x`` and, if ``f`` is not defined
    everywhere, the domain.

    Example (a subclass)::

        Sigmoid().relax(Interval(torch.tensor([[-2.0]]), torch.tensor([[1.0]])))
    """

    @abstractmethod
    def value(self, x: Tensor) -> Tensor: ...

    @abstractmethod
    def derivative(self, x: Tensor) -> Tensor: ...

    @abstractmethod
    def stationary(self, slope: Tensor, lower: Tensor) -> list[tuple[Tensor, Tensor | float, Tensor | float]]:
        """``(point, start, end)`` for each piece ``[start, end]`` of constant curvature that an interval starting at
        ``lower`` may meet: the point of it where ``f' ≈ slope`` (float64 closed forms). Where the piece has none,
        the point must not lie strictly inside it (an edge, or anywhere outside)."""

    def inflections(self, lower: Tensor, upper: Tensor) -> list[Tensor]:
        """The points where the curvature changes (clamped into the interval later; may lie outside it)."""
        return []

    def defined(self, lower: Tensor, upper: Tensor) -> Tensor:
        """Whether ``f`` is defined and finite on all of ``[lower, upper]``."""
        return torch.ones_like(lower, dtype=torch.bool)

    def inside(self, x: Tensor) -> Tensor:
        """``x`` moved into the domain (where ``f`` is not defined the result is discarded; this only keeps the
        arithmetic, and its gradients, finite)."""
        return x

    def offset(self, slope, lower, upper, maximum):
        width = upper - lower
        points = [lower, upper] + [p.clamp(lower, upper) for p in self.inflections(lower, upper)]
        values = [self.value(self.inside(p)) - slope * p for p in points]
        # The stationary points carry no gradient: at a true one d(f(p) − a·p)/da = −p whatever p's own derivative
        # (the envelope theorem), and the closed forms' derivatives blow up where they are clamped.
        for raw, start, end in self.stationary(slope.detach(), lower):
            low, high = torch.maximum(lower, _full(start, lower)), torch.minimum(upper, _full(end, upper))
            p = self.inside(torch.minimum(torch.maximum(raw, low), high).clamp(lower, upper))
            # Only a point strictly inside its piece stands for an interior extreme; one clamped to the piece's
            # edge is an edge point, whose value is exact.
            interior = (raw > low) & (raw < high)
            # A margin for the point's inexactness, not a function of the slope: its gradient (±width, where the
            # true derivative −p is tiny next to it) would send α-CROWN uphill.
            residual = torch.where(interior, (self.derivative(p) - slope).abs() * width, 0).detach()
            values.append(self.value(p) - slope * p + (residual if maximum else -residual))
        stacked = torch.stack(torch.broadcast_tensors(*values))
        extreme = stacked.amax(0) if maximum else stacked.amin(0)
        undefined = ~self.defined(lower, upper)
        return torch.where(undefined, torch.inf if maximum else -torch.inf, extreme)

    def slope_range(self, lower, upper):
        # f' is extreme at the endpoints or where f'' = 0: the inflection points.
        points = [lower, upper] + [p.clamp(lower, upper) for p in self.inflections(lower, upper)]
        slopes = torch.stack([self.derivative(self.inside(p)) for p in points]).clamp(-_SLOPE_LIMIT, _SLOPE_LIMIT)
        defined = self.defined(lower, upper)
        return torch.where(defined, slopes.amin(0), 0), torch.where(defined, slopes.amax(0), 0)

    def candidate_slopes(self, lower, upper):
        low, high = self.inside(lower), self.inside(upper)
        middle = (low + high) / 2
        width = high - low
        secant = (self.value(high) - self.value(low)) / torch.where(width > 0, width, 1)
        secant = torch.where(width > 0, secant, self.derivative(low))
        return [self.derivative(low), self.derivative(high), self.derivative(middle), secant]


def _full(value: Tensor | float, like: Tensor) -> Tensor:
    return value if isinstance(value, Tensor) else torch.full_like(like, value)


class Sigmoid(SmoothActivation):
    """``σ(x) = 1 / (1 + e^−x)``: convex below 0, concave above (ONNX Sigmoid)."""

    onnx_types = ("Sigmoid",)
    relative_ulps = 8
    absolute_ulps = 8

    def forward(self, x: Tensor) -> Tensor:
        return torch.sigmoid(x)

    def value(self, x):
        return torch.sigmoid(x)

    def derivative(self, x):
        s = torch.sigmoid(x)
        return s * (1 - s)

    def inflections(self, lower, upper):
        return [torch.zeros_like(lower)]

    def stationary(self, slope, lower):
        # σ(1 − σ) = a  ⇔  σ = (1 ± √(1 − 4a))/2  ⇔  x = ±2·atanh(√(1 − 4a)), for 0 < a < 1/4 (else x = 0: none)
        root = torch.sqrt((1 - 4 * slope).clamp(0, 1)).clamp(max=1 - 1e-16)
        x = torch.where((slope > 0) & (slope < 0.25), 2 * torch.atanh(root), 0)
        return [(-x, -math.inf, 0.0), (x, 0.0, math.inf)]


class Tanh(SmoothActivation):
    """``tanh(x)``: convex below 0, concave above (ONNX Tanh)."""

    onnx_types = ("Tanh",)
    relative_ulps = 8
    absolute_ulps = 16

    def forward(self, x: Tensor) -> Tensor:
        return torch.tanh(x)

    def value(self, x):
        return torch.tanh(x)

    def derivative(self, x):
        return 1 - torch.tanh(x) ** 2

    def inflections(self, lower, upper):
        return [torch.zeros_like(lower)]

    def stationary(self, slope, lower):
        # 1 − tanh² = a  ⇔  x = ±atanh(√(1 − a)), for 0 < a < 1
        root = torch.sqrt((1 - slope).clamp(0, 1)).clamp(max=1 - 1e-16)
        x = torch.where((slope > 0) & (slope < 1), torch.atanh(root), 0)
        return [(-x, -math.inf, 0.0), (x, 0.0, math.inf)]


class Exp(SmoothActivation):
    """``e^x``, convex (ONNX Exp). Above float32's range (x > 88.7) the network's own output is infinite: the
    relaxation is then unbounded too."""

    onnx_types = ("Exp",)
    relative_ulps = 8

    def forward(self, x: Tensor) -> Tensor:
        return torch.exp(x)

    def value(self, x):
        return torch.exp(x.clamp(max=700))

    derivative = value

    def stationary(self, slope, lower):
        return [(torch.where(slope > 0, torch.log(slope.clamp(min=_TINY)), -math.inf), -math.inf, math.inf)]

    def offset(self, slope, lower, upper, maximum):
        extreme = super().offset(slope, lower, upper, maximum)
        # Past float32's range the network's exp is infinite: no line lies above it.
        return torch.where(upper > 88.0, torch.inf, extreme) if maximum else extreme


class Log(SmoothActivation):
    """Natural logarithm, concave on ``x > 0`` (ONNX Log)."""

    onnx_types = ("Log",)
    relative_ulps = 8

    def forward(self, x: Tensor) -> Tensor:
        return torch.log(x)

    def value(self, x):
        return torch.log(x)

    def derivative(self, x):
        return 1 / x

    def defined(self, lower, upper):
        return lower > 0

    def inside(self, x):
        return x.clamp(min=1e-200)

    def stationary(self, slope, lower):
        return [(1 / slope.clamp(min=_TINY), 0.0, math.inf)]


class Sqrt(SmoothActivation):
    """``√x``, concave on ``x ≥ 0`` (ONNX Sqrt)."""

    onnx_types = ("Sqrt",)
    relative_ulps = 2

    def forward(self, x: Tensor) -> Tensor:
        return torch.sqrt(x)

    def value(self, x):
        return torch.sqrt(x)

    def derivative(self, x):
        return 0.5 / torch.sqrt(x.clamp(min=_TINY))

    def defined(self, lower, upper):
        return lower >= 0

    def inside(self, x):
        return x.clamp(min=0)

    def stationary(self, slope, lower):
        return [(0.25 / slope.clamp(min=1e-150) ** 2, 0.0, math.inf)]


class Reciprocal(SmoothActivation):
    """``1/x`` on an interval of one sign: convex for ``x > 0``, concave for ``x < 0`` (ONNX Reciprocal; Div by a
    computed tensor). Across zero it is unbounded."""

    onnx_types = ("Reciprocal",)
    relative_ulps = 2

    def forward(self, x: Tensor) -> Tensor:
        return torch.reciprocal(x)

    def value(self, x):
        return 1 / x

    def derivative(self, x):
        return -1 / x**2

    def defined(self, lower, upper):
        return (lower > 0) | (upper < 0)

    def inside(self, x):
        return torch.where(x >= 0, x.clamp(min=1e-150), x.clamp(max=-1e-150))

    def stationary(self, slope, lower):
        # −1/x² = a  ⇔  x = ±1/√(−a), for a < 0
        x = 1 / torch.sqrt((-slope).clamp(min=1e-290))
        return [(-x, -math.inf, 0.0), (x, 0.0, math.inf)]


class Pow(SmoothActivation):
    """``x^c`` for a constant exponent (ONNX Pow with a constant exponent): a non-negative integer ``c`` on all of
    ℝ (odd ``c ≥ 3`` has an inflection at 0), any other real ``c`` on ``x ≥ 0`` (``x > 0`` for ``c < 0``), where
    ONNX's result is real. ``c = 2`` is the square (``x·x`` of one tensor is loaded as it).

    Example::

        cube = Pow(3.0)
        cube.forward(torch.tensor([-2.0]))   # tensor([-8.])
    """

    onnx_types = ("Pow",)

    def __init__(self, exponent: float) -> None:
        if exponent in (0.0, 1.0) or not math.isfinite(exponent):
            raise ValueError(
                f"Pow needs a finite exponent other than 0 and 1 (those are constant/identity), got {exponent}"
            )
        self.exponent = float(exponent)
        self._integer = self.exponent.is_integer() and self.exponent > 0
        # onnxruntime: 0.5-1.3 ulps measured for x², x³, x⁻¹; std::pow's 18.5 ulps at subnormal x for x^0.3.
        self.relative_ulps = 8.0 if self._integer and self.exponent <= 4 else 64.0

    def forward(self, x: Tensor) -> Tensor:
        return torch.pow(x, self.exponent)

    def value(self, x):
        return torch.pow(x, self.exponent)

    def derivative(self, x):
        c = self.exponent
        if c == 2:
            return 2 * x
        return c * torch.pow(x, c - 1)

    def defined(self, lower, upper):
        if self._integer:
            return torch.ones_like(lower, dtype=torch.bool)
        return lower > 0 if self.exponent < 0 else lower >= 0

    def inside(self, x):
        if self._integer:
            return x
        return x.clamp(min=1e-150 if self.exponent < 0 else 0)

    def inflections(self, lower, upper):
        odd = self._integer and int(self.exponent) % 2 == 1
        return [torch.zeros_like(lower)] if odd and self.exponent >= 3 else []

    def stationary(self, slope, lower):
        c = self.exponent
        ratio = slope / c  # x^(c−1) = a/c
        if self._integer and int(c) % 2 == 0:  # c − 1 odd: one real root, of the sign of a/c
            return [(ratio.sign() * ratio.abs() ** (1 / (c - 1)), -math.inf, math.inf)]
        root = torch.where(ratio > 0, ratio.clamp(min=_TINY) ** (1 / (c - 1)), 0)
        if self._integer:  # odd c: ±root, in the concave (x ≤ 0) and the convex (x ≥ 0) piece
            return [(-root, -math.inf, 0.0), (root, 0.0, math.inf)]
        return [(root, 0.0, math.inf)]

    def __repr__(self) -> str:
        return f"Pow({self.exponent:g})"


class _Sinusoid(SmoothActivation):
    """``sin(x + phase)``: concave where ``sin > 0``, convex where ``sin < 0``, inflections at ``kπ − phase``. Over
    more than a period, ``g(x) = f(x) − a·x`` changes by ``−2πa`` from one period to the next, so every point has
    one at least as extreme in the first period (``a < 0`` for a minimum) or the last (``a ≥ 0``): the extreme over
    the interval is that of those two windows, each exact on its own."""

    relative_ulps = 8

    phase = 0.0

    def value(self, x):
        return torch.sin(x + self.phase)

    def derivative(self, x):
        return torch.cos(x + self.phase)

    def inflections(self, lower, upper):
        first = torch.ceil((lower + self.phase) / math.pi) * math.pi - self.phase
        return [first + k * math.pi for k in range(3)]

    def stationary(self, slope, lower):
        # cos(y) = a: y = −acos(a) + 2πk in the convex piece [(2k−1)π, 2kπ], y = acos(a) + 2πk in the concave one
        # [2kπ, (2k+1)π]; an interval of at most 2π meets at most two pieces of each kind, all among these.
        turn = torch.acos(slope.clamp(-1, 1))
        y_low = lower + self.phase
        points = []
        for shift, sign in ((-1.0, -1.0), (0.0, 1.0)):  # convex pieces start at (2k−1)π, concave ones at 2kπ
            first = torch.ceil((y_low - shift * math.pi) / (2 * math.pi))
            for k in (first - 1, first, first + 1):
                start = (2 * k + shift) * math.pi - self.phase
                points.append((sign * turn + 2 * math.pi * k - self.phase, start, start + math.pi))
        return points

    def offset(self, slope, lower, upper, maximum):
        period = 2 * math.pi
        first = super().offset(slope, lower, torch.minimum(upper, lower + period), maximum)
        last = super().offset(slope, torch.maximum(lower, upper - period), upper, maximum)
        return torch.maximum(first, last) if maximum else torch.minimum(first, last)


class Sin(_Sinusoid):
    """``sin(x)`` (ONNX Sin)."""

    onnx_types = ("Sin",)

    def forward(self, x: Tensor) -> Tensor:
        return torch.sin(x)


class Cos(_Sinusoid):
    """``cos(x) = sin(x + π/2)`` (ONNX Cos)."""

    onnx_types = ("Cos",)
    phase = math.pi / 2

    def forward(self, x: Tensor) -> Tensor:
        return torch.cos(x)

    def value(self, x):
        return torch.cos(x)

    def derivative(self, x):
        return -torch.sin(x)
