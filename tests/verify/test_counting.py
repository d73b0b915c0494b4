"""Count specifications: ArgMax → OneHot → … → Equal(mask) → ReduceSum heads, loaded, bounded and verified against
onnxruntime (the counting UNet of ``fedshard bench counting`` and hand-built heads with ties)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from onnx import TensorProto, helper

from lightning_fedshard.bench.counting import SHAPE, export_counting_net, write_count_vnnlib
from lightning_fedshard.verify import Verdict, VerifyConfig, load_onnx, verify_files
from lightning_fedshard.verify.bounds.alpha import alpha_crown
from lightning_fedshard.verify.bounds.crown import backward_bound, intermediate_bounds
from lightning_fedshard.verify.onnx import UnsupportedModelError
from lightning_fedshard.verify.ops import Equal, Interval, Positive
from tests.verify.onnx_models import hand_built, reference_outputs

PIXELS = SHAPE[1] * SHAPE[2]


@pytest.fixture(scope="module")
def counting_net(tmp_path_factory) -> tuple[Path, np.ndarray]:
    return export_counting_net(tmp_path_factory.mktemp("counting"))


def _points(centre: np.ndarray, epsilon: float, n: int, seed: int) -> np.ndarray:
    """``n`` points of the box: the image ``centre ± epsilon``, the mask channel the centre's."""
    points = np.repeat(centre[None], n, 0)
    points[:, :3] += np.random.default_rng(seed).uniform(-epsilon, epsilon, (n, 3, *SHAPE[1:])).astype(np.float32)
    return points


def test_the_counting_unet_loads_and_counts_as_onnxruntime_does(counting_net) -> None:
    path, centre = counting_net
    graph = load_onnx(path)
    assert any(isinstance(node.op, Positive) for node in graph.nodes[1:])
    assert any(isinstance(node.op, Equal) for node in graph.nodes[1:])
    x = np.random.default_rng(0).uniform(-1, 1, (64, *SHAPE)).astype(np.float32)
    x[:, 3] = np.random.default_rng(1).integers(0, 2, (64, *SHAPE[1:]))
    x = np.concatenate([x, _points(centre, 0.2, 16, 2)])
    expected = reference_outputs(path, x).reshape(-1)
    ours = graph(torch.from_numpy(x)).numpy().reshape(-1)
    assert np.array_equal(ours, expected)  # integer counts, exactly
    assert len(np.unique(expected)) > 10


@pytest.mark.parametrize("epsilon", [0.005, 0.05])
def test_count_bounds_enclose_onnxruntime_inside_the_box(counting_net, epsilon: float) -> None:
    path, centre = counting_net
    graph = load_onnx(path)
    lower, upper = centre.copy(), centre.copy()
    lower[:3] -= epsilon
    upper[:3] += epsilon
    box = Interval(torch.from_numpy(lower)[None], torch.from_numpy(upper)[None])
    C = torch.tensor([1.0, -1.0]).view(2, 1)
    ibp = graph.ibp(box)[graph.output.name]
    crown = backward_bound(graph, graph.output.name, C, box, intermediate_bounds(graph, box)).lower[:, 0]
    alpha = alpha_crown(graph, box, C, iterations=2).lower[:, 0]
    counts = reference_outputs(path, _points(centre, epsilon, 200, 3)).reshape(-1)
    assert counts.min() < PIXELS or epsilon < 0.01  # the larger box flips pixels
    for method, low, high in (
        ("ibp", float(ibp.lower), float(ibp.upper)),
        ("crown", float(crown[0]), float(-crown[1])),
        ("alpha-crown", float(alpha[0]), float(-alpha[1])),
    ):
        assert low <= counts.min() and counts.max() <= high, method
        assert high - low < PIXELS, method  # some pixels decided
    assert float(crown[0]) >= float(ibp.lower) - 1e-3  # CROWN bounds the logit margins themselves


def test_a_small_box_is_proven_and_a_large_one_falsified_with_a_replaying_counterexample(counting_net, tmp_path):
    path, centre = counting_net
    config = VerifyConfig(timeout=60)
    proven = verify_files(path, write_count_vnnlib(tmp_path / "small.vnnlib", centre, 0.002, PIXELS - 6), config)
    assert proven.verdict is Verdict.UNSAT, proven.reason
    falsified = verify_files(path, write_count_vnnlib(tmp_path / "large.vnnlib", centre, 0.05, PIXELS - 1), config)
    assert falsified.verdict is Verdict.SAT, falsified.reason
    assert falsified.counterexample_check == "ok"
    x = falsified.counterexample.x.astype(np.float32)
    assert np.array_equal(x.reshape(SHAPE)[3], centre[3])  # the mask as the box fixes it
    assert float(reference_outputs(path, x.reshape(1, *SHAPE)).reshape(-1)[0]) <= PIXELS - 1


def _tied_head(path: Path, classes: int, last: bool, op_type: str) -> Path:
    """``x [1, 3, 3]``: logits ``x[:, :2]`` (``classes`` = 3: channel 0 twice, an exact tie of classes 0 and 1), the
    mask ``x[:, 2]``; ArgMax (ArgMin) over the classes → OneHot → Transpose → Cast → Gather(class 1) → Equal(mask)
    → Cast → ReduceSum."""
    nodes = [
        helper.make_node("Gather", ["x", "channels"], ["logits"], axis=1),
        helper.make_node(op_type, ["logits"], ["index"], axis=1, keepdims=0, select_last_index=int(last)),
        helper.make_node("OneHot", ["index", "depth", "values"], ["code"], axis=-1),
        helper.make_node("Transpose", ["code"], ["moved"], perm=[0, 2, 1]),
        helper.make_node("Cast", ["moved"], ["floats"], to=TensorProto.FLOAT),
        helper.make_node("Gather", ["floats", "one"], ["picked"], axis=1),
        helper.make_node("Gather", ["x", "two"], ["mask"], axis=1),
        helper.make_node("Equal", ["picked", "mask"], ["agree"]),
        helper.make_node("Cast", ["agree"], ["ones"], to=TensorProto.FLOAT),
        helper.make_node("ReduceSum", ["ones"], ["y"], keepdims=0),
    ]
    constants = {
        "channels": np.array([0, 0, 1] if classes == 3 else [0, 1], dtype=np.int64),
        "depth": np.array(classes, dtype=np.int64),
        "values": np.array([0, 1], dtype=np.int64),
        "one": np.array(1, dtype=np.int64),
        "two": np.array(2, dtype=np.int64),
    }
    return hand_built(path, nodes, [1, 3, 3], constants)


@pytest.mark.parametrize(("classes", "last"), [(2, False), (2, True), (3, False), (3, True)])
@pytest.mark.parametrize("op_type", ["ArgMax", "ArgMin"])
def test_ties_go_where_onnxruntime_sends_them_and_the_bounds_say_so(tmp_path, classes, last, op_type):
    path = _tied_head(tmp_path / "tie.onnx", classes, last, op_type)
    graph = load_onnx(path)
    up, down = np.nextafter(np.float32(0.25), np.float32(1)), np.nextafter(np.float32(0.25), np.float32(0))
    # Pixel 0: the two logits tied; 1: logit 1 above by one ulp; 2: below by one ulp. Every mask of the 3 pixels.
    logits = np.float32([[0.25, 0.25, 0.25], [0.25, up, down]])
    masks = np.array(np.meshgrid(*[[0.0, 1.0]] * 3, indexing="ij"), dtype=np.float32).reshape(3, -1).T
    x = np.stack([np.concatenate([logits, mask[None]]) for mask in masks])[:, None]
    expected = reference_outputs(path, x).reshape(-1)
    assert np.array_equal(graph(torch.from_numpy(x)).numpy().reshape(-1), expected)
    assert len(np.unique(expected)) == 4  # the masks' agreement with the prediction runs from 0 to 3 pixels
    C = torch.tensor([1.0, -1.0]).view(2, 1)
    for point, count in zip(x, expected, strict=True):
        box = Interval(torch.from_numpy(point), torch.from_numpy(point))
        ibp = graph.ibp(box)[graph.output.name]
        crown = backward_bound(graph, graph.output.name, C, box, intermediate_bounds(graph, box)).lower[:, 0]
        # A point box decides every pixel, ties included: both bounds are onnxruntime's count (up to the sum's
        # rounding charge).
        for low, high in ((float(ibp.lower), float(ibp.upper)), (float(crown[0]), float(-crown[1]))):
            assert low == pytest.approx(count, abs=1e-3) and high == pytest.approx(count, abs=1e-3)


def test_a_split_between_zero_and_one_quantum_settles_a_margin() -> None:
    step = Positive(quantum=2.0**-148)
    below = step.ibp(Interval(torch.tensor([[-1.0]]), torch.tensor([[2.0**-149]])))
    above = step.ibp(Interval(torch.tensor([[2.0**-149]]), torch.tensor([[1.0]])))
    assert (float(below.lower), float(below.upper)) == (0.0, 0.0)
    assert (float(above.lower), float(above.upper)) == (1.0, 1.0)
    point = step.split_point([Interval(torch.tensor([[-1.0]]), torch.tensor([[1.0]]))], 0)
    assert float(point) == 2.0**-149


def test_an_indicator_against_a_fixed_mask_is_linear_and_exact() -> None:
    agree = Equal((True, False))
    indicator = Interval(torch.tensor([[0.0, 0.0]]), torch.tensor([[1.0, 1.0]]))
    mask = Interval(torch.tensor([[1.0, 0.0]]), torch.tensor([[1.0, 0.0]]))
    A = torch.tensor([[[1.0, 1.0]], [[-1.0, -1.0]]])  # Σ y and −Σ y
    (A_indicator, A_mask), constant = agree.backward(A, [indicator, mask])
    assert A_mask is None
    for value in ([0.0, 0.0], [0.0, 1.0], [1.0, 0.0], [1.0, 1.0]):
        x = torch.tensor([value])
        y = agree.forward(x, mask.lower)
        exact = (A * y).sum(-1)
        linear = (A_indicator * x).sum(-1).double() + constant
        assert torch.allclose(linear, exact.double(), atol=1e-6)  # the same function on {0, 1}²


def test_one_hot_of_an_index_no_argmax_computed_is_refused(tmp_path: Path) -> None:
    nodes = [
        helper.make_node("Cast", ["x"], ["index"], to=TensorProto.INT64),
        helper.make_node("OneHot", ["index", "depth", "values"], ["y"]),
    ]
    constants = {"depth": np.array(2, dtype=np.int64), "values": np.array([0, 1], dtype=np.float32)}
    path = hand_built(tmp_path / "one_hot.onnx", nodes, [1, 3], constants)
    with pytest.raises(UnsupportedModelError, match="Cast to INT64"):
        load_onnx(path)
    path = hand_built(
        tmp_path / "rounded.onnx",
        [helper.make_node("Round", ["x"], ["r"]), helper.make_node("OneHot", ["r", "depth", "values"], ["y"])],
        [1, 3],
        constants,
    )
    with pytest.raises(UnsupportedModelError, match="OneHot at 'y' of an index that no ArgMax computed"):
        load_onnx(path)


@pytest.mark.parametrize(("name", "bab"), [("argmax_count_constant", "input"), ("argmax_count_neuron", "neuron")])
def test_branch_and_bound_over_a_count_that_does_not_depend_on_the_input(name: str, bab: str):
    """``fedshard bench fuzz`` seed 7 cases 1101 and 1913 (a 3-class ArgMax of rounded scores, Equal to a mask,
    counted): the count's bound is a constant (every margin's step relaxed flat), so the backward pass reaches no
    input coefficients; input splitting's planes and branch-and-bound's minimising corners then failed
    ('internal error'). They must answer without one (the witness in the property means never ``unsat``)."""
    folder = Path(__file__).parents[1] / "data" / "fuzz_regressions"
    config = VerifyConfig(timeout=1, bab=bab, attack_restarts=0, attack_steps=0, attack_every=0)
    result = verify_files(folder / f"{name}.onnx", folder / f"{name}.vnnlib", config)
    assert not result.reason.startswith("internal error"), result.reason
    assert result.verdict is not Verdict.UNSAT
