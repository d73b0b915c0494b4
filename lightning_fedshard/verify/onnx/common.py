"""What the converters of several operator families share: a node's outputs and optional inputs, ops built per
sample (a 1-D spatial input widened to 2-D), ONNX attributes (pads, pairs, axes), and two computed tensors
broadcast against each other (their product too)."""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import onnx
import torch

from lightning_fedshard.verify.onnx.context import LoadContext, OnnxLoadError, UnsupportedModelError
from lightning_fedshard.verify.ops import BoundOp, Mul, Pow, Select

__all__ = [
    "Converter",
    "common_rank",
    "emit_per_sample",
    "emit_product",
    "emit_spatial",
    "expanded",
    "input_name",
    "onnx_axes",
    "onnx_pads",
    "output_name",
    "spatial_rank",
    "two_d",
]

#: Writes one ONNX node (with its attributes by name) into the graph as the node or the few nodes it becomes.
Converter = Callable[[LoadContext, onnx.NodeProto, dict], None]


def output_name(node: onnx.NodeProto) -> str:
    """The node's (first) output tensor: the name of the graph node its converter writes."""
    return node.output[0]


def input_name(node: onnx.NodeProto, index: int) -> str | None:
    """The node's optional input ``index``; ``None`` where it is left out (absent or named ``""``)."""
    return node.input[index] if len(node.input) > index and node.input[index] else None


def emit_per_sample(ctx: LoadContext, node: onnx.NodeProto, build: Callable[[tuple[int, ...]], BoundOp]) -> None:
    """An op on ONNX ``[N, C, ...]`` tensors built for node shape ``(C, ...)``: without a batch dimension the one
    sample's axis is reshaped away and back. ``N > 1`` samples are not supported."""
    source = node.input[0]
    shape = ctx.onnx_shape(source)
    if shape[0] != 1:
        raise UnsupportedModelError(f"{node.op_type} over {shape[0]} samples at once (the batch must be 1)")
    if ctx.batched:
        ctx.emit(output_name(node), build(shape[1:]), source)
        return
    inner = ctx.reshape(source, shape[1:])
    result = ctx.emit(ctx.fresh(f"{output_name(node)}/sample"), build(shape[1:]), inner)
    ctx.reshape(result, (1, *ctx.variable(result).shape), name=output_name(node))


def emit_spatial(ctx: LoadContext, node: onnx.NodeProto, build: Callable[[tuple[int, int, int]], BoundOp]) -> None:
    """:func:`emit_per_sample` for a 2-D op on ``(C, H, W)``; a 1-D input ``(C, L)`` becomes ``(C, 1, L)`` and back."""

    def per_sample(shape: tuple[int, ...]) -> BoundOp:
        if len(shape) == 3:
            return build(shape)
        raise UnsupportedModelError(f"{node.op_type} on an input of {len(shape) - 1} spatial dimensions")

    shape = ctx.onnx_shape(node.input[0])
    if len(shape) != 3:
        emit_per_sample(ctx, node, per_sample)
        return
    # 1-D: (N, C, L) -> (N, C, 1, L), the 2-D op, and back.
    wide = ctx.reshape(node.input[0], ctx.node_shape((shape[0], shape[1], 1, shape[2])))
    renamed = onnx.NodeProto()
    renamed.CopyFrom(node)
    renamed.input[0] = wide
    renamed.output[0] = ctx.fresh(f"{output_name(node)}/2d")
    emit_per_sample(ctx, renamed, per_sample)
    result = renamed.output[0]
    out = ctx.onnx_shape(result)
    ctx.reshape(result, ctx.node_shape((out[0], out[1], out[3])), name=output_name(node))


def two_d(attrs: dict, name: str, default: int, spatial: int) -> tuple[int, int]:
    value = list(attrs.get(name, [default] * spatial))
    return (default, value[0]) if spatial == 1 else (value[0], value[1])


def onnx_pads(attrs: dict, spatial: int) -> tuple[int, int, int, int]:
    """ONNX pads as ``(top, left, bottom, right)`` (a 1-D op's as the width's)."""
    if attrs.get("auto_pad", b"NOTSET") not in (b"NOTSET", b"VALID"):
        raise OnnxLoadError(f"auto_pad={attrs['auto_pad'].decode()} is not supported; use explicit pads")
    pads = list(attrs.get("pads", [0] * (2 * spatial)))
    if spatial == 1:
        return (0, pads[0], 0, pads[1])
    return (pads[0], pads[1], pads[2], pads[3])


def spatial_rank(ctx: LoadContext, node: onnx.NodeProto) -> int:
    return len(ctx.onnx_shape(node.input[0])) - 2


def common_rank(ctx: LoadContext, a: str, b: str) -> tuple[str, str, tuple[int, ...]]:
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


def expanded(ctx: LoadContext, name: str, shape: tuple[int, ...]) -> str:
    """``name`` broadcast to node shape ``shape`` (of the same rank) by copying."""
    source = ctx.variable(name).shape
    if source == shape:
        return name
    index = torch.arange(math.prod(source)).reshape(source).expand(shape).reshape(-1)
    return ctx.emit(ctx.fresh(f"{name}/expand"), Select(index, source, shape, label="Expand"), name)


def emit_product(ctx: LoadContext, a: str, b: str, name: str) -> str:
    """``a · b`` of two computed tensors (the square where they are one), broadcast as ONNX does."""
    if ctx.variable(a) is ctx.variable(b):
        return ctx.emit(name, Pow(2.0), a)
    a, b, shape = common_rank(ctx, a, b)
    op = Mul((ctx.variable(a).shape, ctx.variable(b).shape), shape)
    return ctx.emit(name, op, a, b)


def onnx_axes(ctx: LoadContext, node: onnx.NodeProto, attrs: dict, rank: int, input_index: int = 1) -> list[int] | None:
    """A reduction's ONNX axes (an attribute, or an input from opset 13/18), normalised; ``None``: all."""
    name = input_name(node, input_index)
    axes = ctx.ints(name, f"{node.op_type} axes") if name else attrs.get("axes")
    if axes is None or len(axes) == 0:
        return None
    return sorted(a % rank for a in axes)
