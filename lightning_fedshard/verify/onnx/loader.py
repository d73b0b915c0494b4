"""Load an ONNX network into a :class:`BoundGraph`, written directly on ``onnx`` (no onnx2torch).

Every node whose inputs are all constants (Constant, and the Shape→Gather→Unsqueeze→Concat chains exporters emit
for ``x.view(x.size(0), -1)``, constant masks) is folded with ONNX's reference evaluator; every other node becomes
one or a few graph nodes (:mod:`~lightning_fedshard.verify.onnx.converters` lists the operators). The leading ONNX
dimension (1, or symbolic) of every tensor becomes the batch dimension ``B`` of the graph — unless the network
moves or mixes it (a Transpose of ``[1, n]``, an input without one): then the graph is loaded again *without* a
batch dimension, node shapes are the full ONNX shapes and the graph's own batch dimension is added in front.

Example::

    graph = load_onnx("mnist-net_256x2.onnx")   # or "mnist-net_256x2.onnx.gz"
    logits = graph(torch.rand(64, 784))          # [64, 10]; the ONNX input is [1, 784, 1]
"""

from __future__ import annotations

import gzip
from pathlib import Path

import onnx
import torch
from onnx import numpy_helper
from torch import Tensor

from lightning_fedshard.verify.graph import BoundGraph, Node
from lightning_fedshard.verify.onnx.context import (
    FLOAT_TYPES,
    LoadContext,
    NeedsUnbatched,
    OnnxLoadError,
    UnsupportedModelError,
)
from lightning_fedshard.verify.onnx.converters import CONVERTERS, DISCRETE
from lightning_fedshard.verify.onnx.evaluate import fold
from lightning_fedshard.verify.ops import ElementwiseAffine, Linear

__all__ = ["load_onnx", "model_dtype", "onnx_source"]


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


def attributes(node: onnx.NodeProto) -> dict:
    return {attr.name: onnx.helper.get_attribute_value(attr) for attr in node.attribute}


def model_dtype(model: onnx.ModelProto) -> torch.dtype:
    """The dtype a model is verified in: float64 for a float64 model, else float32 (float16 and bfloat16 models
    are bounded in float32; their own rounding is charged in their type)."""
    (value,) = [v for v in model.graph.input if v.name not in {init.name for init in model.graph.initializer}]
    return torch.float64 if _input_type(value) == torch.float64 else torch.float32


def _input_type(value: onnx.ValueInfoProto) -> torch.dtype:
    elem_type = value.type.tensor_type.elem_type
    if elem_type not in FLOAT_TYPES:
        name = onnx.TensorProto.DataType.Name(elem_type)
        raise UnsupportedModelError(f"input {value.name!r} has type {name}; the verifier takes float inputs")
    return FLOAT_TYPES[elem_type]


def load_onnx(path: str | Path, dtype: torch.dtype | None = None, device: torch.device | str = "cpu") -> BoundGraph:
    """Read ``path`` (``.onnx`` or gzipped ``.onnx.gz``) into a :class:`BoundGraph` with constants in ``dtype``
    (``None``: :func:`model_dtype`) on ``device`` (built and checked on the CPU, then moved once). Each op's
    ``precision`` is the float type the model computes its node in.

    Node names are the ONNX tensor names (extra nodes of a rewrite are named after them); node shapes drop the
    leading ONNX dimension (1 or symbolic) — or, for a network that moves or mixes it, are the full ONNX shapes.
    Raises :class:`OnnxLoadError` for anything that cannot be represented exactly.

    Example::

        graph = load_onnx("mnist-net_256x2.onnx", dtype=torch.float64)
        graph.input.name, graph.input.shape   # ('0', (784, 1))
        graph = load_onnx("mnist-net_256x2.onnx", device="cuda")   # bounds computed on the GPU
    """
    path = Path(path)
    model = _read(path)
    if not model.HasField("graph") or not model.graph.output:
        raise OnnxLoadError(f"{path} is not an ONNX model: it has no graph outputs")
    dims = _input_dims(model)
    dtype = dtype if dtype is not None else model_dtype(model)
    batched = not dims[0].HasField("dim_value") or dims[0].dim_value == 1
    if batched:
        try:
            ctx = _convert(model, dtype, batched=True)
        except NeedsUnbatched:
            batched = False
    if not batched:
        ctx = _convert(model, dtype, batched=False)
    output = model.graph.output[0].name
    if output not in ctx.variables:
        raise OnnxLoadError(f"the graph output {output!r} is a constant or is never computed")
    nodes = _fuse_biases(ctx.nodes, ctx.variables[output].name)
    _check_finite(nodes, path)
    graph = BoundGraph(nodes, output=ctx.variables[output].name).to(device=device)
    graph.input_precision, graph.working_dtype = ctx.types[nodes[0].name], dtype
    return graph


def _input_dims(model: onnx.ModelProto) -> list:
    initializers = {init.name for init in model.graph.initializer}
    # Old exporters list the initializers among the graph inputs as well.
    inputs = [value for value in model.graph.input if value.name not in initializers]
    if len(inputs) != 1 or len(model.graph.output) != 1:
        raise UnsupportedModelError(
            f"expected one input and one output, got {len(inputs)} inputs and {len(model.graph.output)} outputs"
        )
    dims = list(inputs[0].type.tensor_type.shape.dim)
    if not dims:
        raise UnsupportedModelError(f"input {inputs[0].name!r} is a scalar; the verifier needs a tensor input")
    if not all(d.HasField("dim_value") and d.dim_value > 0 for d in dims[1:]):
        raise UnsupportedModelError(f"input {inputs[0].name!r} has a non-static shape; only the batch may be symbolic")
    return dims


def _convert(model: onnx.ModelProto, dtype: torch.dtype, batched: bool) -> LoadContext:
    graph = model.graph
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 13)
    ctx = LoadContext(dtype, opset, batched)
    for init in graph.initializer:
        ctx.constants[init.name] = numpy_helper.to_array(init)
    (value,) = [v for v in graph.input if v.name not in ctx.constants]
    dims = [d.dim_value if d.HasField("dim_value") else 1 for d in value.type.tensor_type.shape.dim]
    shape = ctx.node_shape(dims)
    ctx.nodes.append(Node(value.name, None, (), shape))
    ctx.variables[value.name] = ctx.nodes[0]
    ctx.types[value.name] = _input_type(value)

    for node in graph.node:
        label = node.name or node.output[0]
        unknown = [name for name in node.input if name and name not in ctx.constants and name not in ctx.variables]
        if unknown:
            raise OnnxLoadError(f"node {label!r} ({node.op_type}) reads unknown tensor {unknown[0]!r}")
        if all(ctx.is_constant(name) for name in node.input if name):
            fold(ctx, node)
            continue
        # A node computes in its inputs' float type, a Cast in its target's (ONNX has no implicit conversions).
        computed = [name for name in node.input if name and not ctx.is_constant(name)]
        ctx.precision = ctx.tensor_type(computed[0])
        if node.op_type == "Cast" and attributes(node).get("to") in FLOAT_TYPES:
            ctx.precision = FLOAT_TYPES[attributes(node)["to"]]
        op_name = f"{node.domain}.{node.op_type}" if node.domain not in ("", "ai.onnx") else node.op_type
        if op_name in DISCRETE:
            raise UnsupportedModelError(
                f"{op_name} at node {label!r} computes a discrete value from the input ({DISCRETE[op_name]}): "
                "no linear bound holds across its jumps; cut the graph before it or restate the property"
            )
        converter = CONVERTERS.get(op_name)
        if converter is None:
            raise UnsupportedModelError(f"unsupported ONNX operator {op_name!r} at node {label!r}")
        try:
            converter(ctx, node, attributes(node))
        except (ValueError, RuntimeError, IndexError) as err:  # op constructors and forward passes reject bad inputs
            raise UnsupportedModelError(f"{node.op_type} node {label!r}: {err}") from err
        for name in node.output:
            if name in ctx.variables:
                ctx.types[name] = ctx.precision
    return ctx


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
        if source.op.bias is None:
            layer = Linear(source.op.weight, shift)
        else:  # one constant for two the model adds one after the other: its rounding scales with both
            layer = Linear(source.op.weight, source.op.bias + shift)
            layer.constant_magnitude = source.op.bias.abs() + shift.abs()
        layer.precision = source.op.precision
        fused[source.name] = None
        fused[node.name] = Node(node.name, layer, source.inputs, node.shape)
    return [fused.get(node.name, node) for node in nodes if fused.get(node.name, node) is not None]
