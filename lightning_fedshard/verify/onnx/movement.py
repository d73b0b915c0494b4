"""Exact data movement: Identity, Dropout, Cast (to a wider float type an alias, to a narrower one a rounding), Shape,
Flatten, Reshape, Squeeze, Unsqueeze, Transpose, Concat, and the operators traced with :func:`run_node` (Slice,
Gather, Split, Expand, Tile, Pad, nearest Resize/Upsample, DepthToSpace, SpaceToDepth, GatherElements)."""

from __future__ import annotations

import math

import numpy as np
import onnx
import torch

from lightning_fedshard.verify.onnx.common import Converter, input_name, onnx_axes, output_name
from lightning_fedshard.verify.onnx.context import (
    FLOAT_TYPES,
    LoadContext,
    NeedsUnbatched,
    OnnxLoadError,
    UnsupportedModelError,
)
from lightning_fedshard.verify.onnx.evaluate import run_node
from lightning_fedshard.verify.ops import Concat, RoundToFloat, Select, Transpose

__all__ = ["MOVEMENT_CONVERTERS"]


def _identity(ctx: LoadContext, node: onnx.NodeProto, attrs: dict) -> None:
    ctx.alias(output_name(node), node.input[0])


def _cast(ctx: LoadContext, node: onnx.NodeProto, attrs: dict) -> None:
    target = FLOAT_TYPES.get(attrs.get("to"))
    if target is None:
        name = onnx.TensorProto.DataType.Name(attrs["to"]) if "to" in attrs else "?"
        raise UnsupportedModelError(
            f"Cast to {name} at node {node.name or output_name(node)!r} of a tensor computed from the input is discrete "
            "(a rounding to integers): no linear bound holds across its jumps"
        )
    if target.itemsize < ctx.tensor_type(node.input[0]).itemsize:
        ctx.emit(output_name(node), RoundToFloat(target), node.input[0])  # narrowing: the model rounds every value
    else:
        ctx.alias(output_name(node), node.input[0])


def _shape(ctx: LoadContext, node: onnx.NodeProto, attrs: dict) -> None:
    # Shapes are static (the batch is 1 in ONNX terms), so Shape of a computed tensor is a constant.
    full = np.array(ctx.onnx_shape(node.input[0]), dtype=np.int64)
    ctx.constants[output_name(node)] = full[attrs.get("start", 0) : attrs.get("end", len(full))]


def _reshape_to(ctx: LoadContext, node: onnx.NodeProto, onnx_out: tuple[int, ...]) -> None:
    ctx.reshape(node.input[0], ctx.node_shape(onnx_out), name=output_name(node))


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
    axes = onnx_axes(ctx, node, attrs, len(shape))
    axes = [i for i, d in enumerate(shape) if d == 1] if axes is None else axes
    _reshape_to(ctx, node, tuple(d for i, d in enumerate(shape) if i not in axes))


def _unsqueeze(ctx: LoadContext, node: onnx.NodeProto, attrs: dict) -> None:
    shape = list(ctx.onnx_shape(node.input[0]))
    name = input_name(node, 1)
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
        ctx.alias(output_name(node), node.input[0])
        return
    ctx.emit(output_name(node), Transpose(perm, ctx.variable(node.input[0]).shape), node.input[0])


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
        value_name = input_name(node, 2)
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


def _computed(ctx: LoadContext, node: onnx.NodeProto) -> list[str]:
    return [name for name in node.input if name and not ctx.is_constant(name)]


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
        ctx.alias(output_name(node), inputs[0])
        return
    ctx.emit(output_name(node), Concat(node_axis, parts, sizes), *inputs)


MOVEMENT_CONVERTERS: dict[str, Converter] = {
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
