"""Floating point never proves a property that onnxruntime's computation breaks: the cases found by hand-built
random graphs (issue 43), each with a witness that onnxruntime puts in the unsafe set, against every method.

* Interval bounds of affine operators rounded to nearest lost a term of the box: ``1 / (⌊1000x₀⌋² + ⌊1000x₁⌋² +
  0.55)`` reaches 1.818 at x = (0.0005, 0.0005) while the verifier's bound of the sum's lower end came out 1.0 (the
  centre of [0.55, 1.8e7] rounded), and ``1 / ((4x)² + 10⁻³)``'s upper bound was 999.596 under y(0) = 999.99994.
* A Cast to float16 and back was the identity: ``Cast(Cast(x, FLOAT16), FLOAT)`` is 1000.0 on [1000.1, 1000.2].
* Valid models crashed: a float64 model's counterexample was replayed in float32, a scalar output (ReduceMax with
  keepdims=0) broke the spec's arithmetic, and a purely affine net reached branching with nothing to split.

Every bound must contain onnxruntime's value at the witness, and no answer may be ``unsat``; the crashes must be
answers whose counterexamples replay.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

from lightning_fedshard.verify import (
    BoundGraph,
    Node,
    Property,
    Verdict,
    VerifyConfig,
    load_onnx,
    read_vnnlib,
    verify,
    verify_files,
)
from lightning_fedshard.verify.bab.loop import branch_and_bound
from lightning_fedshard.verify.bounds.alpha import alpha_crown
from lightning_fedshard.verify.bounds.crown import intermediate_bounds, spec_lower, unstable_count
from lightning_fedshard.verify.budget import Budget
from lightning_fedshard.verify.objective import OutputSpec, box_tensor
from lightning_fedshard.verify.ops import Interval, Linear, ReLU, Softmax
from lightning_fedshard.verify.spec import Case, Disjunct, InputBox
from tests.verify.onnx_models import reference_outputs

pytest.importorskip("onnxruntime")

#: Every way of running an instance that the issue found answering ``unsat``.
RUNS = {
    "default": {},
    "crown": {"method": "crown"},
    "alpha-crown": {"method": "alpha-crown"},
    "bab-input": {"bab": "input"},
    "bab-neuron": {"bab": "neuron"},
}


def _model(path: Path, nodes: list, constants: dict, in_shape: list, out_shape: list, dtype=TensorProto.FLOAT) -> Path:
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("X", dtype, in_shape)],
        [helper.make_tensor_value_info("Y", dtype, out_shape)],
        [numpy_helper.from_array(value, name) for name, value in constants.items()],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    onnx.checker.check_model(model)
    onnx.save(model, str(path))
    return path


def _property(path: Path, box: list[tuple[float, float]], assertion: str, outputs: int = 1) -> Path:
    lines = [f"(declare-const X_{i} Real)" for i in range(len(box))]
    lines += [f"(declare-const Y_{i} Real)" for i in range(outputs)]
    for i, (low, high) in enumerate(box):
        lines += [f"(assert (>= X_{i} {low!r}))", f"(assert (<= X_{i} {high!r}))"]
    path.write_text("\n".join([*lines, assertion]) + "\n")
    return path


def _floor_squares(tmp_path: Path) -> Path:
    """``y = 1 / (⌊1000x₀⌋² + ⌊1000x₁⌋² + 0.55)``: squares by Mul of a tensor with itself, a MatMul with ones."""
    nodes = [
        helper.make_node("Mul", ["X", "k"], ["a"]),
        helper.make_node("Floor", ["a"], ["h"]),
        helper.make_node("Mul", ["h", "h"], ["squares"]),
        helper.make_node("MatMul", ["squares", "ones"], ["total"]),
        helper.make_node("Add", ["total", "c"], ["d"]),
        helper.make_node("Reciprocal", ["d"], ["Y"]),
    ]
    constants = {"k": np.array(1000, np.float32), "ones": np.ones((2, 1), np.float32), "c": np.array(0.55, np.float32)}
    return _model(tmp_path / "floor_squares.onnx", nodes, constants, [1, 2], [1, 1])


def _steep_reciprocal(tmp_path: Path) -> Path:
    """``y = 1 / ((4x)² + 10⁻³)``."""
    nodes = [
        helper.make_node("Mul", ["X", "k"], ["a"]),
        helper.make_node("Mul", ["a", "a"], ["square"]),
        helper.make_node("Add", ["square", "c"], ["d"]),
        helper.make_node("Reciprocal", ["d"], ["Y"]),
    ]
    constants = {"k": np.array(4, np.float32), "c": np.array(1e-3, np.float32)}
    return _model(tmp_path / "steep_reciprocal.onnx", nodes, constants, [1, 1], [1, 1])


def _half_round_trip(tmp_path: Path) -> Path:
    nodes = [
        helper.make_node("Cast", ["X"], ["half"], to=TensorProto.FLOAT16),
        helper.make_node("Cast", ["half"], ["Y"], to=TensorProto.FLOAT),
    ]
    return _model(tmp_path / "half.onnx", nodes, {}, [1, 1], [1, 1])


#: name → (model builder, input box, witness, the unsafe set written with the witness's value ``y``)
CASES = {
    "floor_squares": (_floor_squares, [(-1.0, 3.0), (-1.0, 3.0)], [0.0005, 0.0005], "(assert (>= Y_0 1.5))"),
    "steep_reciprocal": (_steep_reciprocal, [(-1.0, 1.0)], [0.0], "(assert (>= Y_0 999.8))"),
    "half_round_trip": (_half_round_trip, [(1000.1, 1000.2)], [1000.15], "(assert (<= Y_0 1000.05))"),
}


def _bounds(path: Path, box: list[tuple[float, float]]) -> dict[str, tuple[float, float]]:
    """The output's IBP, CROWN and α-CROWN bounds over the box (exact float32 box ends)."""
    graph = load_onnx(path)
    lower, upper = (np.array(side, dtype=np.float64) for side in zip(*box, strict=True))
    interval = box_tensor(lower, upper, graph.input.shape, graph.dtype)
    rows = torch.tensor([[[1.0]], [[-1.0]]])
    ibp = graph.ibp(interval)[graph.output.name]
    crown = spec_lower(graph, rows, interval, intermediate_bounds(graph, interval))[:, 0]
    alpha = alpha_crown(graph, interval, rows, iterations=10).lower[:, 0]
    return {
        "ibp": (float(ibp.lower), float(ibp.upper)),
        "crown": (float(crown[0]), -float(crown[1])),
        "alpha-crown": (float(alpha[0]), -float(alpha[1])),
    }


@pytest.mark.parametrize("case", CASES)
def test_every_bound_contains_onnxruntimes_value_at_the_witness(case: str, tmp_path: Path) -> None:
    build, box, witness, _ = CASES[case]
    path = build(tmp_path)
    value = float(reference_outputs(path, np.array([witness], np.float32))[0].ravel()[0])
    for method, (lower, upper) in _bounds(path, box).items():
        assert lower <= value <= upper, (method, lower, value, upper)


@pytest.mark.parametrize("run", RUNS)
@pytest.mark.parametrize("case", CASES)
def test_no_method_answers_unsat_where_the_witness_violates_the_property(case: str, run: str, tmp_path: Path):
    build, box, witness, unsafe = CASES[case]
    path = build(tmp_path)
    prop = _property(tmp_path / f"{case}.vnnlib", box, unsafe)
    # The witness is in the box and in the unsafe set, by onnxruntime: the property does not hold.
    (parsed,) = read_vnnlib(prop, len(box), 1).cases
    y = reference_outputs(path, np.array([witness], np.float32))[0].ravel()
    assert all(np.all(d.matrix @ y <= d.rhs) for d in parsed.disjuncts)
    result = verify_files(path, prop, VerifyConfig(timeout=20, **RUNS[run]))
    assert result.verdict is not Verdict.UNSAT, result.decided_by
    assert not result.reason.startswith("internal error"), result.reason
    if result.verdict is Verdict.SAT:
        assert result.counterexample_check == "ok"


def test_a_float64_model_is_bounded_and_replayed_in_float64(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    nodes = [
        helper.make_node("Gemm", ["X", "W", "b"], ["h"], transB=1),
        helper.make_node("Relu", ["h"], ["r"]),
        helper.make_node("ReduceSum", ["r"], ["Y"], keepdims=1),
    ]
    constants = {"W": rng.standard_normal((3, 2)), "b": rng.standard_normal(3)}
    path = _model(tmp_path / "double.onnx", nodes, constants, [1, 2], [1, 1], TensorProto.DOUBLE)
    assert load_onnx(path).dtype == torch.float64
    sat = verify_files(path, _property(tmp_path / "sat.vnnlib", [(-1, 1)] * 2, "(assert (>= Y_0 0.0))"))
    assert sat.verdict is Verdict.SAT and sat.counterexample_check == "ok"
    unsat = verify_files(path, _property(tmp_path / "unsat.vnnlib", [(-1, 1)] * 2, "(assert (<= Y_0 -0.5))"))
    assert unsat.verdict is Verdict.UNSAT  # a ReLU sum is never negative


def test_a_float64_model_whose_only_constant_is_a_concat_part_is_bounded_in_float64(tmp_path: Path) -> None:
    """Found by ``fedshard bench fuzz``: ``Concat(c, x)`` held ``c`` in a list, the graph took itself for float32 and
    the spec's float32 matrix met float64 outputs (an internal error on every method)."""
    nodes = [helper.make_node("Concat", ["C", "X"], ["Y"], axis=1)]
    path = _model(tmp_path / "concat.onnx", nodes, {"C": np.array([[0.1, -2.0]])}, [1, 2], [1, 4], TensorProto.DOUBLE)
    assert load_onnx(path).dtype == torch.float64
    sat = verify_files(path, _property(tmp_path / "sat.vnnlib", [(0, 1)] * 2, "(assert (>= Y_3 1.0))", outputs=4))
    assert sat.verdict is Verdict.SAT and sat.counterexample_check == "ok"
    unsat = verify_files(path, _property(tmp_path / "unsat.vnnlib", [(0, 1)] * 2, "(assert (>= Y_0 0.1000001))", 4))
    assert unsat.verdict is Verdict.UNSAT  # the constant 0.1 in float64 stays below 0.1000001


def test_maxpool_over_dead_relus_stays_exactly_zero(tmp_path: Path) -> None:
    """MaxPool loads as a tree of gaps ``a − b`` and ReLUs; over dead ReLUs every gap is ``0 − 0``, exact in the
    model and in ours. Charging it a flushed subnormal (or stepping a float64 0 outwards) made each of those gaps an
    unstable ReLU: ten times the rows in CROWN's pass, 15x the time on verivital's MaxPool net."""
    nodes = [
        helper.make_node("Mul", ["X", "minus_one"], ["negated"]),
        helper.make_node("Add", ["negated", "minus_one"], ["pre"]),  # in [-2, -1] on the box: the ReLUs are dead
        helper.make_node("Relu", ["pre"], ["dead"]),
        helper.make_node("MaxPool", ["dead"], ["Y"], kernel_shape=[2, 2], strides=[2, 2]),
    ]
    minus_one = {"minus_one": np.array(-1.0, dtype=np.float32)}
    path = _model(tmp_path / "dead_pool.onnx", nodes, minus_one, [1, 1, 4, 4], [1, 1, 2, 2])
    graph = load_onnx(path)
    box = Interval(torch.zeros(1, 1, 4, 4), torch.ones(1, 1, 4, 4))
    bounds = graph.ibp(box)
    assert len(graph.relus) > 1  # the pool's gaps are ReLUs too
    for name in (graph.output.name, *graph.pre_activation.values()):
        if name != graph.relus[0].inputs[0]:  # the pool's gaps, and its output
            assert torch.all(bounds[name].lower == 0) and torch.all(bounds[name].upper == 0), name
    assert int(unstable_count(graph, bounds).sum()) == 0


def test_resize_moves_the_elements_onnxruntime_moves(tmp_path: Path) -> None:
    """Found by ``fedshard bench fuzz`` (seed 1002, case 1814): nearest Resize with ``align_corners`` and scale 1/2
    over 5 columns takes columns 0 and 4 in onnxruntime (``i·(5 − 1)/(2 − 1)``) but 0 and 2 in onnx's reference
    evaluator, which traced it: a wrong ``unsat`` on a property only columns 4 break."""
    nodes = [
        helper.make_node(
            "Resize",
            ["X", "", "scales"],
            ["Y"],
            mode="nearest",
            coordinate_transformation_mode="align_corners",
            nearest_mode="floor",
        )
    ]
    scales = {"scales": np.array([1, 1, 1, 0.5], dtype=np.float32)}
    path = _model(tmp_path / "resize.onnx", nodes, scales, [1, 1, 1, 5], [1, 1, 1, 2])
    x = np.arange(5, dtype=np.float32).reshape(1, 5)
    assert reference_outputs(path, x).ravel().tolist() == [0.0, 4.0]
    graph = load_onnx(path)
    assert graph(torch.from_numpy(x)).flatten().tolist() == [0.0, 4.0]
    prop = _property(tmp_path / "p.vnnlib", [(0.0, 1.0)] * 4 + [(3.0, 4.0)], "(assert (>= Y_1 3.5))", outputs=2)
    assert verify_files(path, prop).verdict is Verdict.SAT


def test_a_float64_model_without_constants_computes_in_float64(tmp_path: Path) -> None:
    """Found by ``fedshard bench fuzz`` (seed 1002, case 806): a float64 ``ReduceMean`` alone has no constant to
    tell the graph its dtype; it bounded in float32, and a counterexample at the box's float32-rounded edge lay
    outside the float64 box (answered ``unknown`` by the replay check)."""
    nodes = [helper.make_node("ReduceMean", ["X"], ["Y"], axes=[1], keepdims=0)]
    path = _model(tmp_path / "mean.onnx", nodes, {}, [1, 3], [1], TensorProto.DOUBLE)
    assert load_onnx(path).dtype == torch.float64
    box = [(0.1, 0.3), (1354.6632753668541, 1360.1505207532773), (-0.7, 0.2)]
    edge = (0.3 + 1360.1505207532773 + 0.2) / 3
    result = verify_files(path, _property(tmp_path / "edge.vnnlib", box, f"(assert (>= Y_0 {edge!r}))"))
    assert result.verdict is Verdict.SAT and result.counterexample_check == "ok"


def test_softmax_bounds_hold_where_one_logit_dominates() -> None:
    """Found by ``fedshard bench fuzz`` (seed 1007, case 1774): with logits in [−2.9, 53.5] and [−2.9, 125.7] the
    lower bound of the second output came out 1 — ``(e^{53.5−125.7} + 1) − 1`` is 0 in float64 — though its exact
    minimum over the box is ``e^{−2.9} / (e^{−2.9} + e^{53.5})``, 10⁻²⁵. IBP then proved a property onnxruntime
    breaks."""
    lower, upper = torch.tensor([[-2.898, -2.898]]), torch.tensor([[53.52, 125.71]])
    out = Softmax(0, (2,)).ibp(Interval(lower, upper))
    low, high = (float(v) for v in lower[0].double()), (float(v) for v in upper[0].double())
    (l0, l1), (u0, u1) = low, high
    exact_low = [1 / (1 + math.exp(u1 - l0)), 1 / (1 + math.exp(u0 - l1))]
    assert all(out.lower[0, k] <= exact_low[k] for k in range(2))
    assert all(out.upper[0, k] >= 1 - 1e-6 for k in range(2))  # either output nearly 1 somewhere in the box


def test_a_float16_model_is_bounded_in_its_own_rounding_and_replayed_in_float16(tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    nodes = [helper.make_node("Gemm", ["X", "W", "b"], ["h"], transB=1), helper.make_node("Tanh", ["h"], ["Y"])]
    constants = {"W": rng.standard_normal((2, 3)).astype(np.float16), "b": rng.standard_normal(2).astype(np.float16)}
    path = _model(tmp_path / "half.onnx", nodes, constants, [1, 3], [1, 2], TensorProto.FLOAT16)
    graph = load_onnx(path)
    box = Interval(torch.full((1, 3), -1.0), torch.full((1, 3), 1.0))
    out = graph.ibp(box)[graph.output.name]
    x = rng.uniform(-1, 1, (500, 3)).astype(np.float16)
    y = reference_outputs(path, x).reshape(len(x), -1).astype(np.float64)
    assert np.all(y >= out.lower.double().numpy()) and np.all(y <= out.upper.double().numpy())
    at = int(np.argmax(y[:, 0]))
    prop = _property(tmp_path / "sat.vnnlib", [(-1, 1)] * 3, f"(assert (>= Y_0 {float(y[at, 0])!r}))", outputs=2)
    result = verify_files(path, prop, VerifyConfig(timeout=20))
    assert result.verdict is Verdict.SAT and result.counterexample_check == "ok"


def test_a_scalar_output_is_verified(tmp_path: Path) -> None:
    # ReduceMax(x·W, axes=[1], keepdims=0): the output is one number per sample.
    weight = np.random.default_rng(2).standard_normal((4, 3)).astype(np.float32)
    nodes = [
        helper.make_node("MatMul", ["X", "W"], ["h"]),
        helper.make_node("ReduceMax", ["h"], ["Y"], axes=[1], keepdims=0),
    ]
    path = _model(tmp_path / "max.onnx", nodes, {"W": weight}, [1, 4], [1])
    x = np.random.default_rng(3).uniform(-1, 1, (2000, 4)).astype(np.float32)
    lowest = float(reference_outputs(path, x).min())
    for threshold, allowed in ((lowest, {Verdict.SAT}), (-10.0, {Verdict.UNSAT})):
        prop = _property(tmp_path / "p.vnnlib", [(-1, 1)] * 4, f"(assert (<= Y_0 {threshold!r}))")
        result = verify_files(path, prop, VerifyConfig(timeout=20))
        assert result.verdict in allowed, (threshold, result.verdict, result.reason)
    # max_j (xW)_j ≥ -10 on the box: |xW|_j ≤ Σ|W_ij| ≤ 10 for these weights
    assert np.abs(weight).sum(0).max() < 10


def test_an_affine_net_at_its_exact_minimum_is_answered_without_branching(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    nodes = [
        helper.make_node("Conv", ["X", "K"], ["c"]),
        helper.make_node("Pad", ["c", "pads"], ["p"]),
        helper.make_node("Flatten", ["p"], ["f"]),
        helper.make_node("Transpose", ["f"], ["t"], perm=[1, 0]),
        helper.make_node("MatMul", ["M", "t"], ["m"]),
        helper.make_node("Add", ["m", "bias"], ["a"]),
        helper.make_node("Transpose", ["a"], ["Y"], perm=[1, 0]),
    ]
    constants = {
        "K": rng.standard_normal((2, 1, 3, 3)).astype(np.float32),
        "pads": np.array([0, 0, 1, 1, 0, 0, 1, 1], np.int64),
        "M": rng.standard_normal((2, 50)).astype(np.float32),
        "bias": np.ones((2, 1), np.float32),
    }
    path = _model(tmp_path / "affine.onnx", nodes, constants, [1, 1, 5, 5], [1, 2])
    # The minimising corner of the first output, found by its gradient; the property sits at onnxruntime's value.
    graph = load_onnx(path)
    probe = torch.zeros(1, 1, 5, 5, requires_grad=True)
    graph(probe).reshape(-1)[0].backward()
    corner = torch.where(probe.grad >= 0, -1.0, 1.0).numpy()
    minimum = float(reference_outputs(path, corner)[0].ravel()[0])
    prop = _property(tmp_path / "p.vnnlib", [(-1, 1)] * 25, f"(assert (<= Y_0 {minimum!r}))", outputs=2)
    for bab in ("neuron", "input"):
        result = verify_files(path, prop, VerifyConfig(timeout=20, bab=bab, attack_restarts=0, attack_every=0))
        assert result.verdict in (Verdict.SAT, Verdict.UNKNOWN), (bab, result.verdict, result.reason)
        assert result.reason == "" and (result.verdict is Verdict.UNKNOWN or result.counterexample_check == "ok")


def test_branch_and_bound_with_nothing_to_split_answers_from_the_root() -> None:
    # An affine graph: no relaxation, no neuron to split; the property sits at the exact minimum over the box.
    weight = torch.tensor([[1.0, -2.0, 0.5]])
    graph = BoundGraph([Node("x", None, (), (3,)), Node("y", Linear(weight, torch.tensor([0.25])), ("x",), (1,))])
    minimum = 0.25 - float(weight.abs().sum())
    case = Case(InputBox(-np.ones(3), np.ones(3)), (Disjunct(np.array([[1.0]]), np.array([minimum])),))
    spec = OutputSpec.from_case(case, (1,), torch.float32)
    box = Interval(-torch.ones(1, 3), torch.ones(1, 3))
    root = alpha_crown(graph, box, spec.rows(1), iterations=0)
    with Budget.start(timeout=10).using():
        outcome = branch_and_bound(graph, spec, box, root, VerifyConfig())
    assert outcome.verdict is Verdict.SAT  # the root's minimising corner reaches the minimum exactly
    assert float(graph(outcome.counterexample.view(1, 3))) <= minimum


def test_a_property_coefficient_that_float32_rounds_is_charged_against_the_outputs() -> None:
    # The row 0.1·y₀ + y₁ ≤ 0: 0.1 is not a float32 number, so a bound of the float32 row misses 0.1's rounding
    # times y₀ (1.5e-9·|y₀|): it comes off every margin, and until the outputs are bounded such a row proves nothing.
    case = Case(InputBox(np.zeros(1), np.zeros(1)), (Disjunct(np.array([[0.1, 1.0]]), np.array([0.0])),))
    spec = OutputSpec.from_case(case, (2,), torch.float32)
    lower = torch.tensor([[1.0]], dtype=torch.float64)  # a lower bound of the float32 row (float64: no rounding)
    assert float(spec.margins(lower)[0, 0]) == -float("inf")
    spec.bound_outputs(Interval(torch.tensor([[-4.0, 0.0]]), torch.tensor([[4.0, 0.0]])))
    slack = abs(0.1 - float(np.float32(0.1))) * 4
    assert 1.0 - 2 * slack <= float(spec.margins(lower)[0, 0]) <= 1.0 - slack


def test_tf32_is_off_while_verifying() -> None:
    # cuDNN's TF32 convolutions (on by default in torch 2.13) keep 10 mantissa bits: no float32 bound survives them.
    seen = []

    class Watched(ReLU):
        def ibp(self, x):
            seen.append((torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32))
            return super().ibp(x)

    graph = BoundGraph(
        [
            Node("x", None, (), (2,)),
            Node("r", Watched(), ("x",), (2,)),
            Node("y", Linear(torch.ones(1, 2)), ("r",), (1,)),
        ]
    )
    prop = Property(2, 1, (Case(InputBox(-np.ones(2), np.ones(2)), (Disjunct(np.array([[1.0]]), np.array([-1.0])),)),))
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    try:
        assert verify(graph, prop, VerifyConfig(timeout=10)).verdict is Verdict.UNSAT
        assert (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32) == (True, True)  # restored
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved
    assert seen and all(flags == (False, False) for flags in seen)
