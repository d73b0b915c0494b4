"""LP/MILP-refined pre-activation bounds: the LP equals one written independently here as dense matrices and solved
by HiGHS from them (as scipy's ``linprog(method="highs")`` would: scipy is not a dependency, and importing it cost
every Lightning process 2 s through torchmetrics); LP and MILP bounds hold on sampled points, are never looser than the bounds they start from, and the
MILP (exact ReLUs) reaches the range a dense grid shows; a solver that gives up leaves a bound as it was; refined
bounds feed the verifier."""

from __future__ import annotations

import itertools
from fractions import Fraction

import highspy
import numpy as np
import pytest
import torch

from lightning_fedshard.verify import BoundGraph, Verdict, VerifyConfig, verify
from lightning_fedshard.verify.bounds import lp
from lightning_fedshard.verify.bounds.crown import intermediate_bounds
from lightning_fedshard.verify.budget import Budget
from lightning_fedshard.verify.config import BabMode, Refine
from lightning_fedshard.verify.graph import Node
from lightning_fedshard.verify.ops import Interval, Linear, ReLU
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
            # Ours charges the model's float32 rounding of each pre-activation (its rows are ranges of that width,
            # not equalities): never tighter than the exact program, and looser by no more than that.
            looser = sense * (ours - theirs)
            assert -1e-7 <= looser <= 1e-4 * (1 + abs(theirs)), (neuron, sense, ours, theirs)


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


def test_the_milp_search_stabilises_neurons_the_lp_cannot():
    # Safe bounds at every node of the search over the binaries keep the MILP stronger than its relaxation (which
    # is the triangle LP): here it proves two neurons stable that the LP leaves unstable, and no lower side of it
    # is below the LP's (a neuron proven stable has its other side left unsolved).
    graph = _net(4, widths=(3, 6, 6, 2))
    start = intermediate_bounds(graph, BOX)
    relaxed, lp_stats = lp.refine_bounds(graph, BOX, start, ["fc1"], integer="none")
    exact, milp_stats = lp.refine_bounds(graph, BOX, start, ["fc1"], integer="all")
    assert milp_stats.stabilised >= lp_stats.stabilised + 2
    assert bool((exact["fc1"].lower >= relaxed["fc1"].lower).all())


def _exact_minimum_2d(cost, rows, box) -> Fraction:
    """``min cost·x`` over ``L ≤ a·x ≤ U`` (``rows``: ``(L, U, a)``) and ``box`` in two variables, exactly in
    rationals over the float64 data: the least objective over the feasible vertices (every pair of tight sides)."""
    F = Fraction
    sides = [(F(bound), tuple(F(v) for v in a)) for lo, hi, a in rows for bound in (lo, hi) if np.isfinite(bound)]
    sides += [(F(bound), (F(1), F(0)) if j == 0 else (F(0), F(1))) for j in range(2) for bound in box[j]]

    def feasible(x) -> bool:
        inside = all(F(lo) <= x[j] <= F(hi) for j, (lo, hi) in enumerate(box))
        return inside and all(
            (not np.isfinite(lo) or F(a[0]) * x[0] + F(a[1]) * x[1] >= F(lo))
            and (not np.isfinite(hi) or F(a[0]) * x[0] + F(a[1]) * x[1] <= F(hi))
            for lo, hi, a in rows
        )

    best = None
    for (b1, a1), (b2, a2) in itertools.combinations(sides, 2):
        det = a1[0] * a2[1] - a1[1] * a2[0]
        if det == 0:
            continue
        x = ((b1 * a2[1] - b2 * a1[1]) / det, (a1[0] * b2 - a2[0] * b1) / det)
        if feasible(x):
            value = F(cost[0]) * x[0] + F(cost[1]) * x[1]
            best = value if best is None or value < best else best
    return best


#: ``min 0.7 x + 0.3 y`` over ``0.1 x + 0.2 y ≥ 0.3``, ``x − 3 y ≤ 0.1``, ``x + y = 1.3`` (none of these decimals
#: is exact in binary), ``x, y ∈ [−1.7, 2.9]``.
_COST = np.array([0.7, 0.3])
_ROWS = [(0.3, np.inf, (0.1, 0.2)), (-np.inf, 0.1, (1.0, -3.0)), (1.3, 1.3, (1.0, 1.0))]
_BOX = [(-1.7, 2.9), (-1.7, 2.9)]


def _small_lp() -> tuple[lp.Constraints, np.ndarray]:
    """The LP above as :class:`lp.Constraints`, and HiGHS's row duals for it."""
    rows = [
        (
            lo if np.isfinite(lo) else -highspy.kHighsInf,
            hi if np.isfinite(hi) else highspy.kHighsInf,
            np.array([0, 1], dtype=np.int32),
            np.array(a),
        )
        for lo, hi, a in _ROWS
    ]
    lower, upper = (np.array(side) for side in zip(*_BOX, strict=True))
    h = highspy.Highs()
    h.setOptionValue("output_flag", False)
    h.addVars(2, lower, upper)
    h.changeColsCost(2, np.arange(2, dtype=np.int32), _COST)
    for lo, hi, index, value in rows:
        h.addRow(lo, hi, index.size, index, value)
    h.run()
    assert h.getModelStatus() == highspy.HighsModelStatus.kOptimal
    return lp.Constraints.from_rows(rows, lower, upper), np.asarray(h.getSolution().row_dual)


def test_the_safe_bound_is_below_the_exact_optimum_and_within_rounding_of_it():
    constraints, duals = _small_lp()
    exact = _exact_minimum_2d(_COST, _ROWS, _BOX)
    bound = lp.safe_minimum(_COST, constraints, duals)
    assert Fraction(bound) <= exact
    assert float(exact - Fraction(bound)) < 1e-12 * (1 + abs(float(exact)))


def test_any_dual_gives_a_sound_bound_where_its_dual_objective_alone_would_not():
    constraints, duals = _small_lp()
    exact = _exact_minimum_2d(_COST, _ROWS, _BOX)
    rng = np.random.default_rng(0)
    overshoot = 0
    for scale in (1e-9, 1e-6, 1e-3, 1.0):
        for _ in range(50):
            perturbed = duals + scale * rng.standard_normal(duals.shape)
            assert Fraction(lp.safe_minimum(_COST, constraints, perturbed)) <= exact
            # The dual objective alone (y·b, the residual ignored) claims more than the optimum for many of them.
            y = np.where(perturbed > 0, np.where(np.isfinite(constraints.row_lower), perturbed, 0), perturbed)
            y = np.where(y < 0, np.where(np.isfinite(constraints.row_upper), y, 0), y)
            claimed = sum(
                Fraction(v) * Fraction(lo if v > 0 else hi)
                for v, lo, hi in zip(y, constraints.row_lower, constraints.row_upper, strict=True)
                if v != 0
            )
            overshoot += claimed > exact
    assert overshoot > 0


def test_a_bound_stays_sound_where_the_solver_stops_within_its_dual_tolerance():
    # A reduced cost of −1e-8 lies inside HiGHS's dual feasibility tolerance (1e-7): without presolve the simplex
    # stops at x0 = 0 with objective 0, but over x0 ∈ [0, 10^6] the true minimum of fc1 = −1e-8·x0 + relu(x1 − 0.5)
    # is −0.01. A bound from the objective (moved by 1e-6 relative) would claim −1e-6.
    nodes = [
        Node("x", None, (), (2,)),
        Node("fc0", Linear(torch.eye(2), torch.tensor([0.0, -0.5])), ("x",), (2,)),
        Node("relu0", ReLU(), ("fc0",), (2,)),
        Node("fc1", Linear(torch.tensor([[-1e-8, 1.0]]), torch.zeros(1)), ("relu0",), (1,)),
    ]
    graph = BoundGraph(nodes)
    box = Interval(torch.tensor([[0.0, 0.0]]), torch.tensor([[1e6, 1.0]]))
    program = lp.NetworkProgram.build(graph, box, intermediate_bounds(graph, box), "fc1")
    h = program.highs()
    h.setOptionValue("presolve", "off")
    low = program.solve(h, 0, -1, 10.0)
    assert h.getInfo().objective_function_value > -1e-6  # the solver's own answer is off by 0.01
    true_minimum = Fraction(float(torch.tensor(-1e-8))) * 10**6  # x0 = 10^6, relu(x1 − 0.5) = 0
    assert Fraction(low) <= true_minimum
    assert float(true_minimum - Fraction(low)) < 1e-6  # the model's float32 rounding of fc1, charged: ≈ γ₆·0.51


def test_the_triangle_row_holds_on_the_relu_graph_exactly():
    # u − l and u·l round in float64; the row's right-hand side is rounded so that both ends of the ReLU satisfy
    # the row in exact arithmetic. The product −u·l rounded to nearest (the row as written before) cuts some off.
    rng = np.random.default_rng(1)
    nearest_cuts = 0
    for _ in range(200):
        l, u = -float(rng.uniform(1e-3, 1e3)) / 3, float(rng.uniform(1e-3, 1e3)) / 7
        width = u - l
        ends = [Fraction(width) * Fraction(max(z, 0.0)) - Fraction(u) * Fraction(z) for z in (l, u)]
        assert max(ends) <= Fraction(lp._triangle_side(width, l, u))
        nearest_cuts += max(ends) > Fraction(-u * l)
    assert nearest_cuts > 0


def test_the_time_limit_holds_per_solve_not_per_solver():
    # HiGHS sums its run time over every run of one solver; a limit set as the solve's own seconds stopped every
    # solve after the first 0.02 s of the layer at once (no bound, the neuron left unrefined).
    graph = _net(0)
    program = lp.NetworkProgram.build(graph, BOX, intermediate_bounds(graph, BOX), "fc2")
    h = program.highs()
    bounds = [program.solve(h, n % 6, 1 - 2 * (n % 2), 0.02) for n in range(150)]
    assert h.getRunTime() > 0.02 and all(bound is not None for bound in bounds)


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
    with Budget(deadline=0.0, memory=1 << 30).using():
        refined, stats = lp.refine_bounds(graph, BOX, start, ["fc1", "fc2"], integer="all")
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
