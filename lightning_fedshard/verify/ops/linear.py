"""Fully connected layers (ONNX Gemm, and MatMul with a constant operand on either side)."""

from __future__ import annotations

from torch import Tensor

from lightning_fedshard.verify.ops.base import LinearOp

__all__ = ["LeftLinear", "Linear"]


class Linear(LinearOp):
    """``y = x @ Wᵀ + b`` over the last dimension of ``x``; ``weight [out, in]``, ``bias [out]`` or ``None``.

    Example::

        op = Linear(torch.randn(10, 784), torch.zeros(10))
        (A_in,), bias = op.backward(A, [x_bounds])   # A [S, B, 10] -> A_in [S, B, 784], bias [S, B]
    """

    onnx_types = ("Gemm", "MatMul")

    def __init__(self, weight: Tensor, bias: Tensor | None = None) -> None:
        if weight.dim() != 2:
            raise ValueError(f"Linear weight must be 2-D [out, in], got shape {tuple(weight.shape)}")
        if bias is not None and bias.shape != weight.shape[:1]:
            raise ValueError(f"Linear bias shape {tuple(bias.shape)} does not match {weight.shape[0]} outputs")
        self.weight = weight
        self.bias = bias

    def linear(self, x: Tensor) -> Tensor:
        return x @ self.weight.T

    def abs_linear(self, x: Tensor) -> Tensor:
        return x @ self.weight.abs().T

    def transpose(self, A: Tensor) -> Tensor:
        return A @ self.weight

    def terms(self) -> tuple[int, int]:
        return self.weight.shape[1], self.weight.shape[0]

    def constant(self) -> Tensor | None:
        return self.bias

    def __repr__(self) -> str:
        return f"Linear({self.weight.shape[1]}→{self.weight.shape[0]})"


class LeftLinear(LinearOp):
    """``y = W @ x`` over the last two dimensions of ``x [B, …, in, k]`` (ONNX MatMul with a constant left
    operand); ``weight [out, in]``.

    Example::

        op = LeftLinear(torch.randn(256, 784))   # x [B, 784, 1] -> y [B, 256, 1]
        (A_in,), _ = op.backward(A, [x_bounds])  # A [S, B, 256, 1] -> A_in [S, B, 784, 1]
    """

    onnx_types = ("MatMul",)

    def __init__(self, weight: Tensor) -> None:
        if weight.dim() != 2:
            raise ValueError(f"LeftLinear weight must be 2-D [out, in], got shape {tuple(weight.shape)}")
        self.weight = weight

    def linear(self, x: Tensor) -> Tensor:
        return self.weight @ x

    def abs_linear(self, x: Tensor) -> Tensor:
        return self.weight.abs() @ x

    def transpose(self, A: Tensor) -> Tensor:
        return self.weight.T @ A

    def terms(self) -> tuple[int, int]:
        return self.weight.shape[1], self.weight.shape[0]

    def __repr__(self) -> str:
        return f"LeftLinear({self.weight.shape[1]}→{self.weight.shape[0]})"
