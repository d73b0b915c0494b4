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

from lightning_fedshard.verify.onnx.common import Converter
from lightning_fedshard.verify.onnx.discrete import DISCRETE_CONVERTERS
from lightning_fedshard.verify.onnx.elementwise import ELEMENTWISE_CONVERTERS
from lightning_fedshard.verify.onnx.linear import LINEAR_CONVERTERS
from lightning_fedshard.verify.onnx.movement import MOVEMENT_CONVERTERS
from lightning_fedshard.verify.onnx.reductions import REDUCTION_CONVERTERS

__all__ = ["CONVERTERS", "DISCRETE"]

#: Every accepted operator and the converter that writes it (the families' tables, merged).
CONVERTERS: dict[str, Converter] = {
    **LINEAR_CONVERTERS,
    **ELEMENTWISE_CONVERTERS,
    **REDUCTION_CONVERTERS,
    **MOVEMENT_CONVERTERS,
    **DISCRETE_CONVERTERS,
}

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
