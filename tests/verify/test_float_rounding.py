"""float32 rounding cannot prove a property: a network built so that float32 loses a term of −0.25 in a sum with
2^24 (in the forward pass, and in a backward pass that did not charge its rounding) while in exact arithmetic its
output violates the property. Plain float32 arithmetic sees a margin of +0.125 everywhere; the exact margin,
computed here in rationals, is −0.125. Every bound (interval propagation, CROWN, α-CROWN, the leaves of both
branch-and-bound searches, input splitting's clipping planes) must stay at or below the exact one, and no answer
may be ``unsat``."""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest
import torch

from lightning_fedshard.verify import BoundGraph, Verdict, VerifyConfig, verify
from lightning_fedshard.verify.bab.input_split import input_split
from lightning_fedshard.verify.bab.loop import branch_and_bound
from lightning_fedshard.verify.bab.pieces import prove_by_pieces
from lightning_fedshard.verify.bounds.alpha import alpha_crown
from lightning_fedshard.verify.bounds.crown import intermediate_bounds, spec_lower
from lightning_fedshard.verify.budget import Budget
from lightning_fedshard.verify.config import BabMode
from lightning_fedshard.verify.graph import Node
from lightning_fedshard.verify.objective import OutputSpec, box_tensor
from lightning_fedshard.verify.ops import Interval, Linear, ReLU
from lightning_fedshard.verify.spec import Case, Disjunct, InputBox, Property

BIG = 2.0**24
#: The fixed input x0; the property's unsafe set is ``y ≤ RHS``.
X0, RHS = -0.25, -0.375


def _net() -> BoundGraph:
    """``y = relu(relu(x0 + 2^24) − (2^24 − 1)) − 1.25`` (exactly ``x0 − 0.25 = −0.5``; float32: −0.25), beside an
    unstable ReLU of ``x1`` that the output ignores (something for branch-and-bound to split)."""
    return BoundGraph(
        [
            Node("x", None, (), (2,)),
            Node("fc0", Linear(torch.eye(2), torch.tensor([BIG, 0.0])), ("x",), (2,)),
            Node("relu0", ReLU(), ("fc0",), (2,)),
            Node("fc1", Linear(torch.eye(2), torch.tensor([-(BIG - 1), 0.0])), ("relu0",), (2,)),
            Node("relu1", ReLU(), ("fc1",), (2,)),
            Node("fc2", Linear(torch.tensor([[1.0, 0.0]]), torch.tensor([-1.25])), ("relu1",), (1,)),
        ]
    )


def _exact_output(x0: float) -> Fraction:
    """The network's output in rational arithmetic on its float32 weights (every pre-activation is positive)."""
    hidden = Fraction(x0) + Fraction(BIG)
    return hidden - Fraction(BIG - 1) - Fraction(5, 4)


def _case(x1: tuple[float, float]) -> Case:
    return Case(InputBox(np.array([X0, x1[0]]), np.array([X0, x1[1]])), (Disjunct(np.array([[1.0]]), np.array([RHS])),))


def _spec_and_box(graph: BoundGraph, x1: tuple[float, float]) -> tuple[OutputSpec, Interval]:
    case = _case(x1)
    return OutputSpec.from_case(case, graph.output.shape, graph.dtype), box_tensor(
        case.box.lower, case.box.upper, graph.input.shape, graph.dtype
    )


def test_the_network_fools_float32_and_violates_the_property_exactly():
    graph = _net()
    spec, box = _spec_and_box(graph, (-1.0, 1.0))
    assert _exact_output(X0) - Fraction(RHS) == Fraction(-1, 8)  # a counterexample in exact arithmetic
    with torch.no_grad():
        points = torch.tensor([[X0, x1] for x1 in np.linspace(-1, 1, 11)], dtype=torch.float32)
        assert bool((spec.point_value(graph(points)) == 0.125).all())  # float32 execution: safe everywhere
        crown = spec_lower(graph, spec.rows(1), box, intermediate_bounds(graph, box))
        alpha = alpha_crown(graph, box, spec.rows(1), iterations=5).lower
    for lower in (crown, alpha):  # every bound at or below the exact margin, whatever float32 sums to
        assert float(spec.margins(lower)[0, 0]) <= -0.125


@pytest.mark.parametrize("bab", [BabMode.NEURON, BabMode.INPUT])
def test_the_verifier_does_not_answer_unsat(bab):
    graph = _net()
    prop = Property(2, 1, (_case((X0, X0)),))  # x1 fixed too: input splitting has nothing to split
    result = verify(graph, prop, VerifyConfig(timeout=20, bab=bab, attack_restarts=10))
    assert result.verdict is Verdict.UNKNOWN
    assert result.root_margins[0][0] <= -0.125  # no bound above the exact margin


def test_relu_branch_and_bound_leaves_are_not_proven():
    graph = _net()
    spec, box = _spec_and_box(graph, (-1.0, 1.0))
    root = alpha_crown(graph, box, spec.rows(1), iterations=2)
    with Budget.start(timeout=20).using():
        outcome = branch_and_bound(graph, spec, box, root, VerifyConfig())
    assert outcome.verdict is Verdict.UNKNOWN and outcome.domains_bounded > 0


def test_pieces_are_not_proven():
    graph = _net()
    spec, box = _spec_and_box(graph, (-1.0, 1.0))
    bounds = intermediate_bounds(graph, box)
    lower = spec_lower(graph, spec.rows(1), box, bounds)
    proven, cex = prove_by_pieces(graph, spec, box, bounds, lower)
    assert not bool(proven.any()) and cex is None


@pytest.mark.parametrize(("x1", "verdict"), [((X0, X0), Verdict.UNKNOWN), ((-1.0, 1.0), Verdict.TIMEOUT)])
def test_input_splitting_neither_proves_nor_clips_away_the_counterexample(x1, verdict):
    # A point box: float32 arithmetic would claim its one box. A box wide in x1: open boxes are clipped by their CROWN
    # planes, a plane from plain float32 arithmetic would show every box empty; the search runs to its deadline.
    graph = _net()
    spec, box = _spec_and_box(graph, x1)
    with Budget.start(timeout=1.5).using():
        outcome = input_split(graph, spec, box, VerifyConfig())
    assert outcome.verdict is verdict
