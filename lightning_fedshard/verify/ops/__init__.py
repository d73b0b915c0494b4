"""One bound class per operator: forward, interval propagation (IBP) and the CROWN backward step.

Affine operators derive both from their linear map (:class:`LinearOp`); the non-linear ones relax their function
over their inputs' intervals: element-wise functions by two lines (:class:`Activation`: ReLU and the other
piecewise-linear functions, the smooth ones, Sign and Floor, the indicator [x > 0]), 0/1 equality (:class:`Equal`), the product of two computed tensors by McCormick
planes (:class:`Mul`), maxima over windows (:class:`WindowMax`) and softmax as its parts.
"""

from lightning_fedshard.verify.ops.activation import Activation, Lines
from lightning_fedshard.verify.ops.add import Add
from lightning_fedshard.verify.ops.base import (
    BoundOp,
    Interval,
    LinearOp,
    contract,
    contract_abs,
    contract_error,
    enclose,
    flat,
)
from lightning_fedshard.verify.ops.bilinear import Mul
from lightning_fedshard.verify.ops.cast import RoundToFloat
from lightning_fedshard.verify.ops.conv import Conv2d, ConvTranspose2d
from lightning_fedshard.verify.ops.elementwise import BatchNorm, ElementwiseAffine
from lightning_fedshard.verify.ops.indicator import ClassMargins, Equal, Positive
from lightning_fedshard.verify.ops.linear import LeftLinear, Linear
from lightning_fedshard.verify.ops.patches import Patches
from lightning_fedshard.verify.ops.pool import AvgPool2d
from lightning_fedshard.verify.ops.relu import Clip, LeakyReLU, PiecewiseLinear, ReLU
from lightning_fedshard.verify.ops.reshape import Reshape
from lightning_fedshard.verify.ops.smooth import (
    Cos,
    Exp,
    Log,
    Pow,
    Reciprocal,
    Sigmoid,
    Sin,
    SmoothActivation,
    Sqrt,
    Tanh,
)
from lightning_fedshard.verify.ops.softmax import Softmax
from lightning_fedshard.verify.ops.steps import Ceil, Floor, Round, Sign, Staircase
from lightning_fedshard.verify.ops.structural import Concat, Reduce, Select, Transpose
from lightning_fedshard.verify.ops.window_max import WindowMax

__all__ = [
    "Activation",
    "Add",
    "AvgPool2d",
    "BatchNorm",
    "BoundOp",
    "Ceil",
    "ClassMargins",
    "Clip",
    "Concat",
    "Conv2d",
    "ConvTranspose2d",
    "Cos",
    "ElementwiseAffine",
    "Equal",
    "Exp",
    "Floor",
    "Interval",
    "LeakyReLU",
    "LeftLinear",
    "Linear",
    "LinearOp",
    "Lines",
    "Log",
    "Mul",
    "Patches",
    "PiecewiseLinear",
    "Positive",
    "Pow",
    "ReLU",
    "Reciprocal",
    "Reduce",
    "Reshape",
    "Round",
    "RoundToFloat",
    "Select",
    "Sigmoid",
    "Sign",
    "Sin",
    "SmoothActivation",
    "Softmax",
    "Sqrt",
    "Staircase",
    "Tanh",
    "Transpose",
    "WindowMax",
    "contract",
    "contract_abs",
    "contract_error",
    "enclose",
    "flat",
]
