"""Every accepted operator in the form of each opset from 9 to 21, computed and folded, against onnxruntime.

Operators changed form between opsets (``../shared/research/onnx_opsets.md``): Unsqueeze's, Squeeze's, ReduceSum's
and Split's ``axes``/``split`` moved from attributes to inputs at 13, ReduceMean's/Max's/Min's at 18, Slice's at 10,
Pad's and Clip's at 11; Softmax normalised over all trailing axes before 13; Resize took ``roi`` at 11; Upsample
left at 10. Each model of :mod:`tests.verify.test_onnx_operators` is rewritten into the form of opset ``v``
(checked by onnx's full checker, which rejects another opset's form), its nodes applied twice — to the tensor
computed from the input and to a constant, which the loader folds — and the two results added before the head.
onnxruntime, which implements each opset's own semantics, is the reference: the loaded graph's forward pass must
equal it, and its outputs at points of the box must lie inside the IBP and CROWN bounds.

Networks exported by ``torch.onnx.export`` at opsets 9, 11, 13 and 17 (a small CNN and a 2-layer ViT whose shape
arithmetic is left unfolded, as PyTorch 2.0 exported a ViT at opset 9) are checked the same way.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from onnx import helper, numpy_helper
from torch import nn

from lightning_fedshard.bench.planted import write_robustness_vnnlib
from lightning_fedshard.bench.vit import TinyViT, export_at
from lightning_fedshard.verify import Verdict, VerifyConfig, verify_files
from lightning_fedshard.verify.bounds.crown import backward_bound, intermediate_bounds
from lightning_fedshard.verify.onnx import load_onnx
from lightning_fedshard.verify.ops import Interval
from tests.verify.onnx_models import reference_outputs, weights
from tests.verify.test_onnx_operators import CONSTANTS, HIDDEN, OPERATORS, POSITIVE, STRUCTURAL, _node

pytest.importorskip("onnxruntime")

OPSETS = (9, 11, 13, 17, 18, 21)
SAMPLES = 64
TOLERANCE = 1e-5

#: Operators whose opset-13 form (the tables' form) differs below 13 or from 18: the input that becomes an
#: attribute there, by position, and the attribute's name.
INPUT_TO_ATTRIBUTE_BELOW_13 = {
    "Unsqueeze": (1, "axes"),
    "Squeeze": (1, "axes"),
    "ReduceSum": (1, "axes"),
    "Split": (1, "split"),
}
ATTRIBUTE_TO_INPUT_FROM_18 = {"ReduceMean", "ReduceMax", "ReduceMin"}

#: Operators beyond the tables whose semantics changed with the opset, with the bound op's input shapes.
EXTRA = {
    # Softmax over axis 1 of [1, 2, 3]: before opset 13 over the flattened [2·3], from 13 over the 2 alone.
    "Softmax_axis1": ([_node("Reshape", ["h", "shape_2x3"], ["r"]), _node("Softmax", ["r"], axis=1)], "h"),
    "BatchNormalization": ([_node("BatchNormalization", ["x", "gamma", "beta", "mean", "var"])], "x"),
    "Dropout": ([_node("Dropout", ["x"], ["d"]), _node("Relu", ["d"])], "x"),
}
EXTRA_CONSTANTS = {
    "gamma": weights(2, seed=30, scale=0.5) + 1,
    "beta": weights(2, seed=31, scale=0.5),
    "mean": weights(2, seed=32, scale=0.5),
    "var": np.abs(weights(2, seed=33)) + 0.5,
    "roi": np.zeros(0, np.float32),
    "shape_2x3": np.array([1, 2, 3], np.int64),
}


def _nodes_and_source(name: str) -> tuple[list[onnx.NodeProto], str]:
    if name in EXTRA:
        return EXTRA[name]
    return OPERATORS[name][0], "x" if name in STRUCTURAL else "h"


def _exists(op_type: str, opset: int) -> bool:
    try:
        return not onnx.defs.get_schema(op_type, opset).deprecated
    except onnx.defs.SchemaError:
        return False


def _cases() -> list[tuple[str, int]]:
    return [
        (name, opset)
        for name in [*OPERATORS, *EXTRA]
        for opset in OPSETS
        if all(_exists(node.op_type, opset) for node in _nodes_and_source(name)[0])
    ]


def _in_opset(node: onnx.NodeProto, opset: int, constants: dict[str, np.ndarray]) -> onnx.NodeProto:
    """``node``, written in the opset-13 form, in the form of ``opset``."""
    attributes = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    inputs = list(node.input)

    def to_attribute(position: int, attribute: str) -> None:
        if len(inputs) > position and inputs[position]:
            attributes[attribute] = [int(v) for v in constants[inputs[position]]]
        del inputs[position:]

    if opset < 13 and node.op_type in INPUT_TO_ATTRIBUTE_BELOW_13:
        to_attribute(*INPUT_TO_ATTRIBUTE_BELOW_13[node.op_type])
    if opset >= 18 and node.op_type in ATTRIBUTE_TO_INPUT_FROM_18 and "axes" in attributes:
        axes_name = f"{node.output[0]}_axes"
        constants[axes_name] = np.array(attributes.pop("axes"), np.int64)
        inputs.append(axes_name)
    if opset < 10 and node.op_type == "Slice":  # starts, ends, axes attributes; no steps
        for position, attribute in ((3, "axes"), (2, "ends"), (1, "starts")):
            attributes[attribute] = [int(v) for v in constants[inputs[position]]]
        del inputs[1:]
    if opset < 11 and node.op_type == "Pad":
        attributes["pads"] = [int(v) for v in constants[inputs[1]]]
        if len(inputs) > 2:
            attributes["value"] = float(constants[inputs[2]])
        del inputs[1:]
    if opset < 11 and node.op_type == "Clip":
        attributes["min"], attributes["max"] = float(constants[inputs[1]]), float(constants[inputs[2]])
        del inputs[1:]
    if node.op_type == "Resize" and opset < 13:  # (X, scales) at 10; a roi input required at 11 and 12
        inputs = [inputs[0], inputs[2]] if opset < 11 else [inputs[0], "roi", inputs[2]]
    return helper.make_node(node.op_type, inputs, list(node.output), name=node.name, **attributes)


def _renamed(nodes: list[onnx.NodeProto], source: str, constant: str) -> list[onnx.NodeProto]:
    """``nodes`` applied to ``constant`` instead of ``source``: every tensor they compute gets a ``_folded`` name."""
    computed = {source: constant, "h2": f"{constant}2"}
    copies = []
    for node in nodes:
        for name in node.output:
            computed[name] = f"{name}_folded"
        copy = onnx.NodeProto()
        copy.CopyFrom(node)
        copy.name = f"{node.name}_folded"
        copy.input[:] = [computed.get(name, name) for name in node.input]
        copy.output[:] = [computed[name] for name in node.output]
        copies.append(copy)
    return copies


def _model(name: str, opset: int, path: Path) -> Path:
    """Operator ``name`` in opset ``opset``'s form, on the input's path and on a constant, then a linear head."""
    nodes, source = _nodes_and_source(name)
    constants = {**CONSTANTS, **EXTRA_CONSTANTS}
    nodes = [_in_opset(node, opset, constants) for node in nodes]
    positive = name in POSITIVE
    shape = [1, 2, 4, 4] if source == "x" else [1, 4]
    body = []
    if source == "h":
        scale, offset = (0.1, 2.0) if positive else (1.0, 0.0)
        for i, out in enumerate(["h", "h2"]):
            body.append(_node("Gemm", ["x", f"w{i}", f"b{i}"], [out]))
            constants[f"w{i}"] = weights(4, HIDDEN, seed=i, scale=scale)
            constants[f"b{i}"] = weights(HIDDEN, seed=10 + i, scale=0.5) + offset
    low = 0.6 if positive else -1.0
    constants["folded_in"] = np.random.default_rng(5).uniform(low, 1.0, [1, HIDDEN] if source == "h" else shape)
    constants["folded_in"] = constants["folded_in"].astype(np.float32)
    constants["folded_in2"] = (constants["folded_in"] * 0.5 + 0.5).astype(np.float32)
    body += [*nodes, *_renamed(nodes, source, "folded_in"), _node("Add", ["z", "z_folded"], ["sum"])]
    body.append(_node("Flatten", ["sum"], ["f"], axis=1))
    size = _output_size(body, shape, constants, opset)
    constants["head"] = weights(size, 3, seed=20, scale=size**-0.5)
    body.append(_node("MatMul", ["f", "head"], ["y"]))
    used = {i for node in body for i in node.input}
    initializers = [numpy_helper.from_array(value, key) for key, value in constants.items() if key in used]
    graph = helper.make_graph(
        body,
        name,
        [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, shape)],
        [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1, 3])],
        initializers,
    )
    model = _stamped(helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)]))
    onnx.checker.check_model(model, full_check=True)  # rejects a node in another opset's form
    onnx.save(model, str(path))
    return path


def _output_size(body: list[onnx.NodeProto], shape: list[int], constants: dict, opset: int) -> int:
    """The number of elements of the flattened ``f``, by onnxruntime."""
    import onnxruntime

    used = {name for node in body for name in node.input}
    graph = helper.make_graph(
        body,
        "probe",
        [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, shape)],
        [helper.make_tensor_value_info("f", onnx.TensorProto.FLOAT, None)],
        [numpy_helper.from_array(value, key) for key, value in constants.items() if key in used],
    )
    model = _stamped(helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)]))
    session = onnxruntime.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    (flat,) = session.run(None, {"x": np.zeros(shape, np.float32)})
    return flat.shape[1]


def _stamped(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` with the IR version of its opset's onnx release (make_model stamps the library's newest)."""
    model.ir_version = helper.find_min_ir_version_for(list(model.opset_import))
    return model


def _check_against_onnxruntime_and_bounds(path: Path, radius: float = 1.0) -> None:
    """``path`` loaded: its forward pass equals onnxruntime's at points of ``[-radius, radius]``, and the IBP and
    CROWN bounds over that box hold there."""
    graph = load_onnx(path)
    x = np.random.default_rng(0).uniform(-radius, radius, (SAMPLES, *graph.input.shape)).astype(np.float32)
    expected = reference_outputs(path, x).reshape(len(x), -1).astype(np.float64)
    ours = graph(torch.from_numpy(x)).double().numpy().reshape(len(x), -1)
    np.testing.assert_allclose(ours, expected, atol=1e-5, rtol=1e-5)

    box = Interval(torch.full((1, *graph.input.shape), -radius), torch.full((1, *graph.input.shape), radius))
    outputs = graph.output.size
    C = torch.cat([torch.eye(outputs), -torch.eye(outputs)]).view(2 * outputs, 1, outputs)
    ibp = graph.ibp(box)[graph.output.name]
    crown = backward_bound(graph, graph.output.name, C, box, intermediate_bounds(graph, box)).lower[:, 0]
    slack = TOLERANCE * (1 + np.abs(expected))
    for method, lower, upper in (
        ("ibp", ibp.lower[0].reshape(-1), ibp.upper[0].reshape(-1)),
        ("crown", crown[:outputs], -crown[outputs:]),
    ):
        lower, upper = lower.double().numpy(), upper.double().numpy()
        assert np.all(expected >= lower - slack), f"{method}: onnxruntime below the lower bound"
        assert np.all(expected <= upper + slack), f"{method}: onnxruntime above the upper bound"


@pytest.mark.parametrize(("name", "opset"), _cases(), ids=[f"{n}-opset{v}" for n, v in _cases()])
def test_operator_in_its_opsets_form_computed_and_folded_matches_onnxruntime(name: str, opset: int, tmp_path):
    _check_against_onnxruntime_and_bounds(_model(name, opset, tmp_path / f"{name}_{opset}.onnx"))


def test_every_operator_is_checked_at_opset_9_11_13_and_17():
    """Only operators an opset lacks are left out of it: Round (from 11), Resize (from 10), Upsample (to 9)."""
    cases = set(_cases())
    missing = {(name, v) for name in [*OPERATORS, *EXTRA] for v in (9, 11, 13, 17) if (name, v) not in cases}
    assert missing == {
        ("Round", 9),
        ("Resize_nearest", 9),
        *(("Upsample_opset9", v) for v in (11, 13, 17)),
    }


def test_the_rewritten_nodes_are_in_the_old_form():
    """The rewrite really moves inputs to attributes: an opset-9 Unsqueeze with an axes input is rejected."""
    constants = dict(CONSTANTS)
    old = _in_opset(_node("Unsqueeze", ["x", "axis_1"], ["u"]), 9, constants)
    assert list(old.input) == ["x"] and [a.name for a in old.attribute] == ["axes"]
    new = _in_opset(_node("ReduceMean", ["x"], ["m"], axes=[3], keepdims=1), 18, constants)
    assert len(new.input) == 2 and [a.name for a in new.attribute] == ["keepdims"]


@pytest.mark.parametrize("op_type", ["ReduceSum", "ReduceMean", "ReduceMax", "ReduceMin"])
def test_a_reduction_without_axes_and_noop_with_empty_axes_is_the_identity(op_type: str, tmp_path: Path):
    """Opset 18's ``noop_with_empty_axes=1`` without axes: the input unchanged, not a reduction over all axes."""
    nodes = [
        _node(op_type, ["x"], ["r"], noop_with_empty_axes=1, keepdims=1),
        _node("Relu", ["r"], ["z"]),
        _node("Flatten", ["z"], ["f"], axis=1),
        _node("MatMul", ["f", "head"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        op_type,
        [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1, 2, 4, 4])],
        [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1, 3])],
        [numpy_helper.from_array(weights(32, 3, seed=20, scale=32**-0.5), "head")],
    )
    path = tmp_path / f"{op_type}.onnx"
    onnx.save(_stamped(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])), str(path))
    _check_against_onnxruntime_and_bounds(path)


# --------------------------------------------------------------------------------------------- exported networks


class SmallCNN(nn.Module):
    """The convolutional operators exporters write differently across opsets: BatchNormalization, MaxPool, Pad,
    Clip (ReLU6), nearest Upsample/Resize, Split (chunk), AveragePool, Squeeze/Unsqueeze, Flatten."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 4, 3, padding=1)
        self.norm = nn.BatchNorm2d(4)
        self.head = nn.Linear(2 * 3 * 3, 3)
        with torch.no_grad():
            self.norm.running_mean.uniform_(-0.5, 0.5)
            self.norm.running_var.uniform_(0.5, 1.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = nn.functional.relu6(self.norm(self.conv(x)) * 3)
        h = nn.functional.max_pool2d(nn.functional.pad(h, (1, 0, 0, 1), value=0.5), 2, 2)
        h = nn.functional.interpolate(h, scale_factor=2.0, mode="nearest")
        a, b = h.chunk(2, dim=1)
        h = nn.functional.avg_pool2d(nn.functional.leaky_relu(a - b, 0.1), 2)
        return self.head(h.unsqueeze(1).squeeze(1).flatten(1))


@pytest.mark.parametrize("opset", (9, 11, 13, 17))
@pytest.mark.parametrize(
    ("net", "shape", "radius"),
    # LayerNorm's variance over a wide box reaches 0, where 1/sqrt has no finite bound: the ViT on a small box.
    [(TinyViT, (1, 8, 8), 0.01), (SmallCNN, (2, 6, 6), 1.0)],
    ids=["vit", "cnn"],
)
def test_exported_network_loads_at_every_opset_and_matches_onnxruntime(net, shape, radius, opset: int, tmp_path):
    torch.manual_seed(0)
    path = export_at(net(), shape, opset, tmp_path / f"{net.__name__}_{opset}.onnx")
    assert onnx.load(str(path)).opset_import[0].version == opset
    _check_against_onnxruntime_and_bounds(path, radius)


def test_a_vit_exported_at_opset_9_is_verified_at_small_epsilon_and_falsified_at_large(tmp_path: Path):
    """The 2-layer ViT, its head's bias set so that class 0 leads by 0.1 at the box centre: robust within ±0.001
    (``unsat``), and not within ±0.5, where the counterexample replays in onnxruntime."""
    torch.manual_seed(0)
    vit = TinyViT().eval()
    centre = torch.rand(1, 1, 8, 8, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        vit.head.bias -= vit(centre)[0] - torch.tensor([0.1, 0.0, 0.0])
    path = export_at(vit, (1, 8, 8), 9, tmp_path / "vit.onnx")
    assert int(reference_outputs(path, centre.numpy()).reshape(-1).argmax()) == 0
    verdicts = {}
    for epsilon in (0.001, 0.5):
        vnnlib = tmp_path / f"vit_{epsilon}.vnnlib"
        write_robustness_vnnlib(vnnlib, centre.numpy().reshape(-1), 0, "tiny ViT", epsilon=epsilon, classes=3)
        result = verify_files(path, vnnlib, VerifyConfig(timeout=60))
        verdicts[epsilon] = result.verdict
        if result.verdict == Verdict.SAT:
            x = result.counterexample.x.astype(np.float32)
            assert np.all(np.abs(x - centre.numpy().reshape(-1)) <= epsilon + 1e-7)
            outputs = reference_outputs(path, x.reshape(1, 1, 8, 8)).reshape(-1)
            assert outputs.argmax() != 0 or outputs[1:].max() >= outputs[0]
    assert verdicts == {0.001: Verdict.UNSAT, 0.5: Verdict.SAT}
