"""Element-wise non-linear operators, each relaxed by a lower and an upper line over its input interval.

An operator ``y = f(x)`` is bounded per neuron, over the interval ``[l, u]`` of its input, by
``a_L·x + b_L ≤ f(x) ≤ a_U·x + b_U``. The slopes are a choice — a heuristic, or α-CROWN's optimised parameters —
but the intercepts are not: for a slope ``a`` the highest line still below ``f`` has
``b_L = min_{x∈[l,u]} f(x) − a·x`` (the lowest above it, the ``max``), and each family of functions knows where
that extreme can lie (the endpoints, its kinks, its inflection points, the points where ``f' = a``). So every slope
gives a valid line, and every α is valid as it is: α ∈ [0, 1] only says where in the range of ``f'`` over ``[l, u]``
the slope lies. The lines are computed in float64 for the slope *as rounded to the graph's dtype*, the intercept is
moved outwards past float64's own rounding and then rounded outwards to the dtype, so a float32 line is below
(above) ``f`` everywhere on the interval, not just up to rounding.

Subclasses provide :meth:`Activation.offset` (that extreme), :meth:`Activation.slope_range` and a few candidate
slopes; ReLU, whose lines are cheap and hot, builds them directly (:mod:`.relu`).
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from lightning_fedshard.verify.floats import HUGE, round_down, round_up, smallest_normal, unit_roundoff
from lightning_fedshard.verify.ops.base import BoundOp, Interval, contract, contract_abs, contract_error, enclose, flat
from lightning_fedshard.verify.ops.patches import Patches

__all__ = ["Activation", "Lines", "bias_term", "float64_interval"]

#: Golden-section steps of CROWN's slope search: the bracket shrinks to 0.618¹⁶ ≈ 5e-4 of the slope range.
_GOLDEN_STEPS = 16
_GOLDEN = (5**0.5 - 1) / 2

#: Relative slack added to every float64 extreme before it is rounded to the working dtype: float64's own rounding
#: in evaluating ``f`` and the products (a few ulps of float64), far below one ulp of float32.
_FLOAT64_SLACK = 1e-12


@dataclass(frozen=True)
class Lines:
    """``lower_slope·x + lower_bias ≤ f(x) ≤ upper_slope·x + upper_bias`` for every ``x`` of the interval the lines
    were built on. Each tensor is ``[B, *shape]``, or ``[S, B, *shape]`` where the slopes differ per bounded row
    (α-CROWN); a bias of ``None`` is zero.

    Example::

        lines = Sigmoid().relax(Interval(l, u))
        below = lines.lower_slope * x + lines.lower_bias
    """

    lower_slope: Tensor
    lower_bias: Tensor | None
    upper_slope: Tensor
    upper_bias: Tensor | None

    def gap(self, pre: Interval) -> Tensor:
        """The largest vertical distance between the two lines over the interval: how loose the relaxation is."""
        lower_bias = 0 if self.lower_bias is None else self.lower_bias
        upper_bias = 0 if self.upper_bias is None else self.upper_bias
        slope, bias = self.upper_slope - self.lower_slope, upper_bias - lower_bias
        return torch.maximum(slope * pre.lower + bias, slope * pre.upper + bias)


def float64_interval(pre: Interval) -> tuple[Tensor, Tensor, Tensor]:
    """``(l, u, unbounded)`` in float64 with ``u ≥ l`` (an empty interval — contradicting split assumptions — is a
    point: any line is valid over nothing); where an end reaches past ``±HUGE`` (or is not a number) ``unbounded``
    is set and both ends are 0, to keep the arithmetic finite: the caller's lines there are ``±inf``."""
    lower, upper = pre.lower.double(), pre.upper.double()
    unbounded = ~((lower.abs() <= HUGE) & (upper.abs() <= HUGE))
    lower = torch.where(unbounded, 0, lower)
    upper = torch.where(unbounded, 0, torch.maximum(upper, lower))
    return lower, upper, unbounded


def bias_term(A: Tensor | Patches, bias: Tensor) -> Tensor:
    """``contract(A, bias)`` for the constant term of a lower bound, where an infinite intercept (an unbounded
    relaxation) counts only under a non-zero coefficient, and makes the bound ``−inf``."""
    if bool(torch.isfinite(bias).all()):
        return contract(A, bias)
    dense = A.to_dense() if isinstance(A, Patches) else A
    infinite = ~torch.isfinite(bias)
    term = contract(dense, torch.where(infinite, 0, bias))
    touched = flat(((dense != 0) & infinite), 2).any(-1)
    return torch.where(touched, -torch.inf, term)


def _golden_section(objective, low: Tensor, high: Tensor) -> Tensor:
    """Element-wise argmax over ``[low, high]`` of a concave ``objective`` (float64 tensors), by golden sections:
    interior points ``c < d``; the maximum lies in ``[a, d]`` if ``f(c) > f(d)``, else in ``[c, b]``."""
    a, b = low, high
    c, d = b - _GOLDEN * (b - a), a + _GOLDEN * (b - a)
    fc, fd = objective(c), objective(d)
    for _ in range(_GOLDEN_STEPS):
        left = fc > fd
        a, b = torch.where(left, a, c), torch.where(left, d, b)
        kept, kept_value = torch.where(left, c, d), torch.where(left, fc, fd)  # the new d (left) or c (right)
        probe = torch.where(left, b - _GOLDEN * (b - a), a + _GOLDEN * (b - a))
        value = objective(probe)
        c, fc = torch.where(left, probe, kept), torch.where(left, value, kept_value)
        d, fd = torch.where(left, kept, probe), torch.where(left, kept_value, value)
    return torch.where(fc > fd, c, d)


class Activation(BoundOp):
    """``y = f(x)`` element-wise, relaxed by two lines over the input interval (see the module docs).

    Subclasses implement :meth:`forward`, :meth:`offset`, :meth:`slope_range` and :meth:`candidate_slopes`; the
    rest — IBP, the CROWN backward step, α, what branch-and-bound may split and where — follows from them.

    Example (a subclass)::

        sigmoid = Sigmoid()
        lines = sigmoid.relax(Interval(l, u))                 # CROWN's choice of slopes
        lines = sigmoid.relax(Interval(l, u), alpha)          # α [S, B, 2, *shape]: per-row slopes
        (A_pre,), bias = sigmoid.backward(A, [Interval(l, u)])
    """

    needs_input_bounds = True
    accepts_patches = True  # without α the lines are [B, *shape]: only clamps, products, sums and contractions
    relaxed_inputs = (0,)
    split_inputs = (0,)
    #: α parameters per neuron: 2 (the lower and the upper slope), 1 (the lower slope: the upper line is fixed) or 0.
    alpha_per_neuron: int = 2
    #: Whether the relaxation is exact once no split is left to make (continuous piecewise-linear functions split
    #: at their kinks): a domain with nothing left to split is then a linear program branch-and-bound can settle.
    exact_when_split: bool = False
    #: Branch-and-bound stops splitting a neuron whose interval is narrower than this (GenBaB's ``split_min_gap``).
    split_min_width: float = 1e-3
    #: How far the model's value of ``f`` may be from the exact one: ``relative_ulps·u·|f| + absolute_ulps·u`` (``u``
    #: the model precision's unit roundoff). Library functions: a few times the largest error measured on
    #: onnxruntime's CPU kernels (``docs/verification.md``, "Floating point"); exact functions (ReLU, Floor): 0.
    relative_ulps: float = 0.0
    absolute_ulps: float = 0.0

    @abstractmethod
    def offset(self, slope: Tensor, lower: Tensor, upper: Tensor, maximum: bool) -> Tensor:
        """``min`` (or, with ``maximum``, ``max``) over ``x ∈ [lower, upper]`` of ``f(x) − slope·x``, in float64,
        never above the true minimum (below the true maximum) by more than float64 rounding; all arguments
        float64 and broadcastable, ``lower ≤ upper``."""

    @abstractmethod
    def slope_range(self, lower: Tensor, upper: Tensor) -> tuple[Tensor, Tensor]:
        """The range ``[min f', max f']`` over the interval (float64, finite): where α places the slopes (every
        tight line has its slope in it)."""

    @abstractmethod
    def candidate_slopes(self, lower: Tensor, upper: Tensor) -> list[Tensor]:
        """Slopes to choose CROWN's lines among (float64, inside :meth:`slope_range`): the one whose line is
        tightest at the interval's midpoint is taken, on each side."""

    def alpha_shape(self, shape: tuple[int, ...]) -> tuple[int, ...] | None:
        """The shape of this op's α per (row, batch element): ``None`` where it has none."""
        return {0: None, 1: tuple(shape), 2: (2, *shape)}[self.alpha_per_neuron]

    # -- lines -------------------------------------------------------------------------------------------------

    def relax(self, pre: Interval, alpha: Tensor | None = None) -> Lines:
        """The two lines over ``pre``: CROWN's choice of slopes, or those α ``[S, B, 2, *shape]`` (any values;
        clamped to [0, 1]) places in :meth:`slope_range`."""
        lower, upper, unbounded = float64_interval(pre)
        low, high = self.slope_range(lower, upper)
        if alpha is None:
            lower_slope, upper_slope = self._chosen_slopes(lower, upper, low, high)
        elif self.alpha_per_neuron == 1:
            alpha = alpha.double().clamp(0, 1)
            lower_slope = low + alpha * (high - low)
            (upper_slope,) = self._chosen_slopes(lower, upper, low, high, sides=(True,))
        else:
            alpha = alpha.double().clamp(0, 1)
            lower_slope = low + alpha[:, :, 0] * (high - low)
            upper_slope = low + alpha[:, :, 1] * (high - low)
        return self.lines(lower_slope, upper_slope, lower, upper, unbounded, pre.lower.dtype)

    def lines(
        self,
        lower_slope: Tensor,
        upper_slope: Tensor,
        lower: Tensor,
        upper: Tensor,
        unbounded: Tensor,
        dtype: torch.dtype,
    ) -> Lines:
        """Lines of the given float64 slopes over ``[lower, upper]`` (float64), in ``dtype``: each slope rounded
        once, the intercepts computed for the rounded slopes and rounded outwards (``±inf`` where ``unbounded``, or
        where the function is: outside its domain, or overflowing)."""
        lower_slope = torch.where(unbounded, 0, lower_slope).to(dtype)
        upper_slope = torch.where(unbounded, 0, upper_slope).to(dtype)
        reach = torch.maximum(lower.abs(), upper.abs())
        below = self.offset(lower_slope.double(), lower, upper, maximum=False)
        above = self.offset(upper_slope.double(), lower, upper, maximum=True)
        below = below - _FLOAT64_SLACK * (1 + below.abs() + lower_slope.double().abs() * reach)
        above = above + _FLOAT64_SLACK * (1 + above.abs() + upper_slope.double().abs() * reach)
        below = torch.where(unbounded, -torch.inf, below)
        above = torch.where(unbounded, torch.inf, above)
        return Lines(lower_slope, round_down(below, dtype), upper_slope, round_up(above, dtype))

    def _chosen_slopes(
        self,
        lower: Tensor,
        upper: Tensor,
        low: Tensor,
        high: Tensor,
        sides: tuple[bool, ...] = (False, True),
        search: bool = True,
    ) -> tuple[Tensor, ...]:
        """Per neuron, the slope whose lower (upper) line is highest (lowest) at the interval's midpoint: the line of
        largest (smallest) integral over it, CROWN's choice. That height, ``slope·m + offset(slope)``, is a minimum
        (maximum) of functions affine in the slope, so concave (convex) in it: a golden-section search over the
        slope range finds its best; the candidate slopes (the ends', the kinks', the secant) win where the search's
        precision falls short (ranges of 10¹² near a square root's 0). ``sides``: which slopes, ``False`` for the
        lower line's and ``True`` for the upper's; without ``search`` the best candidate (an estimate, 18x cheaper)."""
        middle = (lower + upper) / 2

        def height(slope: Tensor, maximum: bool) -> Tensor:
            return slope * middle + self.offset(slope, lower, upper, maximum=maximum)

        slopes = torch.stack([s.clamp(low, high) for s in self.candidate_slopes(lower, upper)])
        chosen = []
        for maximum in sides:
            sign = -1 if maximum else 1  # maximise sign·height
            heights = sign * height(slopes, maximum)
            best = slopes.gather(0, heights.argmax(0, keepdim=True))[0]
            if not search:
                chosen.append(best)
                continue
            searched = _golden_section(lambda slope, m=maximum, s=sign: s * height(slope, m), low, high)
            better = sign * height(searched, maximum) > heights.amax(0)
            chosen.append(torch.where(better, searched, best))
        return tuple(chosen)

    # -- the BoundOp contract ----------------------------------------------------------------------------------

    def _range(self, x: Interval) -> tuple[Tensor, Tensor]:
        """The exact range of ``f`` over the interval in float64, moved outwards past float64's own rounding
        (``±inf`` where unbounded)."""
        lower, upper, unbounded = float64_interval(x)
        zero = torch.zeros_like(lower)
        low = self.offset(zero, lower, upper, maximum=False)
        high = self.offset(zero, lower, upper, maximum=True)
        low = torch.where(unbounded, -torch.inf, low - _FLOAT64_SLACK * (1 + low.abs()))
        high = torch.where(unbounded, torch.inf, high + _FLOAT64_SLACK * (1 + high.abs()))
        return low, high

    def _model_error(self, value: Tensor, dtype: torch.dtype) -> Tensor | float:
        """The model's rounding of ``f`` where its exact value is ``value`` (float64), or at most ``|value|``."""
        if not (self.relative_ulps or self.absolute_ulps):
            return 0.0
        model = self.model_precision(dtype)
        u = unit_roundoff(model)
        return self.relative_ulps * u * value.abs() + self.absolute_ulps * u + smallest_normal(model)

    def ibp(self, x: Interval) -> Interval:
        # The model's value is within its rounding of f(x), which moves monotonically with f(x): each end widens by
        # the rounding at that end.
        low, high = self._range(x)
        dtype = x.lower.dtype
        return enclose(
            low - self._model_error(low, dtype), high + self._model_error(high, dtype), 0.0, dtype, self.precision
        )

    def rounding(self, inputs: Sequence[Interval | None]) -> Tensor:
        (pre,) = inputs
        return self.line_rounding(self.relax(pre), pre)

    def line_rounding(self, lines: Lines, pre: Interval) -> Tensor:
        """``[B, *shape]``: the model's rounding of ``f``, and that of a step through ``lines``: its products with the
        slopes (relative ``u`` each, on values up to ``|slope|·|x|``) and with the intercepts. ``max |f|`` comes from
        the lines at the interval's ends (``f`` lies between them); per-row lines (α) are charged their largest."""
        with torch.no_grad():
            ends = (pre.lower, pre.upper)
            lower_bias = 0 if lines.lower_bias is None else lines.lower_bias
            upper_bias = 0 if lines.upper_bias is None else lines.upper_bias
            values = [
                slope * x + bias
                for slope, bias in ((lines.lower_slope, lower_bias), (lines.upper_slope, upper_bias))
                for x in ends
            ]
            reach = torch.stack(torch.broadcast_tensors(*values)).abs().amax(0).double() * (1 + 2**-20)
            steepest = (lines.lower_slope.abs() + lines.upper_slope.abs()).double()
            intercepts = (torch.as_tensor(lower_bias).abs() + torch.as_tensor(upper_bias).abs()).double()
            dtype = pre.lower.dtype
            own = (
                unit_roundoff(dtype) * steepest * pre.magnitude
                + contract_error(pre.lower[0].numel(), dtype) * intercepts
            )
            error = own + self._model_error(reach, pre.lower.dtype)
            if error.dim() == pre.lower.dim():
                return error
            return error.amax(0) if error.shape[0] else error.new_zeros(error.shape[1:])  # a rank with no rows

    def backward(self, A, inputs, alpha=None):
        (pre,) = inputs
        lines = self.relax(pre, alpha)
        A_pos, A_neg = A.clamp(min=0), A.clamp(max=0)
        A_pre = A_pos * lines.lower_slope + A_neg * lines.upper_slope
        bias = -contract_abs(A, self.line_rounding(lines, pre))
        if lines.lower_bias is not None:
            bias = bias + bias_term(A_pos, lines.lower_bias)
        if lines.upper_bias is not None:
            bias = bias + bias_term(A_neg, lines.upper_bias)
        return [A_pre], bias

    # -- α, refinement and branching ---------------------------------------------------------------------------

    def initial_alpha(self, inputs: Sequence[Interval]) -> Tensor | None:
        """α ``[B, *alpha_shape]`` that reproduces CROWN's lines on these input intervals (``None``: no α)."""
        if not self.alpha_per_neuron:
            return None
        (pre,) = inputs
        lower, upper, _ = float64_interval(pre)
        low, high = self.slope_range(lower, upper)
        chosen = self._chosen_slopes(lower, upper, low, high)
        width = high - low
        params = [torch.where(width > 0, (s - low) / torch.where(width > 0, width, 1), 0.5) for s in chosen]
        if self.alpha_per_neuron == 1:
            return params[0].to(pre.lower.dtype)
        return torch.stack(params, 1).to(pre.lower.dtype)

    def refine_mask(self, inputs: Sequence[Interval | None], index: int) -> Tensor:
        """``[B, *shape]``: the neurons of input ``index`` whose tighter bounds would tighten this relaxation (the
        others are exact already)."""
        pre = inputs[index]
        return pre.upper > pre.lower

    def split_mask(self, inputs: Sequence[Interval], index: int) -> Tensor:
        """``[B, *shape]``: the neurons of input ``index`` branch-and-bound may split."""
        pre = inputs[index]
        return (pre.upper - pre.lower) > self.split_min_width * (1 + pre.lower.abs() + pre.upper.abs())

    def split_point(self, inputs: Sequence[Interval], index: int) -> Tensor:
        """``[B, *shape]``: where to split each neuron of input ``index``: of a few points inside the interval, the
        one that leaves the two halves with the smallest relaxation gaps (GenBaB's optimised branching points,
        computed for the interval at hand instead of looked up in a table)."""
        pre = inputs[index]
        lower, upper, _ = float64_interval(pre)
        fractions = torch.tensor([0.25, 0.5, 0.75], dtype=torch.float64, device=lower.device)
        points = lower + fractions.view(-1, *([1] * lower.dim())) * (upper - lower)
        left = self._gap_area(lower.expand_as(points), points)
        right = self._gap_area(points, upper.expand_as(points))
        best = (left + right).argmin(0, keepdim=True)
        return points.gather(0, best)[0].to(pre.lower.dtype)

    def _estimated_lines(self, lower: Tensor, upper: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """``(a_L, b_L, a_U, b_U)`` in float64: CROWN's lines over ``[lower, upper]`` among the candidate slopes only
        (no search), for the branching estimates, which relax every neuron at several candidate splits."""
        low, high = self.slope_range(lower, upper)
        lower_slope, upper_slope = self._chosen_slopes(lower, upper, low, high, search=False)
        below = self.offset(lower_slope, lower, upper, maximum=False)
        above = self.offset(upper_slope, lower, upper, maximum=True)
        return lower_slope, below, upper_slope, above

    def _gap_area(self, lower: Tensor, upper: Tensor) -> Tensor:
        """``∫ (U − L)`` over ``[lower, upper]`` for CROWN's (estimated) lines there: the looseness a child keeps."""
        lower_slope, below, upper_slope, above = self._estimated_lines(lower, upper)
        middle = (lower + upper) / 2
        return ((upper_slope - lower_slope) * middle + above - below) * (upper - lower)

    def _largest_gap(self, lower: Tensor, upper: Tensor) -> Tensor:
        """The largest ``U − L`` over ``[lower, upper]`` for CROWN's (estimated) lines there (at an end)."""
        lower_slope, below, upper_slope, above = self._estimated_lines(lower, upper)
        slope, bias = upper_slope - lower_slope, above - below
        return torch.maximum(slope * lower + bias, slope * upper + bias)

    def branch_gain(self, A_out: Tensor, inputs: Sequence[Interval], index: int, bias: Tensor | None) -> Tensor:
        """``[S, N, *shape]``: the estimated rise of each bounded row's lower bound from splitting each neuron of
        input ``index`` at :meth:`split_point`: the row's weight on the neuron's output times the relaxation gap
        the split removes (the gap of the wider half is what is left). ``bias`` (the constant of the layer that
        computed the input) is for the ReLU score, which uses it."""
        pre = inputs[index]
        lower, upper, unbounded = float64_interval(pre)
        point = self.split_point(inputs, index).double().clamp(lower, upper)
        before = self._largest_gap(lower, upper)
        after = torch.maximum(self._largest_gap(lower, point), self._largest_gap(point, upper))
        gain = torch.where(unbounded, 0, (before - after).clamp(min=0)).to(pre.lower.dtype)
        return A_out.abs() * gain
