"""Every non-linear operator's relaxation against dense sampling in float64.

For random boxes of several kinds — wide (past the S-shapes' saturation), narrow down to 1e-9, straddling each
function's inflection points, kinks and jumps, at domain edges (log, sqrt, reciprocal and fractional powers near
0, odd and even powers of negative numbers), degenerate — and for CROWN's slopes and random α (outside [0, 1] too,
which the ops must project), the backward step's linear bound ``Σ A_in·x + c`` must lie below ``Σ A·f(x)`` at every
sampled point (endpoints, their float32 neighbours, the special points, thousands of uniform ones), and IBP must
contain ``f(x)``. The reference ``f`` is numpy's float64 function, not the op's own code. The bound's coefficients
are the float32 ones the verifier uses, evaluated exactly in float64: a line that is right only up to float32
rounding fails. A deliberately loosened line (its intercept moved by 1e-6 the wrong way) must be caught, so that the
check can fail.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from lightning_fedshard.verify.ops import (
    Clip,
    Cos,
    Exp,
    Floor,
    Interval,
    LeakyReLU,
    Log,
    Mul,
    Pow,
    Reciprocal,
    ReLU,
    Sigmoid,
    Sign,
    Sin,
    Softmax,
    Sqrt,
    Tanh,
    WindowMax,
)

WIDTH = 64  # boxes per family (one neuron each)
SAMPLES = 2001

# op, numpy reference, box families: (centre range, width range), special points (inflections, kinks, jumps)
UNARY = {
    "sigmoid": (Sigmoid(), lambda x: 0.5 * (1 + np.tanh(x / 2)), (-600, 600), [0.0]),
    "tanh": (Tanh(), np.tanh, (-600, 600), [0.0]),
    "exp": (Exp(), np.exp, (-80, 40), []),
    "log": (Log(), np.log, (0, 50), []),
    "sqrt": (Sqrt(), np.sqrt, (0, 50), []),
    "reciprocal_positive": (Reciprocal(), lambda x: 1 / x, (0, 20), []),
    "reciprocal_negative": (Reciprocal(), lambda x: 1 / x, (-20, 0), []),
    "square": (Pow(2.0), np.square, (-30, 30), [0.0]),
    "cube": (Pow(3.0), lambda x: x**3, (-10, 10), [0.0]),
    "fourth_power": (Pow(4.0), lambda x: x**4, (-6, 6), [0.0]),
    "sqrt_as_power": (Pow(0.5), np.sqrt, (0, 30), []),
    "power_1.5": (Pow(1.5), lambda x: np.power(x, 1.5), (0, 30), []),
    "inverse_square": (Pow(-2.0), lambda x: np.power(x, -2.0), (0, 10), []),
    "sin": (Sin(), np.sin, (-30, 30), [k * math.pi for k in range(-10, 11)]),
    "cos": (Cos(), np.cos, (-30, 30), [math.pi / 2 + k * math.pi for k in range(-10, 10)]),
    "relu": (ReLU(), lambda x: np.maximum(x, 0), (-5, 5), [0.0]),
    "leaky_relu": (LeakyReLU(0.1), lambda x: np.where(x >= 0, x, 0.1 * x), (-5, 5), [0.0]),
    "leaky_relu_steep": (LeakyReLU(3.0), lambda x: np.where(x >= 0, x, 3.0 * x), (-5, 5), [0.0]),
    "abs": (LeakyReLU(-1.0), np.abs, (-5, 5), [0.0]),
    "clip": (Clip(-1.0, 2.0), lambda x: np.clip(x, -1, 2), (-6, 6), [-1.0, 2.0]),
    "clip_below_only": (Clip(0.5), lambda x: np.maximum(x, 0.5), (-6, 6), [0.5]),
    "sign": (Sign(), np.sign, (-4, 4), [0.0]),
    "floor": (Floor(), np.floor, (-6, 6), [float(k) for k in range(-6, 7)]),
}

# Where an operator is only defined on part of the line, its boxes stay inside.
DOMAIN = {
    "log": (1e-30, None),
    "sqrt": (0.0, None),
    "sqrt_as_power": (0.0, None),
    "power_1.5": (0.0, None),
    "inverse_square": (1e-3, None),
    "reciprocal_positive": (1e-3, None),
    "reciprocal_negative": (None, -1e-3),
}


def _boxes(name: str, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 ``[families, WIDTH]`` lower and upper bounds: wide, narrow, straddling the special points, at the
    domain's edge, degenerate."""
    _, _, (low, high), special = UNARY[name]
    rng = np.random.default_rng(seed)
    centre = rng.uniform(low, high, WIDTH)
    families = [
        (centre, rng.uniform(0, (high - low) / 2, WIDTH)),  # wide
        (centre, 10.0 ** rng.uniform(-9, -3, WIDTH)),  # narrow
        (centre, np.zeros(WIDTH)),  # degenerate
    ]
    if special:
        points = rng.choice(special, WIDTH)
        families.append((points + rng.uniform(-1, 1, WIDTH) * 0.3, rng.uniform(0.3, 3, WIDTH)))  # straddling
        families.append((points + rng.uniform(-1, 1, WIDTH), np.zeros(WIDTH)))  # ending exactly at one
    lowers, uppers = [], []
    floor, ceiling = DOMAIN.get(name, (None, None))
    for kind, (c, w) in enumerate(families):
        lo, hi = c - w, c + w
        if special and kind == 4:  # [point, point + width]: a box ending on the special point
            lo, hi = points, points + rng.uniform(0, 2, WIDTH)
        if floor is not None:
            lo, hi = np.maximum(lo, floor), np.maximum(hi, floor)
            if kind == 4 or kind == 1:
                lo = np.where(rng.random(WIDTH) < 0.3, floor, lo)  # at the edge itself
        if ceiling is not None:
            lo, hi = np.minimum(lo, ceiling), np.minimum(hi, ceiling)
        lowers.append(np.minimum(lo, hi))
        uppers.append(np.maximum(lo, hi))
    lower = torch.tensor(np.stack(lowers), dtype=torch.float32)
    upper = torch.tensor(np.stack(uppers), dtype=torch.float32)
    return lower, torch.maximum(upper, lower)


def _samples(lower: torch.Tensor, upper: torch.Tensor, special: list[float]) -> np.ndarray:
    """``[points, *shape]`` float64 points of every box: endpoints and their float32 neighbours inside, the special
    points inside, and uniform ones."""
    lo, hi = lower.double().numpy(), upper.double().numpy()
    t = np.linspace(0, 1, SAMPLES).reshape(-1, *([1] * lo.ndim))
    points = [lo + t * (hi - lo), lo[None], hi[None]]
    inward_lo = np.nextafter(lower.numpy(), np.float32(np.inf)).astype(np.float64)
    inward_hi = np.nextafter(upper.numpy(), np.float32(-np.inf)).astype(np.float64)
    points += [np.clip(inward_lo, lo, hi)[None], np.clip(inward_hi, lo, hi)[None]]
    points += [np.clip(np.full_like(lo, s), lo, hi)[None] for s in special]
    return np.concatenate(points)


def _check_backward(
    op, boxes: list[Interval], reference, points: list[np.ndarray], alpha, rows: int = 3, seed: int = 0
):
    """``Σ A·f(x) ≥ Σ_i A_i·x_i + c`` at every sampled point, for random coefficients ``A`` (both signs); returns the
    smallest slack (≥ 0 when sound)."""
    generator = torch.Generator().manual_seed(seed)
    out = op.forward(*(b.lower for b in boxes))
    # float64 coefficients: the relaxation's float32 lines are then combined without rounding (the float32
    # arithmetic of a whole bound pass is another matter than whether each line is on its side).
    A = torch.randn(rows, *out.shape, generator=generator, dtype=torch.float64)
    A_in, bias = op.backward(A, boxes, alpha)
    bias = torch.zeros(rows, out.shape[0]) if bias is None else bias
    value = reference(*points)  # [P, B, *shape]

    def contract(coefficients: torch.Tensor, x: np.ndarray) -> np.ndarray:  # [S, B, *s] · [P, B, *s] -> [P, S, B]
        product = coefficients.double().numpy()[None] * x[:, None]
        return product.reshape(*product.shape[:3], -1).sum(-1)

    lhs = contract(A, value.reshape(value.shape[0], *out.shape))
    rhs = bias.double().numpy()[None]
    for A_i, x in zip(A_in, points, strict=True):
        if A_i is not None:
            rhs = rhs + contract(A_i, np.broadcast_to(x, (x.shape[0], *A_i.shape[1:])))
    return float(np.nanmin(lhs - rhs))


@pytest.mark.parametrize("name", UNARY)
@pytest.mark.parametrize("seed", [0, 1])
def test_unary_relaxations_hold_at_every_sampled_point(name: str, seed: int) -> None:
    op, reference, _, special = UNARY[name]
    lower, upper = _boxes(name, seed)
    box = Interval(lower, upper)
    x = _samples(lower, upper, special)
    with np.errstate(all="ignore"):
        y = reference(x)
    assert np.isfinite(y).all(), "the boxes stay inside the domain"
    ibp = op.ibp(box)
    assert (ibp.lower.double().numpy() <= y).all() and (y <= ibp.upper.double().numpy()).all(), "IBP"
    alpha_shape = op.alpha_shape(tuple(lower.shape[1:]))
    generator = torch.Generator().manual_seed(seed)
    alphas = [None]
    if alpha_shape is not None:  # α anywhere, [0, 1] and beyond: the op projects it
        alphas += [torch.rand(3, lower.shape[0], *alpha_shape, generator=generator) * 2 - 0.5 for _ in range(3)]
    for alpha in alphas:
        with np.errstate(all="ignore"):
            slack = _check_backward(op, [box], reference, [x], alpha, seed=seed)
        assert slack >= 0, (
            f"{name}: a sampled point lies {-slack:.3g} outside the bound (α {'given' if alpha is not None else 'CROWN'})"
        )


def test_the_sampling_check_catches_a_line_moved_by_1e_6():
    # The same check on a relaxation whose lower intercepts are raised by 1e-6: it must fail. (Its rounding charge
    # is left out, which on these wide boxes is larger than 1e-6: the lines themselves must be caught.)
    op = Sigmoid()
    lower, upper = _boxes("sigmoid", 0)
    lines = op.relax(Interval(lower, upper))

    class Loosened(Sigmoid):
        def relax(self, pre, alpha=None):
            return type(lines)(lines.lower_slope, lines.lower_bias + 1e-6, lines.upper_slope, lines.upper_bias)

        def line_rounding(self, lines, pre):
            return torch.zeros_like(pre.lower)

    x = _samples(lower, upper, [0.0])
    reference = UNARY["sigmoid"][1]
    assert _check_backward(op, [Interval(lower, upper)], reference, [x], None) >= 0
    assert _check_backward(Loosened(), [Interval(lower, upper)], reference, [x], None) < 0


@pytest.mark.parametrize("seed", range(3))
def test_products_of_two_tensors_hold_on_every_sign_pattern(seed: int) -> None:
    rng = np.random.default_rng(seed)
    n = 81  # the nine sign patterns of the two factors, nine boxes each, some degenerate
    signs = np.array([(a, b) for a in (-1, 0, 1) for b in (-1, 0, 1)]).repeat(9, 0)
    width = rng.uniform(0, 3, (2, n)) * (rng.random((2, n)) > 0.1)
    centre = signs.T * rng.uniform(0.5, 3, (2, n))
    lo = (centre - width / 2).astype(np.float32).astype(np.float64)  # the boxes the op sees, exactly
    hi = np.maximum((centre + width / 2).astype(np.float32).astype(np.float64), lo)
    boxes = [
        Interval(torch.tensor(lo[i : i + 1], dtype=torch.float32), torch.tensor(hi[i : i + 1], dtype=torch.float32))
        for i in range(2)
    ]
    op = Mul(((n,), (n,)), (n,))
    grid = np.linspace(0, 1, 41)
    u, v = np.meshgrid(grid, grid, indexing="ij")
    a = lo[0] + u.reshape(-1, 1) * (hi[0] - lo[0])
    b = lo[1] + v.reshape(-1, 1) * (hi[1] - lo[1])
    points = [a[:, None], b[:, None]]  # [P, B=1, n]
    ibp = op.ibp(*boxes)
    product = a * b
    assert (ibp.lower.double().numpy() <= product).all() and (product <= ibp.upper.double().numpy()).all()
    generator = torch.Generator().manual_seed(seed)
    for alpha in [None, torch.rand(3, 1, 2, n, generator=generator) * 2 - 0.5]:
        assert _check_backward(op, boxes, lambda x, y: x * y, points, alpha, seed=seed) >= 0


def test_products_broadcast_their_coefficients_back_to_each_factor() -> None:
    # a [2, 3] times b [2, 1]: b's coefficient is the sum over the row it multiplies.
    op = Mul(((2, 3), (2, 1)), (2, 3))
    rng = np.random.default_rng(0)
    lo_a, lo_b = rng.uniform(-2, 1, (1, 2, 3)), rng.uniform(-2, 1, (1, 2, 1))
    boxes = [
        Interval(torch.tensor(lo_a, dtype=torch.float32), torch.tensor(lo_a + 1, dtype=torch.float32)),
        Interval(torch.tensor(lo_b, dtype=torch.float32), torch.tensor(lo_b + 2, dtype=torch.float32)),
    ]
    t = rng.random((500, 1, 2, 3))
    s = rng.random((500, 1, 2, 1))
    points = [lo_a + t, lo_b + 2 * s]
    assert _check_backward(op, boxes, lambda x, y: x * y, points, None) >= 0


@pytest.mark.parametrize("seed", range(3))
def test_window_maxima_hold_and_are_exact_where_one_element_dominates(seed: int) -> None:
    rng = np.random.default_rng(seed)
    size, outputs, k = 12, 8, 4
    windows = torch.tensor(np.stack([rng.choice(size, k, replace=False) for _ in range(outputs)]))
    windows[0, 0] = -1  # padding
    op = WindowMax(windows, (size,), (outputs,))
    centre = rng.uniform(-2, 2, (1, size)).astype(np.float32).astype(np.float64)
    radius = (rng.uniform(0, 1.5, (1, size)) * (rng.random((1, size)) > 0.2)).astype(np.float32).astype(np.float64)
    lower = torch.tensor(centre - radius, dtype=torch.float32)
    upper = torch.tensor(centre + radius, dtype=torch.float32)
    x = np.clip(centre + radius * rng.uniform(-1, 1, (4000, 1, size)), lower.double().numpy(), upper.double().numpy())
    index = windows.clamp(min=0).numpy()

    def maxima(points):
        taken = points[..., index]
        return np.where(windows.numpy() < 0, -np.inf, taken).max(-1)

    assert _check_backward(op, [Interval(lower, upper)], maxima, [x], None, seed=seed) >= 0
    # A window whose first element dominates: the bound is that element exactly.
    dominant = WindowMax(torch.tensor([[0, 1, 2]]), (3,), (1,))
    box = Interval(torch.tensor([[5.0, 0.0, -1.0]]), torch.tensor([[6.0, 4.0, 2.0]]))
    (A_in,), bias = dominant.backward(torch.tensor([[[-1.0]]]), [box])
    assert A_in.tolist() == [[[-1.0, 0.0, 0.0]]] and float(bias) == 0.0


@pytest.mark.parametrize("seed", range(3))
def test_softmax_bounds_hold_for_wide_and_dominated_logits(seed: int) -> None:
    rng = np.random.default_rng(seed)
    classes = 5
    centre = rng.uniform(-8, 8, (1, classes))
    centre[0, 0] += 20 * (seed == 2)  # one dominant logit
    radius = rng.uniform(0, 4, (1, classes))
    lower = torch.tensor(centre - radius, dtype=torch.float32)
    upper = torch.tensor(centre + radius, dtype=torch.float32)
    lo, hi = lower.double().numpy(), upper.double().numpy()
    op = Softmax(0, (classes,))
    x = lo + (hi - lo) * rng.random((4000, 1, classes))
    corners = np.where(rng.random((200, 1, classes)) < 0.5, lo, hi)
    x = np.concatenate([x, corners])

    def softmax(points):
        e = np.exp(points - points.max(-1, keepdims=True))
        return e / e.sum(-1, keepdims=True)

    ibp = op.ibp(Interval(lower, upper))
    y = softmax(x)
    assert (ibp.lower.double().numpy() <= y).all() and (y <= ibp.upper.double().numpy()).all()
    assert _check_backward(op, [Interval(lower, upper)], softmax, [x], None, seed=seed) >= 0


@pytest.mark.parametrize("name", ["sigmoid", "tanh", "exp", "log", "sqrt", "reciprocal_positive", "cube", "sin", "cos"])
def test_alpha_gradients_are_those_of_the_lines(name: str) -> None:
    # α-CROWN climbs the bound along autograd's gradient with respect to α: it must be the derivative of the lines
    # themselves (central differences, in float64), not that of a safety margin inside them.
    op, _, (low, high), _ = UNARY[name]
    floor, _ = DOMAIN.get(name, (None, None))
    rng = np.random.default_rng(7)
    start = low if floor is None else max(low, floor)
    centre = rng.uniform(start + 1, high, (1, 256))
    half = rng.uniform(0.2, 3, (1, 256))
    lower = np.maximum(centre - half, floor) if floor is not None else centre - half
    pre = Interval(torch.tensor(lower), torch.tensor(centre + half))  # float64: the lines are not rounded
    point = pre.lower + torch.tensor(rng.random((1, 256))) * (pre.upper - pre.lower)

    def heights(alpha: torch.Tensor) -> torch.Tensor:  # [2, 256]: the lower and the upper line at the point
        lines = op.relax(pre, alpha)
        return torch.cat([lines.lower_slope * point + lines.lower_bias, lines.upper_slope * point + lines.upper_bias])

    alpha = torch.tensor(rng.uniform(0.1, 0.9, (1, 1, 2, 256)), requires_grad=True)
    heights(alpha).sum().backward()
    step = 1e-6
    for side in range(2):
        up, down = alpha.detach().clone(), alpha.detach().clone()
        up[:, :, side] += step
        down[:, :, side] -= step
        numeric = (heights(up)[side] - heights(down)[side]) / (2 * step)
        agree = torch.isclose(alpha.grad[0, 0, side], numeric, rtol=1e-3, atol=1e-4)
        # the line's height is piecewise smooth in α (where its touching point jumps): a few may straddle a kink
        assert float(agree.double().mean()) >= 0.95, (side, alpha.grad[0, 0, side][~agree][:4], numeric[~agree][:4])
