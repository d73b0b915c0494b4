"""The contract every bound operator follows, and the interval type they exchange.

Shapes: a node's tensors are ``[B, *shape]`` (B = points, boxes or BaB domains; ``shape`` is the ONNX shape
without its leading batch dimension). Linear bounds are carried backwards as coefficient tensors
``A: [S, B, *shape]`` (S = rows of the specification being bounded), always for a *lower* bound: an upper
bound of ``c·y`` is minus the lower bound of ``-c·y``, so one propagation rule per operator serves both. Rows that
are positions of a convolutional node may instead travel as :class:`~lightning_fedshard.verify.ops.patches.Patches`
(their local windows) through the ops that declare ``accepts_patches``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from lightning_fedshard.verify.ops.patches import Patches

__all__ = ["BoundOp", "Interval", "LinearOp", "contract"]


@dataclass(frozen=True)
class Interval:
    """Element-wise bounds ``lower <= v <= upper`` of a node's values, each ``[B, *shape]``.

    Example::

        box = Interval(torch.zeros(1, 784), torch.full((1, 784), 0.03))
        box.center, box.radius
    """

    lower: Tensor
    upper: Tensor

    @property
    def center(self) -> Tensor:
        return (self.upper + self.lower) / 2

    @property
    def radius(self) -> Tensor:
        return (self.upper - self.lower) / 2

    def to(self, device: torch.device | str) -> Interval:
        """These bounds on ``device`` (tensors already there are not copied)."""
        return Interval(self.lower.to(device), self.upper.to(device))


def contract(A: Tensor | Patches, value: Tensor) -> Tensor:
    """``Σ A·value`` over the node dimensions: ``A [S, B, *shape]`` (or :class:`Patches`) with ``value``
    broadcastable to ``[B, *shape]`` (or to ``shape``) gives ``[S, B]``."""
    if isinstance(A, Patches):
        return A.contract(value)
    return (A * value).flatten(2).sum(-1)


class BoundOp(ABC):
    """One operator of a verification graph: its forward function, interval bounds (IBP) and the backward step
    of linear bound propagation (CROWN).

    Subclasses hold their constants (weights, biases, strides) as attributes; inputs arrive as tensors or
    :class:`Interval` in the order of the node's inputs. Example (a subclass)::

        op = Linear(weight, bias)
        y = op.forward(x)
        out = op.ibp(Interval(xl, xu))
        (A_x,), bias = op.backward(A, [None])
    """

    #: ONNX operator names this class is built from, for error messages and documentation.
    onnx_types: tuple[str, ...] = ()
    #: Whether :meth:`backward` takes :class:`Patches` coefficients; other ops are handed dense ones.
    accepts_patches: bool = False
    #: Whether :meth:`backward` needs the intervals of its inputs (relaxations of non-linear ops do).
    needs_input_bounds: bool = False
    #: The inputs whose intervals the relaxation is built on: the graph tightens their bounds by CROWN before this
    #: op is crossed, and branch-and-bound keeps them per domain.
    relaxed_inputs: tuple[int, ...] = ()
    #: The inputs branch-and-bound may split (a subset of ``relaxed_inputs``); such an op also provides
    #: ``split_mask``, ``split_point`` and ``branch_gain`` (see :class:`~.activation.Activation`).
    split_inputs: tuple[int, ...] = ()

    @abstractmethod
    def forward(self, *inputs: Tensor) -> Tensor: ...

    @abstractmethod
    def ibp(self, *inputs: Interval) -> Interval: ...

    @abstractmethod
    def backward(
        self, A: Tensor | Patches, inputs: Sequence[Interval | None], alpha: Tensor | None = None
    ) -> tuple[list[Tensor | Patches | None], Tensor | None]:
        """Push a lower bound ``Σ A·out + c`` back to one in terms of the inputs.

        Returns one coefficient tensor per input (``None`` where the bound does not depend on it) and the
        constant added on the way (``[S, B]``, or ``None`` for zero). ``inputs`` are the intervals of the
        input nodes where the op needs them (non-linear ops), ``alpha`` its α-CROWN parameters
        ``[S, B, *alpha_shape]`` (``None``: CROWN's choice).
        """

    def alpha_shape(self, shape: tuple[int, ...]) -> tuple[int, ...] | None:
        """The shape of this op's α per (row, batch element) for an output of ``shape``; ``None``: no α."""
        return None

    def initial_alpha(self, inputs: Sequence[Interval]) -> Tensor | None:
        """α ``[B, *alpha_shape]`` that reproduces CROWN's relaxation on these input intervals."""
        return None

    def refine_mask(self, inputs: Sequence[Interval | None], index: int) -> Tensor:
        """``[B, *input shape]``: the neurons of relaxed input ``index`` whose tighter bounds would tighten this
        relaxation (those whose interval has width, by default)."""
        pre = inputs[index]
        return pre.upper > pre.lower

    def to(self, dtype: torch.dtype | None = None, device: torch.device | str | None = None) -> BoundOp:
        """This op with its floating-point constants in ``dtype`` (the graph computes in one dtype) and all its
        constants (integer indices too) on ``device``; ``None`` keeps either as it is."""
        for name, value in vars(self).items():
            if isinstance(value, Tensor) and value.device.type != "meta":  # a sharded-away placeholder stays
                cast = dtype if dtype is not None and value.is_floating_point() else None
                setattr(self, name, value.to(device=device, dtype=cast))
        return self

    def __repr__(self) -> str:
        return type(self).__name__


class LinearOp(BoundOp):
    """An affine operator ``y = L(x) + c``: CROWN's backward step is exact, and interval bounds follow from the
    centre and radius of the input (``L(mid) + c ± |L|(rad)``)."""

    @abstractmethod
    def linear(self, x: Tensor) -> Tensor:
        """``L(x)`` without the constant term."""

    @abstractmethod
    def abs_linear(self, x: Tensor) -> Tensor:
        """``|L|(x)``: the operator with every coefficient replaced by its absolute value."""

    @abstractmethod
    def transpose(self, A: Tensor | Patches) -> Tensor | Patches:
        """``Lᵀ`` applied to coefficients ``A [S, B, *out_shape]`` → ``[S, B, *in_shape]`` (Patches only where the op
        ``accepts_patches``)."""

    def constant(self) -> Tensor | None:
        """The constant term ``c`` (broadcastable to the output), or ``None``."""
        return None

    def forward(self, x: Tensor) -> Tensor:
        c = self.constant()
        y = self.linear(x)
        return y if c is None else y + c

    def ibp(self, x: Interval) -> Interval:
        mid, rad = self.forward(x.center), self.abs_linear(x.radius)
        return Interval(mid - rad, mid + rad)

    def backward(self, A, inputs, alpha=None):
        c = self.constant()
        return [self.transpose(A)], None if c is None else contract(A, c)
