"""Operators over axes and windows: AveragePool, GlobalAveragePool, ReduceSum/ReduceMean, ReduceMax/ReduceMin, MaxPool
(windows of maxima, or pairwise ReLUs over non-overlapping 2-D windows) and Softmax."""

from __future__ import annotations

import math

import onnx
import torch
import torch.nn.functional as F

from lightning_fedshard.verify.onnx.common import (
    Converter,
    emit_spatial,
    onnx_axes,
    onnx_pads,
    output_name,
    spatial_rank,
    two_d,
)
from lightning_fedshard.verify.onnx.context import LoadContext, NeedsUnbatched, OnnxLoadError, UnsupportedModelError
from lightning_fedshard.verify.ops import Add, AvgPool2d, BoundOp, Reduce, ReLU, Select, Softmax, WindowMax

__all__ = ["REDUCTION_CONVERTERS"]


def _average_pool(ctx: LoadContext, node: onnx.NodeProto, attrs: dict) -> None:
    spatial = spatial_rank(ctx, node)
    if any(d != 1 for d in attrs.get("dilations", [1] * spatial)):
        raise OnnxLoadError("AveragePool with dilations is not supported")
    kernel = two_d(attrs, "kernel_shape", 1, spatial)
    top, left, bottom, right = onnx_pads(attrs, spatial)
    if (top, left) != (bottom, right):
        raise OnnxLoadError(f"AveragePool pads {[top, left, bottom, right]} are asymmetric")
    stride = two_d(attrs, "strides", 1, spatial)
    include, ceil = bool(attrs.get("count_include_pad", 0)), bool(attrs.get("ceil_mode", 0))
    emit_spatial(ctx, node, lambda shape: AvgPool2d(shape, kernel, stride, (top, left), include, ceil))


def _global_average_pool(ctx: LoadContext, node: onnx.NodeProto, attrs: dict) -> None:
    emit_spatial(ctx, node, lambda shape: AvgPool2d(shape, shape[1:], shape[1:]))


def _reduced_axes(ctx: LoadContext, node: onnx.NodeProto, attrs: dict, rank: int) -> list[int]:
    """A reduction's ONNX axes: all where none are given — none (an identity) with ``noop_with_empty_axes``."""
    axes = onnx_axes(ctx, node, attrs, rank)
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
        ctx.alias(output_name(node), node.input[0])
        return
    node_axes = [ctx.axis(a, len(shape)) for a in axes]
    op = Reduce(node_axes, ctx.variable(node.input[0]).shape, keepdims=keep, mean=node.op_type == "ReduceMean")
    ctx.emit(output_name(node), op, node.input[0])


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
    name = output_name(node) if source == node.input[0] else ctx.fresh(f"{output_name(node)}/softmax")
    ctx.emit(name, Softmax(node_axis, ctx.variable(source).shape), source)
    if name != output_name(node):
        ctx.reshape(name, ctx.variable(node.input[0]).shape, name=output_name(node))


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
    spatial = spatial_rank(ctx, node)
    if len(node.output) > 1 and node.output[1]:
        raise UnsupportedModelError("MaxPool with an Indices output")
    kernel, stride = two_d(attrs, "kernel_shape", 1, spatial), two_d(attrs, "strides", 1, spatial)
    dilation, pads = two_d(attrs, "dilations", 1, spatial), onnx_pads(attrs, spatial)
    ceil = bool(attrs.get("ceil_mode", 0))
    shape = ctx.onnx_shape(node.input[0])
    tiles = kernel == stride and pads == (0, 0, 0, 0) and dilation == (1, 1) and not ceil and kernel != (1, 1)
    if tiles and spatial == 2 and shape[0] == 1:
        _max_pool_as_relus(ctx, node, kernel)
        return

    def build(in_shape: tuple[int, int, int]) -> BoundOp:
        index, out = _pool_windows(in_shape, kernel, stride, pads, dilation, ceil)
        return WindowMax(index, in_shape, out)

    emit_spatial(ctx, node, build)


def _max_pool_as_relus(ctx: LoadContext, node: onnx.NodeProto, kernel: tuple[int, int]) -> None:
    """A 2-D max pool over non-overlapping windows as pairwise maxima ``max(a, b) = ReLU(a − b) + b``: one strided
    selection per window offset, then a balanced tree of them. Exact, and every comparison becomes a ReLU with its
    own intermediate bounds, α and splits (α,β-CROWN's ``maxpool_to_relu``)."""
    source = node.input[0]
    node_shape = ctx.variable(source).shape
    C, H, W = ctx.onnx_shape(source)[1:]
    out_h, out_w = H // kernel[0], W // kernel[1]
    positions = torch.arange(math.prod(node_shape)).view(C, H, W)
    base = output_name(node)
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
        ctx.alias(output_name(node), source)
        return
    if node.op_type == "ReduceMin":  # min(x) = −max(−x)
        source = ctx.affine(
            source, torch.tensor(-1.0, dtype=torch.float64), None, ctx.fresh(f"{output_name(node)}/negated")
        )
    node_axes = [ctx.axis(a, len(shape)) for a in axes]
    in_shape = ctx.variable(source).shape
    kept = [d for d in range(len(in_shape)) if d not in node_axes]
    positions = torch.arange(math.prod(in_shape)).view(in_shape).permute(*kept, *node_axes)
    windows = positions.reshape(math.prod(in_shape[d] for d in kept), -1)
    out_shape = (
        tuple(1 if d in node_axes else n for d, n in enumerate(in_shape)) if keep else tuple(in_shape[d] for d in kept)
    )
    name = output_name(node) if node.op_type == "ReduceMax" else ctx.fresh(f"{output_name(node)}/max")
    ctx.emit(name, WindowMax(windows, in_shape, out_shape), source)
    if node.op_type == "ReduceMin":
        ctx.affine(name, torch.tensor(-1.0, dtype=torch.float64), None, output_name(node))


REDUCTION_CONVERTERS: dict[str, Converter] = {
    "AveragePool": _average_pool,
    "GlobalAveragePool": _global_average_pool,
    "ReduceSum": _reduce,
    "ReduceMean": _reduce,
    "Softmax": _softmax,
    "MaxPool": _max_pool,
    "ReduceMax": _reduce_max,
    "ReduceMin": _reduce_max,
}
