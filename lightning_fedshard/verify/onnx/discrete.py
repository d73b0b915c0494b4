"""ArgMax (ArgMin), OneHot and Equal on tensors computed from the input: the counting heads of segmentation benchmarks
(``ArgMax → OneHot → Transpose → Cast → Gather → Equal(mask) → Cast → ReduceSum``: how many pixels are predicted
as the mask says) as graph nodes with sound bounds.

ArgMax over ``C`` classes becomes, per pixel, the classes moved last, one *margin* per pair of classes
``2·(x_loser − x_winner)`` (the winner being the one ArgMax picks on a tie: the first index, or the last with
``select_last_index``), a :class:`~lightning_fedshard.verify.ops.Positive` per margin (the loser strictly above),
and the one-hot code: class ``k`` wins where every pair it is in goes its way, ``ReLU(Σ conditions − (C − 2))``
(the ReLU only for ``C > 2``; with two classes the code is ``[1 − s, s]``), then the index ``Σ k·onehot_k``. The
margins are linear in the logits, so CROWN bounds them directly (the correlation of the two logits cancels); a
margin is doubled so that the split between its two nearest possible values, 0 and two quanta, is a float.

OneHot of such an index is a copy of that one-hot code (any axis; ``values`` give an affine map); Equal is
:class:`~lightning_fedshard.verify.ops.Equal`, told which operands are integer-valued (indicators, indices, their
copies, sums and integer affine maps). Anything else on those paths is refused with the reason: OneHot of an index
that no ArgMax computed, ArgMax over one class, Equal whose constant broadcasts its operand up.

Example::

    graph = load_onnx("unet_count.onnx")   # ... ArgMax, OneHot, ..., Equal, ReduceSum: the count of agreeing pixels
"""

from __future__ import annotations

import math

import numpy as np
import onnx
import torch

from lightning_fedshard.verify.onnx.common import Converter, common_rank, expanded
from lightning_fedshard.verify.onnx.context import LoadContext, UnsupportedModelError
from lightning_fedshard.verify.ops import (
    ClassMargins,
    ElementwiseAffine,
    Equal,
    Linear,
    Positive,
    Reduce,
    ReLU,
    Reshape,
    Select,
    Transpose,
)

__all__ = ["DISCRETE_CONVERTERS", "integer_valued"]


def _smallest_subnormal(dtype: torch.dtype) -> float:
    info = torch.finfo(dtype)
    return info.tiny * info.eps


def _argmax(ctx: LoadContext, node: onnx.NodeProto, attrs: dict) -> None:
    out, source = node.output[0], node.input[0]
    shape = ctx.onnx_shape(source)
    axis = attrs.get("axis", 0) % len(shape)
    node_axis = ctx.axis(axis, len(shape))
    in_shape = ctx.variable(source).shape
    classes = in_shape[node_axis]
    if classes < 2:
        raise UnsupportedModelError(f"{node.op_type} at {out!r} over {classes} class (a constant 0)")
    # The classes last: [*pixels, C].
    positions = torch.arange(math.prod(in_shape)).reshape(in_shape).movedim(node_axis, -1)
    moved = ctx.emit(ctx.fresh(f"{out}/classes"), Select(positions.reshape(-1), in_shape, positions.shape), source)
    last = bool(attrs.get("select_last_index", 0))
    sign = 1 if node.op_type == "ArgMax" else -1  # ArgMin: the loser of a pair is strictly below the winner
    pairs = [(j, k) for k in range(classes) for j in range(k)]
    winners, losers = [], []
    condition = torch.zeros(classes, len(pairs), dtype=torch.float64)
    bias = torch.full((classes,), -(classes - 2.0), dtype=torch.float64)
    for p, (j, k) in enumerate(pairs):
        winner, loser = (k, j) if last else (j, k)  # the class ArgMax picks where the two are equal
        condition[loser, p] = 1.0  # the loser needs the margin positive ...
        condition[winner, p], bias[winner] = -1.0, bias[winner] + 1  # ... the winner needs it not
        winner, loser = (winner, loser) if sign > 0 else (loser, winner)  # the margin whose sign decides
        winners.append(winner)
        losers.append(loser)
    margin_op = ClassMargins(torch.tensor(winners), torch.tensor(losers), classes)
    margins = ctx.emit(ctx.fresh(f"{out}/margins"), margin_op, moved)
    # A difference of two floats of the logits' type is a multiple of its smallest subnormal; doubled, of twice it.
    quantum = 2 * _smallest_subnormal(ctx.tensor_type(source))
    beats = ctx.emit(ctx.fresh(f"{out}/beats"), Positive(quantum), margins)
    onehot = ctx.emit(ctx.fresh(f"{out}/onehot" if classes == 2 else f"{out}/votes"), Linear(condition, bias), beats)
    if classes > 2:
        onehot = ctx.emit(ctx.fresh(f"{out}/onehot"), ReLU(), onehot)
    index = ctx.emit(ctx.fresh(f"{out}/index"), Linear(torch.arange(classes, dtype=torch.float64)[None]), onehot)
    keep = bool(attrs.get("keepdims", 1))
    out_shape = list(shape)
    if keep:
        out_shape[axis] = 1
    else:
        del out_shape[axis]
    ctx.reshape(index, ctx.node_shape(out_shape), name=out)
    ctx.one_hots[ctx.variable(out).name] = onehot


def _one_hot(ctx: LoadContext, node: onnx.NodeProto, attrs: dict) -> None:
    out, (indices, depth_name, values_name) = node.output[0], node.input
    onehot = ctx.one_hots.get(ctx.variable(indices).name)
    if onehot is None:
        raise UnsupportedModelError(
            f"OneHot at {out!r} of an index that no ArgMax computed: only one-hot codes of an ArgMax are bounded"
        )
    classes = ctx.variable(onehot).shape[-1]
    depth = int(ctx.scalar(depth_name, "OneHot depth"))
    if depth != classes:
        raise UnsupportedModelError(f"OneHot at {out!r} of depth {depth} over an ArgMax of {classes} classes")
    off, on = (float(v) for v in np.asarray(ctx.constant(values_name, "OneHot values")).reshape(-1))
    index_shape = ctx.onnx_shape(indices)
    axis = attrs.get("axis", -1) % (len(index_shape) + 1)
    # Element (…, k at axis, …) of the output is class k of the pixel at (…): the one-hot node [*pixels, C] moved.
    positions = np.arange(math.prod(index_shape) * classes).reshape(*index_shape, classes)
    positions = np.moveaxis(positions, -1, axis)
    source_shape = ctx.variable(onehot).shape
    out_shape = ctx.node_shape(positions.shape)
    plain = (off, on) == (0.0, 1.0)
    copied = out if plain else ctx.fresh(f"{out}/code")
    index = torch.from_numpy(positions.reshape(-1).copy())
    if out_shape == source_shape and torch.equal(index, torch.arange(index.numel())):
        ctx.alias(copied, onehot)  # the class axis stays last: the code itself
    else:
        ctx.emit(copied, Select(index, source_shape, out_shape, label="OneHot"), onehot)
    if not plain:
        ctx.affine(copied, torch.tensor(on - off, dtype=torch.float64), torch.tensor(off, dtype=torch.float64), out)


def _equal(ctx: LoadContext, node: onnx.NodeProto, attrs: dict) -> None:
    out, (a, b) = node.output[0], node.input
    if ctx.is_constant(a):  # Equal is symmetric: the computed operand first
        a, b = b, a
    if ctx.is_constant(b):
        value = torch.from_numpy(np.asarray(ctx.constant(b, "Equal operand"), dtype=np.float64))
        shape = ctx.onnx_shape(a)
        if np.broadcast_shapes(shape, tuple(value.shape)) != shape:
            raise UnsupportedModelError(f"Equal at {out!r} with a constant that broadcasts its operand up")
        constant = ctx.broadcast_constant(value, len(shape))
        integer = bool((constant == torch.round(constant)).all())
        ctx.emit(out, Equal((integer_valued(ctx, a), integer), constant), a)
        return
    a, b, shape = common_rank(ctx, a, b)
    a, b = expanded(ctx, a, shape), expanded(ctx, b, shape)
    ctx.emit(out, Equal((integer_valued(ctx, a), integer_valued(ctx, b))), a, b)


def _integral(value: torch.Tensor | None) -> bool:
    return value is None or bool((value == torch.round(value)).all())


def integer_valued(ctx: LoadContext, name: str) -> bool:
    """Whether every value the model computes for tensor ``name`` is an integer: an indicator (Positive, Equal),
    or copies, integer sums and integer affine maps of integer values (floats past 2^24, the limit of float32's
    exact integers, are integers too, so the model's rounding keeps them integers)."""
    node = ctx.variable(name)
    by_name = {n.name: n for n in ctx.nodes}
    while node.op is not None:
        op = node.op
        if isinstance(op, Positive | Equal):
            return True
        copies = isinstance(op, Reshape | Transpose | ReLU) or (isinstance(op, Select) and _integral(op.fill))
        summed = isinstance(op, Reduce) and not op.mean
        affine = (isinstance(op, Linear) and _integral(op.weight) and _integral(op.bias)) or (
            isinstance(op, ElementwiseAffine) and _integral(op.scale) and _integral(op.shift)
        )
        if not (copies or summed or affine):
            return False
        node = by_name[node.inputs[0]]
    return False


DISCRETE_CONVERTERS: dict[str, Converter] = {"ArgMax": _argmax, "ArgMin": _argmax, "OneHot": _one_hot, "Equal": _equal}
