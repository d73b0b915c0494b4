"""ONNX operators as graph nodes: one converter per operator, each writing the node (or the few nodes) it becomes.

Accepted (on tensors computed from the input; anything on constants alone is folded):

* linear: Gemm; MatMul with a constant on either side (``x @ W``, ``W @ x``, 1-D operands too); Conv and
  ConvTranspose (1-D and 2-D); BatchNormalization (inference); AveragePool, GlobalAveragePool; ReduceSum,
  ReduceMean; Add/Sub/Mul/Div with a constant; Add/Sub of two computed tensors (broadcast); Neg;
* data movement (exact): Reshape, Flatten, Squeeze, Unsqueeze, Identity, Dropout, Cast to a wider float type,
  Transpose, Concat (with constant pieces too), and — as output element *i* is input element *index[i]*, the
  indices found by running the ONNX operator itself on the input's positions — Slice, Gather with constant
  indices, Split, Expand, Tile, Pad (any constant value, reflect, edge), nearest-neighbour Resize/Upsample,
  DepthToSpace, SpaceToDepth, GatherElements;
* rounding: Cast to a narrower float type (float16, bfloat16; float32 in a float64 model), Floor, Ceil, Round;
* non-linear: Relu, LeakyRelu, Abs, Clip, Sign, Sigmoid, Tanh, Exp, Log, Sqrt, Reciprocal, Pow with a
  constant exponent (and a positive constant base: ``c^x = exp(x·ln c)``), Sin, Cos, Softmax, MaxPool (any
  kernel, stride, padding, dilation; non-overlapping 2-D pools as pairwise maxima ``ReLU(a − b) + b``),
  ReduceMax/ReduceMin, Mul and Div of two computed tensors (``x·x`` is the square; ``x / y = x · (1/y)``), MatMul
  of two computed tensors (products and a sum).

* discrete: ArgMax, ArgMin, OneHot of either, Equal (:mod:`~lightning_fedshard.verify.onnx.discrete`: class indicators
  bounded from the logit margins, as counting heads use them).

Other discrete ops on the input's path (comparisons, booleans, ...) are refused with the reason (the instance
is ``unknown``); any other operator is ``unsupported ONNX operator 'X' at node 'N'``.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import onnx
import torch
import torch.nn.functional as F

from lightning_fedshard.verify.onnx.discrete import DISCRETE_CONVERTERS
from lightning_fedshard.verify.onnx.loader import (
    FLOAT_TYPES,
    LoadContext,
    NeedsUnbatched,
    OnnxLoadError,
    UnsupportedModelError,
    run_node,
)
from lightning_fedshard.verify.ops import (
    Add,
    AvgPool2d,
    BatchNorm,
    BoundOp,
    Ceil,
    Clip,
    Concat,
    Conv2d,
    ConvTranspose2d,
    Cos,
    Exp,
    Floor,
    LeakyReLU,
    LeftLinear,
    Linear,
    Log,
    Mul,
    Pow,
    Reciprocal,
    Reduce,
    ReLU,
    Round,
    RoundToFloat,
    Select,
    Sigmoid,
    Sign,
    Sin,
    Softmax,
    Sqrt,
    Tanh,
    Transpose,
    WindowMax,
)

__all__ = ["CONVERTERS", "DISCRETE"]

Converter = Callable[[LoadContext, onnx.NodeProto, dict], None]

#: Ops whose output is discrete in their input: no sound linear relaxation exists across a jump.
DISCRETE = {
    "Less": "a comparison",
    "LessOrEqual": "a comparison",
    "Greater": "a comparison",
    "GreaterOrEqual": "a comparison",
    "Not": "a boolean",
    "And": "a boolean",
    "Or": "a boolean",
    "Xor": "a boolean",
    "IsNaN": "a boolean",
    "IsInf": "a boolean",
    "NonZero": "indices",
    "TopK": "indices and a sort",
}


# --------------------------------------------------------------------------------------------------- helpers


def _out(node: onnx.NodeProto) -> str:
    return node.output[0]


def _input(node: onnx.NodeProto, index: int) -> str | None:
    return node.input[index] if len(node.input) > index and node.input[index] else None


def _computed(ctx: LoadContext, node: onnx.NodeProto) -> list[str]:
    return [name for name in node.input if name and not ctx.is_constant(name)]


def _per_sample(ctx: LoadContext, node: onnx.NodeProto, build: Callable[[tuple[int, ...]], BoundOp]) -> None:
    """An op on ONNX ``[N, C, ...]`` tensors built for node shape ``(C, ...)``: without a batch dimension the one
    sample's axis is reshaped away and back. ``N > 1`` samples are not supported."""
    source = node.input[0]
    shape = ctx.onnx_shape(source)
    if shape[0] != 1:
        raise UnsupportedModelError(f"{node.op_type} over {shape[0]} samples at once (the batch must be 1)")
    if ctx.batched:
        ctx.emit(_out(node), build(shape[1:]), source)
        return
    inner = ctx.reshape(source, shape[1:])
    result = ctx.emit(ctx.fresh(f"{_out(node)}/sample"), build(shape[1:]), inner)
    ctx.reshape(result, (1, *ctx.variable(result).shape), name=_out(node))


def _spatial(ctx: LoadContext, node: onnx.NodeProto, build: Callable[[tuple[int, int, int]], BoundOp]) -> None:
    """:func:`_per_sample` for a 2-D op on ``(C, H, W)``; a 1-D input ``(C, L)`` becomes ``(C, 1, L)`` and back."""

    def per_sample(shape: tuple[int, ...]) -> BoundOp:
        if len(shape) == 3:
            return build(shape)
        raise UnsupportedModelError(f"{node.op_type} on an input of {len(shape) - 1} spatial dimensions")

    shape = ctx.onnx_shape(node.input[0])
    if len(shape) != 3:
        _per_sample(ctx, node, per_sample)
        return
    # 1-D: (N, C, L) -> (N, C, 1, L), the 2-D op, and back.
    wide = ctx.reshape(node.input[0], ctx.node_shape((shape[0], shape[1], 1, shape[2])))
    renamed = onnx.NodeProto()
    renamed.CopyFrom(node)
    renamed.input[0] = wide
    renamed.output[0] = ctx.fresh(f"{_out(node)}/2d")
    _per_sample(ctx, renamed, per_sample)
    result = renamed.output[0]
    out = ctx.onnx_shape(result)
    ctx.reshape(result, ctx.node_shape((out[0], out[1], out[3])), name=_out(node))


def _two_d(attrs: dict, name: str, default: int, spatial: int) -> tuple[int, int]:
    value = list(attrs.get(name, [default] * spatial))
    return (default, value[0]) if spatial == 1 else (value[0], value[1])


def _pads(attrs: dict, spatial: int) -> tuple[int, int, int, int]:
    """ONNX pads as ``(top, left, bottom, right)`` (a 1-D op's as the width's)."""
    if attrs.get("auto_pad", b"NOTSET") not in (b"NOTSET", b"VALID"):
        raise OnnxLoadError(f"auto_pad={attrs['auto_pad'].decode()} is not supported; use explicit pads")
    pads = list(attrs.get("pads", [0] * (2 * spatial)))
    if spatial == 1:
        return (0, pads[0], 0, pads[1])
    return (pads[0], pads[1], pads[2], pads[3])


def _spatial_rank(ctx: LoadContext, node: onnx.NodeProto) -> int:
    return len(ctx.onnx_shape(node.input[0])) - 2


# --------------------------------------------------------------------------------------------------- linear


def _gemm(ctx: LoadContext, node: onnx.NodeProto, attrs: dict) -> None:
    x = node.input[0]
    if len(ctx.onnx_shape(x)) != 2:
        raise OnnxLoadError("Gemm needs a 2-D input")
    if attrs.get("transA", 0):
        if ctx.batched:
            raise NeedsUnbatched
        x = ctx.emit(ctx.fresh(f"{_out(node)}/transA"), Transpose((1, 0), ctx.variable(x).shape), x)
    b = ctx.weight(node.input[1], "Gemm operand B")
    weight = (attrs.get("alpha", 1.0) * (b if attrs.get("transB", 0) else b.T)).contiguous()
    bias = None
    c_name = _input(node, 2)
    if c_name is not None and attrs.get("beta", 1.0) != 0:
        c = attrs.get("beta", 1.0) * ctx.weight(c_name, "Gemm operand C")
        rows = ctx.onnx_shape(x)[0]
        if c.dim() == 2 and c.shape[0] != 1 and rows != 1:  # a bias per row as well as per column
            name = ctx.emit(ctx.fresh(f"{_out(node)}/product"), Linear(weight), x)
            ctx.affine(name, None, c, _out(node))
            return
        bias = c.broadcast_to(1, weight.shape[0]).reshape(-1).clone()
    ctx.emit(_out(node), Linear(weight, bias), x)


def _matmul(ctx: LoadContext, node: onnx.NodeProto, attrs: dict) -> None:
    left, right = node.input
    if not ctx.is_constant(left) and not ctx.is_constant(right):
        _matmul_of_two(ctx, node)
        return
    x = right if ctx.is_constant(left) else left
    shape = ctx.onnx_shape(x)
    weight = ctx.weight(left if ctx.is_constant(left) else right, "MatMul constant operand")
    while weight.dim() > 2 and weight.shape[0] == 1:  # leading broadcast dimensions of 1
        weight = weight[0]
    if weight.dim() > 2:
        raise UnsupportedModelError(f"MatMul with a constant of shape {list(weight.shape)} (a batch of matrices)")
    if ctx.is_constant(left):  # W @ x over the second-to-last dimension of x
        vector = weight.dim() == 1
        if len(shape) < 2:
            raise UnsupportedModelError(f"MatMul W @ x with x of shape {list(shape)}")
        if ctx.batched and len(shape) == 2:
            raise NeedsUnbatched  # x [1, k]: W's rows would run along the batch
        name = _out(node) if not vector else ctx.fresh(f"{_out(node)}/matrix")
        ctx.emit(name, LeftLinear((weight.view(1, -1) if vector else weight).contiguous()), x)
        if vector:  # a 1-D W drops x's second-to-last dimension
            out = ctx.onnx_shape(name)
            ctx.reshape(name, ctx.node_shape((*out[:-2], out[-1])), name=_out(node))
        return
    if weight.dim() == 1:  # x @ w drops x's last dimension
        name = ctx.emit(ctx.fresh(f"{_out(node)}/matrix"), Linear(weight.view(1, -1).contiguous()), x)
        ctx.reshape(name, ctx.node_shape(shape[:-1]), name=_out(node))
        return
    ctx.emit(_out(node), Linear(weight.T.contiguous()), x)


def _matmul_of_two(ctx: LoadContext, node: onnx.NodeProto) -> None:
    """``X @ Y`` of two computed tensors: every product ``X_ik·Y_kj`` (one bilinear Mul over ``[..., n, k, m]``),
    then the sum over ``k``."""
    left, right = node.input
    a, b = list(ctx.onnx_shape(left)), list(ctx.onnx_shape(right))
    if len(a) < 2 or len(b) < 2:
        raise UnsupportedModelError("MatMul of two computed tensors needs both of rank ≥ 2")
    rank = max(len(a), len(b))
    a, b = [1] * (rank - len(a)) + a, [1] * (rank - len(b)) + b
    xa = ctx.reshape(left, ctx.node_shape((*a, 1)))  # [..., n, k, 1]
    xb = ctx.reshape(right, ctx.node_shape((*b[:-2], 1, *b[-2:])))  # [..., 1, k, m]
    product = _product(ctx, xa, xb, ctx.fresh(f"{_out(node)}/products"))
    ctx.emit(
        _out(node),
        Reduce((len(ctx.variable(product).shape) - 2,), ctx.variable(product).shape, keepdims=False),
        product,
    )


def _product(ctx: LoadContext, a: str, b: str, name: str) -> str:
    """``a · b`` of two computed tensors (the square where they are one), broadcast as ONNX does."""
    if ctx.variable(a) is ctx.variable(b):
        return ctx.emit(name, Pow(2.0), a)
    a, b, shape = _common_rank(ctx, a, b)
    op = Mul((ctx.variable(a).shape, ctx.variable(b).shape), shape)
    return ctx.emit(name, op, a, b)


def _common_rank(ctx: LoadContext, a: str, b: str) -> tuple[str, str, tuple[int, ...]]:
    """``a`` and ``b`` reshaped to a common rank (leading 1s, as ONNX broadcasting aligns the trailing
    dimensions), and their broadcast node shape."""
    sa, sb = ctx.onnx_shape(a), ctx.onnx_shape(b)
    rank = max(len(sa), len(sb))
    sa, sb = (1,) * (rank - len(sa)) + sa, (1,) * (rank - len(sb)) + sb
    try:
        out = np.broadcast_shapes(sa, sb)
    except ValueError:
        raise OnnxLoadError(f"shapes {list(sa)} and {list(sb)} do not broadcast") from None
    return ctx.reshape(a, ctx.node_shape(sa)), ctx.reshape(b, ctx.node_shape(sb)), ctx.node_shape(out)


def _expanded(ctx: LoadContext, name: str, shape: tuple[int, ...]) -> str:
    """``name`` broadcast to node shape ``shape`` (of the same rank) by copying."""
    source = ctx.variable(name).shape
    if source == shape:
        return name
    index = torch.arange(math.prod(source)).reshape(source).expand(shape).reshape(-1)
    return ctx.emit(ctx.fresh(f"{name}/expand"), Select(index, source, shape, label="Expand"), name)


def _arithmetic(ctx: LoadContext, node: onnx.NodeProto, attrs: dict) -> None:
    op_type, (a, b) = node.op_type, node.input
    if not ctx.is_constant(a) and not ctx.is_constant(b):
        if op_type == "Mul":
            _product(ctx, a, b, _out(node))
        elif op_type == "Div":
            reciprocal = ctx.emit(ctx.fresh(f"{_out(node)}/reciprocal"), Reciprocal(), b)
            _product(ctx, a, reciprocal, _out(node))
        else:
            a, b, shape = _common_rank(ctx, a, b)
            ctx.emit(_out(node), Add(subtract=op_type == "Sub"), _expanded(ctx, a, shape), _expanded(ctx, b, shape))
        return
    constant_first = ctx.is_constant(a)
    x, c = (b, a) if constant_first else (a, b)
    value = ctx.weight(c, f"{op_type} operand")
    if op_type == "Div":
        if constant_first:  # c / x = c · (1/x)
            reciprocal = ctx.emit(ctx.fresh(f"{_out(node)}/reciprocal"), Reciprocal(), x)
            ctx.affine(reciprocal, value, None, _out(node))
            return
        if bool((value == 0).any()):
            raise OnnxLoadError("division by a constant that contains zeros")
    minus = torch.tensor(-1.0, dtype=torch.float64)
    scale, shift = {
        "Add": (None, value),
        "Sub": (minus, value) if constant_first else (None, -value),
        "Mul": (value, None),
        "Div": (1 / value, None),
    }[op_type]
    ctx.affine(x, scale, shift, _out(node))


def _neg(ctx: LoadContext, node: onnx.NodeProto, attrs: dict) -> None:
    ctx.affine(node.input[0], torch.tensor(-1.0, dtype=torch.float64), None, _out(node))


def _pow(ctx: LoadContext, node: onnx.NodeProto, attrs: dict) -> None:
    base, exponent = node.input
    if ctx.is_constant(base):  # c^x = exp(x · ln c)
        c = ctx.scalar(base, "Pow base")
        if c <= 0:
            raise UnsupportedModelError(f"Pow of the constant base {c} to a computed exponent")
        scaled = ctx.affine(
            exponent, torch.tensor(math.log(c), dtype=torch.float64), None, ctx.fresh(f"{_out(node)}/log")
        )
        ctx.emit(_out(node), Exp(), scaled)
        return
    if not ctx.is_constant(exponent):
        raise UnsupportedModelError("Pow with a computed exponent")
    values = np.unique(ctx.constant(exponent, "Pow exponent"))
    if values.size != 1:
        raise UnsupportedModelError("Pow with an exponent that differs per element")
    c = float(values[0])
    if c == 1:
        ctx.alias(_out(node), base)
    elif c == -1:
        ctx.emit(_out(node), Reciprocal(), base)
    elif c == 0:
        raise UnsupportedModelError("Pow with exponent 0 (a constant output)")
    else:
        ctx.emit(_out(node), Pow(c), base)


def _conv(ctx: LoadContext, node: onnx.NodeProto, attrs: dict) -> None:
    spatial = _spatial_rank(ctx, node)
    weight = ctx.weight(node.input[1], "Conv weight")
    if weight.dim() != spatial + 2:
        raise OnnxLoadError(f"Conv weight {list(weight.shape)} does not match a {spatial}-D input")
    if "kernel_shape" in attrs and list(attrs["kernel_shape"]) != list(weight.shape[2:]):
        raise OnnxLoadError(f"kernel_shape {attrs['kernel_shape']} does not match the weight {list(weight.shape)}")
    if spatial == 1:
        weight = weight.unsqueeze(2)
    bias_name = _input(node, 2)
    bias = ctx.weight(bias_name, "Conv bias") if bias_name else None
    stride, dilation = _two_d(attrs, "strides", 1, spatial), _two_d(attrs, "dilations", 1, spatial)
    pads = _pads(attrs, spatial)
    group = attrs.get("group", 1)
    _spatial(ctx, node, lambda shape: Conv2d(weight, bias, shape, stride, pads, dilation, group))


def _conv_transpose(ctx: LoadContext, node: onnx.NodeProto, attrs: dict) -> None:
    spatial = _spatial_rank(ctx, node)
    if "output_shape" in attrs:
        raise UnsupportedModelError("ConvTranspose with output_shape (give pads and output_padding instead)")
    weight = ctx.weight(node.input[1], "ConvTranspose weight")
    if weight.dim() != spatial + 2:
        raise OnnxLoadError(f"ConvTranspose weight {list(weight.shape)} does not match a {spatial}-D input")
    if spatial == 1:
        weight = weight.unsqueeze(2)
    bias_name = _input(node, 2)
    bias = ctx.weight(bias_name, "ConvTranspose bias") if bias_name else None
    stride, dilation = _two_d(attrs, "strides", 1, spatial), _two_d(attrs, "dilations", 1, spatial)
    output_padding = _two_d(attrs, "output_padding", 0, spatial)
    pads = _pads(attrs, spatial)
    group = attrs.get("group", 1)
    _spatial(ctx, node, lambda shape: ConvTranspose2d(weight, bias, stride, pads, output_padding, dilation, group))


def _batch_norm(ctx: LoadContext, node: onnx.NodeProto, attrs: dict) -> None:
    if attrs.get("training_mode", 0) or any(node.output[1:]):
        raise OnnxLoadError("BatchNormalization in training mode; export the model in eval mode")
    gamma, beta, mean, var = (
        ctx.weight(name, f"BatchNormalization {role}")
        for name, role in zip(node.input[1:], ("scale", "bias", "mean", "var"), strict=True)
    )
    epsilon = attrs.get("epsilon", 1e-5)
    _per_sample(ctx, node, lambda shape: BatchNorm(gamma, beta, mean, var, epsilon, shape))


def _average_pool(ctx: LoadContext, node: onnx.NodeProto, attrs: dict) -> None:
    spatial = _spatial_rank(ctx, node)
    if any(d != 1 for d in attrs.get("dilations", [1] * spatial)):
        raise OnnxLoadError("AveragePool with dilations is not supported")
    kernel = _two_d(attrs, "kernel_shape", 1, spatial)
    top, left, bottom, right = _pads(attrs, spatial)
    if (top, left) != (bottom, right):
        raise OnnxLoadError(f"AveragePool pads {[top, left, bottom, right]} are asymmetric")
    stride = _two_d(attrs, "strides", 1, spatial)
    include, ceil = bool(attrs.get("count_include_pad", 0)), bool(attrs.get("ceil_mode", 0))
    _spatial(ctx, node, lambda shape: AvgPool2d(shape, kernel, stride, (top, left), include, ceil))


def _global_average_pool(ctx: LoadContext, node: onnx.NodeProto, attrs: dict) -> None:
    _spatial(ctx, node, lambda shape: AvgPool2d(shape, shape[1:], shape[1:]))


def _axes(ctx: LoadContext, node: onnx.NodeProto, attrs: dict, rank: int, input_index: int = 1) -> list[int] | None:
    """A reduction's ONNX axes (an attribute, or an input from opset 13/18), normalised; ``None``: all."""
    name = _input(node, input_index)
    axes = ctx.ints(name, f"{node.op_type} axes") if name else attrs.get("axes")
    if axes is None or len(axes) == 0:
        return None
    return sorted(a % rank for a in axes)


def _reduced_axes(ctx: LoadContext, node: onnx.NodeProto, attrs: dict, rank: int) -> list[int]:
    """A reduction's ONNX axes: all where none are given — none (an identity) with ``noop_with_empty_axes``."""
    axes = _axes(ctx, node, attrs, rank)
    if axes is None:
        return [] if attrs.get("noop_with_empty_axes", 0) else list(range(rank))
    return axes


def _reduce(ctx: LoadContext, node: onnx.NodeProto, attrs: dict) -> None:
    shape = ctx.onnx_shape(node.input[0])
    axes = _reduced_axes(ctx, node, attrs, len(shape))
    keep = bool(attrs.get("keepdims", 1))
    if ctx.batched and 0 in axes:  # reducing over the batch of 1 changes nothing but its rank
        if not keep:
            raise NeedsUnbatched
        axes = [a for a in axes if a != 0]
    if not axes:
        ctx.alias(_out(node), node.input[0])
        return
    node_axes = [ctx.axis(a, len(shape)) for a in axes]
    op = Reduce(node_axes, ctx.variable(node.input[0]).shape, keepdims=keep, mean=node.op_type == "ReduceMean")
    ctx.emit(_out(node), op, node.input[0])


# --------------------------------------------------------------------------------------------------- non-linear


def _activation(op_class: type[BoundOp]) -> Converter:
    def convert(ctx: LoadContext, node: onnx.NodeProto, attrs: dict) -> None:
        ctx.emit(_out(node), op_class(), node.input[0])

    return convert


def _leaky_relu(ctx: LoadContext, node: onnx.NodeProto, attrs: dict) -> None:
    ctx.emit(_out(node), LeakyReLU(attrs.get("alpha", 0.01)), node.input[0])


def _abs(ctx: LoadContext, node: onnx.NodeProto, attrs: dict) -> None:
    ctx.emit(_out(node), LeakyReLU(-1.0), node.input[0])


def _clip(ctx: LoadContext, node: onnx.NodeProto, attrs: dict) -> None:
    if ctx.opset < 11:
        low, high = attrs.get("min", -math.inf), attrs.get("max", math.inf)
    else:
        low_name, high_name = _input(node, 1), _input(node, 2)
        low = ctx.scalar(low_name, "Clip min") if low_name else -math.inf
        high = ctx.scalar(high_name, "Clip max") if high_name else math.inf
    if math.isinf(low) and math.isinf(high):
        ctx.alias(_out(node), node.input[0])
        return
    ctx.emit(_out(node), Clip(low, high), node.input[0])


def _softmax(ctx: LoadContext, node: onnx.NodeProto, attrs: dict) -> None:
    shape = ctx.onnx_shape(node.input[0])
    axis = attrs.get("axis", -1 if ctx.opset >= 13 else 1) % len(shape)
    source = node.input[0]
    if ctx.opset < 13 and axis != len(shape) - 1:  # before opset 13: over all dimensions from axis on, flattened
        flat = (*shape[:axis], math.prod(shape[axis:]))
        source = ctx.reshape(source, ctx.node_shape(flat))
        shape, axis = flat, len(flat) - 1
    if ctx.batched and shape[0] == 1 and axis == 0:  # softmax over the batch of 1: every output is 1
        raise UnsupportedModelError("Softmax over the batch dimension (a constant 1)")
    node_axis = ctx.axis(axis, len(shape))
    name = _out(node) if source == node.input[0] else ctx.fresh(f"{_out(node)}/softmax")
    ctx.emit(name, Softmax(node_axis, ctx.variable(source).shape), source)
    if name != _out(node):
        ctx.reshape(name, ctx.variable(node.input[0]).shape, name=_out(node))


def _pool_windows(
    shape: tuple[int, int, int], kernel, stride, pads, dilation, ceil: bool
) -> tuple[torch.Tensor, tuple]:
    """Flat input indices of every 2-D pooling window ``[C·H'·W', kH·kW]`` (−1: padding) and the output shape, as
    torch (and onnxruntime) lay the windows out, ``ceil_mode`` included."""
    C, H, W = shape
    top, left, bottom, right = pads
    probe = torch.zeros(1, C, H + top + bottom, W + left + right)
    out = F.max_pool2d(probe, kernel, stride, 0, dilation, ceil_mode=ceil).shape[2:]
    # Room for the last windows of ceil_mode, which may run past the padded input (into more padding).
    extra_h = max(0, (out[0] - 1) * stride[0] + dilation[0] * (kernel[0] - 1) + 1 - probe.shape[2])
    extra_w = max(0, (out[1] - 1) * stride[1] + dilation[1] * (kernel[1] - 1) + 1 - probe.shape[3])
    positions = torch.arange(1, C * H * W + 1, dtype=torch.float64).view(1, C, H, W)
    padded = F.pad(positions, (left, right + extra_w, top, bottom + extra_h))
    windows = F.unfold(padded, kernel, dilation=dilation, stride=stride)  # [1, C·kH·kW, L]
    rows = windows.view(C, kernel[0] * kernel[1], -1)
    grid = (padded.shape[2] - dilation[0] * (kernel[0] - 1) - 1) // stride[0] + 1
    columns = (padded.shape[3] - dilation[1] * (kernel[1] - 1) - 1) // stride[1] + 1
    rows = rows.view(C, -1, grid, columns)[:, :, : out[0], : out[1]]
    index = rows.permute(0, 2, 3, 1).reshape(-1, kernel[0] * kernel[1]).long() - 1
    return index, (C, out[0], out[1])


def _max_pool(ctx: LoadContext, node: onnx.NodeProto, attrs: dict) -> None:
    spatial = _spatial_rank(ctx, node)
    if len(node.output) > 1 and node.output[1]:
        raise UnsupportedModelError("MaxPool with an Indices output")
    kernel, stride = _two_d(attrs, "kernel_shape", 1, spatial), _two_d(attrs, "strides", 1, spatial)
    dilation, pads = _two_d(attrs, "dilations", 1, spatial), _pads(attrs, spatial)
    ceil = bool(attrs.get("ceil_mode", 0))
    shape = ctx.onnx_shape(node.input[0])
    tiles = kernel == stride and pads == (0, 0, 0, 0) and dilation == (1, 1) and not ceil and kernel != (1, 1)
    if tiles and spatial == 2 and shape[0] == 1:
        _max_pool_as_relus(ctx, node, kernel)
        return

    def build(in_shape: tuple[int, int, int]) -> BoundOp:
        index, out = _pool_windows(in_shape, kernel, stride, pads, dilation, ceil)
        return WindowMax(index, in_shape, out)

    _spatial(ctx, node, build)


def _max_pool_as_relus(ctx: LoadContext, node: onnx.NodeProto, kernel: tuple[int, int]) -> None:
    """A 2-D max pool over non-overlapping windows as pairwise maxima ``max(a, b) = ReLU(a − b) + b``: one strided
    selection per window offset, then a balanced tree of them. Exact, and every comparison becomes a ReLU with its
    own intermediate bounds, α and splits (α,β-CROWN's ``maxpool_to_relu``)."""
    source = node.input[0]
    node_shape = ctx.variable(source).shape
    C, H, W = ctx.onnx_shape(source)[1:]
    out_h, out_w = H // kernel[0], W // kernel[1]
    positions = torch.arange(math.prod(node_shape)).view(C, H, W)
    base = _out(node)
    level = []
    for i in range(kernel[0]):
        for j in range(kernel[1]):
            index = positions[:, i : out_h * kernel[0] : kernel[0], j : out_w * kernel[1] : kernel[1]]
            out_shape = ctx.node_shape((1, C, out_h, out_w))
            op = Select(index.reshape(-1), node_shape, out_shape, label="MaxPoolWindow")
            level.append(ctx.emit(ctx.fresh(f"{base}/window{i}_{j}"), op, source))
    while len(level) > 1:
        paired = []
        for a, b in zip(level[::2], level[1::2], strict=False):
            last = len(level) == 2
            difference = ctx.emit(ctx.fresh(f"{base}/gap"), Add(subtract=True), a, b)
            above = ctx.emit(ctx.fresh(f"{base}/excess"), ReLU(), difference)
            paired.append(ctx.emit(base if last else ctx.fresh(f"{base}/max"), Add(), above, b))
        if len(level) % 2:
            paired.append(level[-1])
        level = paired


def _reduce_max(ctx: LoadContext, node: onnx.NodeProto, attrs: dict) -> None:
    shape = ctx.onnx_shape(node.input[0])
    axes = _reduced_axes(ctx, node, attrs, len(shape))
    keep = bool(attrs.get("keepdims", 1))
    if ctx.batched:
        if 0 in axes and not keep:
            raise NeedsUnbatched
        axes = [a for a in axes if a != 0]  # the maximum over the batch of 1 is the element itself
    source = node.input[0]
    if not axes:
        ctx.alias(_out(node), source)
        return
    if node.op_type == "ReduceMin":  # min(x) = −max(−x)
        source = ctx.affine(source, torch.tensor(-1.0, dtype=torch.float64), None, ctx.fresh(f"{_out(node)}/negated"))
    node_axes = [ctx.axis(a, len(shape)) for a in axes]
    in_shape = ctx.variable(source).shape
    kept = [d for d in range(len(in_shape)) if d not in node_axes]
    positions = torch.arange(math.prod(in_shape)).view(in_shape).permute(*kept, *node_axes)
    windows = positions.reshape(math.prod(in_shape[d] for d in kept), -1)
    out_shape = (
        tuple(1 if d in node_axes else n for d, n in enumerate(in_shape)) if keep else tuple(in_shape[d] for d in kept)
    )
    name = _out(node) if node.op_type == "ReduceMax" else ctx.fresh(f"{_out(node)}/max")
    ctx.emit(name, WindowMax(windows, in_shape, out_shape), source)
    if node.op_type == "ReduceMin":
        ctx.affine(name, torch.tensor(-1.0, dtype=torch.float64), None, _out(node))


# --------------------------------------------------------------------------------------------------- movement


def _identity(ctx: LoadContext, node: onnx.NodeProto, attrs: dict) -> None:
    ctx.alias(_out(node), node.input[0])


def _cast(ctx: LoadContext, node: onnx.NodeProto, attrs: dict) -> None:
    target = FLOAT_TYPES.get(attrs.get("to"))
    if target is None:
        name = onnx.TensorProto.DataType.Name(attrs["to"]) if "to" in attrs else "?"
        raise UnsupportedModelError(
            f"Cast to {name} at node {node.name or _out(node)!r} of a tensor computed from the input is discrete "
            "(a rounding to integers): no linear bound holds across its jumps"
        )
    if target.itemsize < ctx.tensor_type(node.input[0]).itemsize:
        ctx.emit(_out(node), RoundToFloat(target), node.input[0])  # narrowing: the model rounds every value
    else:
        ctx.alias(_out(node), node.input[0])


def _shape(ctx: LoadContext, node: onnx.NodeProto, attrs: dict) -> None:
    # Shapes are static (the batch is 1 in ONNX terms), so Shape of a computed tensor is a constant.
    full = np.array(ctx.onnx_shape(node.input[0]), dtype=np.int64)
    ctx.constants[_out(node)] = full[attrs.get("start", 0) : attrs.get("end", len(full))]


def _reshape_to(ctx: LoadContext, node: onnx.NodeProto, onnx_out: tuple[int, ...]) -> None:
    ctx.reshape(node.input[0], ctx.node_shape(onnx_out), name=_out(node))


def _flatten(ctx: LoadContext, node: onnx.NodeProto, attrs: dict) -> None:
    shape = ctx.onnx_shape(node.input[0])
    axis = attrs.get("axis", 1) % (len(shape) + 1)
    _reshape_to(ctx, node, (math.prod(shape[:axis]), math.prod(shape[axis:])))


def _reshape(ctx: LoadContext, node: onnx.NodeProto, attrs: dict) -> None:
    shape = ctx.onnx_shape(node.input[0])
    target = ctx.ints(node.input[1], "Reshape shape")
    if attrs.get("allowzero", 0) and 0 in target:
        raise OnnxLoadError("Reshape with allowzero=1 and a zero dimension")
    target = [shape[i] if d == 0 else d for i, d in enumerate(target)]
    try:
        out = np.empty(shape, dtype=np.uint8).reshape(target).shape
    except ValueError:
        raise OnnxLoadError(f"cannot reshape {list(shape)} to {target}") from None
    _reshape_to(ctx, node, out)


def _squeeze(ctx: LoadContext, node: onnx.NodeProto, attrs: dict) -> None:
    shape = ctx.onnx_shape(node.input[0])
    axes = _axes(ctx, node, attrs, len(shape))
    axes = [i for i, d in enumerate(shape) if d == 1] if axes is None else axes
    _reshape_to(ctx, node, tuple(d for i, d in enumerate(shape) if i not in axes))


def _unsqueeze(ctx: LoadContext, node: onnx.NodeProto, attrs: dict) -> None:
    shape = list(ctx.onnx_shape(node.input[0]))
    name = _input(node, 1)
    axes = ctx.ints(name, "Unsqueeze axes") if name else list(attrs["axes"])
    rank = len(shape) + len(axes)
    for axis in sorted(a % rank for a in axes):
        shape.insert(axis, 1)
    _reshape_to(ctx, node, tuple(shape))


def _transpose(ctx: LoadContext, node: onnx.NodeProto, attrs: dict) -> None:
    shape = ctx.onnx_shape(node.input[0])
    perm = list(attrs.get("perm", reversed(range(len(shape)))))
    if ctx.batched:
        if perm[0] != 0:
            _traced(ctx, node, attrs)  # the batch moves: fine if it is still a leading 1, else unbatched
            return
        perm = [p - 1 for p in perm[1:]]
    if perm == sorted(perm):
        ctx.alias(_out(node), node.input[0])
        return
    ctx.emit(_out(node), Transpose(perm, ctx.variable(node.input[0]).shape), node.input[0])


def _traced(ctx: LoadContext, node: onnx.NodeProto, attrs: dict) -> None:
    """A pure data movement as :class:`Select` nodes: onnxruntime (:func:`run_node`, in the model's opset) runs the
    node on the positions ``1..n`` of its input (0 where the input has none, e.g. padding), so each output element
    names the input element it copies. Every output becomes one node (Split has several)."""
    source = node.input[0]
    shape = ctx.onnx_shape(source)
    size = math.prod(shape)
    if node.op_type == "Resize" or node.op_type == "Upsample":
        mode = attrs.get("mode", b"nearest")
        if mode != b"nearest":
            raise UnsupportedModelError(f"{node.op_type} with mode={mode.decode()} (only nearest moves data)")
    dtype = np.float32 if size < 2**24 else np.float64
    positions = np.arange(1, size + 1, dtype=dtype).reshape(shape)
    feeds = {source: positions}
    for name in node.input[1:]:
        if name:
            value = ctx.constants[name]
            feeds[name] = value.astype(dtype) if node.op_type == "Pad" and value.dtype.kind == "f" else value
    pad_value = 0.0
    if node.op_type == "Pad" and attrs.get("mode", b"constant") == b"constant":
        # Trace with padding 0 (no position); the padded elements are then the constant.
        value_name = _input(node, 2)
        if value_name:
            pad_value = ctx.scalar(value_name, "Pad value")
            feeds[value_name] = np.zeros((), dtype=dtype)
        elif "value" in attrs:  # opset < 11
            pad_value = float(attrs["value"])
            node = _without_attribute(node, "value")
    try:
        results = run_node(node, feeds, ctx.opset)
    except Exception as err:  # onnxruntime and the reference evaluator raise many types
        raise OnnxLoadError(f"cannot trace {node.op_type}: {err}") from err
    for name, moved in zip(node.output, results, strict=False):
        if not name:
            continue
        moved = np.asarray(moved)
        index = np.rint(moved).astype(np.int64) - 1
        if not np.array_equal(moved, index + 1) or index.min(initial=0) < -1 or index.max(initial=-1) >= size:
            raise UnsupportedModelError(f"{node.op_type} at {name!r} does not only move values")
        out_shape = ctx.node_shape(moved.shape)
        flat = torch.from_numpy(index.reshape(-1))
        if out_shape == ctx.variable(source).shape and torch.equal(flat, torch.arange(size)):
            ctx.alias(name, source)
            continue
        fill = torch.full((flat.numel(),), pad_value, dtype=torch.float64) if bool((flat < 0).any()) else None
        op = Select(flat, ctx.variable(source).shape, out_shape, fill=fill, label=node.op_type)
        ctx.emit(name, op, source)


def _without_attribute(node: onnx.NodeProto, name: str) -> onnx.NodeProto:
    copy = onnx.NodeProto()
    copy.CopyFrom(node)
    kept = [attr for attr in copy.attribute if attr.name != name]
    del copy.attribute[:]
    copy.attribute.extend(kept)
    return copy


def _where(ctx: LoadContext, node: onnx.NodeProto, attrs: dict) -> None:
    """``where(c, x, y)`` with a constant condition: ``c·x + (1 − c)·y``, linear in whichever of x, y is computed."""
    condition, x, y = node.input
    if not ctx.is_constant(condition):
        raise UnsupportedModelError(
            f"Where at node {_out(node)!r} selects by a condition computed from the input: no linear bound holds "
            "across the switch"
        )
    mask = torch.from_numpy(np.asarray(ctx.constants[condition], dtype=np.float64))
    terms = []
    for name, weight in ((x, mask), (y, 1 - mask)):
        if ctx.is_constant(name):
            terms.append(("constant", weight * ctx.weight(name, "Where value")))
        else:
            terms.append(("computed", ctx.affine(name, weight, None, ctx.fresh(f"{_out(node)}/part"))))
    computed = [value for kind, value in terms if kind == "computed"]
    constants = [value for kind, value in terms if kind == "constant"]
    if len(computed) == 1:
        ctx.affine(computed[0], None, constants[0], _out(node))
        return
    a, b, shape = _common_rank(ctx, *computed)
    ctx.emit(_out(node), Add(), _expanded(ctx, a, shape), _expanded(ctx, b, shape))


def _max_min(ctx: LoadContext, node: onnx.NodeProto, attrs: dict) -> None:
    """Element-wise Max/Min of several tensors, pairwise: ``max(a, b) = ReLU(a − b) + b``, ``min(a, b) =
    b − ReLU(b − a)`` (with a constant ``b``: ``ReLU(a − b) + b`` is an affine map of a ReLU)."""
    names = [name for name in node.input if name]
    computed = [name for name in names if not ctx.is_constant(name)]
    constants = [ctx.weight(name, f"{node.op_type} operand") for name in names if ctx.is_constant(name)]
    bound = None
    if constants:
        bound = constants[0]
        for c in constants[1:]:
            bound = torch.maximum(bound, c) if node.op_type == "Max" else torch.minimum(bound, c)
    sign = 1.0 if node.op_type == "Max" else -1.0
    result = computed[0]
    steps = [*computed[1:], *(["constant"] if bound is not None else [])]
    for position, other in enumerate(steps):
        name = _out(node) if position == len(steps) - 1 else ctx.fresh(f"{_out(node)}/step")
        if other == "constant":  # ±ReLU(±(x − c)) + c
            shifted = ctx.affine(
                result, torch.tensor(sign, dtype=torch.float64), -sign * bound, ctx.fresh(f"{name}/gap")
            )
            excess = ctx.emit(ctx.fresh(f"{name}/excess"), ReLU(), shifted)
            result = ctx.affine(excess, torch.tensor(sign, dtype=torch.float64), bound, name)
            continue
        a, b, shape = _common_rank(ctx, result, other)
        a, b = _expanded(ctx, a, shape), _expanded(ctx, b, shape)
        first, second = (a, b) if sign > 0 else (b, a)
        gap = ctx.emit(ctx.fresh(f"{name}/gap"), Add(subtract=True), first, second)
        excess = ctx.emit(ctx.fresh(f"{name}/excess"), ReLU(), gap)
        result = ctx.emit(name, Add(subtract=sign < 0), b, excess) if sign < 0 else ctx.emit(name, Add(), excess, b)
    if result != _out(node):
        ctx.alias(_out(node), result)


def _concat(ctx: LoadContext, node: onnx.NodeProto, attrs: dict) -> None:
    computed = _computed(ctx, node)
    rank = len(ctx.onnx_shape(computed[0]))
    axis = attrs["axis"] % rank
    if ctx.batched and axis == 0:
        raise NeedsUnbatched
    node_axis = ctx.axis(axis, rank)
    parts, sizes, inputs = [], [], []
    for name in node.input:
        if ctx.is_constant(name):
            value = ctx.weight(name, "Concat constant")
            part = ctx.broadcast_constant(value, rank)
            parts.append(part)
            sizes.append(part.shape[node_axis])
        else:
            parts.append(None)
            sizes.append(ctx.variable(name).shape[node_axis])
            inputs.append(name)
    if len(parts) == 1:
        ctx.alias(_out(node), inputs[0])
        return
    ctx.emit(_out(node), Concat(node_axis, parts, sizes), *inputs)


CONVERTERS: dict[str, Converter] = {
    "Gemm": _gemm,
    "MatMul": _matmul,
    "Add": _arithmetic,
    "Sub": _arithmetic,
    "Mul": _arithmetic,
    "Div": _arithmetic,
    "Neg": _neg,
    "Pow": _pow,
    "Conv": _conv,
    "ConvTranspose": _conv_transpose,
    "BatchNormalization": _batch_norm,
    "AveragePool": _average_pool,
    "GlobalAveragePool": _global_average_pool,
    "ReduceSum": _reduce,
    "ReduceMean": _reduce,
    "Relu": _activation(ReLU),
    "LeakyRelu": _leaky_relu,
    "Abs": _abs,
    "Clip": _clip,
    "Sign": _activation(Sign),
    "Floor": _activation(Floor),
    "Ceil": _activation(Ceil),
    "Round": _activation(Round),
    "Sigmoid": _activation(Sigmoid),
    "Tanh": _activation(Tanh),
    "Exp": _activation(Exp),
    "Log": _activation(Log),
    "Sqrt": _activation(Sqrt),
    "Reciprocal": _activation(Reciprocal),
    "Sin": _activation(Sin),
    "Cos": _activation(Cos),
    "Softmax": _softmax,
    "MaxPool": _max_pool,
    "ReduceMax": _reduce_max,
    "ReduceMin": _reduce_max,
    "Identity": _identity,
    "Dropout": _identity,
    "Cast": _cast,
    "Shape": _shape,
    "Flatten": _flatten,
    "Reshape": _reshape,
    "Squeeze": _squeeze,
    "Unsqueeze": _unsqueeze,
    "Transpose": _transpose,
    "Concat": _concat,
    "Where": _where,
    "Max": _max_min,
    "Min": _max_min,
    **DISCRETE_CONVERTERS,
    **{
        op: _traced
        for op in (
            "Slice",
            "Gather",
            "GatherElements",
            "Split",
            "Expand",
            "Tile",
            "Pad",
            "Resize",
            "Upsample",
            "DepthToSpace",
            "SpaceToDepth",
        )
    },
}
