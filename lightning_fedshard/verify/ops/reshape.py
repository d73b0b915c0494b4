"""Shape-only operators (ONNX Flatten and Reshape): bounds and coefficients are reshaped, nothing else."""

from __future__ import annotations

from torch import Tensor

from lightning_fedshard.verify.ops.base import LinearOp

__all__ = ["Reshape"]


class Reshape(LinearOp):
    """Reshape a node of shape ``in_shape`` to ``out_shape`` (both without the batch dimension).

    Example::

        flatten = Reshape(in_shape=(1, 28, 28), out_shape=(784,))
    """

    onnx_types = ("Flatten", "Reshape")

    def __init__(self, in_shape: tuple[int, ...], out_shape: tuple[int, ...]) -> None:
        self.in_shape, self.out_shape = tuple(in_shape), tuple(out_shape)

    def linear(self, x: Tensor) -> Tensor:
        return x.reshape(x.shape[0], *self.out_shape)

    abs_linear = linear

    def transpose(self, A: Tensor) -> Tensor:
        return A.reshape(*A.shape[:2], *self.in_shape)

    def terms(self) -> tuple[int, int]:
        return 0, 1

    def __repr__(self) -> str:
        return f"Reshape({self.in_shape}→{self.out_shape})"
