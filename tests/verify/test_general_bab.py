"""Branch-and-bound over general non-linearities (GenBaB) against exhaustive evaluation.

Small two-input nets with sigmoid, tanh, sine, products of two computed values and squares: the true minimum of the
output over the box comes from a dense grid in float64 (with the grid's own error bounded by the net's Lipschitz
constant times the spacing, estimated on the grid itself). A threshold clearly below it must be proven ``unsat``
by input splitting, and by neuron splitting where the root's α-CROWN bound does not prove it already; one clearly
above must be refuted with a counterexample. Split constraints with their points must keep the bound of every
child below the values of the points that child holds, a smooth-graph search that can split nothing more answers
``unknown``, and each op's split point leaves its children no looser than bisection would.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lightning_fedshard.verify import Node, Verdict, VerifyConfig, verify
from lightning_fedshard.verify.bab.domains import DomainBatch
from lightning_fedshard.verify.bounds.alpha import alpha_crown
from lightning_fedshard.verify.bounds.beta import beta_crown
from lightning_fedshard.verify.objective import OutputSpec
from lightning_fedshard.verify.ops import Concat, Interval, Mul, Pow, Sigmoid, Sin, Tanh
from lightning_fedshard.verify.spec import Case, Disjunct, InputBox, Property
from tests.verify.nets import GraphBuilder

GRID = 401  # per axis


def _net(seed: int, kind: str):
    b = GraphBuilder(seed, (2,))
    b.linear("fc0", 6)
    if kind == "sigmoid":
        b.add("a0", Sigmoid())
        b.linear("fc1", 6)
        b.add("a1", Tanh())
    elif kind == "sine":
        b.add("a0", Sin())
        b.linear("fc1", 6)
        b.add("a1", Sigmoid())
    elif kind == "concat":  # a join of a computed branch, the input's own layer and a constant
        b.add("a0", Sigmoid())
        b.linear("fc0b", 3, "x")
        b.add("join", Concat(0, [None, torch.tensor([0.5, -0.25]), None], [6, 2, 3]), "a0", "fc0b")
        b.linear("fc1", 6)
        b.add("a1", Tanh())
    else:  # products: (fc0)·(fc0') and a square
        b.linear("fc0b", 6, "x")
        b.add("a0", Mul(((6,), (6,)), (6,)), "fc0", "fc0b")
        b.linear("fc1", 6)
        b.add("a1", Pow(2.0))
    b.linear("out", 1)
    return b.graph()


def _grid_minimum(graph) -> tuple[float, float, np.ndarray]:
    """The least output over a dense grid of [-1, 1]², an upper bound on how far below it the true minimum can lie
    (the largest change between neighbouring grid points), and the argmin."""
    t = torch.linspace(-1, 1, GRID, dtype=torch.float64)
    x = torch.cartesian_prod(t, t)
    with torch.no_grad():
        y = graph(x.float()).double().view(GRID, GRID)
    step = max(float((y[1:] - y[:-1]).abs().max()), float((y[:, 1:] - y[:, :-1]).abs().max()))
    index = int(y.argmin())
    return float(y.min()), step, x[index].numpy()


def _property(threshold: float) -> Property:
    """Unsafe: ``y ≤ threshold`` anywhere in [-1, 1]²."""
    box = InputBox(np.full(2, -1.0), np.full(2, 1.0))
    return Property(2, 1, (Case(box, [Disjunct(np.ones((1, 1)), np.array([threshold]))]),))


def _root_bound(graph) -> float:
    """α-CROWN's lower bound of the output over [-1, 1]² (no branching)."""
    box = Interval(torch.full((1, 2), -1.0), torch.full((1, 2), 1.0))
    return float(alpha_crown(graph, box, torch.ones(1, 1, 1), iterations=40).lower[0, 0])


def _beyond_the_root(graph) -> float:
    """A threshold halfway between the root's α-CROWN bound and the true minimum: the root cannot prove ``y`` above
    it, and it lies clearly below the minimum (by more than the grid's own error)."""
    minimum, step, _ = _grid_minimum(graph)
    root = _root_bound(graph)
    assert root < minimum - 8 * step, "the root bound is too tight for the case to need branching"
    return (root + minimum) / 2


@pytest.mark.parametrize("kind", ["sigmoid", "sine", "products", "concat"])
@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("bab", ["neuron", "input"])
def test_branch_and_bound_agrees_with_a_dense_grid(kind: str, seed: int, bab: str) -> None:
    # Input splitting, the search the verifier picks for two inputs, must come within 5 % of the spread of the
    # minimum; neuron splitting (GenBaB: the intermediate bounds stay the root's, only the split neurons narrow) as
    # well, or at least close a fifth of the root's gap to it where the root is far off (on the sine net it gets no
    # further than a quarter within the timeout, from α-CROWN's root at −0.1350: the sigmoid's input bounds stay the
    # root's unless its own neurons are split). Above the minimum, both must find a counterexample.
    graph = _net(seed, kind)
    minimum, step, _ = _grid_minimum(graph)
    spread = minimum - float(graph(torch.zeros(1, 2))[0, 0])  # how far the minimum lies below the centre's value
    gap = max(0.05 * abs(spread), 4 * step)
    safe_threshold = minimum - gap
    if bab == "neuron":
        root = _root_bound(graph)
        safe_threshold = min(safe_threshold, root + (minimum - root) / 5)
    config = VerifyConfig(timeout=60, bab=bab, attack_restarts=0, attack_every=0)
    safe = verify(graph, _property(safe_threshold), config)
    assert safe.verdict is Verdict.UNSAT, (safe.verdict, safe.root_margins)
    unsafe = verify(graph, _property(minimum + gap), VerifyConfig(timeout=60, bab=bab))
    assert unsafe.verdict is Verdict.SAT
    assert float(unsafe.counterexample.y[0]) <= minimum + gap


@pytest.mark.parametrize("kind", ["sigmoid", "products"])
def test_children_split_at_a_point_bound_the_points_they_hold(kind: str) -> None:
    # Split every neuron of the first non-linear layer's input at a random interior point, optimise β, and check each
    # child's bound against the sampled points whose neuron value lies on that child's side.
    graph = _net(0, kind)
    box = Interval(torch.full((1, 2), -1.0), torch.full((1, 2), 1.0))
    case = _property(0.0).cases[0]
    spec = OutputSpec.from_case(case, graph.output.shape, graph.dtype)
    root = alpha_crown(graph, box, spec.rows(1), iterations=5)
    domains = DomainBatch.at_root(graph, spec, root)
    name = graph.split_nodes[0]
    interval = root.bounds[name]
    generator = torch.Generator().manual_seed(0)
    t = torch.rand(interval.lower.shape, generator=generator) * 0.8 + 0.1
    points = interval.lower + t * (interval.upper - interval.lower)
    layer = torch.tensor([graph.split_nodes.index(name)])
    children = domains.split(graph.split_nodes, layer, torch.tensor([2]), points[0, 2:3])
    result = beta_crown(graph, box, spec.rows(2), children, iterations=10, lr_beta=0.5)
    x = torch.rand(20000, 2, generator=generator) * 2 - 1
    values = {graph.input.name: x}
    for node in graph.nodes[1:]:
        values[node.name] = node.op.forward(*(values[i] for i in node.inputs))
    z, y = values[name][:, 2], values[graph.output.name][:, 0]
    above, below = z >= points[0, 2], z <= points[0, 2]
    assert above.any() and below.any()
    assert float(result.lower[0, 0]) <= float(y[above].min()) + 1e-5
    assert float(result.lower[0, 1]) <= float(y[below].min()) + 1e-5


def test_neuron_splitting_proves_what_the_root_cannot_and_is_unknown_when_nothing_is_left_to_split(monkeypatch):
    graph = _net(0, "sigmoid")
    prop = _property(_beyond_the_root(graph))
    config = VerifyConfig(timeout=60, bab="neuron", attack_restarts=0)
    proven = verify(graph, prop, config)
    assert proven.verdict is Verdict.UNSAT and proven.decided_by == "bab" and proven.domains_bounded > 0
    # No neuron may be split (every interval counts as too narrow): the search cannot go on, and must say so.
    for op in (Sigmoid, Tanh):
        monkeypatch.setattr(op, "split_min_width", 1e9)
    assert verify(graph, prop, config).verdict is Verdict.UNKNOWN


def _children_gap(op, lower: float, point: float, upper: float) -> float:
    """``∫ (U − L)`` over both children of a split at ``point``, of the op's lines on each child, by the trapezoidal
    rule on a dense grid: how loose the two children's relaxations are together."""
    total = 0.0
    for a, b in ((lower, point), (point, upper)):
        lines = op.relax(Interval(torch.tensor([[a]]), torch.tensor([[b]])))
        x = torch.linspace(a, b, 2001, dtype=torch.float64)
        gap = (lines.upper_slope.double() - lines.lower_slope.double())[0, 0] * x
        gap = gap + float(lines.upper_bias[0, 0]) - float(lines.lower_bias[0, 0])
        total += float(torch.trapezoid(gap, x))
    return total


def test_split_points_come_from_each_op() -> None:
    # ReLU at its kink; a product's factor at 0 where it straddles it, else its middle; a smooth function where its
    # children's relaxations are loosest together no more than after bisection (GenBaB's optimised points).
    from lightning_fedshard.verify.ops import ReLU

    interval = Interval(torch.tensor([[-1.0, 0.5]]), torch.tensor([[3.0, 2.5]]))
    assert ReLU().split_point([interval], 0).tolist() == [[0.0, 0.0]]
    assert Mul(((2,), (2,)), (2,)).split_point([interval, interval], 0).tolist() == [[0.0, 1.5]]
    for op, (lower, upper) in [
        (Sigmoid(), (-2.0, 2.0)),
        (Sigmoid(), (-6.0, 1.0)),
        (Tanh(), (0.5, 4.0)),
        (Sin(), (-1.0, 2.5)),
    ]:
        point = float(op.split_point([Interval(torch.tensor([[lower]]), torch.tensor([[upper]]))], 0)[0, 0])
        assert lower < point < upper
        middle = (lower + upper) / 2
        assert _children_gap(op, lower, point, upper) <= _children_gap(op, lower, middle, upper) + 1e-6


def test_mul_nodes_split_both_factors() -> None:
    graph = _net(0, "products")
    product = next(node for node in graph.nodes if isinstance(node.op, Mul))
    assert set(product.inputs) <= set(graph.split_nodes)
    assert all(isinstance(graph.splitter[name][0].op, Mul) for name in product.inputs)
    assert isinstance(Node, type)  # the public node type is re-exported
