"""2-D convolution (ONNX Conv) with pads, strides, dilations and groups."""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor

from lightning_fedshard.verify.ops.base import LinearOp
from lightning_fedshard.verify.ops.patches import Patches

__all__ = ["Conv2d"]


class Conv2d(LinearOp):
    """``y = conv2d(pad(x), W) + b`` on ``[B, C, H, W]`` inputs.

    ``pads`` is ONNX's ``(top, left, bottom, right)``; asymmetric padding is applied explicitly so that the
    transposed convolution (CROWN's backward step) can crop exactly what the forward added. ``in_shape`` (the
    input's ``(C, H, W)``) fixes the transposed convolution's output padding.

    Example::

        op = Conv2d(weight, bias, in_shape=(3, 32, 32), stride=(1, 1), pads=(1, 1, 1, 1))
        (A_in,), bias = op.backward(A, [x_bounds])   # A [S, B, C', H', W'] -> [S, B, 3, 32, 32]
    """

    onnx_types = ("Conv",)
    accepts_patches = True

    def __init__(
        self,
        weight: Tensor,
        bias: Tensor | None,
        in_shape: tuple[int, int, int],
        stride: tuple[int, int] = (1, 1),
        pads: tuple[int, int, int, int] = (0, 0, 0, 0),
        dilation: tuple[int, int] = (1, 1),
        groups: int = 1,
    ) -> None:
        if weight.dim() != 4:
            raise ValueError(f"Conv2d weight must be 4-D [C_out, C_in/groups, kH, kW], got {tuple(weight.shape)}")
        if in_shape[0] != weight.shape[1] * groups:
            raise ValueError(
                f"Conv2d input has {in_shape[0]} channels but the weight expects {weight.shape[1]} × {groups} groups"
            )
        self.weight, self.bias = weight, bias
        self.in_shape, self.stride, self.pads, self.dilation, self.groups = in_shape, stride, pads, dilation, groups
        top, left, bottom, right = pads
        self._symmetric = top == bottom and left == right
        padded = (in_shape[1] + top + bottom, in_shape[2] + left + right)
        kernel = weight.shape[2:]
        out = [(padded[i] - dilation[i] * (kernel[i] - 1) - 1) // stride[i] + 1 for i in range(2)]
        if min(out) < 1:
            raise ValueError(f"Conv2d kernel {tuple(kernel)} does not fit the padded input {padded}")
        # Rows/columns of the padded input that no output reads (stride remainder) need output padding.
        self._output_padding = tuple(
            padded[i] - ((out[i] - 1) * stride[i] + dilation[i] * (kernel[i] - 1) + 1) for i in range(2)
        )

    def _conv(self, x: Tensor, weight: Tensor) -> Tensor:
        top, left, bottom, right = self.pads
        if self._symmetric:
            return F.conv2d(x, weight, None, self.stride, (top, left), self.dilation, self.groups)
        return F.conv2d(F.pad(x, (left, right, top, bottom)), weight, None, self.stride, 0, self.dilation, self.groups)

    def linear(self, x: Tensor) -> Tensor:
        return self._conv(x, self.weight)

    def abs_linear(self, x: Tensor) -> Tensor:
        return self._conv(x, self.weight.abs())

    def transpose(self, A: Tensor | Patches) -> Tensor | Patches:
        top, left, bottom, right = self.pads
        if isinstance(A, Patches):
            return A.conv_transpose(self.weight, self.stride, (top, left), self.dilation, self.groups, self.in_shape)
        S, B = A.shape[:2]
        padding = (top, left) if self._symmetric else 0
        out = F.conv_transpose2d(
            A.reshape(S * B, *A.shape[2:]),
            self.weight,
            None,
            self.stride,
            padding,
            self._output_padding,
            self.groups,
            self.dilation,
        )
        if not self._symmetric:
            out = out[:, :, top : out.shape[2] - bottom, left : out.shape[3] - right]
        return out.reshape(S, B, *self.in_shape)

    def terms(self) -> tuple[int, int]:
        c_out, c_in, kh, kw = self.weight.shape  # c_in per group
        return c_in * kh * kw, c_out // self.groups * kh * kw

    def constant(self) -> Tensor | None:
        return None if self.bias is None else self.bias.view(-1, 1, 1)

    def __repr__(self) -> str:
        return f"Conv2d({self.weight.shape[1] * self.groups}→{self.weight.shape[0]}, k={tuple(self.weight.shape[2:])})"


class ConvTranspose2d(LinearOp):
    """``y = crop(conv_transpose2d(x, W)) + b`` on ``[B, C, H, W]`` (ONNX ConvTranspose): ``weight [C_in, C_out /
    groups, kH, kW]``, ``pads`` ONNX's ``(top, left, bottom, right)`` cropped from the full output and
    ``output_padding`` rows/columns added after it. The backward step is the convolution with the same weight
    (the adjoint), applied to the coefficients padded back to the full output.

    Example::

        up = ConvTranspose2d(weight, bias, stride=(2, 2))   # [B, 8, 4, 4] -> [B, C_out, 8, 8] for 2×2 kernels
    """

    onnx_types = ("ConvTranspose",)

    def __init__(
        self,
        weight: Tensor,
        bias: Tensor | None,
        stride: tuple[int, int] = (1, 1),
        pads: tuple[int, int, int, int] = (0, 0, 0, 0),
        output_padding: tuple[int, int] = (0, 0),
        dilation: tuple[int, int] = (1, 1),
        groups: int = 1,
    ) -> None:
        if weight.dim() != 4:
            raise ValueError(
                f"ConvTranspose2d weight must be 4-D [C_in, C_out/groups, kH, kW], got {tuple(weight.shape)}"
            )
        if any(p >= s and p >= d for p, s, d in zip(output_padding, stride, dilation, strict=True)):
            raise ValueError(f"output_padding {output_padding} must be smaller than the stride or the dilation")
        self.weight, self.bias = weight, bias
        self.stride, self.pads, self.output_padding, self.dilation, self.groups = (
            stride,
            pads,
            output_padding,
            dilation,
            groups,
        )

    def _crop(self) -> tuple[int, int, int, int]:
        """``F.pad`` amounts (left, right, top, bottom) taking the full output to ONNX's (negative: crop)."""
        top, left, bottom, right = self.pads
        return (-left, self.output_padding[1] - right, -top, self.output_padding[0] - bottom)

    def _apply(self, x: Tensor, weight: Tensor) -> Tensor:
        full = F.conv_transpose2d(x, weight, None, self.stride, 0, 0, self.groups, self.dilation)
        return F.pad(full, self._crop())

    def linear(self, x: Tensor) -> Tensor:
        return self._apply(x, self.weight)

    def abs_linear(self, x: Tensor) -> Tensor:
        return self._apply(x, self.weight.abs())

    def transpose(self, A: Tensor) -> Tensor:
        S, B = A.shape[:2]
        full = F.pad(A.reshape(S * B, *A.shape[2:]), tuple(-p for p in self._crop()))
        out = F.conv2d(full, self.weight, None, self.stride, 0, self.dilation, self.groups)
        return out.reshape(S, B, *out.shape[1:])

    def terms(self) -> tuple[int, int]:
        c_in, c_out, kh, kw = self.weight.shape  # c_out per group
        return c_in // self.groups * kh * kw, c_out * kh * kw

    def constant(self) -> Tensor | None:
        return None if self.bias is None else self.bias.view(-1, 1, 1)

    def __repr__(self) -> str:
        return f"ConvTranspose2d({self.weight.shape[0]}→{self.weight.shape[1] * self.groups}, k={tuple(self.weight.shape[2:])})"
