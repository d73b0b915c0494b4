"""Random small ONNX models for ``fedshard bench fuzz``: one to four layers drawn from every operator the
verifier's loader accepts, in float32, float64 or float16, each with an input box. Used by :mod:`lightning_fedshard.bench.fuzz`::

    case = random_model(np.random.default_rng(7))
    case.model, case.lower, case.upper, case.operators

A layer is one operator under test on the tensor computed so far, with whatever plumbing it needs (a Reshape to
the rank it takes, a second computed operand, ...). Before a function with kinks, jumps, inflections or a domain
edge, an affine map — element-wise ``Mul``/``Add`` by constants, or a ``MatMul``/``Add`` whose sums cancel large
terms, as a network's layer would — takes the values sampled on the box onto a range chosen for the function:
across 0 for ReLU or Sign (or only just across, where one corner decides the bound), across integers for Floor,
into ``[δ, …]`` near the domain edge of Log or Reciprocal, below the overflow of Exp, where float16 rounds by whole
units for a Cast. The samples are onnxruntime's, so a range is only approximately hit; a model whose sampled
outputs are not finite is discarded by the caller.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import onnx
import onnxruntime
from onnx import TensorProto, helper, numpy_helper

__all__ = ["OPERATORS", "FuzzModel", "GraphBuilder", "Tensor", "box_samples", "ort_session", "random_model"]

OPSET = 13
#: Upsample left the standard after opset 9: a model with it is written in opset 9, with layers that read the same.
UPSAMPLE_OPSET = 9
#: Largest tensor a layer may produce before the next one shrinks it (the verifier's passes grow with it).
MAX_ELEMENTS = 64
NUMPY_TYPES = {TensorProto.FLOAT: np.float32, TensorProto.DOUBLE: np.float64, TensorProto.FLOAT16: np.float16}


def ort_session(model: onnx.ModelProto | bytes) -> onnxruntime.InferenceSession:
    """onnxruntime on the CPU with one intra-op thread: the judge of every answer, and the source of samples."""
    onnxruntime.set_default_logger_severity(4)  # deprecated attributes, and models it rejects, are drawn on purpose
    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads = options.inter_op_num_threads = 1
    options.log_severity_level = 4
    data = model if isinstance(model, bytes) else model.SerializeToString()
    return onnxruntime.InferenceSession(data, options, providers=["CPUExecutionProvider"])


@dataclass(frozen=True)
class Tensor:
    """A computed tensor of the graph being built: its name, full ONNX shape and element type."""

    name: str
    shape: tuple[int, ...]
    elem: int

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def rank(self) -> int:
        return len(self.shape)


@dataclass
class FuzzModel:
    """A generated model and its input box (flat, in the input's element type, widened to float64)."""

    model: onnx.ModelProto
    lower: np.ndarray
    upper: np.ndarray
    #: The operators under test, one per layer (``"Pow"``), and each layer's variant (``"Pow(-1.5)"``).
    operators: list[str]
    variants: list[str]
    input_elem: int
    #: ``narrow``, ``unit`` or ``wide``: the box's width against its magnitude.
    box_style: str

    @property
    def input_type(self) -> type:
        return NUMPY_TYPES[self.input_elem]

    @property
    def relu_only(self) -> bool:
        """Whether ReLU is the only non-linearity: the networks LP refinement writes programs for."""
        affine = {"Gemm", "MatMul", "Add/Sub/Mul/Div(constant)", "Add(of two)", "Sub(of two)", "Neg", "Flatten"}
        return "Relu" in self.operators and set(self.operators) <= affine | {"Relu", "Reshape", "Identity"}


class GraphBuilder:
    """Nodes and constants of one model, grown layer by layer from the input ``x``; every new tensor's shape is
    onnx's own shape inference, and :meth:`probe` gives its values at the box samples (onnxruntime)."""

    def __init__(
        self, rng: np.random.Generator, elem: int, input_shape: tuple[int, ...], lower: np.ndarray, upper: np.ndarray
    ) -> None:
        self.rng, self.elem = rng, elem
        self.opset = OPSET
        self.input = Tensor("x", input_shape, elem)
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: list[onnx.TensorProto] = []
        self.variants: list[str] = []
        self._counter = itertools.count()
        self._samples = box_samples(rng, lower, upper, NUMPY_TYPES[elem], count=48).reshape(-1, *input_shape)

    def fresh(self, stem: str) -> str:
        return f"{stem.lower()}_{next(self._counter)}"

    def constant(self, value: np.ndarray | float | list, elem: int | None = None) -> str:
        """An initializer: floats in ``elem`` (default the model's float type), integers as int64, bools as is."""
        array = np.asarray(value)
        if array.dtype.kind == "f" or elem is not None:
            array = array.astype(NUMPY_TYPES[elem or self.elem])
        elif array.dtype.kind in "iu":
            array = array.astype(np.int64)
        name = self.fresh("c")
        self.initializers.append(numpy_helper.from_array(array, name))
        return name

    def weights(self, *shape: int, scale: float | None = None) -> str:
        """Random float constants; the scale (default: drawn from 10⁻³…10³, rarely up to 10⁶) spans the magnitudes
        where float32 rounding of the weights and their products matters."""
        if scale is None:
            scale = 10 ** self.rng.uniform(-3, 3) if self.rng.random() < 0.9 else 10 ** self.rng.uniform(3, 6)
            if self.elem == TensorProto.FLOAT16:
                scale = min(scale, 4.0)
        return self.constant(self.rng.normal(size=shape) * scale / math.sqrt(max(1, shape[0] if shape else 1)))

    def node(self, op_type: str, inputs: list[str], outputs: int = 1, **attributes) -> Tensor | list[Tensor]:
        """Append one node; its output tensors (one, or a list where ``outputs > 1``)."""
        names = [self.fresh(op_type) for _ in range(outputs)]
        self.nodes.append(helper.make_node(op_type, inputs, names, name=names[0], **attributes))
        inferred = self._infer()
        tensors = []
        for name in names:
            kind = inferred[name].type.tensor_type
            tensors.append(Tensor(name, tuple(d.dim_value for d in kind.shape.dim), kind.elem_type))
        return tensors if outputs > 1 else tensors[0]

    def model(self, output: Tensor) -> onnx.ModelProto:
        graph = helper.make_graph(
            self.nodes,
            "fuzz",
            [helper.make_tensor_value_info("x", self.elem, self.input.shape)],
            [helper.make_tensor_value_info(output.name, output.elem, output.shape)],
            self.initializers,
        )
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", self.opset)], producer_name="fuzz")
        model.ir_version = 8  # onnxruntime reads it; newer IR versions of onnx may be ahead of it
        return model

    def probe(self, tensor: Tensor) -> np.ndarray:
        """``tensor``'s values at the box samples, ``[samples, *shape]`` in float64."""
        session = ort_session(self.model(tensor))
        return np.stack([session.run(None, {"x": x})[0] for x in self._samples]).astype(np.float64)

    def fit(self, tensor: Tensor, low: float, high: float) -> Tensor:
        """``tensor`` mapped so that its values at the box samples span ``[low, high]``: element-wise by
        ``· scale + shift`` (each element onto the range, so that every neuron straddles the points it was chosen
        around; or one scale for all), or as a network's layer would, by ``tensor @ (W·scale) + shift`` over the
        last axis, whose sums then cancel large terms down to the range, where float32 rounding shows."""
        mixing = tensor.rank >= 1 and self.rng.random() < 0.5
        if mixing:
            n = tensor.shape[-1]
            weight = self.rng.normal(size=(n, n)) * 10 ** self.rng.uniform(-1, 1)
            values = self.probe(self.node("MatMul", [tensor.name, self.constant(weight)]))
            del self.nodes[-1], self.initializers[-1]  # probed only: the layer below folds the scale into W
            axes = tuple(range(values.ndim - 1))  # one scale per column of W
        else:
            values = self.probe(tensor)
            axes = 0 if self.rng.random() < 0.7 else None
        lo, hi = values.min(axis=axes), values.max(axis=axes)
        with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
            scale = np.where(hi > lo, (high - low) / np.where(hi > lo, hi - lo, 1.0), 1.0)
            shift = low - scale * lo
            dtype = NUMPY_TYPES[tensor.elem]
            if not (np.all(np.isfinite(scale.astype(dtype))) and np.all(np.isfinite(shift.astype(dtype)))):
                return tensor  # beyond the float type (float16): left as it is
        if mixing:
            scaled = self.node("MatMul", [tensor.name, self.constant(weight * scale)])
        else:
            scaled = self.node("Mul", [tensor.name, self.constant(scale, tensor.elem)])
        return self.node("Add", [scaled.name, self.constant(shift, tensor.elem)])

    def reshape(self, tensor: Tensor, shape: tuple[int, ...]) -> Tensor:
        if tuple(shape) == tensor.shape:
            return tensor
        return self.node("Reshape", [tensor.name, self.constant(np.array(shape, dtype=np.int64))])

    def as_rank(self, tensor: Tensor, rank: int) -> Tensor:
        """``tensor`` as ``[1, n]`` (rank 2), ``[1, C, L]`` (3) or ``[1, C, H, W]`` (4): batch of 1, then factors."""
        if tensor.rank == rank and tensor.shape[0] == 1 and self.rng.random() < 0.7:
            return tensor
        return self.reshape(tensor, (1, *_factor(tensor.size, rank - 1, self.rng)))

    def mixed(self, tensor: Tensor) -> Tensor:
        """A second tensor of ``tensor``'s shape computed from it (``tensor @ W`` over its last axis): the other
        operand of a product, a sum, a maximum."""
        n = tensor.shape[-1]
        return self.node("MatMul", [tensor.name, self.weights(n, n, scale=10 ** self.rng.uniform(-1, 1))])

    def _infer(self) -> dict[str, onnx.ValueInfoProto]:
        graph = helper.make_graph(
            self.nodes,
            "probe",
            [helper.make_tensor_value_info("x", self.elem, self.input.shape)],
            [helper.make_tensor_value_info("x", self.elem, self.input.shape)],
            self.initializers,
        )
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", self.opset)])
        inferred = onnx.shape_inference.infer_shapes(model, strict_mode=True, data_prop=True)
        return {info.name: info for info in inferred.graph.value_info}


def _factor(size: int, parts: int, rng: np.random.Generator) -> tuple[int, ...]:
    """``parts`` positive integers whose product is ``size``, drawn from its divisors."""
    dims = []
    for _ in range(parts - 1):
        divisors = [d for d in range(1, size + 1) if size % d == 0]
        d = int(rng.choice(divisors))
        dims.append(d)
        size //= d
    return (*dims, size)


def box_samples(
    rng: np.random.Generator, lower: np.ndarray, upper: np.ndarray, dtype: type, count: int, corners: int = 64
) -> np.ndarray:
    """Points of the box ``[lower, upper]`` in ``dtype``: the centre, the corners (all where there are at most
    ``log2(corners)`` free dimensions, else ``corners`` random ones) and ``count`` uniform points."""
    free = np.flatnonzero(upper > lower)
    centre = (lower + (upper - lower) / 2)[None]
    if 2**free.size <= corners:
        bits = np.array(list(itertools.product((0, 1), repeat=free.size)), dtype=bool).reshape(-1, free.size)
    else:
        bits = rng.random((corners, free.size)) < 0.5
    corner = np.repeat(lower[None], bits.shape[0], axis=0)
    corner[:, free] = np.where(bits, upper[free], lower[free])
    uniform = lower + (upper - lower) * rng.random((count, lower.size))
    points = np.concatenate([centre, corner, uniform]).astype(dtype)
    return np.clip(points, lower.astype(dtype), upper.astype(dtype))


# ----------------------------------------------------------------------------------------------- the operators
# Each takes the builder and the tensor computed so far and returns the layer's output; it records its variant.

Layer = Callable[[GraphBuilder, Tensor], Tensor]


def _straddling(b: GraphBuilder, point: float = 0.0) -> tuple[float, float]:
    """A range around ``point``: width 10⁻⁴…10³ (10² in float16), mostly across it, sometimes wholly on one side."""
    width = 10 ** b.rng.uniform(-4, 2 if b.elem == TensorProto.FLOAT16 else 3)
    # across; wholly on one side; or just across, where the last corner past the point decides the bound
    below = float(b.rng.choice([b.rng.uniform(0.05, 0.95), 0.0, 1.0, 0.999, 0.001], p=[0.6, 0.1, 0.1, 0.1, 0.1]))
    return point - below * width, point + (1 - below) * width


def _positive(b: GraphBuilder) -> tuple[float, float]:
    """A range ``[δ, δ + w]`` near the domain edge 0 of Log, Sqrt, Reciprocal, fractional powers."""
    edge = 10 ** b.rng.uniform(-4, 1)
    return edge, edge + 10 ** b.rng.uniform(-3, 2)


def _unary(op_type: str, domain: Callable[[GraphBuilder], tuple[float, float]]) -> Layer:
    """An element-wise function on its input mapped onto ``domain``'s range."""

    def layer(b: GraphBuilder, x: Tensor) -> Tensor:
        b.variants.append(op_type)
        return b.node(op_type, [b.fit(x, *domain(b)).name])

    return layer


def _sigmoid_like(b: GraphBuilder) -> tuple[float, float]:
    if b.rng.random() < 0.15:  # saturated: the far tails, where the curve is flat to float precision
        low = b.rng.uniform(15, 40)
        return (low, low + 10) if b.rng.random() < 0.5 else (-low - 10, -low)
    return _straddling(b)


def _exp_range(b: GraphBuilder) -> tuple[float, float]:
    top = 8.0 if b.elem == TensorProto.FLOAT16 else 60.0  # below the overflow of exp
    high = b.rng.uniform(-10, top)
    return high - 10 ** b.rng.uniform(-3, 1.5), high


def _step_range(b: GraphBuilder) -> tuple[float, float]:
    """Across integer jumps (Floor, Ceil) and half-integers (Round), around small or large values."""
    centre = float(b.rng.integers(-3, 4)) if b.rng.random() < 0.7 else float(b.rng.integers(100, 2000))
    return _straddling(b, centre + float(b.rng.choice([0.0, 0.5])))


def _periodic(b: GraphBuilder) -> tuple[float, float]:
    """Sin and Cos over less than a period, about one, or several, around a multiple of π/2."""
    centre = float(b.rng.integers(-6, 7)) * math.pi / 2
    width = 10 ** b.rng.uniform(-3, 1.5)
    offset = b.rng.uniform(-0.5, 0.5) * width
    return centre + offset - width / 2, centre + offset + width / 2


def _relu(b: GraphBuilder, x: Tensor) -> Tensor:
    b.variants.append("Relu")
    return b.node("Relu", [b.fit(x, *_straddling(b)).name])


def _leaky_relu(b: GraphBuilder, x: Tensor) -> Tensor:
    alpha = float(b.rng.choice([0.01, 0.2, 0.5, 2.0]))
    b.variants.append(f"LeakyRelu({alpha})")
    return b.node("LeakyRelu", [b.fit(x, *_straddling(b)).name], alpha=alpha)


def _clip(b: GraphBuilder, x: Tensor) -> Tensor:
    low, high = _straddling(b)
    x = b.fit(x, low, high)
    cut = np.sort(b.rng.uniform(low, high, size=2))
    which = b.rng.choice(["both", "min", "max"])
    inputs = [x.name, b.constant(cut[0]) if which != "max" else "", b.constant(cut[1]) if which != "min" else ""]
    b.variants.append(f"Clip({which})")
    return b.node("Clip", inputs[: 3 if which != "min" else 2])


def _pow(b: GraphBuilder, x: Tensor) -> Tensor:
    if b.rng.random() < 0.15:  # c^x with a positive constant base: exp(x · ln c)
        base = float(b.rng.choice([0.5, 2.0, math.e, 10.0]))
        b.variants.append(f"Pow({base}^x)")
        reach = 8.0 if b.elem == TensorProto.FLOAT16 else 40.0
        return b.node("Pow", [b.constant(base), b.fit(x, -reach / math.log(10), reach / math.log(10)).name])
    exponent = float(b.rng.choice([2, 3, 4, -1, -2, 0.5, 1.5, 2.5, 0.3, -0.5, -1.5]))
    if exponent == int(exponent) and exponent > 0:
        low, high = _straddling(b)
    else:
        low, high = _positive(b)
        if exponent == int(exponent) and b.rng.random() < 0.3:  # 1/x², 1/x: the negative side too
            low, high = -high, -low
    reach = max(abs(low), abs(high))
    if b.elem == TensorProto.FLOAT16 and reach > 6.0:  # x⁴ and 1/x² inside float16's range
        low, high = low * 6.0 / reach, high * 6.0 / reach
    b.variants.append(f"Pow({exponent})")
    return b.node("Pow", [b.fit(x, low, high).name, b.constant(exponent)])


def _reciprocal(b: GraphBuilder, x: Tensor) -> Tensor:
    low, high = _positive(b)
    if b.rng.random() < 0.4:
        low, high = -high, -low
    b.variants.append("Reciprocal")
    return b.node("Reciprocal", [b.fit(x, low, high).name])


def _softmax(b: GraphBuilder, x: Tensor) -> Tensor:
    axes = [a for a in range(x.rank) if x.shape[a] > 1] or [x.rank - 1]
    axis = int(b.rng.choice(axes))
    b.variants.append(f"Softmax(axis={axis})")
    width = 10 ** b.rng.uniform(-2, 1.5)
    return b.node("Softmax", [b.fit(x, -width / 2, width / 2).name], axis=axis)


def _gemm(b: GraphBuilder, x: Tensor) -> Tensor:
    if x.rank != 2:
        axis = 0 if x.rank == 1 else 1 if x.shape[0] == 1 else int(b.rng.integers(1, x.rank))
        x = b.node("Flatten", [x.name], axis=axis)
    rows, n = x.shape
    m = int(b.rng.integers(1, 9))
    trans_a = rows > 1 and b.rng.random() < 0.2
    if trans_a:
        rows, n = n, rows
    trans_b = bool(b.rng.random() < 0.5)
    alpha, beta = float(b.rng.choice([1.0, 0.5, 2.5])), float(b.rng.choice([1.0, 1.0, -1.5, 0.0]))
    weight = b.weights(m, n) if trans_b else b.weights(n, m)
    inputs = [x.name, weight]
    if b.rng.random() < 0.8 or b.opset < 11:  # C is optional from opset 11
        inputs.append(b.weights(*([m] if b.rng.random() < 0.6 else [1, m])))
    b.variants.append(f"Gemm(transA={int(trans_a)}, transB={int(trans_b)}, alpha={alpha}, beta={beta})")
    return b.node("Gemm", inputs, transA=int(trans_a), transB=int(trans_b), alpha=alpha, beta=beta)


def _matmul_constant(b: GraphBuilder, x: Tensor) -> Tensor:
    m = int(b.rng.integers(1, 7))
    if b.rng.random() < 0.6:  # x @ W over the last axis (a 1-D W drops it)
        n = x.shape[-1]
        vector = b.rng.random() < 0.15
        b.variants.append("MatMul(x @ w)" if vector else "MatMul(x @ W)")
        return b.node("MatMul", [x.name, b.weights(n) if vector else b.weights(n, m)])
    x = b.as_rank(x, 3) if x.rank < 3 or b.rng.random() < 0.3 else x  # W @ x over the second-to-last axis
    k = x.shape[-2]
    vector = b.rng.random() < 0.15
    b.variants.append("MatMul(w @ x)" if vector else "MatMul(W @ x)")
    return b.node("MatMul", [b.weights(k) if vector else b.weights(m, k), x.name])


def _spatial(b: GraphBuilder, x: Tensor) -> tuple[Tensor, int]:
    """``x`` as ``[1, C, L]`` or ``[1, C, H, W]``, and its number of spatial dimensions."""
    spatial = int(b.rng.choice([1, 2], p=[0.3, 0.7]))
    return b.as_rank(x, spatial + 2), spatial


def _conv(b: GraphBuilder, x: Tensor) -> Tensor:
    x, spatial = _spatial(b, x)
    channels, sizes = x.shape[1], x.shape[2:]
    groups = int(b.rng.choice([g for g in (1, 2, 3) if channels % g == 0]))
    out_channels = groups * int(b.rng.integers(1, 3))
    dilation = [int(b.rng.choice([1, 1, 2])) for _ in sizes]
    kernel = [int(b.rng.integers(1, min(3, (s - 1) // d + 1) + 1)) for s, d in zip(sizes, dilation, strict=True)]
    pads = [int(b.rng.integers(0, k)) for k in kernel] + [int(b.rng.integers(0, k)) for k in kernel]
    strides = [int(b.rng.choice([1, 1, 2])) for _ in sizes]
    inputs = [x.name, b.weights(out_channels, channels // groups, *kernel)]
    if b.rng.random() < 0.7:
        inputs.append(b.weights(out_channels))
    b.variants.append(f"Conv({spatial}-D, k={kernel}, pads={pads}, strides={strides}, dil={dilation}, g={groups})")
    return b.node("Conv", inputs, kernel_shape=kernel, pads=pads, strides=strides, dilations=dilation, group=groups)


def _conv_transpose(b: GraphBuilder, x: Tensor) -> Tensor:
    x, spatial = _spatial(b, x)
    channels, sizes = x.shape[1], x.shape[2:]
    groups = int(b.rng.choice([g for g in (1, 2) if channels % g == 0]))
    out_per_group = int(b.rng.integers(1, 3))
    kernel = [int(b.rng.integers(1, 4)) for _ in sizes]
    strides = [int(b.rng.choice([1, 2])) for _ in sizes]
    dilation = [int(b.rng.choice([1, 1, 2])) for _ in sizes]
    # at most the kernel's reach in padding, so that even a 1-wide input gives an output
    pads = [int(b.rng.integers(0, (k - 1) * d // 2 + 1)) for k, d in zip(kernel, dilation, strict=True)] * 2
    output_padding = [int(b.rng.integers(0, s)) if b.rng.random() < 0.3 else 0 for s in strides]
    inputs = [x.name, b.weights(channels, out_per_group, *kernel)]
    if b.rng.random() < 0.7:
        inputs.append(b.weights(out_per_group * groups))
    b.variants.append(f"ConvTranspose({spatial}-D, k={kernel}, strides={strides}, dil={dilation}, g={groups})")
    return b.node(
        "ConvTranspose",
        inputs,
        kernel_shape=kernel,
        strides=strides,
        dilations=dilation,
        pads=pads,
        output_padding=output_padding,
        group=groups,
    )


def _batch_norm(b: GraphBuilder, x: Tensor) -> Tensor:
    x = b.as_rank(x, int(b.rng.integers(2, 5)))
    c = x.shape[1]
    variance = b.constant(10 ** b.rng.uniform(-4, 2, size=c))
    epsilon = float(b.rng.choice([1e-5, 1e-3, 0.0]))
    b.variants.append(f"BatchNormalization(rank {x.rank}, eps={epsilon})")
    return b.node("BatchNormalization", [x.name, b.weights(c), b.weights(c), b.weights(c), variance], epsilon=epsilon)


def _average_pool(b: GraphBuilder, x: Tensor) -> Tensor:
    x, spatial = _spatial(b, x)
    sizes = x.shape[2:]
    kernel = [int(b.rng.integers(1, min(3, s) + 1)) for s in sizes]
    pads = [int(b.rng.integers(0, k // 2 + 1)) for k in kernel]
    strides = [int(b.rng.choice([1, 2])) for _ in sizes]
    include, ceil = int(b.rng.random() < 0.5), int(b.rng.random() < 0.3)
    b.variants.append(f"AveragePool({spatial}-D, k={kernel}, pads={pads}, include_pad={include}, ceil={ceil})")
    return b.node(
        "AveragePool",
        [x.name],
        kernel_shape=kernel,
        pads=pads * 2,
        strides=strides,
        count_include_pad=include,
        ceil_mode=ceil,
    )


def _global_average_pool(b: GraphBuilder, x: Tensor) -> Tensor:
    x, spatial = _spatial(b, x)
    b.variants.append(f"GlobalAveragePool({spatial}-D)")
    return b.node("GlobalAveragePool", [x.name])


def _reduce_axes(b: GraphBuilder, x: Tensor) -> list[int]:
    first = 1 if x.shape[0] == 1 and x.rank > 1 else 0
    axes = [a for a in range(first, x.rank) if b.rng.random() < 0.5] or [x.rank - 1]
    return [a - x.rank if b.rng.random() < 0.3 else a for a in axes]


def _reduce_sum(b: GraphBuilder, x: Tensor) -> Tensor:
    axes, keep = _reduce_axes(b, x), int(b.rng.random() < 0.5)
    b.variants.append(f"ReduceSum(axes={axes}, keepdims={keep})")
    return b.node("ReduceSum", [x.name, b.constant(np.array(axes, dtype=np.int64))], keepdims=keep)


def _reduce(op_type: str, nonlinear: bool) -> Layer:
    def layer(b: GraphBuilder, x: Tensor) -> Tensor:
        axes, keep = _reduce_axes(b, x), int(b.rng.random() < 0.5)
        if nonlinear:
            x = b.fit(x, *_straddling(b))
        b.variants.append(f"{op_type}(axes={axes}, keepdims={keep})")
        return b.node(op_type, [x.name], axes=axes, keepdims=keep)

    return layer


def _with_constant(b: GraphBuilder, x: Tensor) -> Tensor:
    op_type = str(b.rng.choice(["Add", "Sub", "Mul", "Div"]))
    shape = [(), (x.shape[-1],), x.shape, (1,) * x.rank][int(b.rng.integers(0, 4))]
    value = b.rng.normal(size=shape) * 10 ** b.rng.uniform(-3, 3)
    if op_type == "Div":
        value = np.where(np.abs(value) < 1e-3, 1.0, value)
    constant = b.constant(value)
    first = op_type in ("Add", "Sub", "Mul") and b.rng.random() < 0.4
    b.variants.append(f"{op_type}({'c, x' if first else 'x, c'}; c{list(np.shape(value))})")
    return b.node(op_type, [constant, x.name] if first else [x.name, constant])


def _constant_over_x(b: GraphBuilder, x: Tensor) -> Tensor:
    """``c / x``: a reciprocal with a constant factor."""
    low, high = _positive(b)
    b.variants.append("Div(c / x)")
    return b.node("Div", [b.constant(b.rng.normal(size=x.shape[-1:]) * 3), b.fit(x, low, high).name])


def _two_computed(op_type: str) -> Layer:
    """``x op y`` of two computed tensors; ``y`` of the same shape, or broadcast along an axis of 1."""

    def layer(b: GraphBuilder, x: Tensor) -> Tensor:
        y = b.mixed(x)
        if op_type == "Div":
            low, high = _positive(b)
            y = b.fit(y, low, high) if b.rng.random() < 0.7 else b.fit(y, -high, -low)
        elif op_type in ("Mul", "Max", "Min"):
            x, y = b.fit(x, *_straddling(b)), b.fit(y, *_straddling(b))
        if x.rank >= 2 and x.shape[-1] > 1 and b.rng.random() < 0.25:  # broadcast one operand's last axis
            y = b.node("ReduceMean", [y.name], axes=[-1], keepdims=1)
        if op_type == "Mul" and b.rng.random() < 0.1:
            y = x  # x·x: the square
        operands = [x.name, y.name]
        if op_type in ("Max", "Min") and b.rng.random() < 0.3:
            operands.append(b.constant(b.rng.normal(size=x.shape[-1:])))
        b.variants.append(f"{op_type}(of {len(operands)}{', x·x' if y is x else ''})")
        return b.node(op_type, operands)

    return layer


def _matmul_of_two(b: GraphBuilder, x: Tensor) -> Tensor:
    """``X @ Y`` with ``X`` the input as ``[1, n, k]`` and ``Y [1, k, m]`` a linear map of all of it."""
    x = b.as_rank(x, 3)
    k, m = x.shape[-1], int(b.rng.integers(1, 4))
    flat = b.reshape(x, (1, x.size))
    other = b.reshape(b.node("MatMul", [flat.name, b.weights(x.size, k * m, scale=1.0)]), (1, k, m))
    x, other = b.fit(x, *_straddling(b)), b.fit(other, *_straddling(b))
    b.variants.append("MatMul(of two)")
    return b.node("MatMul", [x.name, other.name])


def _neg(b: GraphBuilder, x: Tensor) -> Tensor:
    b.variants.append("Neg")
    return b.node("Neg", [x.name])


def _max_pool(b: GraphBuilder, x: Tensor) -> Tensor:
    x, spatial = _spatial(b, x)
    sizes = x.shape[2:]
    x = b.fit(x, *_straddling(b))
    if spatial == 2 and b.rng.random() < 0.5 and min(sizes) >= 2:  # non-overlapping tiles: the ReLU rewrite
        kernel = [int(b.rng.integers(2, s + 1)) for s in sizes]
        b.variants.append(f"MaxPool(tiles {kernel})")
        return b.node("MaxPool", [x.name], kernel_shape=kernel, strides=kernel)
    dilation = [int(b.rng.choice([1, 1, 2])) for _ in sizes]
    kernel = [int(b.rng.integers(1, min(3, (s - 1) // d + 1) + 1)) for s, d in zip(sizes, dilation, strict=True)]
    pads = [int(b.rng.integers(0, k // 2 + 1)) for k in kernel] * 2
    strides = [int(b.rng.choice([1, 2])) for _ in sizes]
    ceil = int(b.rng.random() < 0.3)
    b.variants.append(f"MaxPool({spatial}-D, k={kernel}, pads={pads}, strides={strides}, dil={dilation}, ceil={ceil})")
    return b.node(
        "MaxPool", [x.name], kernel_shape=kernel, pads=pads, strides=strides, dilations=dilation, ceil_mode=ceil
    )


def _concat(b: GraphBuilder, x: Tensor) -> Tensor:
    first = 1 if x.shape[0] == 1 and x.rank > 1 else 0
    axis = int(b.rng.integers(first, x.rank))
    parts = [x.name]
    if b.rng.random() < 0.6:
        parts.append(b.mixed(x).name)
    if b.rng.random() < 0.5 or len(parts) == 1:
        shape = list(x.shape)
        shape[axis] = int(b.rng.integers(1, 3))
        parts.insert(int(b.rng.integers(0, len(parts) + 1)), b.weights(*shape))
    b.variants.append(f"Concat(axis={axis}, {len(parts)} parts)")
    return b.node("Concat", parts, axis=axis)


def _slice(b: GraphBuilder, x: Tensor) -> Tensor:
    axes = [a for a in range(x.rank) if x.shape[a] > 1] or [x.rank - 1]
    axes = sorted(set(b.rng.choice(axes, size=int(b.rng.integers(1, len(axes) + 1)))))
    starts, ends, steps = [], [], []
    for a in axes:
        n = x.shape[a]
        step = int(b.rng.choice([1, 1, 2, -1, -2]))
        start, end = sorted(b.rng.choice(n + 1, size=2, replace=False)) if n > 1 else (0, 1)
        if step < 0:
            start, end = end - 1, start - 1
            end = end if end >= 0 else -(2**31)  # past the front: a clamped end
        starts.append(int(start) - n if b.rng.random() < 0.3 and start > 0 else int(start))
        ends.append(int(end) if b.rng.random() < 0.8 or step < 0 else 2**31 - 1)
        steps.append(step)
    b.variants.append(f"Slice(axes={axes}, steps={steps})")
    inputs = [starts, ends, [int(a) for a in axes], steps]
    return b.node("Slice", [x.name, *(b.constant(np.array(v, dtype=np.int64)) for v in inputs)])


def _gather(b: GraphBuilder, x: Tensor) -> Tensor:
    axes = [a for a in range(x.rank) if x.shape[a] > 1] or [x.rank - 1]
    axis = int(b.rng.choice(axes))
    n = x.shape[axis]
    if b.rng.random() < 0.2:  # GatherElements: indices of the input's own shape
        indices = b.rng.integers(-n, n, size=x.shape)
        b.variants.append(f"GatherElements(axis={axis})")
        return b.node("GatherElements", [x.name, b.constant(indices)], axis=axis)
    scalar = b.rng.random() < 0.2
    indices = np.array(b.rng.integers(-n, n)) if scalar else b.rng.integers(-n, n, size=int(b.rng.integers(1, n + 2)))
    b.variants.append(f"Gather(axis={axis}, {'scalar' if scalar else f'{indices.size} indices'})")
    return b.node("Gather", [x.name, b.constant(indices)], axis=axis)


def _split(b: GraphBuilder, x: Tensor) -> Tensor:
    if x.size == 1:  # nothing to split: two values first
        x = b.node("Concat", [x.name, b.mixed(x).name], axis=x.rank - 1)
    axes = [a for a in range(x.rank) if x.shape[a] > 1]
    axis = int(b.rng.choice(axes))
    n = x.shape[axis]
    cut = int(b.rng.integers(1, n))
    first, second = b.node("Split", [x.name, b.constant(np.array([cut, n - cut]))], outputs=2, axis=axis)
    b.variants.append(f"Split(axis={axis}, [{cut}, {n - cut}])")
    if cut == n - cut and b.rng.random() < 0.5:
        return b.node("Sub", [first.name, second.name])
    return b.node("Concat", [second.name, first.name], axis=axis)  # the pieces swapped


def _expand(b: GraphBuilder, x: Tensor) -> Tensor:
    x = b.node("Unsqueeze", [x.name, b.constant(np.array([x.rank], dtype=np.int64))])
    target = (*x.shape[:-1], int(b.rng.integers(1, 4)))
    if b.rng.random() < 0.3:
        target = (int(b.rng.integers(1, 3)), *target)  # a new leading axis too
    b.variants.append(f"Expand({list(x.shape)} → {list(target)})")
    return b.node("Expand", [x.name, b.constant(np.array(target, dtype=np.int64))])


def _tile(b: GraphBuilder, x: Tensor) -> Tensor:
    repeats = [int(b.rng.integers(1, 3)) if b.rng.random() < 0.5 else 1 for _ in x.shape]
    if x.shape[0] == 1 and x.rank > 1:
        repeats[0] = 1
    b.variants.append(f"Tile({repeats})")
    return b.node("Tile", [x.name, b.constant(np.array(repeats, dtype=np.int64))])


def _pad(b: GraphBuilder, x: Tensor) -> Tensor:
    mode = str(b.rng.choice(["constant", "reflect", "edge"]))
    first = 1 if x.shape[0] == 1 and x.rank > 1 else 0
    pads = np.zeros(2 * x.rank, dtype=np.int64)
    for a in range(first, x.rank):
        limit = x.shape[a] - 1 if mode == "reflect" else 2
        pads[a], pads[x.rank + a] = b.rng.integers(0, limit + 1, size=2)
    inputs = [x.name, b.constant(pads)]
    if mode == "constant":
        inputs.append(b.constant(np.array(b.rng.normal() * 3)))
    b.variants.append(f"Pad({mode}, {pads.tolist()})")
    return b.node("Pad", inputs, mode=mode)


def _resize(b: GraphBuilder, x: Tensor) -> Tensor:
    x = b.as_rank(x, int(b.rng.choice([3, 4])))
    scales = [1.0, 1.0] + [float(b.rng.choice([1.0, 2.0, 3.0, 1.5, 0.5] if d > 1 else [1.0, 2.0])) for d in x.shape[2:]]
    modes = ["asymmetric", "half_pixel", "align_corners", "pytorch_half_pixel", "tf_half_pixel_for_nn"]
    transform = str(b.rng.choice(modes))
    nearest = str(b.rng.choice(["round_prefer_floor", "round_prefer_ceil", "floor", "ceil"]))
    if b.rng.random() < 0.3:
        sizes = [int(max(1, round(d * s))) for d, s in zip(x.shape, scales, strict=True)]
        inputs = [x.name, "", "", b.constant(np.array(sizes, dtype=np.int64))]
    else:
        inputs = [x.name, "", b.constant(np.array(scales, dtype=np.float32), TensorProto.FLOAT)]
    b.variants.append(f"Resize(nearest, {transform}, {nearest}, scales={scales[2:]})")
    return b.node("Resize", inputs, mode="nearest", coordinate_transformation_mode=transform, nearest_mode=nearest)


def _upsample(b: GraphBuilder, x: Tensor) -> Tensor:
    """Upsample-9 (the model is written in opset 9): nearest, integer scales."""
    b.opset = UPSAMPLE_OPSET
    x = b.as_rank(x, 4)
    scales = np.array([1, 1, b.rng.integers(1, 3), b.rng.integers(1, 4)], dtype=np.float32)
    b.variants.append(f"Upsample(opset 9, scales={scales[2:].tolist()})")
    return b.node("Upsample", [x.name, b.constant(scales, TensorProto.FLOAT)], mode="nearest")


def _transpose(b: GraphBuilder, x: Tensor) -> Tensor:
    if x.rank < 2:
        x = b.as_rank(x, 2)
    perm = list(range(x.rank))
    if x.shape[0] == 1 and x.rank > 2 and b.rng.random() < 0.8:
        perm = [0, *(1 + b.rng.permutation(x.rank - 1))]
    else:
        perm = list(b.rng.permutation(x.rank))
    perm = [int(p) for p in perm]
    b.variants.append(f"Transpose({perm})")
    return b.node("Transpose", [x.name], perm=perm)


def _squeeze_unsqueeze(b: GraphBuilder, x: Tensor) -> Tensor:
    axis = int(b.rng.integers(0, x.rank + 1))
    wider = b.node("Unsqueeze", [x.name, b.constant(np.array([axis - x.rank - 1 if b.rng.random() < 0.3 else axis]))])
    ones = [a for a, d in enumerate(wider.shape) if d == 1]
    squeezed = [int(b.rng.choice(ones))] if ones and b.rng.random() < 0.7 else [axis]
    b.variants.append(f"Unsqueeze({axis}) → Squeeze({squeezed})")
    return b.node("Squeeze", [wider.name, b.constant(np.array(squeezed))])


def _flatten(b: GraphBuilder, x: Tensor) -> Tensor:
    axis = int(b.rng.integers(0, x.rank + 1))
    b.variants.append(f"Flatten(axis={axis})")
    return b.node("Flatten", [x.name], axis=axis)


def _reshape(b: GraphBuilder, x: Tensor) -> Tensor:
    shape = list(_factor(x.size, int(b.rng.integers(1, 5)), b.rng))
    if b.rng.random() < 0.5:
        shape[int(b.rng.integers(0, len(shape)))] = -1
    if len(shape) <= x.rank and shape[0] == x.shape[0] and b.rng.random() < 0.3:
        shape[0] = 0  # copy the input's dimension
    b.variants.append(f"Reshape({shape})")
    return b.node("Reshape", [x.name, b.constant(np.array(shape, dtype=np.int64))])


def _cast(b: GraphBuilder, x: Tensor) -> Tensor:
    """A round trip through another float type: float16 rounds (by whole units above 2048), float32 rounds a
    float64 model, float64 is exact; or a Cast to this model's own type."""
    target = int(b.rng.choice([TensorProto.FLOAT16, TensorProto.FLOAT, TensorProto.DOUBLE]))
    if target == TensorProto.FLOAT16:
        magnitude = 10 ** b.rng.uniform(-2, 4.5)
        x = b.fit(x, magnitude * b.rng.uniform(-1, 0.5), magnitude)
    name = onnx.TensorProto.DataType.Name(target).lower()
    b.variants.append(f"Cast(to {name} and back)" if target != x.elem else f"Cast(to {name})")
    cast = b.node("Cast", [x.name], to=target)
    return cast if target == x.elem else b.node("Cast", [cast.name], to=x.elem)


def _identity(b: GraphBuilder, x: Tensor) -> Tensor:
    op_type = str(b.rng.choice(["Identity", "Dropout"]))
    b.variants.append(op_type)
    return b.node(op_type, [x.name])


def _where(b: GraphBuilder, x: Tensor) -> Tensor:
    condition = b.constant(b.rng.random(x.shape[-1:] if b.rng.random() < 0.5 else x.shape) < 0.5)
    computed = b.rng.random() < 0.5
    other = b.mixed(x).name if computed else b.weights(*x.shape[-1:])
    operands = [x.name, other] if b.rng.random() < 0.5 else [other, x.name]
    b.variants.append(f"Where({'computed' if computed else 'constant'} other)")
    return b.node("Where", [condition, *operands])


def _depth_to_space(b: GraphBuilder, x: Tensor) -> Tensor:
    """DepthToSpace on ``[1, 4c, h, w]`` or SpaceToDepth on ``[1, c, 2h, 2w]`` (block 2)."""
    if x.size % 4:
        x = b.node("Concat", [x.name] * 4, axis=x.rank - 1)
    c, h, w = _factor(x.size // 4, 3, b.rng)
    if b.rng.random() < 0.5:
        mode = str(b.rng.choice(["DCR", "CRD"]))
        b.variants.append(f"DepthToSpace({mode})")
        return b.node("DepthToSpace", [b.reshape(x, (1, 4 * c, h, w)).name], blocksize=2, mode=mode)
    b.variants.append("SpaceToDepth")
    return b.node("SpaceToDepth", [b.reshape(x, (1, c, 2 * h, 2 * w)).name], blocksize=2)


def _arg_max_count(b: GraphBuilder, x: Tensor) -> Tensor:
    """A counting head: ``C`` class scores for each of ``P`` pixels (``[1, C, P]``, a layer of ``x``; rounded to
    integers in some models, so that ties are common), ArgMax or ArgMin over the classes (either tie rule), then
    the pixels whose class equals a constant mask counted (Equal → Cast → ReduceSum), or the one-hot code
    (OneHot → Cast)."""
    classes, pixels = int(b.rng.integers(2, 4)), int(b.rng.integers(1, 6))
    flat = b.node("Flatten", [x.name], axis=1) if x.rank != 2 or x.shape[0] != 1 else x
    scores = b.node("Gemm", [flat.name, b.weights(flat.shape[1], classes * pixels)])
    rounded = b.rng.random() < 0.4
    if rounded:
        scores = b.node("Round", [b.fit(scores, -2.0, 2.0).name])
    scores = b.reshape(scores, (1, classes, pixels))
    op_type = "ArgMax" if b.rng.random() < 0.75 else "ArgMin"
    last = int(b.rng.random() < 0.5)
    index = b.node(op_type, [scores.name], axis=1, keepdims=0, select_last_index=last)
    if b.rng.random() < 0.6:
        mask = b.constant(b.rng.integers(0, classes, size=(1, pixels)))
        agree = b.node("Equal", [index.name, mask])
        counted = b.node("Cast", [agree.name], to=b.elem)
        out = b.node("ReduceSum", [counted.name, b.constant(np.array([1], dtype=np.int64))], keepdims=1)
        tail = "Equal(mask) count"
    else:
        values = b.constant(np.array([0, 1], dtype=np.int64))
        code = b.node("OneHot", [index.name, b.constant(np.array(classes, dtype=np.int64)), values], axis=1)
        out = b.node("Cast", [code.name], to=b.elem)
        tail = "OneHot"
    b.variants.append(f"{op_type}({classes} classes{', rounded' if rounded else ''}, last={last}) {tail}")
    return out


OPERATORS: dict[str, Layer] = {
    "Gemm": _gemm,
    "MatMul": _matmul_constant,
    "Conv": _conv,
    "ConvTranspose": _conv_transpose,
    "BatchNormalization": _batch_norm,
    "AveragePool": _average_pool,
    "GlobalAveragePool": _global_average_pool,
    "ReduceSum": _reduce_sum,
    "ReduceMean": _reduce("ReduceMean", nonlinear=False),
    "Add/Sub/Mul/Div(constant)": _with_constant,
    "Add(of two)": _two_computed("Add"),
    "Sub(of two)": _two_computed("Sub"),
    "Neg": _neg,
    "Relu": _relu,
    "LeakyRelu": _leaky_relu,
    "Abs": _unary("Abs", _straddling),
    "Clip": _clip,
    "Sign": _unary("Sign", _straddling),
    "Floor": _unary("Floor", _step_range),
    "Round": _unary("Round", _step_range),
    "Ceil": _unary("Ceil", _step_range),
    "Sigmoid": _unary("Sigmoid", _sigmoid_like),
    "Tanh": _unary("Tanh", _sigmoid_like),
    "Exp": _unary("Exp", _exp_range),
    "Log": _unary("Log", _positive),
    "Sqrt": _unary("Sqrt", _positive),
    "Reciprocal": _reciprocal,
    "Div(c / x)": _constant_over_x,
    "Sin": _unary("Sin", _periodic),
    "Cos": _unary("Cos", _periodic),
    "Pow": _pow,
    "Softmax": _softmax,
    "MaxPool": _max_pool,
    "ReduceMax": _reduce("ReduceMax", nonlinear=True),
    "ReduceMin": _reduce("ReduceMin", nonlinear=True),
    "Max": _two_computed("Max"),
    "Min": _two_computed("Min"),
    "Mul(of two)": _two_computed("Mul"),
    "Div(of two)": _two_computed("Div"),
    "MatMul(of two)": _matmul_of_two,
    "Concat": _concat,
    "Slice": _slice,
    "Gather": _gather,
    "Split": _split,
    "Expand": _expand,
    "Tile": _tile,
    "Pad": _pad,
    "Resize": _resize,
    "Upsample": _upsample,
    "Transpose": _transpose,
    "Squeeze/Unsqueeze": _squeeze_unsqueeze,
    "Flatten": _flatten,
    "Reshape": _reshape,
    "Cast": _cast,
    "Identity": _identity,
    "Where": _where,
    "DepthToSpace/SpaceToDepth": _depth_to_space,
    "ArgMax/ArgMin(count)": _arg_max_count,
}
#: Operators whose nodes read the same in opset 9 and 13: the other layers of a model with Upsample.
OPSET9_LAYERS = ("Gemm", "Relu", "Sigmoid", "Tanh", "Abs", "Exp", "Flatten", "Reshape", "Neg", "Sin", "Cos")


# --------------------------------------------------------------------------------------------------- a model


@dataclass
class _Box:
    shape: tuple[int, ...]
    lower: np.ndarray
    upper: np.ndarray
    style: str


def _input_box(rng: np.random.Generator, dtype: type) -> _Box:
    """An input shape (with or without a leading batch of 1) and a box in ``dtype``: narrow, unit or wide, around
    0 or around magnitudes up to 10⁶ (10 in float16), sometimes with a fixed coordinate."""
    layouts = [
        (1, int(rng.integers(1, 9))),
        (1, int(rng.integers(1, 4)), int(rng.integers(2, 6))),
        (1, int(rng.integers(1, 3)), int(rng.integers(2, 5)), int(rng.integers(2, 5))),
        (int(rng.integers(1, 9)),),
        (int(rng.integers(2, 4)), int(rng.integers(2, 5))),
    ]
    shape = layouts[int(rng.choice(len(layouts), p=[0.3, 0.15, 0.25, 0.15, 0.15]))]
    n = math.prod(shape)
    magnitude = 0.0 if rng.random() < 0.3 else 10 ** rng.uniform(-3, 1 if dtype == np.float16 else 6)
    centre = rng.normal(size=n) * magnitude
    style = str(rng.choice(["narrow", "unit", "wide"], p=[0.3, 0.5, 0.2]))
    width = {
        "narrow": 10 ** rng.uniform(-6, -2) * max(1.0, magnitude),
        "unit": 10 ** rng.uniform(-1, 0),
        "wide": 10 ** rng.uniform(0, 2),
    }[style]
    if dtype == np.float16:  # float16 has 11 bits: narrower boxes are single points
        width = max(width, 1e-2 * max(1.0, magnitude))
    radius = width * rng.uniform(0.5, 1.0, size=n)
    if n > 1 and rng.random() < 0.15:
        radius[int(rng.integers(0, n))] = 0.0  # a fixed coordinate
    lower, upper = (centre - radius).astype(dtype), (centre + radius).astype(dtype)
    return _Box(shape, lower.astype(np.float64), upper.astype(np.float64), style)


def random_model(rng: np.random.Generator, first: str | None = None, layers: int | None = None) -> FuzzModel:
    """A model of ``layers`` (1–4, drawn) operators, the first one ``first`` if given, over a random input box.
    Raises (onnx's checker or shape inference, onnxruntime) where a drawn combination is not a valid model; the
    caller draws again."""
    elem = int(rng.choice([TensorProto.FLOAT, TensorProto.DOUBLE, TensorProto.FLOAT16], p=[0.86, 0.08, 0.06]))
    box = _input_box(rng, NUMPY_TYPES[elem])
    b = GraphBuilder(rng, elem, box.shape, box.lower, box.upper)
    count = layers or int(rng.choice([1, 2, 3, 4], p=[0.4, 0.3, 0.2, 0.1]))  # short models point at an operator
    names = [first or str(rng.choice(list(OPERATORS)))]
    pool = OPSET9_LAYERS if names[0] == "Upsample" else [n for n in OPERATORS if n != "Upsample"]
    names += [str(rng.choice(pool)) for _ in range(count - 1)]
    x = b.input
    for name in names:
        if x.size > MAX_ELEMENTS:
            flat = b.node("Flatten", [x.name], axis=1)
            x = b.node("Gemm", [flat.name, b.weights(flat.shape[1], 8, scale=1.0)])
        x = OPERATORS[name](b, x)
        if x.rank == 0:  # everything reduced away: the next layer gets a vector
            x = b.reshape(x, (1,))
    if x.size > 16 or rng.random() < 0.4:  # a head: a few outputs mixing all of it
        flat = b.node("Flatten", [x.name], axis=1 if x.shape[0] == 1 or rng.random() < 0.5 else 0) if x.rank != 2 else x
        x = b.node("Gemm", [flat.name, b.weights(flat.shape[1], int(rng.integers(1, 5)))])
    model = b.model(x)
    onnx.checker.check_model(model, full_check=True)
    return FuzzModel(model, box.lower, box.upper, names, b.variants, elem, box.style)
