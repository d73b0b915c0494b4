"""LP/MILP-refined pre-activation bounds: the LP equals one written independently here as dense matrices and solved
by HiGHS from them (as scipy's ``linprog(method="highs")`` would: scipy is not a dependency, and importing it cost
every Lightning process 2 s through torchmetrics); LP and MILP bounds hold on sampled points, are never looser than the bounds they start from, and the
MILP (exact ReLUs) reaches the range a dense grid shows; a solver that gives up leaves a bound as it was; refined
bounds feed the verifier."""

from __future__ import annotations

import itertools

import highspy
import numpy as np
import pytest
import torch

from lightning_fedshard.verify import BoundGraph, Verdict, VerifyConfig, verify
from lightning_fedshard.verify.bounds import lp
from lightning_fedshard.verify.bounds.crown import intermediate_bounds
from lightning_fedshard.verify.config import BabMode, Refine
from lightning_fedshard.verify.ops import Interval, Linear
from lightning_fedshard.verify.spec import Case, Disjunct, InputBox, Property
from tests.verify.nets import random_mlp


def _net(seed: int, widths=(3, 8, 8, 6, 2)) -> BoundGraph:
    return random_mlp(seed, widths)


BOX = Interval(-torch.ones(1, 3), torch.ones(1, 3))


def _triangle_lp(graph: BoundGraph, bounds: dict[str, Interval], target: str, neuron: int, sense: int) -> float:
    """The same LP written out by hand over the layer weights (x, then z and a per ReLU layer) for linprog: rows
    are ``{column: coefficient}`` with their right-hand side, made dense once every column exists."""
    layers = [node for node in graph.nodes if isinstance(node.op, Linear)]
    depth = [node.name for node in layers].index(target)
    equalities, inequalities, box = [], [], [(-1.0, 1.0)] * 3
    previous = [0, 1, 2]  # the columns the next layer reads
    for node in layers[:depth]:
        W, b = node.op.weight.double().numpy(), node.op.bias.double().numpy()
        l, u = bounds[node.name].lower[0].double().numpy(), bounds[node.name].upper[0].double().numpy()
        n = W.shape[0]
        z = list(range(len(box), len(box) + n))
        a = list(range(len(box) + n, len(box) + 2 * n))
        box += list(zip(l, u, strict=True)) + [(max(0.0, lo), max(0.0, hi)) for lo, hi in zip(l, u, strict=True)]
        for j in range(n):
            equalities.append(({z[j]: 1.0, **{previous[i]: -W[j, i] for i in range(len(previous))}}, b[j]))
            if u[j] <= 0:  # inactive: a = 0
                equalities.append(({a[j]: 1.0}, 0.0))
            elif l[j] >= 0:  # active: a = z
                equalities.append(({a[j]: 1.0, z[j]: -1.0}, 0.0))
            else:  # triangle: a ≥ z, (u − l)·a − u·z ≤ −u·l
                inequalities.append(({z[j]: 1.0, a[j]: -1.0}, 0.0))
                inequalities.append(({a[j]: u[j] - l[j], z[j]: -u[j]}, -u[j] * l[j]))
        previous = a

    def dense(rows):
        matrix = np.zeros((len(rows), len(box)))
        for r, (entries, _) in enumerate(rows):
            for column, value in entries.items():
                matrix[r, column] += value
        return matrix, np.array([rhs for _, rhs in rows])

    W, b = layers[depth].op.weight.double().numpy(), layers[depth].op.bias.double().numpy()
    cost = np.zeros(len(box))
    cost[previous] = W[neuron]
    (A_eq, b_eq), (A_ub, b_ub) = dense(equalities), dense(inequalities)
    return -sense * _minimise(-sense * cost, A_ub, b_ub, A_eq, b_eq, box) + b[neuron]


def _minimise(cost, A_ub, b_ub, A_eq, b_eq, box) -> float:
    """``min cost·x`` s.t. ``A_ub x ≤ b_ub``, ``A_eq x = b_eq``, ``x`` in ``box``: HiGHS given the dense rows."""
    h = highspy.Highs()
    h.setOptionValue("output_flag", False)
    lower, upper = (np.array(side) for side in zip(*box, strict=True))
    h.addVars(len(box), lower, upper)
    h.changeColsCost(len(box), np.arange(len(box), dtype=np.int32), cost)
    rows = np.vstack([A_ub, A_eq])
    row_lower = np.concatenate([np.full(len(b_ub), -highspy.kHighsInf), b_eq])
    for row, lo, hi in zip(rows, row_lower, np.concatenate([b_ub, b_eq]), strict=True):
        columns = np.flatnonzero(row).astype(np.int32)
        h.addRow(lo, hi, len(columns), columns, row[columns])
    h.run()
    assert h.getModelStatus() == highspy.HighsModelStatus.kOptimal, h.modelStatusToString(h.getModelStatus())
    return h.getInfo().objective_function_value


@pytest.mark.parametrize("seed", range(3))
def test_the_lp_equals_one_written_independently(seed):
    graph = _net(seed)
    bounds = intermediate_bounds(graph, BOX)
    program = lp.NetworkProgram.build(graph, BOX, bounds, "fc2")
    h = program.highs()
    for neuron in range(6):
        for sense in (-1, 1):
            ours = program.solve(h, neuron, sense, 10.0)
            theirs = _triangle_lp(graph, bounds, "fc2", neuron, sense)
            assert ours == pytest.approx(theirs, abs=1e-5), (neuron, sense)


def _sampled(graph: BoundGraph, name: str, points: int = 20000) -> torch.Tensor:
    x = torch.rand(points, 3, generator=torch.Generator().manual_seed(1)) * 2 - 1
    corners = torch.tensor(list(itertools.product((-1.0, 1.0), repeat=3)))
    values = {graph.input.name: torch.cat([x, corners])}
    for node in graph.nodes[1:]:
        values[node.name] = node.op.forward(*(values[n] for n in node.inputs))
    return values[name]


@pytest.mark.parametrize("integer", ["none", "last", "all"])
@pytest.mark.parametrize("seed", range(3))
def test_refined_bounds_hold_and_are_never_looser(seed, integer):
    graph = _net(seed)
    start = intermediate_bounds(graph, BOX)
    layers = ["fc1", "fc2"]
    refined, stats = lp.refine_bounds(graph, BOX, start, layers, integer=integer)
    assert stats.layers == layers and stats.solves > 0
    for name in layers:
        value = _sampled(graph, name)
        assert bool((value >= refined[name].lower - 1e-5).all() and (value <= refined[name].upper + 1e-5).all())
        assert bool(
            (refined[name].lower >= start[name].lower).all() and (refined[name].upper <= start[name].upper).all()
        )
    assert stats.tightened > 0


def test_the_milp_decides_every_sign_and_reaches_the_true_range_of_unstable_neurons():
    graph = _net(4, widths=(3, 6, 6, 2))
    refined, _ = lp.refine_bounds(graph, BOX, intermediate_bounds(graph, BOX), ["fc1"], integer="all")
    low, high = refined["fc1"].lower[0], refined["fc1"].upper[0]
    value = _sampled(graph, "fc1", points=200000)
    seen_low, seen_high = value.min(0).values, value.max(0).values
    # Exact ReLUs: a neuron the samples show clearly on one side is proven stable (its other side is not solved,
    # as α,β-CROWN does); one they show on both sides gets its exact extremes (the samples come within their
    # spacing of them).
    for j in range(6):
        if seen_high[j] < -0.05:
            assert high[j] <= 0
        elif seen_low[j] > 0.05:
            assert low[j] >= 0
        elif seen_low[j] < -0.05 and seen_high[j] > 0.05:
            assert abs(low[j] - seen_low[j]) < 0.05 and abs(high[j] - seen_high[j]) < 0.05
    assert int(((seen_low < -0.05) & (seen_high > 0.05)).sum()) >= 2  # the fixture has unstable neurons


def test_a_solver_that_gives_up_leaves_the_bounds_alone(monkeypatch):
    graph = _net(0)
    start = intermediate_bounds(graph, BOX)
    monkeypatch.setattr(lp.NetworkProgram, "solve", lambda *args, **kwargs: None)
    refined, stats = lp.refine_bounds(graph, BOX, start, ["fc1", "fc2"])
    assert stats.tightened == 0
    for name in ("fc1", "fc2"):
        assert torch.equal(refined[name].lower, start[name].lower) and torch.equal(
            refined[name].upper, start[name].upper
        )


def test_a_passed_deadline_skips_the_solves():
    graph = _net(0)
    start = intermediate_bounds(graph, BOX)
    refined, stats = lp.refine_bounds(graph, BOX, start, ["fc1", "fc2"], integer="all", deadline=0.0)
    assert stats.solves == 0 and torch.equal(refined["fc2"].lower, start["fc2"].lower)


def test_parallel_workers_give_the_serial_bounds():
    graph = _net(1)
    start = intermediate_bounds(graph, BOX)
    serial, _ = lp.refine_bounds(graph, BOX, start, ["fc1", "fc2"])
    parallel, _ = lp.refine_bounds(graph, BOX, start, ["fc1", "fc2"], workers=2)
    for name in ("fc1", "fc2"):
        torch.testing.assert_close(parallel[name].lower, serial[name].lower, rtol=0, atol=1e-6)
        torch.testing.assert_close(parallel[name].upper, serial[name].upper, rtol=0, atol=1e-6)


@pytest.mark.parametrize("refine", [Refine.LP, Refine.MILP])
def test_the_verifier_branches_on_refined_bounds(refine):
    graph = _net(2)
    grid = torch.stack(torch.meshgrid(*[torch.linspace(-1, 1, 61)] * 3, indexing="ij"), -1).reshape(-1, 3)
    with torch.no_grad():
        y = graph(grid)
    threshold = float((y[:, 0] - y[:, 1]).min()) - 0.05
    case = Case(InputBox(-np.ones(3), np.ones(3)), (Disjunct(np.array([[1.0, -1.0]]), np.array([threshold])),))
    config = VerifyConfig(timeout=60, bab=BabMode.NEURON, refine=refine, attack_restarts=0)
    result = verify(graph, Property(3, 2, (case,)), config)
    assert result.verdict is Verdict.UNSAT and result.refinement["solves"] > 0


def test_programs_are_written_for_fully_connected_nets_only():
    from tests.verify.nets import resnet

    assert lp.supports_programs(_net(0))
    assert not lp.supports_programs(resnet())  # its convolutions' dense matrices would not fit
