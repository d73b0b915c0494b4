"""Load an ONNX network into a :class:`BoundGraph`, written directly on ``onnx`` (no onnx2torch).

Supported: Gemm, MatMul (constant right operand), Add/Sub/Mul/Div (with a constant, or Add/Sub of two computed
tensors), Relu, Flatten, Reshape, Conv (2-D), BatchNormalization (inference), AveragePool, GlobalAveragePool,
Identity and Shape. Any node whose inputs are all constants (Constant, and the Shape→Gather→Unsqueeze→Concat
chains exporters emit for ``x.view(x.size(0), -1)``) is folded with ONNX's reference evaluator instead of becoming
a graph node. The leading ONNX dimension (1, or symbolic) becomes the batch dimension ``B`` of the graph.

Example::

    graph = load_onnx("mnist-net_256x2.onnx")   # or "mnist-net_256x2.onnx.gz"
    logits = graph(torch.rand(64, 784))          # [64, 10]; the ONNX input is [1, 784, 1]
"""

from __future__ import annotations

import gzip
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx
import torch
from onnx import numpy_helper
from onnx.reference import ReferenceEvaluator
from torch import Tensor

from lightning_fedshard.verify.graph import BoundGraph, Node
from lightning_fedshard.verify.ops import (
    Add,
    AvgPool2d,
    BatchNorm,
    BoundOp,
    Conv2d,
    ElementwiseAffine,
    LeftLinear,
    Linear,
    ReLU,
    Reshape,
)

__all__ = ["OnnxLoadError", "UnsupportedModelError", "load_onnx", "onnx_source"]


class OnnxLoadError(ValueError):
    """The file is missing, is not an ONNX model, or uses something the verifier cannot represent.

    Example::

        try:
            graph = load_onnx(path)
        except OnnxLoadError as err:
            print(f"cannot verify {path}: {err}")
    """


class UnsupportedModelError(OnnxLoadError):
    """A well-formed ONNX model that uses something the verifier cannot represent (an operator, an attribute, a
    signature): the instance is answered ``unknown`` with this reason, not failed."""


class _Context:
    """The graph built so far: computed tensors (graph nodes) and constants (numpy), keyed by ONNX tensor name."""

    def __init__(self, dtype: torch.dtype, opset: int) -> None:
        self.dtype, self.opset = dtype, opset
        self.constants: dict[str, np.ndarray] = {}
        self.variables: dict[str, Node] = {}  # Identity makes several tensor names point at one node
        self.nodes: list[Node] = []

    def is_constant(self, name: str) -> bool:
        return name in self.constants

    def variable(self, name: str) -> Node:
        if name not in self.variables:
            raise OnnxLoadError(f"expected a computed tensor, but {name!r} is a constant")
        return self.variables[name]

    def constant(self, name: str, role: str) -> np.ndarray:
        if name not in self.constants:
            raise OnnxLoadError(f"the {role} must be a constant, but {name!r} is computed from the input")
        return self.constants[name]

    def weight(self, name: str, role: str) -> Tensor:
        """A float constant as a float64 tensor: ops are built in float64 and cast once, so derived constants
        (1/c, alpha·B, folded batch norm) are rounded only once."""
        value = self.constant(name, role)
        if value.dtype not in (np.float32, np.float64):
            raise OnnxLoadError(f"the {role} {name!r} has type {value.dtype}; only float32/float64 are supported")
        return torch.from_numpy(np.array(value, dtype=np.float64))

    def emit(self, onnx_node: onnx.NodeProto, op: BoundOp, *inputs: str) -> None:
        """Add ``op`` as a graph node, its shape found by running it on zeros.

        Not from ``onnx.shape_inference``: for AveragePool with ceil_mode it counts windows that start in the
        padding, which onnxruntime, ONNX's reference evaluator and torch all drop."""
        sources = [self.variable(name) for name in inputs]
        op.to(self.dtype)
        probe = [torch.zeros(1, *node.shape, dtype=self.dtype) for node in sources]
        shape = tuple(op.forward(*probe).shape[1:])
        node = Node(onnx_node.output[0], op, tuple(source.name for source in sources), shape)
        self.nodes.append(node)
        self.variables[node.name] = node


_Converter = Callable[[_Context, onnx.NodeProto, dict], None]


def _gemm(ctx: _Context, node: onnx.NodeProto, attrs: dict) -> None:
    if attrs.get("transA", 0):
        raise OnnxLoadError("transA=1 is not supported (the batch must stay the leading dimension)")
    if len(ctx.variable(node.input[0]).shape) != 1:
        raise OnnxLoadError("Gemm needs a 2-D input [batch, features]")
    b = ctx.weight(node.input[1], "Gemm operand B")
    weight = (attrs.get("alpha", 1.0) * (b if attrs.get("transB", 0) else b.T)).contiguous()
    bias = None
    if len(node.input) > 2 and node.input[2] and attrs.get("beta", 1.0) != 0:
        c = attrs.get("beta", 1.0) * ctx.weight(node.input[2], "Gemm operand C")
        bias = c.broadcast_to(1, weight.shape[0]).reshape(-1).clone()
    ctx.emit(node, Linear(weight, bias), node.input[0])


def _matmul(ctx: _Context, node: onnx.NodeProto, attrs: dict) -> None:
    left, right = node.input
    if not ctx.is_constant(left) and not ctx.is_constant(right):
        raise OnnxLoadError("MatMul of two computed tensors is non-linear")
    if ctx.is_constant(left):  # W @ x: a linear map over the second-to-last dimension of x
        weight = ctx.weight(left, "MatMul left operand")
        if weight.dim() != 2 or len(ctx.variable(right).shape) < 2:
            raise OnnxLoadError(
                f"MatMul W @ x needs a 2-D W and x of rank ≥ 2 besides the batch, got W {list(weight.shape)} and "
                f"x [1, {ctx.variable(right).shape}]"
            )
        ctx.emit(node, LeftLinear(weight.contiguous()), right)
        return
    weight = ctx.weight(right, "MatMul right operand")
    if weight.dim() != 2:
        raise OnnxLoadError(f"MatMul right operand must be 2-D [in, out], got {list(weight.shape)}")
    ctx.emit(node, Linear(weight.T.contiguous()), left)


def _arithmetic(ctx: _Context, node: onnx.NodeProto, attrs: dict) -> None:
    op_type, (a, b) = node.op_type, node.input
    if not ctx.is_constant(a) and not ctx.is_constant(b):
        if op_type not in ("Add", "Sub"):
            raise OnnxLoadError(f"{op_type} of two computed tensors is non-linear")
        if ctx.variable(a).shape != ctx.variable(b).shape:
            raise OnnxLoadError(f"{op_type} of shapes {ctx.variable(a).shape} and {ctx.variable(b).shape} broadcasts")
        ctx.emit(node, Add(subtract=op_type == "Sub"), a, b)
        return
    constant_first = ctx.is_constant(a)
    x, c = (b, a) if constant_first else (a, b)
    if constant_first and op_type == "Div":
        raise OnnxLoadError("Div of a constant by a computed tensor is non-linear")
    in_shape, value = ctx.variable(x).shape, ctx.weight(c, f"{op_type} operand")
    try:
        full = np.broadcast_shapes((1, *in_shape), tuple(value.shape))
    except ValueError:
        raise OnnxLoadError(f"constant of shape {list(value.shape)} does not broadcast to [1, {in_shape}]") from None
    if len(full) != len(in_shape) + 1 or full[0] != 1:
        raise OnnxLoadError(f"constant of shape {list(value.shape)} would change the input's rank or batch")
    if value.dim() == len(full):  # its leading 1 is the batch dimension, which the graph does not store
        value = value[0]
    if op_type == "Div" and bool((value == 0).any()):
        raise OnnxLoadError("division by a constant that contains zeros")
    scale, shift = {
        "Add": (None, value),
        "Sub": (torch.tensor(-1.0, dtype=torch.float64), value) if constant_first else (None, -value),
        "Mul": (value, None),
        "Div": (1 / value, None),
    }[op_type]
    ctx.emit(node, ElementwiseAffine(scale, shift, in_shape, full[1:]), x)


def _relu(ctx: _Context, node: onnx.NodeProto, attrs: dict) -> None:
    ctx.emit(node, ReLU(), node.input[0])


def _flatten(ctx: _Context, node: onnx.NodeProto, attrs: dict) -> None:
    shape = ctx.variable(node.input[0]).shape
    axis = attrs.get("axis", 1) % (len(shape) + 1)
    # [1, *shape] flattened at `axis` keeps the batch as its leading dimension only if what merges into it is 1.
    if int(np.prod((1, *shape)[:axis])) != 1:
        raise OnnxLoadError(f"Flatten with axis={attrs.get('axis')} on [1, {shape}] merges the batch dimension")
    ctx.emit(node, Reshape(shape, (int(np.prod(shape)),)), node.input[0])


def _reshape(ctx: _Context, node: onnx.NodeProto, attrs: dict) -> None:
    in_shape = ctx.variable(node.input[0]).shape
    target = [int(d) for d in ctx.constant(node.input[1], "Reshape shape")]
    if attrs.get("allowzero", 0) and 0 in target:
        raise OnnxLoadError("Reshape with allowzero=1 and a zero dimension")
    full = (1, *in_shape)
    target = [full[i] if d == 0 else d for i, d in enumerate(target)]
    try:
        out = np.empty(full, dtype=np.uint8).reshape(target).shape
    except ValueError:
        raise OnnxLoadError(f"cannot reshape [1, {in_shape}] to {target}") from None
    if not out or out[0] != 1:
        raise OnnxLoadError(f"Reshape to {target} does not keep the batch as the leading dimension")
    ctx.emit(node, Reshape(in_shape, out[1:]), node.input[0])


def _padding(attrs: dict) -> list[int]:
    if attrs.get("auto_pad", b"NOTSET") not in (b"NOTSET", b"VALID"):
        raise OnnxLoadError(f"auto_pad={attrs['auto_pad'].decode()} is not supported; use explicit pads")
    return list(attrs.get("pads", [0, 0, 0, 0]))


def _conv(ctx: _Context, node: onnx.NodeProto, attrs: dict) -> None:
    in_shape = ctx.variable(node.input[0]).shape
    weight = ctx.weight(node.input[1], "Conv weight")
    if len(in_shape) != 3 or weight.dim() != 4:
        raise OnnxLoadError(f"only 2-D Conv is supported, got input [1, {in_shape}] and weight {list(weight.shape)}")
    if "kernel_shape" in attrs and list(attrs["kernel_shape"]) != list(weight.shape[2:]):
        raise OnnxLoadError(f"kernel_shape {attrs['kernel_shape']} does not match the weight {list(weight.shape)}")
    bias = ctx.weight(node.input[2], "Conv bias") if len(node.input) > 2 and node.input[2] else None
    top, left, bottom, right = _padding(attrs)
    op = Conv2d(
        weight,
        bias,
        in_shape,
        tuple(attrs.get("strides", (1, 1))),
        (top, left, bottom, right),
        tuple(attrs.get("dilations", (1, 1))),
        attrs.get("group", 1),
    )
    ctx.emit(node, op, node.input[0])


def _batch_norm(ctx: _Context, node: onnx.NodeProto, attrs: dict) -> None:
    if attrs.get("training_mode", 0) or any(node.output[1:]):
        raise OnnxLoadError("BatchNormalization in training mode; export the model in eval mode")
    gamma, beta, mean, var = (
        ctx.weight(name, f"BatchNormalization {role}")
        for name, role in zip(node.input[1:], ("scale", "bias", "mean", "var"), strict=True)
    )
    op = BatchNorm(gamma, beta, mean, var, attrs.get("epsilon", 1e-5), ctx.variable(node.input[0]).shape)
    ctx.emit(node, op, node.input[0])


def _average_pool(ctx: _Context, node: onnx.NodeProto, attrs: dict) -> None:
    in_shape = ctx.variable(node.input[0]).shape
    kernel = tuple(attrs["kernel_shape"])
    if len(in_shape) != 3 or len(kernel) != 2:
        raise OnnxLoadError(f"only 2-D AveragePool is supported, got input [1, {in_shape}]")
    if any(d != 1 for d in attrs.get("dilations", (1, 1))):
        raise OnnxLoadError("AveragePool with dilations is not supported")
    top, left, bottom, right = _padding(attrs)
    if (top, left) != (bottom, right):
        raise OnnxLoadError(f"AveragePool pads {[top, left, bottom, right]} are asymmetric")
    op = AvgPool2d(
        in_shape,
        kernel,
        tuple(attrs.get("strides", (1, 1))),
        (top, left),
        bool(attrs.get("count_include_pad", 0)),
        bool(attrs.get("ceil_mode", 0)),
    )
    ctx.emit(node, op, node.input[0])


def _global_average_pool(ctx: _Context, node: onnx.NodeProto, attrs: dict) -> None:
    in_shape = ctx.variable(node.input[0]).shape
    if len(in_shape) != 3:
        raise OnnxLoadError(f"only 2-D GlobalAveragePool is supported, got input [1, {in_shape}]")
    ctx.emit(node, AvgPool2d(in_shape, in_shape[1:], in_shape[1:]), node.input[0])


def _identity(ctx: _Context, node: onnx.NodeProto, attrs: dict) -> None:
    ctx.variables[node.output[0]] = ctx.variable(node.input[0])


def _shape(ctx: _Context, node: onnx.NodeProto, attrs: dict) -> None:
    # Shapes are static (the batch is 1 in ONNX terms), so Shape of a computed tensor is a constant.
    full = np.array((1, *ctx.variable(node.input[0]).shape), dtype=np.int64)
    ctx.constants[node.output[0]] = full[attrs.get("start", 0) : attrs.get("end", len(full))]


_CONVERTERS: dict[str, _Converter] = {
    "Gemm": _gemm,
    "MatMul": _matmul,
    "Add": _arithmetic,
    "Sub": _arithmetic,
    "Mul": _arithmetic,
    "Div": _arithmetic,
    "Relu": _relu,
    "Flatten": _flatten,
    "Reshape": _reshape,
    "Conv": _conv,
    "BatchNormalization": _batch_norm,
    "AveragePool": _average_pool,
    "GlobalAveragePool": _global_average_pool,
    "Identity": _identity,
    "Shape": _shape,
}


def _fold(ctx: _Context, node: onnx.NodeProto) -> None:
    """Evaluate a node whose inputs are all constants (Constant, shape arithmetic, a transposed weight)."""
    try:
        evaluator = ReferenceEvaluator(node, opsets={"": ctx.opset})
        values = evaluator.run(None, {name: ctx.constants[name] for name in node.input if name})
    except Exception as err:  # the reference evaluator raises many types for ops it cannot run
        raise OnnxLoadError(f"cannot fold constant operator {node.op_type!r}: {err}") from err
    for name, value in zip(node.output, values):
        if name:
            ctx.constants[name] = np.asarray(value)


def onnx_source(path: str | Path) -> str | bytes:
    """What to hand an ONNX reader for ``path``: the model's bytes if the file is gzipped (recognised by its
    content, as VNN-COMP ships ``.onnx.gz``), else the path (which also finds external data files)."""
    path = Path(path)
    if not path.is_file():
        raise OnnxLoadError(f"no such ONNX file: {path}")
    with path.open("rb") as f:
        gzipped = f.read(2) == b"\x1f\x8b"
    if not gzipped:
        return str(path)
    try:
        return gzip.decompress(path.read_bytes())
    except (OSError, EOFError) as err:
        raise OnnxLoadError(f"{path} is not an ONNX model: {err}") from err


def _read(path: Path) -> onnx.ModelProto:
    source = onnx_source(path)
    try:
        return onnx.load_model_from_string(source) if isinstance(source, bytes) else onnx.load(source)
    except Exception as err:  # protobuf and external-data errors share no base class
        raise OnnxLoadError(f"{path} is not an ONNX model: {err}") from err


def _attributes(node: onnx.NodeProto) -> dict:
    return {attr.name: onnx.helper.get_attribute_value(attr) for attr in node.attribute}


def load_onnx(
    path: str | Path, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"
) -> BoundGraph:
    """Read ``path`` (``.onnx`` or gzipped ``.onnx.gz``) into a :class:`BoundGraph` with constants in ``dtype``
    on ``device`` (built and checked on the CPU, then moved once).

    Node names are the ONNX tensor names; node shapes drop the leading ONNX dimension (which must be 1 or
    symbolic). Raises :class:`OnnxLoadError` for anything that cannot be represented exactly.

    Example::

        graph = load_onnx("mnist-net_256x2.onnx", dtype=torch.float64)
        graph.input.name, graph.input.shape   # ('0', (784, 1))
        graph = load_onnx("mnist-net_256x2.onnx", device="cuda")   # bounds computed on the GPU
    """
    path = Path(path)
    model = _read(path)
    graph = model.graph
    if not model.HasField("graph") or not graph.output:
        raise OnnxLoadError(f"{path} is not an ONNX model: it has no graph outputs")
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 13)
    ctx = _Context(dtype, opset)
    for init in graph.initializer:
        ctx.constants[init.name] = numpy_helper.to_array(init)
    # Old exporters list the initializers among the graph inputs as well.
    inputs = [value for value in graph.input if value.name not in ctx.constants]
    if len(inputs) != 1 or len(graph.output) != 1:
        raise UnsupportedModelError(
            f"expected one input and one output, got {len(inputs)} inputs and {len(graph.output)} outputs"
        )
    dims = inputs[0].type.tensor_type.shape.dim
    if not dims or (dims[0].HasField("dim_value") and dims[0].dim_value != 1):
        raise UnsupportedModelError(f"input {inputs[0].name!r} needs a leading batch dimension of 1")
    if not all(d.HasField("dim_value") and d.dim_value > 0 for d in dims[1:]):
        raise UnsupportedModelError(f"input {inputs[0].name!r} has a non-static shape; only the batch may be symbolic")
    ctx.nodes.append(Node(inputs[0].name, None, (), tuple(d.dim_value for d in dims[1:])))
    ctx.variables[inputs[0].name] = ctx.nodes[0]

    for node in graph.node:
        label = node.name or node.output[0]
        unknown = [name for name in node.input if name and name not in ctx.constants and name not in ctx.variables]
        if unknown:
            raise OnnxLoadError(f"node {label!r} ({node.op_type}) reads unknown tensor {unknown[0]!r}")
        converter = _CONVERTERS.get(node.op_type) if node.domain in ("", "ai.onnx") else None
        folded = all(ctx.is_constant(name) for name in node.input if name)
        if converter is None and not folded:
            op_name = f"{node.domain}.{node.op_type}" if node.domain else node.op_type
            raise UnsupportedModelError(f"unsupported ONNX operator {op_name!r} at node {label!r}")
        try:
            if folded:
                _fold(ctx, node)
            else:
                converter(ctx, node, _attributes(node))
        except (ValueError, RuntimeError) as err:  # op constructors and forward passes reject bad configurations
            raise UnsupportedModelError(f"{node.op_type} node {label!r}: {err}") from err

    output = graph.output[0].name
    if output not in ctx.variables:
        raise OnnxLoadError(f"the graph output {output!r} is a constant or is never computed")
    nodes = _fuse_biases(ctx.nodes, ctx.variables[output].name)
    _check_finite(nodes, path)
    return BoundGraph(nodes, output=ctx.variables[output].name).to(device=device)


def _check_finite(nodes: list[Node], path: Path) -> None:
    """Every constant of every op finite, as cast to the graph's dtype (a float64 weight beyond float32's range
    becomes infinite): a NaN in a weight makes the bounds NaN, and a verdict drawn from them means nothing."""
    for node in nodes[1:]:
        for role, value in vars(node.op).items():
            if isinstance(value, Tensor) and value.is_floating_point() and not bool(value.isfinite().all()):
                bad = value[~value.isfinite()]
                raise OnnxLoadError(
                    f"{path}: node {node.name!r} ({type(node.op).__name__}) has {bad.numel()} non-finite value(s) "
                    f"in its {role} (first {float(bad[0])}): a corrupt model cannot be verified"
                )


def _fuse_biases(nodes: list[Node], output: str) -> list[Node]:
    """``Linear`` followed by the addition of a constant vector (MatMul then Add, as MATLAB and other exporters
    write a dense layer) becomes one ``Linear`` with that bias, where nothing else reads the product: one node
    less to propagate through, and the branching heuristics see the layer's bias."""
    consumers: dict[str, int] = {}
    for node in nodes:
        for name in node.inputs:
            consumers[name] = consumers.get(name, 0) + 1
    by_name = {node.name: node for node in nodes}
    fused: dict[str, Node] = {}
    for node in nodes:
        op = node.op
        if not (isinstance(op, ElementwiseAffine) and type(op) is ElementwiseAffine and op.scale is None):
            continue
        source = by_name[node.inputs[0]]
        if not isinstance(source.op, Linear) or consumers.get(source.name) != 1 or source.name == output:
            continue
        if op.in_shape != op.out_shape or op.shift.numel() != source.shape[-1]:
            continue  # a constant that varies along other dimensions than the layer's outputs
        shift = op.shift.reshape(-1)
        bias = shift if source.op.bias is None else source.op.bias + shift
        fused[source.name] = None
        fused[node.name] = Node(node.name, Linear(source.op.weight, bias), source.inputs, node.shape)
    return [fused.get(node.name, node) for node in nodes if fused.get(node.name, node) is not None]
