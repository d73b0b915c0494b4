"""One bound class per operator: forward, interval propagation (IBP) and the CROWN backward step."""

from lightning_fedshard.verify.ops.add import Add
from lightning_fedshard.verify.ops.base import BoundOp, Interval, LinearOp, contract
from lightning_fedshard.verify.ops.conv import Conv2d
from lightning_fedshard.verify.ops.elementwise import BatchNorm, ElementwiseAffine
from lightning_fedshard.verify.ops.linear import LeftLinear, Linear
from lightning_fedshard.verify.ops.patches import Patches
from lightning_fedshard.verify.ops.pool import AvgPool2d
from lightning_fedshard.verify.ops.relu import ReLU
from lightning_fedshard.verify.ops.reshape import Reshape

__all__ = [
    "Add",
    "AvgPool2d",
    "BatchNorm",
    "BoundOp",
    "Conv2d",
    "ElementwiseAffine",
    "Interval",
    "LeftLinear",
    "Linear",
    "LinearOp",
    "Patches",
    "ReLU",
    "Reshape",
    "contract",
]
