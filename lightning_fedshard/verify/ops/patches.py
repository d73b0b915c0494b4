"""Coefficients of convolutional spec rows stored as local windows ("patches mode", after auto_LiRPA).

A backward pass started at a convolutional node ``(C₀, H₀, W₀)`` has one spec row per refined position
``(c, h, w)``, and after a few convolutions each row still depends on a small window of the current node only.
Dense coefficients ``[S, B, C, H, W]`` spend almost all their memory on the zeros outside that window;
:class:`Patches` keeps the window alone and turns dense only where an operator needs it (Reshape, Linear).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["Patches"]


@dataclass(frozen=True)
class Patches:
    """Lower-bound coefficients ``[S, B, C, H, W]`` whose row ``s`` is zero outside one ``kH × kW`` window.

    ``values [S, B, C, kH, kW]`` hold each row's window over all channels of the node it lies on (its shape
    ``node_shape = (C, H, W)``). The window of row ``s`` starts (top-left) at ``positions[s] · stride − padding``
    in that node's coordinates, where ``positions [S, 2]`` are the rows' (h, w) on the start node: all windows lie
    on one strided grid, so two Patches of the same rows line up. Window entries outside the node's image are
    kept at zero (a transposed convolution would otherwise carry them onto real pixels).

    Supports what the backward steps do with coefficients: ``*`` by tensors broadcastable to ``[B, C, H, W]``,
    ``+``, unary ``-``, :meth:`clamp`, :meth:`abs`, :meth:`contract`, :meth:`conv_transpose` and
    :meth:`to_dense`.

    Example::

        rows = Patches.identity(torch.tensor([0, 17]), batch=1, shape=(4, 8, 8), dtype=torch.float32)
        rows = rows.conv_transpose(weight, stride=(1, 1), pads=(1, 1), dilation=(1, 1), groups=1, in_shape=(3, 8, 8))
        rows.values.shape   # [4, 1, 3, 3, 3]: rows +e_0, +e_17, -e_0, -e_17 through the convolution
        rows.to_dense()     # [4, 1, 3, 8, 8], what the dense (matrix) pass would hold
    """

    values: Tensor
    positions: Tensor
    stride: tuple[int, int]
    padding: tuple[int, int]
    node_shape: tuple[int, int, int]

    @classmethod
    def identity(cls, index: Tensor, batch: int, shape: tuple[int, ...], dtype: torch.dtype) -> Patches:
        """Rows ``+e_i`` then ``-e_i`` for each flat index ``i`` of a node of shape ``(C, H, W)`` (the rows of
        :func:`~lightning_fedshard.verify.bounds.crown.selection_rows`), as ``1 × 1`` windows."""
        C, H, W = shape
        channel, h, w = index // (H * W), index // W % H, index % W
        signs = torch.tensor([1.0, -1.0], dtype=dtype, device=index.device).repeat_interleave(index.numel())
        values = F.one_hot(channel, C).to(dtype).repeat(2, 1) * signs[:, None]
        values = values.view(-1, 1, C, 1, 1).expand(-1, batch, -1, -1, -1)
        return cls(values, torch.stack([h, w], 1).repeat(2, 1), (1, 1), (0, 0), (C, H, W))

    def _with(self, values: Tensor) -> Patches:
        return dataclasses.replace(self, values=values)

    def _spans(self) -> list[tuple[Tensor, int, int]]:
        """Per spatial dimension: the node coordinate of every window entry ``[S, k]``, and the zero padding
        ``(before, after)`` of the image that puts every window inside it."""
        spans = []
        for d in range(2):
            size, k = self.node_shape[1 + d], self.values.shape[3 + d]
            first = self.positions[:, d] * self.stride[d] - self.padding[d]
            index = first[:, None] + torch.arange(k, device=first.device)
            spans.append((index, max(0, -int(first.min())), max(0, int(first.max()) + k - size)))
        return spans

    @staticmethod
    def _as_4d(value: Tensor) -> Tensor:
        """``value`` viewed as ``[B' (1 or B), C', H', W']`` (each of the last three 1 or full size)."""
        if value.dim() > 4:
            raise ValueError(f"Patches take tensors broadcastable to [B, C, H, W], got {tuple(value.shape)}")
        return value.reshape((1,) * (4 - value.dim()) + tuple(value.shape))

    def _windows(self, value: Tensor) -> Tensor:
        """``value [B', C', H', W']`` (broadcast to the node's ``(C, H, W)``, zero outside the image) cut into every
        row's window: ``[S, B', C, kH, kW]``."""
        (rows, top, bottom), (cols, left, right) = self._spans()
        value = value.expand(value.shape[0], *self.node_shape)
        padded = F.pad(value, (left, right, top, bottom)).permute(2, 3, 0, 1)  # [H + pads, W + pads, B', C]
        return padded[rows[:, :, None] + top, cols[:, None, :] + left].permute(0, 3, 4, 1, 2)

    def to_dense(self) -> Tensor:
        """The same coefficients as a dense ``[S, B, C, H, W]`` tensor."""
        S, B, C = self.values.shape[:3]
        (rows, top, bottom), (cols, left, right) = self._spans()
        _, H, W = self.node_shape
        dense = self.values.new_zeros(S, H + top + bottom, W + left + right, B, C)
        index = (torch.arange(S, device=rows.device)[:, None, None], rows[:, :, None] + top, cols[:, None, :] + left)
        dense = dense.index_put(index, self.values.permute(0, 3, 4, 1, 2))
        return dense[:, top : top + H, left : left + W].permute(0, 3, 4, 1, 2).contiguous()

    def _zero_outside(self) -> Patches:
        """These patches with the window entries that fall outside the image set to zero."""
        (rows, _, _), (cols, _, _) = self._spans()
        _, H, W = self.node_shape
        inside_h, inside_w = (rows >= 0) & (rows < H), (cols >= 0) & (cols < W)
        if bool(inside_h.all()) and bool(inside_w.all()):
            return self
        inside = inside_h[:, None, None, :, None] & inside_w[:, None, None, None, :]
        return self._with(torch.where(inside, self.values, 0.0))

    def __mul__(self, value: Tensor | float) -> Patches:
        """Element-wise product with ``value`` broadcastable to ``[B, C, H, W]`` (per-channel or per-pixel)."""
        if not isinstance(value, Tensor):
            return self._with(self.values * value)
        value = self._as_4d(value)
        if value.shape[-2:] == (1, 1):  # per channel: [B', C', 1, 1] broadcasts onto every window as it is
            return self._with(self.values * value)
        return self._with(self.values * self._windows(value))

    __rmul__ = __mul__

    def contract(self, value: Tensor, exact: bool = True) -> Tensor:
        """``Σ A·value`` over the node, as float64 (summed in float64 if ``exact``, as
        :func:`~lightning_fedshard.verify.ops.base.contract` does for large nodes): ``value`` broadcastable to ``[B, C,
        H, W]`` gives ``[S, B]`` (the image is zero-padded, like a convolution's input)."""
        value = self._as_4d(value)
        dtype = torch.float64 if exact else None
        if value.shape[-2:] == (1, 1):  # entries outside the image are zero, so a per-channel value needs no window
            return (self.values.sum((3, 4), dtype=dtype) * value[..., 0, 0]).sum(-1, dtype=dtype).double()
        return (self.values * self._windows(value)).sum((2, 3, 4), dtype=dtype).double()

    def _widened(self, padding: tuple[int, int], size: tuple[int, int]) -> Tensor:
        """``values`` zero-padded to the window ``size`` that starts at ``positions · stride − padding``."""
        top, left = padding[0] - self.padding[0], padding[1] - self.padding[1]
        kH, kW = self.values.shape[3:]
        if (top, left, kH, kW) == (0, 0, *size):
            return self.values
        return F.pad(self.values, (left, size[1] - left - kW, top, size[0] - top - kH))

    def __add__(self, other: Patches | Tensor) -> Patches | Tensor:
        """Sum with coefficients of the same rows on the same node; windows of different sizes (the two branches
        of a residual block meeting at its fork) are padded to the one window that covers both."""
        if isinstance(other, Tensor):
            return self.to_dense() + other
        if self.stride != other.stride or not torch.equal(self.positions, other.positions):
            return self.to_dense() + other.to_dense()
        padding = (max(self.padding[0], other.padding[0]), max(self.padding[1], other.padding[1]))
        size = tuple(max(padding[d] - p.padding[d] + p.values.shape[3 + d] for p in (self, other)) for d in range(2))
        values = self._widened(padding, size) + other._widened(padding, size)
        return dataclasses.replace(self, values=values, padding=padding)

    def __radd__(self, other: Tensor) -> Tensor:
        return self + other

    def __neg__(self) -> Patches:
        return self._with(-self.values)

    def clamp(self, min: float | None = None, max: float | None = None) -> Patches:
        return self._with(self.values.clamp(min=min, max=max))

    def abs(self) -> Patches:
        return self._with(self.values.abs())

    def conv_transpose(
        self,
        weight: Tensor,
        stride: tuple[int, int],
        pads: tuple[int, int],
        dilation: tuple[int, int],
        groups: int,
        in_shape: tuple[int, int, int],
    ) -> Patches | Tensor:
        """The coefficients on ``x`` of ``y = conv2d(pad(x), weight)`` (``pads`` = the top and left padding; the
        bottom and right padding only decides which window entries fall outside ``x``).

        Output ``h`` of ``y`` reads input rows ``h·stride − top + i·dilation``, so a window of size ``k`` at
        ``o`` on ``y`` becomes one of size ``(k − 1)·stride + dilation·(kernel − 1) + 1`` at ``o·stride − top`` on
        ``x``, filled by the transposed convolution of the window with the kernel. Returns dense coefficients
        once the windows hold as many numbers as the whole image.
        """
        S, B, C, kH, kW = self.values.shape
        windows = F.conv_transpose2d(
            self.values.reshape(S * B, C, kH, kW), weight, None, stride, 0, 0, groups, dilation
        )
        composed = Patches(
            windows.view(S, B, *windows.shape[1:]),
            self.positions,
            (self.stride[0] * stride[0], self.stride[1] * stride[1]),
            (self.padding[0] * stride[0] + pads[0], self.padding[1] * stride[1] + pads[1]),
            tuple(in_shape),
        )._zero_outside()
        if composed.values.numel() >= S * B * math.prod(in_shape):
            return composed.to_dense()
        return composed

    def __repr__(self) -> str:
        return (
            f"Patches(rows={self.values.shape[0]}, window={tuple(self.values.shape[3:])}, stride={self.stride}, "
            f"padding={self.padding}, node={self.node_shape})"
        )
