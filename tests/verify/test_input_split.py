"""Input-space branch and bound: verdicts on small random nets against a dense grid, for every branching rule;
soundness of every sub-box bound met during a search; clipping and splitting against sampled points."""

from __future__ import annotations

import math
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from lightning_fedshard.verify import BoundGraph, Node, Verdict, VerifyConfig, verify, verify_files
from lightning_fedshard.verify.bab import input_split as split_module
from lightning_fedshard.verify.bab import pieces as pieces_module
from lightning_fedshard.verify.bounds.forward import forward_bounds, forward_bytes_per_box
from lightning_fedshard.verify.budget import seconds_left
from lightning_fedshard.verify.config import BabMode, InputBranching
from lightning_fedshard.verify.memory import PeakMemoryMeter
from lightning_fedshard.verify.objective import OutputSpec
from lightning_fedshard.verify.ops import Interval
from lightning_fedshard.verify.spec import Case, Disjunct, InputBox, Property
from tests.verify.nets import random_mlp


def _random_net(seed: int, inputs: int, hidden: int = 16, depth: int = 3) -> BoundGraph:
    return random_mlp(seed, (inputs, *([hidden] * depth), 2))


def _grid(inputs: int) -> torch.Tensor:
    points = 201 if inputs == 2 else 41
    axis = torch.linspace(-1, 1, points)
    return torch.stack(torch.meshgrid(*([axis] * inputs), indexing="ij"), -1).reshape(-1, inputs)


def _property(graph: BoundGraph, inputs: int, safe: bool, margin: float = 0.05) -> tuple[Property, float]:
    """``y_0 − y_1 ≤ threshold`` is unsafe, the threshold ``margin`` below (safe) or above (violated) the grid's
    minimum. 0.05 is far more than the nets' Lipschitz constant times the grid step, so the verdict is known."""
    with torch.no_grad():
        y = graph(_grid(inputs))
    minimum = (y[:, 0] - y[:, 1]).min().item()
    threshold = minimum - margin if safe else minimum + margin
    case = Case(
        InputBox(-np.ones(inputs), np.ones(inputs)), (Disjunct(np.array([[1.0, -1.0]]), np.array([threshold])),)
    )
    return Property(inputs, 2, (case,)), threshold


RULES = [(InputBranching.SB,), (InputBranching.TRIAL,), (InputBranching.SB, InputBranching.TRIAL)]


@pytest.mark.parametrize("rules", RULES, ids=lambda r: "+".join(b.value for b in r))
@pytest.mark.parametrize("inputs", [2, 3])
@pytest.mark.parametrize("seed", range(4))
def test_input_splitting_agrees_with_a_dense_grid(seed, inputs, rules):
    graph = _random_net(seed, inputs)
    for safe in (True, False):
        prop, threshold = _property(graph, inputs, safe)
        config = VerifyConfig(timeout=60, bab=BabMode.INPUT, input_branching=rules, attack_restarts=0, attack_steps=0)
        result = verify(graph, prop, config)
        if safe:
            assert result.verdict is Verdict.UNSAT and result.bab_modes == ["input"]
        else:
            assert result.verdict is Verdict.SAT
            x = torch.tensor(result.counterexample.x, dtype=torch.float32).view(1, -1)
            y = graph(x)[0]
            assert (y[0] - y[1]).item() <= threshold
            assert bool((x.abs() <= 1).all())


def test_every_sub_box_bound_holds_on_points_sampled_in_it(monkeypatch):
    graph = _random_net(7, 3)
    prop, _ = _property(graph, 3, safe=True)
    gen = torch.Generator().manual_seed(0)
    checked = []
    bound = split_module._bound

    def checked_bound(graph, spec, boxes, known=None):
        out, bounds = bound(graph, spec, boxes, known)
        n = boxes.lower.shape[0]
        points = boxes.lower + (boxes.upper - boxes.lower) * torch.rand(64, *boxes.lower.shape, generator=gen)
        y = graph(points.reshape(64 * n, -1)).reshape(64, n, -1)
        value = torch.einsum("sk,pnk->psn", spec.matrix, y)  # [points, rows, boxes]
        assert bool((value >= out.lower - 1e-5).all()), "a sampled point lies below its sub-box's bound"
        checked.append(n)
        return out, bounds

    monkeypatch.setattr(split_module, "_bound", checked_bound)
    result = verify(graph, prop, VerifyConfig(timeout=60, bab=BabMode.INPUT, attack_restarts=0))
    assert result.verdict is Verdict.UNSAT
    assert sum(checked) == result.domains_bounded > 100  # a real search, every bound checked


def _values(graph: BoundGraph, x: torch.Tensor) -> dict[str, torch.Tensor]:
    values = {graph.input.name: x}
    for node in graph.nodes[1:]:
        values[node.name] = node.op.forward(*(values[name] for name in node.inputs))
    return values


def test_pieces_with_fixed_phases_are_bounded_soundly(monkeypatch):
    """The boxes closed piece by piece: for every piece (a box with the phases of its unstable ReLUs fixed), the
    points sampled in its box whose activations agree with those phases lie above its β-CROWN bound."""
    graph = _random_net(3, 2, hidden=8)
    # Tight (closer than the grid can vouch for): boxes near the minimum need their pieces.
    prop, threshold = _property(graph, 2, safe=True, margin=0.005)
    gen = torch.Generator().manual_seed(0)
    pieces_checked = []
    beta_crown = pieces_module.beta_crown

    def checked(graph, box, C, domains, *args, **kwargs):
        splits = {pre: value.clone() for pre, value in domains.splits.items()}
        result = beta_crown(graph, box, C, domains, *args, **kwargs)
        n = box.lower.shape[0]
        points = box.lower + (box.upper - box.lower) * torch.rand(256, *box.lower.shape, generator=gen)
        values = _values(graph, points.reshape(256 * n, -1))
        agree = torch.ones(256, n, dtype=torch.bool)
        for pre, split in splits.items():
            z = values[pre].reshape(256, n, -1)
            agree &= ((split == 0) | (split * z >= 0)).all(-1)
        y = values[graph.output.name].reshape(256, n, -1)
        value = torch.einsum("snk,pnk->psn", C, y)
        assert bool((value >= result.lower - 1e-4)[agree.unsqueeze(1).expand_as(value)].all())
        pieces_checked.append(n)
        return result

    monkeypatch.setattr(pieces_module, "beta_crown", checked)
    result = verify(graph, prop, VerifyConfig(timeout=60, bab=BabMode.INPUT, attack_restarts=0))
    assert pieces_checked, "no box was tried piece by piece"
    assert result.verdict in (Verdict.UNSAT, Verdict.SAT)
    if result.verdict is Verdict.SAT:
        y = graph(torch.tensor(result.counterexample.x, dtype=torch.float32).view(1, -1))[0]
        assert (y[0] - y[1]).item() <= threshold


def test_clipping_keeps_every_point_the_planes_allow():
    gen = torch.Generator().manual_seed(0)
    n, d, rows = 200, 3, 2
    lower = torch.rand(n, d, generator=gen) - 1
    upper = lower + torch.rand(n, d, generator=gen)
    boxes = split_module._Boxes(lower, upper, torch.zeros(n, dtype=torch.long))
    A = torch.randn(rows, n, d, generator=gen, dtype=torch.float64)
    c = torch.randn(rows, n, generator=gen, dtype=torch.float64)
    rhs = torch.zeros(rows)
    clipped, keep = split_module._clip(boxes, A, c, rhs)
    points = lower + (upper - lower) * torch.rand(5000, n, d, generator=gen)
    allowed = (torch.einsum("snd,pnd->psn", A, points.double()) + c <= 0).all(1)  # [points, boxes]
    inside = ((points >= clipped.lower) & (points <= clipped.upper)).all(-1)
    assert not bool((allowed & ~inside).any()), "clipping cut off a point every plane allows"
    assert not bool((allowed & ~keep).any()), "a box with an allowed point was dropped"
    assert bool((clipped.upper - clipped.lower)[keep].sum() < (upper - lower)[keep].sum())  # it does shrink


def test_a_plane_that_is_not_a_number_clips_nothing():
    """An infinite bound (log near 0, a reciprocal past float16's range) makes the plane ``∞ − ∞``: the box must
    stay whole. A NaN limit made it look empty, and input splitting dropped it unproven (a wrong ``unsat``)."""
    boxes = split_module._Boxes(torch.tensor([[0.0, -1.0]]), torch.tensor([[1.0, 1.0]]), torch.zeros(1))
    A = torch.tensor([[[1.0, 0.0]]], dtype=torch.float64)
    clipped, keep = split_module._clip(boxes, A, torch.tensor([[math.nan]], dtype=torch.float64), torch.zeros(1))
    assert keep.tolist() == [True]
    assert clipped.lower.tolist() == boxes.lower.tolist() and clipped.upper.tolist() == boxes.upper.tolist()


@pytest.mark.parametrize("name", ["log_reducemax", "half_division", "cos_softmax", "softmax_sum_half"])
def test_fuzz_finds_are_not_proven_by_input_splitting(name):
    """``fedshard bench fuzz`` seed 1006 cases 1107 (Log → ReduceMax, float32) and 1520 (Div of two tensors in
    float16), seed 1007 case 1774 (Cos → Softmax), seed 1009 case 1524 (float16 Softmax, ``p₀ + p₁`` below 1):
    onnxruntime's outputs at a point of the box break the property; input splitting (the first two), IBP's softmax
    (the third) and CROWN's softmax, which charged the rounding on the plane's gradient (the fourth), proved it."""
    folder = Path(__file__).parents[1] / "data" / "fuzz_regressions"
    config = VerifyConfig(timeout=2, bab=BabMode.INPUT, attack_restarts=0, attack_steps=0, attack_every=0)
    assert verify_files(folder / f"{name}.onnx", folder / f"{name}.vnnlib", config).verdict is not Verdict.UNSAT


def test_splitting_partitions_each_box():
    boxes = split_module._Boxes(torch.tensor([[0.0, 0.0, 0.0]]), torch.tensor([[1.0, 2.0, 4.0]]), torch.zeros(1))
    children = split_module._split(boxes, torch.tensor([[2, 0]]))
    assert len(children) == 4 and children.depth.tolist() == [2, 2, 2, 2]
    volume = (children.upper - children.lower).prod(1)
    assert torch.allclose(volume, torch.full((4,), 2.0))
    corners = {tuple(row) for row in children.lower.tolist()}
    assert corners == {(0.0, 0.0, 0.0), (0.5, 0.0, 0.0), (0.0, 0.0, 2.0), (0.5, 0.0, 2.0)}


def test_auto_splits_the_input_of_small_boxes_with_many_unstable_relus_or_smooth_operators():
    from lightning_fedshard.verify.ops import Interval, Sigmoid
    from lightning_fedshard.verify.verifier import _bab_mode

    config = VerifyConfig()
    relu_net = _random_net(0, 5)
    sigmoid_net = BoundGraph(
        [*relu_net.nodes[:2], Node("squash", Sigmoid(), (relu_net.nodes[1].name,), relu_net.nodes[1].shape)]
    )
    five = Interval(torch.zeros(1, 5), torch.tensor([[1.0, 1.0, 0.0, 1.0, 1.0]]))  # 4 free dimensions
    assert _bab_mode(config, relu_net, five, unstable=150) is BabMode.INPUT
    assert _bab_mode(config, relu_net, five, unstable=3) is BabMode.NEURON  # fewer ReLU splits than input dimensions
    assert _bab_mode(config, sigmoid_net, five, unstable=3) is BabMode.INPUT  # splits of smooth ops never end
    wide = Interval(torch.zeros(1, 784), torch.full((1, 784), 0.1))
    assert _bab_mode(config, relu_net, wide, unstable=150) is BabMode.NEURON
    assert _bab_mode(config, sigmoid_net, wide, unstable=150) is BabMode.NEURON
    assert _bab_mode(VerifyConfig(bab="input"), relu_net, wide, unstable=150) is BabMode.INPUT
    small = _random_net(0, 3)
    prop, _ = _property(small, 3, safe=True)
    assert verify(small, prop, VerifyConfig(timeout=60)).bab_modes == ["input"]


def test_a_forward_pass_holds_a_few_nodes_functions_not_the_whole_networks():
    """Every node's functions are ``2·(d+1)`` values per neuron and box; a deep net's would fill the memory if all
    were kept. The measured peak of a forward pass stays within ``forward_bytes_per_box`` (the bounds it returns
    and a few copies of the largest node's functions); keeping every node's functions took 2.8 times that here."""
    graph = random_mlp(0, (4, *([256] * 12), 2))
    n = 64
    gen = torch.Generator().manual_seed(0)
    centre = torch.rand(n, 4, generator=gen) * 2 - 1
    boxes = Interval(centre - 0.01, centre + 0.01)
    meter = PeakMemoryMeter(torch.device("cpu"))
    with meter, torch.no_grad():
        bounds = forward_bounds(graph, boxes)
    assert len(bounds) == len(graph.nodes)
    assert meter.peak_bytes <= n * forward_bytes_per_box(graph, 4)


def test_the_branching_trial_bounds_its_halves_in_chunks_with_the_scores_of_one_pass():
    """The trial's ``2 × dimensions × boxes`` halves bounded a few at a time score every box and dimension as one
    pass over all of them does, and the pass's peak memory follows the chunk, not the number of halves."""
    graph = _random_net(1, 3, hidden=64)
    prop, _ = _property(graph, 3, safe=True)
    spec = OutputSpec.from_case(prop.cases[0], graph.output.shape, graph.dtype, graph.device)
    gen = torch.Generator().manual_seed(0)
    lower = torch.rand(40, 3, generator=gen) - 1
    boxes = split_module._Boxes(lower, lower + 0.5, torch.zeros(40, dtype=torch.long))
    splittable = torch.ones(40, 3, dtype=torch.bool)
    sb = torch.zeros(40, 3, dtype=torch.float64)
    peaks, scores = [], []
    for per_pass in (240, 7):
        meter = PeakMemoryMeter(torch.device("cpu"))
        with meter, torch.no_grad():
            scores.append(split_module._trial_scores(graph, spec, boxes, splittable, sb, per_pass))
        peaks.append(meter.peak_bytes)
    torch.testing.assert_close(scores[1], scores[0], rtol=1e-6, atol=1e-6)
    assert bool(torch.isfinite(scores[0]).all())
    assert peaks[1] < peaks[0] / 4


def test_a_round_of_the_search_takes_at_most_an_eighth_of_the_time_left(monkeypatch):
    """On a net where bounding one box takes a while (here 20 ms more per box), the search sizes each round by the
    last round's pace: the boxes it bounds at once take no more than an eighth of the time left (before: 128 boxes,
    2.6 s of a 4 s budget, in the round after the root)."""
    graph = _random_net(3, 3, hidden=16)
    prop, _ = _property(graph, 3, safe=True, margin=0.002)
    per_box = 0.02
    rounds = []
    bound = split_module._bound

    def slow_bound(graph, spec, boxes, known=None):
        n = boxes.lower.shape[0]
        rounds.append((n, seconds_left()))
        time.sleep(per_box * n)
        return bound(graph, spec, boxes, known)

    monkeypatch.setattr(split_module, "_bound", slow_bound)
    verify(graph, prop, VerifyConfig(timeout=4, bab=BabMode.INPUT, attack_restarts=0))
    assert len(rounds) > 4
    for n, left in rounds:
        assert n == 1 or n * per_box <= left / 8, (n, left)


def test_the_root_box_is_bounded_once_from_the_verifiers_own_root_pass(monkeypatch):
    """Both searches (two branching rules) start at the root box: it is bounded once, from the intermediate bounds
    of the verifier's CROWN pass at the root (before: twice, each with its own intermediate passes)."""
    graph = _random_net(5, 3)
    prop, _ = _property(graph, 3, safe=True, margin=0.01)
    calls = []
    bound = split_module._bound

    def recording_bound(graph, spec, boxes, known=None):
        calls.append((boxes.lower.clone(), boxes.upper.clone(), known is not None))
        return bound(graph, spec, boxes, known)

    monkeypatch.setattr(split_module, "_bound", recording_bound)
    rules = (InputBranching.SB, InputBranching.TRIAL)
    result = verify(graph, prop, VerifyConfig(timeout=60, bab=BabMode.INPUT, input_branching=rules, attack_restarts=0))
    assert result.verdict is Verdict.UNSAT
    at_root = [c for c in calls if c[0].shape[0] == 1 and bool((c[0] == -1).all() and (c[1] == 1).all())]
    assert [known for _, _, known in at_root] == [True]
    assert len(calls) > 2
