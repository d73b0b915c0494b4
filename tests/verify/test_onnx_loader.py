"""The ONNX loader against onnxruntime: VNN-COMP mnist nets, an exported ResNet, tiny exported and hand-built
graphs, error messages, and the adjoint identity <A, L(x)> = <Lᵀ(A), x> of every linear op it builds."""

from __future__ import annotations

import gzip
import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper
from torch import nn

import lightning_fedshard.verify
from lightning_fedshard.verify.onnx import OnnxLoadError, UnsupportedModelError, load_onnx
from lightning_fedshard.verify.ops import Add, AvgPool2d, BatchNorm, Conv2d, Linear, ReLU, Reshape
from tests.import_cycles import import_cycle
from tests.verify.onnx_models import (
    check_adjoint,
    check_against_onnxruntime,
    export,
    hand_built,
    onnx_ops,
    our_ops,
    weights,
)

ort = pytest.importorskip("onnxruntime")

MNIST = Path(__file__).resolve().parents[2].parent / "shared" / "vnncomp" / "mnist_fc_2022"
ACASXU = MNIST.parent / "acasxu_2022"


# --------------------------------------------------------------------------- mnist_fc (VNN-COMP 2022)


@pytest.mark.parametrize("depth", [2, 4, 6])
def test_mnist_nets_match_onnxruntime(depth: int) -> None:
    path = MNIST / "onnx" / f"mnist-net_256x{depth}.onnx"
    if not path.exists():
        pytest.skip(f"{path} is not available")
    graph = check_against_onnxruntime(path, 64, low=0.0)
    assert graph.input.name == "0" and graph.input.shape == (784, 1)
    assert [type(node.op) for node in graph.nodes[1:]] == [Reshape] + [Linear, ReLU] * depth + [Linear]
    assert graph.output.name == onnx.load(str(path)).graph.output[0].name and graph.output.shape == (10,)


def test_mnist_net_loads_gzipped(tmp_path: Path) -> None:
    path = MNIST / "onnx" / "mnist-net_256x2.onnx"
    if not path.exists():
        pytest.skip(f"{path} is not available")
    zipped = tmp_path / "net.onnx.gz"
    with path.open("rb") as source, gzip.open(zipped, "wb") as target:
        shutil.copyfileobj(source, target)
    x = torch.rand(8, 784)
    plain, packed = load_onnx(path, dtype=torch.float64), load_onnx(zipped, dtype=torch.float64)
    assert packed.dtype == torch.float64
    assert torch.equal(plain(x.double()), packed(x.double()))


# --------------------------------------------------------------------------- an exported ResNet


class _ResNet(nn.Module):
    """Normalised input, conv-bn-relu, one residual block, a strided conv, 2×2 average pooling, two dense layers."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("mean", torch.tensor([0.49, 0.48, 0.45]).view(1, 3, 1, 1))
        self.register_buffer("std", torch.tensor([0.25, 0.24, 0.26]).view(1, 3, 1, 1))
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU())
        self.branch = nn.Sequential(
            nn.Conv2d(8, 8, 3, padding=1),
            nn.BatchNorm2d(8),
            nn.ReLU(),
            nn.Conv2d(8, 8, 3, padding=1),
            nn.BatchNorm2d(8),
        )
        self.down = nn.Sequential(nn.Conv2d(8, 16, 3, stride=2, padding=1), nn.ReLU(), nn.AvgPool2d(2))
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(16 * 4 * 4, 32), nn.ReLU(), nn.Linear(32, 10))
        generator = torch.Generator().manual_seed(0)
        for bn in (m for m in self.modules() if isinstance(m, nn.BatchNorm2d)):
            for tensor, low, high in (
                (bn.running_mean, -0.5, 0.5),
                (bn.running_var, 0.5, 2.0),
                (bn.weight.data, 0.5, 1.5),
                (bn.bias.data, -0.5, 0.5),
            ):
                tensor.copy_(torch.rand(tensor.shape, generator=generator) * (high - low) + low)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem((x - self.mean) / self.std)
        x = torch.relu(x + self.branch(x))
        return self.head(self.down(x))


@pytest.fixture(scope="module")
def resnet_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.manual_seed(0)
    return export(_ResNet(), (3, 16, 16), tmp_path_factory.mktemp("resnet") / "resnet.onnx")


def test_resnet_matches_onnxruntime(resnet_path: Path) -> None:
    exported = onnx_ops(resnet_path)
    assert {"BatchNormalization", "Add", "Sub", "Div", "Conv", "AveragePool", "Flatten", "Gemm"} <= set(exported)
    graph = check_against_onnxruntime(resnet_path, 32)
    assert {BatchNorm, Add, Conv2d, AvgPool2d, Linear, ReLU, Reshape} <= our_ops(graph)
    assert graph.input.shape == (3, 16, 16) and graph.output.shape == (10,)
    assert sum(isinstance(node.op, BatchNorm) for node in graph.nodes) == exported.count("BatchNormalization")


def test_resnet_transposes_are_adjoints(resnet_path: Path) -> None:
    check_adjoint(load_onnx(resnet_path, dtype=torch.float64))


# --------------------------------------------------------------------------- tiny exported models


class _ViewFlatten(nn.Module):
    """``x.view(x.size(0), -1)``: exported as a Constant/Unsqueeze/Concat chain feeding Reshape."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(2 * 3 * 3, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x.view(x.size(0), -1))


EXPORTED = {
    # nn.Linear without bias exports as Transpose(weight) + MatMul; the Transpose folds into the weight.
    "matmul": (lambda: nn.Sequential(nn.Linear(6, 5, bias=False), nn.ReLU(), nn.Linear(5, 3, bias=False)), (6,)),
    "grouped_dilated_conv": (lambda: nn.Conv2d(4, 6, 3, padding=2, dilation=2, groups=2), (4, 9, 9)),
    "strided_conv_odd": (lambda: nn.Conv2d(2, 3, 3, stride=2, padding=1), (2, 9, 9)),
    "strided_conv_remainder": (lambda: nn.Conv2d(2, 3, 2, stride=2), (2, 9, 8)),
    "avgpool_exclude_pad": (lambda: nn.AvgPool2d(3, stride=2, padding=1, count_include_pad=False), (2, 7, 7)),
    "avgpool_include_pad": (lambda: nn.AvgPool2d(3, stride=2, padding=1, count_include_pad=True), (2, 7, 7)),
    "global_avgpool": (lambda: nn.Sequential(nn.Conv2d(2, 3, 3), nn.AdaptiveAvgPool2d(1), nn.Flatten()), (2, 6, 6)),
    "view_flatten": (_ViewFlatten, (2, 3, 3)),
}


@pytest.mark.parametrize("name", EXPORTED)
def test_exported_model_matches_onnxruntime(name: str, tmp_path: Path) -> None:
    factory, shape = EXPORTED[name]
    torch.manual_seed(0)
    path = export(factory(), shape, tmp_path / f"{name}.onnx")
    expected_op = {"matmul": "MatMul", "global_avgpool": "GlobalAveragePool", "view_flatten": "Concat"}.get(name)
    assert expected_op is None or expected_op in onnx_ops(path)
    graph = check_against_onnxruntime(path, 16)
    check_adjoint(load_onnx(path, dtype=torch.float64))
    if name == "matmul":
        assert [type(node.op) for node in graph.nodes[1:]] == [Linear, ReLU, Linear]


# --------------------------------------------------------------------------- hand-built graphs


HAND_BUILT = {
    # W @ x over the second-to-last dimension (mnist_fc's input is [1, 784, 1]).
    "left_matmul": ([helper.make_node("MatMul", ["w", "x"], ["y"])], [1, 3, 2], {"w": weights(4, 3)}),
    "matmul_then_bias": (
        [helper.make_node("MatMul", ["x", "w"], ["m"]), helper.make_node("Add", ["m", "b"], ["y"])],
        [1, 3],
        {"w": weights(3, 4), "b": weights(4, seed=1)},
    ),
    # torch only exports symmetric pads; ONNX's (top, left, bottom, right) = (0, 0, 1, 1) with stride 2.
    "asymmetric_pad_conv": (
        [helper.make_node("Conv", ["x", "w", "b"], ["y"], pads=[0, 0, 1, 1], strides=[2, 2])],
        [1, 2, 6, 6],
        {"w": weights(3, 2, 3, 3), "b": weights(3, seed=1)},
    ),
    # ceil_mode's last window would start in the padding: onnxruntime and torch drop it (onnx's shape inference
    # does not); the graph must follow onnxruntime.
    "avgpool_ceil_mode": (
        [
            helper.make_node(
                "AveragePool",
                ["x"],
                ["y"],
                kernel_shape=[2, 3],
                pads=[1, 1, 1, 1],
                strides=[2, 2],
                count_include_pad=1,
                ceil_mode=1,
            )
        ],
        [1, 2, 5, 6],
        {},
    ),
    "reshape_zero_and_minus_one": (
        [helper.make_node("Reshape", ["x", "shape"], ["r"]), helper.make_node("Relu", ["r"], ["y"])],
        [1, 4, 3, 2],
        {"shape": np.array([0, -1, 2], dtype=np.int64)},
    ),
    "gemm_alpha_beta": (
        [helper.make_node("Gemm", ["x", "w", "c"], ["y"], alpha=0.5, beta=2.0)],
        [1, 4],
        {"w": weights(4, 3), "c": weights(1, 3, seed=1)},
    ),
    "constant_arithmetic": (
        [
            helper.make_node("Constant", [], ["k"], value=numpy_helper.from_array(weights(3, 1, 1, seed=2))),
            helper.make_node("Sub", ["k", "x"], ["a"]),
            helper.make_node("Div", ["a", "s"], ["b"]),
            helper.make_node("Mul", ["s", "b"], ["c"]),
            helper.make_node("Identity", ["c"], ["d"]),
            helper.make_node("Add", ["d", "row"], ["y"]),  # broadcasts [1, 3, 1, 2] up to [1, 3, 4, 2]
        ],
        [1, 3, 1, 2],
        {"s": np.float32([0.5, -2.0, 4.0]).reshape(3, 1, 1), "row": weights(1, 4, 1, seed=3)},
    ),
    # Formerly refused, now graphs without a batch dimension or with computed products: x·x is the square, 1/x a
    # reciprocal, W [4, 1] @ x [1, 4] an outer product, transA a transpose, [1, 4] → [4] a graph without batch.
    "square": ([helper.make_node("Mul", ["x", "x"], ["y"])], [1, 4], {}),
    "constant_over_x": ([helper.make_node("Div", ["one", "x"], ["y"])], [1, 4], {"one": np.float32([1.0])}),
    "outer_product_matmul": ([helper.make_node("MatMul", ["w", "x"], ["y"])], [1, 4], {"w": weights(4, 1)}),
    "transposed_gemm_input": ([helper.make_node("Gemm", ["x", "w"], ["y"], transA=1)], [1, 4], {"w": weights(1, 2)}),
    "batch_merging_reshape": ([helper.make_node("Reshape", ["x", "s"], ["y"])], [1, 4], {"s": np.int64([-1])}),
    "shape_gather_chain": (
        [
            helper.make_node("Shape", ["x"], ["shape"]),
            helper.make_node("Gather", ["shape", "zero"], ["batch"], axis=0),
            helper.make_node("Unsqueeze", ["batch", "zero_axis"], ["batch_1d"]),
            helper.make_node("Concat", ["batch_1d", "minus_one"], ["target"], axis=0),
            helper.make_node("Reshape", ["x", "target"], ["y"]),
        ],
        [1, 2, 3],
        {
            "zero": np.array(0, dtype=np.int64),
            "zero_axis": np.array([0], dtype=np.int64),
            "minus_one": np.array([-1], dtype=np.int64),
        },
    ),
}


@pytest.mark.parametrize("name", HAND_BUILT)
def test_hand_built_graph_matches_onnxruntime(name: str, tmp_path: Path) -> None:
    nodes, shape, initializers = HAND_BUILT[name]
    path = hand_built(tmp_path / f"{name}.onnx", nodes, shape, initializers)
    graph = check_against_onnxruntime(path, 16, low=0.5 if name == "constant_over_x" else -1.0)
    check_adjoint(load_onnx(path, dtype=torch.float64))
    assert graph.output.name == "y"


def test_initializers_listed_as_inputs_are_skipped(tmp_path: Path) -> None:
    weight = helper.make_tensor_value_info("w", TensorProto.FLOAT, [3, 4])
    path = hand_built(
        tmp_path / "old.onnx", [helper.make_node("MatMul", ["x", "w"], ["y"])], [1, 3], {"w": weights(3, 4)}, (weight,)
    )
    graph = check_against_onnxruntime(path, 4)
    assert graph.input.name == "x" and graph.input.shape == (3,)


def test_a_matmul_and_its_bias_become_one_layer(tmp_path: Path) -> None:
    nodes, shape, initializers = HAND_BUILT["matmul_then_bias"]
    graph = load_onnx(hand_built(tmp_path / "dense.onnx", nodes, shape, initializers))
    (layer,) = graph.nodes[1:]
    assert isinstance(layer.op, Linear) and layer.name == "y"
    torch.testing.assert_close(layer.op.bias, torch.from_numpy(initializers["b"]))
    # A product that something else reads too keeps its own node.
    shared = [*nodes, helper.make_node("Add", ["m", "y"], ["z"])]
    path = hand_built(tmp_path / "shared.onnx", shared, shape, initializers)
    model = onnx.load(path)
    model.graph.output[0].name = "z"
    onnx.save(model, path)
    graph = check_against_onnxruntime(path, 8)
    assert [node.name for node in graph.nodes[1:]] == ["m", "y", "z"]


def test_a_symbolic_batch_dimension_is_the_batch(tmp_path: Path) -> None:
    nodes, _, initializers = HAND_BUILT["matmul_then_bias"]
    path = hand_built(tmp_path / "symbolic.onnx", nodes, ["N", 3], initializers)
    graph = check_against_onnxruntime(path, 8)
    assert graph.input.shape == (3,)


@pytest.mark.skipif(not ACASXU.is_dir(), reason="../shared/vnncomp/acasxu_2022 is absent")
@pytest.mark.parametrize("net", ["1_1", "3_3", "5_9"])
def test_acasxu_matlab_exports_match_onnxruntime(net: str) -> None:
    # gzipped, opset 8, weights listed among the graph inputs, Sub normalisation, MatMul then Add per layer
    path = ACASXU / "onnx" / f"ACASXU_run2a_{net}_batch_2000.onnx.gz"
    graph = check_against_onnxruntime(path, 32, low=-0.5)
    assert [type(node.op).__name__ for node in graph.nodes[1:]].count("Linear") == 7  # each bias folded in


# --------------------------------------------------------------------------- errors


ERRORS = {
    "unsupported": (
        [helper.make_node("Erf", ["x"], ["y"], name="Erf_3")],
        {},
        "unsupported ONNX operator 'Erf' at node 'Erf_3'",
    ),
    "discrete_output": (
        [helper.make_node("IsNaN", ["x"], ["y"], name="head")],
        {},
        "IsNaN at node 'head' computes a discrete value from the input",
    ),
    "computed_condition": (
        [
            helper.make_node("Greater", ["x", "zero"], ["c"], name="compare"),
            helper.make_node("Where", ["c", "x", "zero"], ["y"]),
        ],
        {"zero": np.float32([0.0])},
        "Greater at node 'compare' computes a discrete value",
    ),
    "computed_exponent": (
        [helper.make_node("Pow", ["x", "x"], ["y"], name="p")],
        {},
        "Pow node 'p'.*computed exponent",
    ),
    "integer_weight": ([helper.make_node("MatMul", ["x", "w"], ["y"])], {"w": np.ones((4, 2), np.int64)}, "int64"),
    "unknown_tensor": ([helper.make_node("Add", ["x", "ghost"], ["y"])], {}, "unknown tensor 'ghost'"),
}


@pytest.mark.parametrize("name", ERRORS)
def test_load_errors_name_the_problem(name: str, tmp_path: Path) -> None:
    nodes, initializers, message = ERRORS[name]
    path = hand_built(tmp_path / f"{name}.onnx", nodes, [1, 4], initializers)
    with pytest.raises(OnnxLoadError, match=message):
        load_onnx(path)


def test_auto_pad_same_is_rejected(tmp_path: Path) -> None:
    node = helper.make_node("Conv", ["x", "w"], ["y"], auto_pad="SAME_UPPER", name="conv0")
    path = hand_built(tmp_path / "same.onnx", [node], [1, 1, 5, 5], {"w": weights(1, 1, 3, 3)})
    with pytest.raises(OnnxLoadError, match="conv0.*auto_pad=SAME_UPPER"):
        load_onnx(path)


def test_unsupported_models_are_told_apart_from_broken_files(tmp_path: Path) -> None:
    nodes, initializers, _ = ERRORS["unsupported"]
    with pytest.raises(UnsupportedModelError, match="Erf"):
        load_onnx(hand_built(tmp_path / "erf.onnx", nodes, [1, 4], initializers))
    garbage = tmp_path / "garbage.onnx"
    garbage.write_bytes(b"\x00\x01")
    with pytest.raises(OnnxLoadError) as error:
        load_onnx(garbage)
    assert not isinstance(error.value, UnsupportedModelError)


def test_two_inputs_are_rejected(tmp_path: Path) -> None:
    second = helper.make_tensor_value_info("z", TensorProto.FLOAT, [1, 4])
    path = hand_built(tmp_path / "two.onnx", [helper.make_node("Add", ["x", "z"], ["y"])], [1, 4], {}, (second,))
    with pytest.raises(OnnxLoadError, match="2 inputs"):
        load_onnx(path)


def test_garbage_and_missing_files(tmp_path: Path) -> None:
    garbage = tmp_path / "garbage.onnx"
    garbage.write_bytes(b"\x00\xffthis is not a protobuf\x00" * 10)
    with pytest.raises(OnnxLoadError, match="not an ONNX model"):
        load_onnx(garbage)
    not_gzip = tmp_path / "garbage.onnx.gz"
    not_gzip.write_bytes(b"not gzip")
    with pytest.raises(OnnxLoadError, match="not an ONNX model"):
        load_onnx(not_gzip)
    with pytest.raises(OnnxLoadError, match="no such ONNX file"):
        load_onnx(tmp_path / "missing.onnx")


@pytest.mark.parametrize(
    ("weight", "message"),
    [
        (np.float32([[1.0, np.nan], [0.5, 2.0]]), r"node 'y' \(Linear\) has 1 non-finite value\(s\) in its weight"),
        (np.float64([[1e300, 0.0], [0.0, 1.0]]), r".* in its weight \(first inf\)"),  # finite in float64 only
    ],
    ids=["nan", "beyond-float32"],
)
def test_a_non_finite_weight_is_rejected_at_load_time(weight, message, tmp_path: Path) -> None:
    # A NaN weight made every bound NaN, and the instance came out unsat: a proof of nothing.
    path = hand_built(tmp_path / "nan.onnx", [helper.make_node("MatMul", ["x", "w"], ["y"])], [1, 2], {"w": weight})
    with pytest.raises(OnnxLoadError, match=f"^{path}: {message}") as error:
        load_onnx(path)
    assert not isinstance(error.value, UnsupportedModelError)
    if np.isfinite(weight).all():  # the check is on the constants as cast: a float64 graph holds this one
        assert float(load_onnx(path, dtype=torch.float64).output.op.weight.max()) == 1e300


def test_the_verify_modules_import_each_other_without_a_cycle() -> None:
    """The ONNX loader and its converters once imported each other (the converters at load time, the loader and
    the discrete converters lazily, inside functions)."""
    assert import_cycle(lightning_fedshard.verify) is None
