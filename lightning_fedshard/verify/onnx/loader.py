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

import numpy as np
import onnx
import torch
from onnx import numpy_helper
from onnx.reference import ReferenceEvaluator
from torch import Tensor

from lightning_fedshard.verify.graph import BoundGraph, Node
from lightning_fedshard.verify.ops import BoundOp, ElementwiseAffine, Linear, Reshape

__all__ = [
    "FLOAT_TYPES",
    "OnnxLoadError",
    "UnsupportedModelError",
    "load_onnx",
    "model_dtype",
    "onnx_source",
    "run_node",
]

#: The ONNX float types and the torch dtypes they are computed in.
FLOAT_TYPES = {
    onnx.TensorProto.FLOAT: torch.float32,
    onnx.TensorProto.DOUBLE: torch.float64,
    onnx.TensorProto.FLOAT16: torch.float16,
    onnx.TensorProto.BFLOAT16: torch.bfloat16,
}


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


class NeedsUnbatched(Exception):
    """A node moves or mixes the leading dimension: the graph must be loaded without a batch dimension."""


class LoadContext:
    """The graph built so far: computed tensors (graph nodes) and constants (numpy), keyed by ONNX tensor name,
    and how ONNX shapes and axes map onto node shapes (``batched``: the leading ONNX dimension is the batch)."""

    def __init__(self, dtype: torch.dtype, opset: int, batched: bool) -> None:
        self.dtype, self.opset, self.batched = dtype, opset, batched
        self.constants: dict[str, np.ndarray] = {}
        self.variables: dict[str, Node] = {}  # Identity makes several tensor names point at one node
        self.nodes: list[Node] = []
        self._names: set[str] = set()
        #: The float type the model computes each computed tensor in (by ONNX tensor name).
        self.types: dict[str, torch.dtype] = {}
        #: The float type of the ONNX node being converted: the precision of the ops it becomes.
        self.precision: torch.dtype | None = None

    # -- tensors -----------------------------------------------------------------------------------------------

    def is_constant(self, name: str) -> bool:
        return name in self.constants

    def tensor_type(self, name: str) -> torch.dtype:
        """The float type the model computes the computed tensor ``name`` in."""
        return self.types.get(name, torch.float32)

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
        if value.dtype not in (np.float32, np.float64, np.float16):
            raise OnnxLoadError(f"the {role} {name!r} has type {value.dtype}; only float32/float64 are supported")
        return torch.from_numpy(np.array(value, dtype=np.float64))

    def scalar(self, name: str, role: str) -> float:
        value = self.constant(name, role)
        if value.size != 1:
            raise UnsupportedModelError(f"the {role} {name!r} must be a single number, got shape {list(value.shape)}")
        return float(value.reshape(()))

    def ints(self, name: str, role: str) -> list[int]:
        return [int(v) for v in np.asarray(self.constant(name, role)).reshape(-1)]

    # -- shapes ------------------------------------------------------------------------------------------------

    def onnx_shape(self, name: str) -> tuple[int, ...]:
        """The ONNX shape of a computed tensor."""
        shape = self.variable(name).shape
        return (1, *shape) if self.batched else shape

    def node_shape(self, onnx_shape: tuple[int, ...] | list[int]) -> tuple[int, ...]:
        """The node shape of a tensor of ``onnx_shape``; batched, its leading dimension must be the batch of 1."""
        onnx_shape = tuple(int(d) for d in onnx_shape)
        if not self.batched:
            return onnx_shape
        if len(onnx_shape) < 2 or onnx_shape[0] != 1:  # one number per sample is a vector of one, unbatched
            raise NeedsUnbatched
        return onnx_shape[1:]

    def axis(self, axis: int, rank: int) -> int:
        """The node-shape axis of ONNX ``axis`` of a tensor of ONNX ``rank`` (batched: never the batch's)."""
        if not -rank <= axis < rank:
            raise OnnxLoadError(f"axis {axis} is outside a tensor of rank {rank}")
        axis %= rank
        if self.batched:
            if axis == 0:
                raise NeedsUnbatched
            return axis - 1
        return axis

    def broadcast_constant(self, value: Tensor, rank: int) -> Tensor:
        """A constant of ONNX rank ≤ ``rank`` as a tensor that broadcasts against node tensors ``[B, *shape]``."""
        value = value.reshape((1,) * (rank - value.dim()) + tuple(value.shape))
        if self.batched:
            if value.shape[0] != 1:
                raise NeedsUnbatched
            value = value[0]
        return value

    # -- nodes -------------------------------------------------------------------------------------------------

    def fresh(self, base: str) -> str:
        """A node name not used yet, from ``base``."""
        name, count = base, 0
        while name in self._names or name in self.variables or name in self.constants:
            count += 1
            name = f"{base}#{count}"
        return name

    def emit(self, name: str, op: BoundOp, *inputs: str) -> str:
        """Add ``op`` as node ``name`` reading the tensors ``inputs``, its shape found by running it on zeros; returns
        the name.

        Not from ``onnx.shape_inference``: for AveragePool with ceil_mode it counts windows that start in the
        padding, which onnxruntime, ONNX's reference evaluator and torch all drop."""
        sources = [self.variable(source) for source in inputs]
        op.to(self.dtype)
        if op.precision is None:
            op.precision = self.precision
        probe = [torch.zeros(1, *node.shape, dtype=self.dtype) for node in sources]
        shape = tuple(op.forward(*probe).shape[1:])
        if not shape and self.batched:  # one number per sample (a reduction without keepdims): load unbatched
            raise NeedsUnbatched
        node = Node(name, op, tuple(source.name for source in sources), shape)
        self.nodes.append(node)
        self.variables[name] = node
        self._names.add(name)
        return name

    def alias(self, name: str, source: str) -> None:
        """Tensor ``name`` is tensor ``source`` (Identity, Cast between float types, an identity Pad)."""
        self.variables[name] = self.variable(source)

    def reshape(self, source: str, shape: tuple[int, ...], name: str | None = None) -> str:
        """Tensor ``source`` reshaped to node shape ``shape`` (no node where it already has it)."""
        node = self.variable(source)
        if node.shape == tuple(shape):
            if name is not None:
                self.alias(name, source)
                return name
            return source
        return self.emit(name or self.fresh(f"{source}/reshape"), Reshape(node.shape, shape), source)

    def affine(self, source: str, scale: Tensor | None, shift: Tensor | None, name: str) -> str:
        """``source · scale + shift`` for float64 ONNX constants (either may be ``None``), broadcast as ONNX does."""
        constants = [c for c in (scale, shift) if c is not None]
        in_onnx = self.onnx_shape(source)
        rank = max(len(in_onnx), *(c.dim() for c in constants))
        in_onnx = (1,) * (rank - len(in_onnx)) + in_onnx
        try:
            out_onnx = np.broadcast_shapes(in_onnx, *(tuple(c.shape) for c in constants))
        except ValueError:
            shapes = [list(c.shape) for c in constants]
            raise OnnxLoadError(f"constants of shapes {shapes} do not broadcast to {list(in_onnx)}") from None
        source = self.reshape(source, self.node_shape(in_onnx))
        scale, shift = (None if c is None else self.broadcast_constant(c, rank) for c in (scale, shift))
        op = ElementwiseAffine(scale, shift, self.variable(source).shape, self.node_shape(out_onnx))
        return self.emit(name, op, source)


def fold(ctx: LoadContext, node: onnx.NodeProto) -> None:
    """Evaluate a node whose inputs are all constants (Constant, shape arithmetic, a transposed weight) in the form
    of the model's own opset (:func:`run_node`)."""
    feeds = {name: ctx.constants[name] for name in node.input if name}
    try:
        values = _constant_value(node) or run_node(node, feeds, ctx.opset)
    except Exception as err:  # onnxruntime and the reference evaluator raise many types for ops they cannot run
        raise OnnxLoadError(f"cannot fold constant operator {node.op_type!r} (opset {ctx.opset}): {err}") from err
    for name, value in zip(node.output, values, strict=False):
        if name:
            ctx.constants[name] = np.asarray(value)


#: A Constant's value attributes (every opset's) and the numpy type of each; ``value`` holds a whole tensor.
_CONSTANT_ATTRIBUTES = {
    "value_float": np.float32,
    "value_floats": np.float32,
    "value_int": np.int64,
    "value_ints": np.int64,
}


def _constant_value(node: onnx.NodeProto) -> list[np.ndarray] | None:
    """A Constant node's value, read directly (models hold hundreds of them; a runtime session each costs ~2 ms);
    ``None`` for any other node or another attribute (strings, sparse), which :func:`run_node` runs."""
    if node.op_type != "Constant" or node.domain not in ("", "ai.onnx") or len(node.attribute) != 1:
        return None
    (attribute,) = node.attribute
    if attribute.name == "value":
        return [numpy_helper.to_array(attribute.t)]
    if attribute.name in _CONSTANT_ATTRIBUTES:
        return [np.array(onnx.helper.get_attribute_value(attribute), dtype=_CONSTANT_ATTRIBUTES[attribute.name])]
    return None


def run_node(node: onnx.NodeProto, feeds: dict[str, np.ndarray], opset: int) -> list[np.ndarray]:
    """``node`` of an opset-``opset`` model run on ``feeds``, one array per output (``None`` for an unnamed one).

    The node is wrapped in a model that imports the same opset, so it runs in that opset's form (Unsqueeze's
    ``axes`` an attribute before 13, an input from 13; Softmax over the flattened trailing axes before 13). Run by
    onnxruntime — the runtime whose results the verifier answers for; onnx's reference evaluator runs Softmax and
    LogSoftmax in their opset-13 form at every opset, BatchNormalization 9–13 with training statistics and Resize
    with ``align_corners`` on other pixels — or by the reference evaluator where onnxruntime has no kernel for the
    types or the opset. (A bare node given to the reference evaluator always runs at the newest opset.)"""
    inputs = [
        onnx.helper.make_tensor_value_info(name, onnx.helper.np_dtype_to_tensor_dtype(value.dtype), value.shape)
        for name, value in feeds.items()
    ]
    outputs = [onnx.helper.make_empty_tensor_value_info(name) for name in node.output if name]
    graph = onnx.helper.make_graph([node], "node", inputs, outputs)
    model = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", opset)])
    try:
        import onnxruntime

        options = onnxruntime.SessionOptions()
        options.log_severity_level = 3  # opsets before 7 are run with a warning
        session = onnxruntime.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
        results = session.run(None, feeds)
    except Exception:  # noqa: BLE001 (not installed, no kernel for these types, an opset it does not run)
        results = ReferenceEvaluator(model).run(None, feeds)
    named = dict(zip([name for name in node.output if name], results, strict=True))
    return [named.get(name) for name in node.output]


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
    from lightning_fedshard.verify.onnx.converters import CONVERTERS, DISCRETE

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
