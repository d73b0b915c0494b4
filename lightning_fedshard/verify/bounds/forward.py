"""Forward-mode linear bounds: every node's lower and upper bound as linear functions of the input, built in one
pass from the input to the output.

For networks with few inputs (ACAS Xu has 5) this is the cheap way to intermediate bounds: a node of ``n`` values
carries ``2·(d+1)·n`` coefficients per box, where a CROWN pass started at it carries ``2·u·n'`` per node it
crosses (``u`` unstable neurons, all nodes before it). It is looser than CROWN, whose backward passes choose the
ReLU relaxation per row, but on the small boxes of input-space branch-and-bound the gap closes, at a twentieth of
the cost. Affine operators map the functions through their centre and radius (``L(mid) ± |L|(rad)``, the linear
version of interval propagation), joins (Concat) and sums join and add them; an element-wise non-linear op takes
its two lines (CROWN's choice: for ReLU the chord above and the adaptive line below); an operator with no forward
rule falls back to its interval bounds (constant functions).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import Tensor

from lightning_fedshard.verify.budget import check_deadline_between_steps
from lightning_fedshard.verify.floats import gamma, round_down, round_up, unit_roundoff
from lightning_fedshard.verify.graph import BoundGraph, Node
from lightning_fedshard.verify.objective import free_coordinates
from lightning_fedshard.verify.ops import Activation, Add, Concat, Interval, LinearOp, flat

__all__ = ["ForwardPass", "LinearFunctions", "forward_bounds", "forward_bytes_per_box"]

#: Copies of the largest node's functions alive at once while it is built: its inputs' functions, the centre and
#: radius of their image, the result, the products of concretising it, and the copy its rounding widens.
_LIVE_COPIES = 7


@dataclass(frozen=True)
class LinearFunctions:
    """``lower(z) ≤ v ≤ upper(z)`` for a node ``v`` over ``d`` coordinates ``z`` (the input's free ones): each
    ``[B, d + 1, *shape]``, rows ``0..d-1`` the coefficients of ``z``, row ``d`` the constant.

    Example::

        functions, coordinates = LinearFunctions.identity(box)   # the input itself, and its free coordinates
        interval = functions.concretize(coordinates)
    """

    lower: Tensor
    upper: Tensor

    @classmethod
    def identity(cls, box: Interval) -> tuple[LinearFunctions, Interval]:
        """The input as functions of its free coordinates (those of non-zero width in some box of the batch; the
        others are constants of the functions: a box of 96 inputs of which 32 vary carries 33 rows, not 97), and
        the box of those coordinates ``[B, d]``."""
        batch, size = box.lower.shape[0], box.lower[0].numel()
        lower, upper = box.lower.reshape(batch, size), box.upper.reshape(batch, size)
        varies = free_coordinates(box)
        free = varies.nonzero().flatten()
        d = free.numel()
        rows = lower.new_zeros(batch, d + 1, size)
        rows[:, torch.arange(d, device=free.device), free] = 1
        below, above = rows.clone(), rows
        below[:, d] = torch.where(varies, 0, lower)  # a fixed input is a constant between its (ulp-wide) bounds
        above[:, d] = torch.where(varies, 0, upper)
        shape = (batch, d + 1, *box.lower.shape[1:])
        return cls(below.reshape(shape), above.reshape(shape)), Interval(lower[:, free], upper[:, free])

    @classmethod
    def constant(cls, interval: Interval, d: int) -> LinearFunctions:
        """The interval as functions with no ``x`` dependence."""
        zeros = interval.lower.new_zeros(interval.lower.shape[0], d, *interval.lower.shape[1:])
        return cls(
            torch.cat([zeros, interval.lower.unsqueeze(1)], 1), torch.cat([zeros, interval.upper.unsqueeze(1)], 1)
        )

    def concretize(self, box: Interval) -> Interval:
        """The range of the functions over the coordinates' ``box`` ``[B, d]``: ``min lower``, ``max upper`` per
        element. The centre's sum of ``d`` products rounds by ``γ_d·Σ |coefficient|·|centre|``, charged to the
        radius's sum (non-negative terms, scaled up past its own rounding); the constant is added in float64 and the
        result rounded outwards."""
        batch = box.lower.shape[0]
        center = box.center
        radius = box.radius_around(center)
        d = center.shape[1]
        g = gamma(d + 1, self.lower.dtype)
        center, spread = center.reshape(batch, -1, 1), (radius + g * (center.abs() + radius)).reshape(batch, -1, 1)
        shape = self.lower.shape[2:]

        def extreme(functions: Tensor, sign: float) -> Tensor:
            coefficients, constant = flat(functions[:, :d], 2), flat(functions[:, d], 1)
            value = (coefficients * center).sum(1).double() + constant.double()
            value = value + sign * (coefficients.abs() * spread).sum(1).double() * (1 + 2 * g)
            rounded = round_up(value, self.lower.dtype) if sign > 0 else round_down(value, self.lower.dtype)
            return rounded.view(batch, *shape)

        return Interval(extreme(self.lower, -1.0), extreme(self.upper, 1.0))

    def magnitude(self, box: Interval) -> Tensor:
        """``[B, *shape]``: an upper bound over the coordinates' ``box`` of ``Σ_i (|lower_i| + |upper_i|)·|z_i|`` plus
        the constants' magnitudes — what the rounding of arithmetic on the functions' coefficients scales with
        (it also bounds the values between them)."""
        batch = box.lower.shape[0]
        reach = torch.maximum(box.lower.abs(), box.upper.abs()).reshape(batch, -1, 1)
        d = reach.shape[1]
        both = self.lower.abs() + self.upper.abs()
        total = (flat(both[:, :d], 2) * reach).sum(1) + flat(both[:, d], 1)
        return (total * (1 + 2 * gamma(d + 2, total.dtype))).view(batch, *self.lower.shape[2:])

    def widen_(self, error: Tensor | float) -> LinearFunctions:
        """These functions moved apart by ``error`` (per element) in their constants, rounded outwards, in place
        (the functions of a node being built, nothing else holds them)."""
        self.lower[:, -1] = round_down(self.lower[:, -1].double() - error, self.lower.dtype)
        self.upper[:, -1] = round_up(self.upper[:, -1].double() + error, self.upper.dtype)
        return self


def _through_linear(
    op: LinearOp, functions: LinearFunctions, out_shape: tuple[int, ...], magnitude: Tensor | None
) -> LinearFunctions:
    """``L(mid) ± |L|(rad) + c`` of the functions' midpoint and radius, moved apart by the op's rounding on values up
    to the functions' ``magnitude`` (:meth:`LinearOp.map_rounding` also covers the halving of the functions into
    a midpoint and a radius). Copies map each function as it is: exactly."""
    batch, rows = functions.lower.shape[:2]
    flat = (batch * rows, *functions.lower.shape[2:])

    def mapped(function: Tensor, linear) -> Tensor:
        return linear(function.reshape(flat)).expand(batch * rows, *out_shape).reshape(batch, rows, *out_shape)

    constant = op.constant()
    if op.terms()[0] == 0:
        lower, upper = mapped(functions.lower, op.linear), mapped(functions.upper, op.linear)
        if constant is not None:  # a padding constant lands on zeros
            lower, upper = lower.clone(), upper.clone()
            lower[:, -1] += constant
            upper[:, -1] += constant
        return LinearFunctions(lower, upper)
    mid = mapped((functions.lower + functions.upper) / 2, op.linear)
    rad = mapped((functions.upper - functions.lower) / 2, op.abs_linear)
    if constant is not None:
        mid = mid.clone()
        mid[:, -1] += constant
    error = op.map_rounding([Interval(-magnitude, magnitude)])
    return LinearFunctions(mid - rad, mid + rad).widen_(error.double())


def _through_activation(
    op: Activation, functions: LinearFunctions, pre: Interval, magnitude: Tensor
) -> LinearFunctions:
    """``a_L·z + b_L ≤ f(z) ≤ a_U·z + b_U`` with ``z`` between its two functions: each line takes the function on
    the side its slope's sign asks for; the products with the slopes round by ``u·|slope|`` of the functions'
    magnitude, and the op's own rounding (the model's, the intercepts') is charged as in a backward step."""
    lines = op.relax(pre)

    def line(slope: Tensor, bias: Tensor | None, toward: Tensor, away: Tensor) -> Tensor:
        slope = slope.unsqueeze(1)
        out = torch.where(slope >= 0, toward, away) * slope
        if bias is not None:
            out = out.clone()
            out[:, -1] += bias
        return out

    out = LinearFunctions(
        line(lines.lower_slope, lines.lower_bias, functions.lower, functions.upper),
        line(lines.upper_slope, lines.upper_bias, functions.upper, functions.lower),
    )
    steepest = torch.maximum(lines.lower_slope.abs(), lines.upper_slope.abs()).double()
    products = 2 * unit_roundoff(pre.lower.dtype) * steepest * magnitude.double()
    return out.widen_(op.line_rounding(lines, pre).double() + products)


def _through_concat(op: Concat, sources: list[LinearFunctions], d: int) -> LinearFunctions:
    """The pieces joined along the op's axis (a constant piece is a constant function)."""
    batch = sources[0].lower.shape[0]
    computed = iter(sources)
    lower, upper = [], []
    for part in op.parts:
        if part is None:
            piece = next(computed)
            lower.append(piece.lower)
            upper.append(piece.upper)
        else:
            constant = LinearFunctions.constant(Interval(*(part.expand(batch, *part.shape),) * 2), d)
            lower.append(constant.lower)
            upper.append(constant.upper)
    return LinearFunctions(torch.cat(lower, op.axis + 2), torch.cat(upper, op.axis + 2))


class ForwardPass:
    """Forward linear functions built node by node in topological order, each from the bounds known so far: the
    caller may tighten a node's bounds (e.g. with CROWN) before the nodes after it are reached, and the ReLU
    relaxations after it then use the tighter bounds. A node's functions are dropped once every node that reads
    them is built, so the pass holds a few nodes' functions at a time, not the whole network's (``2·(d+1)`` values
    per neuron and box: on a conv net over a thousand boxes, gigabytes per layer).

    Example::

        forward = ForwardPass(graph, box)
        for node in graph.nodes[1:]:
            bounds[node.name] = forward.tighten(node, node.op.ibp(*inputs), bounds)
    """

    def __init__(self, graph: BoundGraph, box: Interval) -> None:
        self.box = box
        self.identity, self.coordinates = LinearFunctions.identity(box)
        self.d = self.coordinates.lower.shape[1]
        self.functions: dict[str, LinearFunctions] = {}
        self._magnitudes: dict[str, Tensor] = {}  # of the functions held, once some reader needed it
        self._readers_left = Counter(name for node in graph.nodes for name in node.inputs)

    def tighten(self, node: Node, interval: Interval, bounds: Mapping[str, Interval]) -> Interval:
        """``interval`` (valid bounds of ``node``) intersected with the range of its forward functions; ``bounds``
        holds the bounds of every node before it."""
        if node.op is None:
            self.functions[node.name] = self.identity
            return interval
        mapped = self._map(node, bounds)
        for name in node.inputs:
            self._readers_left[name] -= 1
            if not self._readers_left[name]:
                del self.functions[name]
                self._magnitudes.pop(name, None)
        if mapped is None:  # no forward rule: constant functions of its interval
            mapped = LinearFunctions.constant(interval, self.d)
        else:
            linear = mapped.concretize(self.coordinates)
            lower, upper = torch.maximum(interval.lower, linear.lower), torch.minimum(interval.upper, linear.upper)
            interval = Interval(lower, upper)
        if self._readers_left[node.name]:
            self.functions[node.name] = mapped
        return interval

    def _magnitude(self, name: str) -> Tensor:
        if name not in self._magnitudes:
            self._magnitudes[name] = self.functions[name].magnitude(self.coordinates)
        return self._magnitudes[name]

    def _map(self, node: Node, bounds: Mapping[str, Interval]) -> LinearFunctions | None:
        """The functions of ``node`` from its inputs' (``None``: the op has no forward rule)."""
        op, sources = node.op, [self.functions[name] for name in node.inputs]
        if isinstance(op, LinearOp):
            magnitude = self._magnitude(node.inputs[0]) if op.terms()[0] else None
            return _through_linear(op, sources[0], node.shape, magnitude)
        if isinstance(op, Add):
            a, b = sources
            out = (
                LinearFunctions(a.lower - b.upper, a.upper - b.lower)
                if op.subtract
                else LinearFunctions(a.lower + b.lower, a.upper + b.upper)
            )
            # Each coefficient's sum rounds (half an ulp), and so does the model's sum of the values.
            magnitude = sum(self._magnitude(name).double() for name in node.inputs)
            return out.widen_(
                2 * unit_roundoff(a.lower.dtype) * magnitude + op.rounding([bounds[n] for n in node.inputs])
            )
        if isinstance(op, Concat):
            return _through_concat(op, sources, self.d)
        if isinstance(op, Activation):
            return _through_activation(op, sources[0], bounds[node.inputs[0]], self._magnitude(node.inputs[0]))
        return None


def forward_bytes_per_box(graph: BoundGraph, free_dims: int) -> int:
    """The working memory of :func:`forward_bounds` per box over ``free_dims`` input coordinates: every node's
    bounds, which it returns, and a few copies of the largest node's two functions, which it holds while building
    that node. Input splitting sizes its batches by it."""
    itemsize = torch.empty((), dtype=graph.dtype).element_size()
    bounds = sum(2 * node.size for node in graph.nodes)
    functions = _LIVE_COPIES * 2 * (free_dims + 1) * max(node.size for node in graph.nodes)
    return (bounds + functions) * itemsize


def forward_bounds(
    graph: BoundGraph,
    box: Interval,
    reference: Mapping[str, Interval] | None = None,
) -> dict[str, Interval]:
    """Bounds ``[B, *shape]`` of every node up to the output over the boxes ``box [B, *input shape]``: the
    concretised forward linear functions, intersected with interval propagation (and with ``reference`` bounds,
    known valid, where given). The ReLU relaxations use these intersected bounds. A one-rank pass stops at the
    run's deadline between nodes (:func:`~lightning_fedshard.verify.budget.check_deadline_between_steps`).

    Example::

        bounds = forward_bounds(graph, boxes)          # then e.g. spec_lower(graph, C, boxes, bounds)
    """
    forward = ForwardPass(graph, box)
    bounds = {graph.input.name: forward.tighten(graph.input, box, {})}
    for node in graph.nodes[1:]:
        check_deadline_between_steps()
        interval = node.op.ibp(*(bounds[name] for name in node.inputs))
        if reference is not None and node.name in reference:
            ref = reference[node.name]
            interval = Interval(torch.maximum(interval.lower, ref.lower), torch.minimum(interval.upper, ref.upper))
        bounds[node.name] = forward.tighten(node, interval, bounds)
        if node is graph.output:
            break
    return bounds
