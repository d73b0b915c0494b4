"""Element-wise operators: Add/Sub/Mul/Div (with a constant: an affine map; of two computed tensors: broadcast sums,
products, ``x / y = x · (1/y)``), Neg, Pow, the activations (Relu, LeakyRelu, Abs, Clip, Sign, Floor, Ceil, Round,
Sigmoid, Tanh, Exp, Log, Sqrt, Reciprocal, Sin, Cos), Where with a constant condition, Max/Min as ReLUs."""

from __future__ import annotations

import math

import numpy as np
import onnx
import torch

from lightning_fedshard.verify.onnx.common import (
    Converter,
    common_rank,
    emit_product,
    expanded,
    input_name,
    output_name,
)
from lightning_fedshard.verify.onnx.context import LoadContext, OnnxLoadError, UnsupportedModelError
from lightning_fedshard.verify.ops import (
    Add,
    BoundOp,
    Ceil,
    Clip,
    Cos,
    Exp,
    Floor,
    LeakyReLU,
    Log,
    Pow,
    Reciprocal,
    ReLU,
    Round,
    Sigmoid,
    Sign,
    Sin,
    Sqrt,
    Tanh,
)

__all__ = ["ELEMENTWISE_CONVERTERS"]


def _arithmetic(ctx: LoadContext, node: onnx.NodeProto, attrs: dict) -> None:
    op_type, (a, b) = node.op_type, node.input
    if not ctx.is_constant(a) and not ctx.is_constant(b):
        if op_type == "Mul":
            emit_product(ctx, a, b, output_name(node))
        elif op_type == "Div":
            reciprocal = ctx.emit(ctx.fresh(f"{output_name(node)}/reciprocal"), Reciprocal(), b)
            emit_product(ctx, a, reciprocal, output_name(node))
        else:
            a, b, shape = common_rank(ctx, a, b)
            ctx.emit(
                output_name(node), Add(subtract=op_type == "Sub"), expanded(ctx, a, shape), expanded(ctx, b, shape)
            )
        return
    constant_first = ctx.is_constant(a)
    x, c = (b, a) if constant_first else (a, b)
    value = ctx.weight(c, f"{op_type} operand")
    if op_type == "Div":
        if constant_first:  # c / x = c · (1/x)
            reciprocal = ctx.emit(ctx.fresh(f"{output_name(node)}/reciprocal"), Reciprocal(), x)
            ctx.affine(reciprocal, value, None, output_name(node))
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
    ctx.affine(x, scale, shift, output_name(node))


def _neg(ctx: LoadContext, node: onnx.NodeProto, attrs: dict) -> None:
    ctx.affine(node.input[0], torch.tensor(-1.0, dtype=torch.float64), None, output_name(node))


def _pow(ctx: LoadContext, node: onnx.NodeProto, attrs: dict) -> None:
    base, exponent = node.input
    if ctx.is_constant(base):  # c^x = exp(x · ln c)
        c = ctx.scalar(base, "Pow base")
        if c <= 0:
            raise UnsupportedModelError(f"Pow of the constant base {c} to a computed exponent")
        scaled = ctx.affine(
            exponent, torch.tensor(math.log(c), dtype=torch.float64), None, ctx.fresh(f"{output_name(node)}/log")
        )
        ctx.emit(output_name(node), Exp(), scaled)
        return
    if not ctx.is_constant(exponent):
        raise UnsupportedModelError("Pow with a computed exponent")
    values = np.unique(ctx.constant(exponent, "Pow exponent"))
    if values.size != 1:
        raise UnsupportedModelError("Pow with an exponent that differs per element")
    c = float(values[0])
    if c == 1:
        ctx.alias(output_name(node), base)
    elif c == -1:
        ctx.emit(output_name(node), Reciprocal(), base)
    elif c == 0:
        raise UnsupportedModelError("Pow with exponent 0 (a constant output)")
    else:
        ctx.emit(output_name(node), Pow(c), base)


def _activation(op_class: type[BoundOp]) -> Converter:
    def convert(ctx: LoadContext, node: onnx.NodeProto, attrs: dict) -> None:
        ctx.emit(output_name(node), op_class(), node.input[0])

    return convert


def _leaky_relu(ctx: LoadContext, node: onnx.NodeProto, attrs: dict) -> None:
    ctx.emit(output_name(node), LeakyReLU(attrs.get("alpha", 0.01)), node.input[0])


def _abs(ctx: LoadContext, node: onnx.NodeProto, attrs: dict) -> None:
    ctx.emit(output_name(node), LeakyReLU(-1.0), node.input[0])


def _clip(ctx: LoadContext, node: onnx.NodeProto, attrs: dict) -> None:
    if ctx.opset < 11:
        low, high = attrs.get("min", -math.inf), attrs.get("max", math.inf)
    else:
        low_name, high_name = input_name(node, 1), input_name(node, 2)
        low = ctx.scalar(low_name, "Clip min") if low_name else -math.inf
        high = ctx.scalar(high_name, "Clip max") if high_name else math.inf
    if math.isinf(low) and math.isinf(high):
        ctx.alias(output_name(node), node.input[0])
        return
    ctx.emit(output_name(node), Clip(low, high), node.input[0])


def _where(ctx: LoadContext, node: onnx.NodeProto, attrs: dict) -> None:
    """``where(c, x, y)`` with a constant condition: ``c·x + (1 − c)·y``, linear in whichever of x, y is computed."""
    condition, x, y = node.input
    if not ctx.is_constant(condition):
        raise UnsupportedModelError(
            f"Where at node {output_name(node)!r} selects by a condition computed from the input: no linear bound holds "
            "across the switch"
        )
    mask = torch.from_numpy(np.asarray(ctx.constants[condition], dtype=np.float64))
    terms = []
    for name, weight in ((x, mask), (y, 1 - mask)):
        if ctx.is_constant(name):
            terms.append(("constant", weight * ctx.weight(name, "Where value")))
        else:
            terms.append(("computed", ctx.affine(name, weight, None, ctx.fresh(f"{output_name(node)}/part"))))
    computed = [value for kind, value in terms if kind == "computed"]
    constants = [value for kind, value in terms if kind == "constant"]
    if len(computed) == 1:
        ctx.affine(computed[0], None, constants[0], output_name(node))
        return
    a, b, shape = common_rank(ctx, *computed)
    ctx.emit(output_name(node), Add(), expanded(ctx, a, shape), expanded(ctx, b, shape))


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
        name = output_name(node) if position == len(steps) - 1 else ctx.fresh(f"{output_name(node)}/step")
        if other == "constant":  # ±ReLU(±(x − c)) + c
            shifted = ctx.affine(
                result, torch.tensor(sign, dtype=torch.float64), -sign * bound, ctx.fresh(f"{name}/gap")
            )
            excess = ctx.emit(ctx.fresh(f"{name}/excess"), ReLU(), shifted)
            result = ctx.affine(excess, torch.tensor(sign, dtype=torch.float64), bound, name)
            continue
        a, b, shape = common_rank(ctx, result, other)
        a, b = expanded(ctx, a, shape), expanded(ctx, b, shape)
        first, second = (a, b) if sign > 0 else (b, a)
        gap = ctx.emit(ctx.fresh(f"{name}/gap"), Add(subtract=True), first, second)
        excess = ctx.emit(ctx.fresh(f"{name}/excess"), ReLU(), gap)
        result = ctx.emit(name, Add(subtract=sign < 0), b, excess) if sign < 0 else ctx.emit(name, Add(), excess, b)
    if result != output_name(node):
        ctx.alias(output_name(node), result)


ELEMENTWISE_CONVERTERS: dict[str, Converter] = {
    "Add": _arithmetic,
    "Sub": _arithmetic,
    "Mul": _arithmetic,
    "Div": _arithmetic,
    "Neg": _neg,
    "Pow": _pow,
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
    "Where": _where,
    "Max": _max_min,
    "Min": _max_min,
}
