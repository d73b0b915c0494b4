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

from lightning_fedshard.verify.ops.chunks import row_chunks

__all__ = ["DENSE_FILL", "Patches"]

#: Windows covering at least this share of the node's image are made dense. ``fedshard bench convpass`` (column
#: ``p/dense``, docs/benchmarks.md) times each step on patches and on the same coefficients made dense: on
#: cifar_biasfield 7 × 7 windows on an 8 × 8 image (0.77) step 1.65x faster dense, 3 × 3 on 4 × 4 (0.56) as fast
#: either way, 13 × 13 on 16 × 16 (0.66) and 27 × 27 on 32 × 32 (0.71) 1.0-2.3x faster as patches.
DENSE_FILL = 0.75


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
    #: What the rows' positions alone decide (their distinct positions, each row's among them, the extremes), read
    #: from the host once for a pass's rows instead of at every step of it (each read waits for a GPU): shared by
    #: the coefficients made from these with the same positions.
    layout: dict = dataclasses.field(default_factory=dict, repr=False, compare=False)

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

    def _spans(self, positions: Tensor | None = None) -> list[tuple[Tensor, int, int]]:
        """Per spatial dimension: the node coordinate of every window entry ``[S, k]`` (of the rows at ``positions``,
        by default this one's), and the zero padding ``(before, after)`` of the image that puts every window inside
        it."""
        positions = self.positions if positions is None else positions
        lowest, highest = self._layout()["extremes"]  # the distinct positions have the rows' extremes
        spans = []
        for d in range(2):
            size, k = self.node_shape[1 + d], self.values.shape[3 + d]
            first = positions[:, d] * self.stride[d] - self.padding[d]
            index = first[:, None] + torch.arange(k, device=first.device)
            low, high = lowest[d] * self.stride[d] - self.padding[d], highest[d] * self.stride[d] - self.padding[d]
            spans.append((index, max(0, -low), max(0, high + k - size)))
        return spans

    @staticmethod
    def _as_4d(value: Tensor) -> Tensor:
        """``value`` viewed as ``[B' (1 or B), C', H', W']`` (each of the last three 1 or full size)."""
        if value.dim() > 4:
            raise ValueError(f"Patches take tensors broadcastable to [B, C, H, W], got {tuple(value.shape)}")
        return value.reshape((1,) * (4 - value.dim()) + tuple(value.shape))

    def _windows(self, value: Tensor) -> tuple[Tensor, Tensor]:
        """``value [B', C', H', W']`` (broadcast to the node's ``(C, H, W)``, zero outside the image) cut into the
        window of every distinct position of the rows: ``[U, B', C, kH, kW]`` (contiguous), and the window of each
        row ``[S]`` (index into the first dimension). Rows of one neuron's ``±e_i`` and of the channels of one pixel
        share a window, so this is far smaller than one window per row."""
        layout = self._layout()
        positions, of_row = layout["distinct"], layout["of_row"]
        (rows, top, bottom), (cols, left, right) = self._spans(positions)
        value = value.expand(value.shape[0], *self.node_shape)
        padded = F.pad(value, (left, right, top, bottom))
        width = padded.shape[-1]
        pixels = ((rows + top)[:, :, None] * width + (cols + left)[:, None, :]).flatten()  # [U·kH·kW]
        windows = padded.reshape(-1, padded.shape[-2] * width)[:, pixels]  # [B'·C, U·kH·kW]
        windows = windows.view(value.shape[0], value.shape[1], positions.shape[0], *self.values.shape[3:])
        return windows.permute(2, 0, 1, 3, 4).contiguous(), of_row

    def _layout(self) -> dict:
        """:attr:`layout`, computed on the first call for these positions."""
        if self.layout.get("positions") is not self.positions:
            positions = self.positions
            columns = int(positions[:, 1].max()) + 1  # one key per position: a 1-D unique is 50x faster than dim=0
            keys, of_row = torch.unique(positions[:, 0] * columns + positions[:, 1], return_inverse=True)
            extremes = tuple(p.tolist() for p in positions.aminmax(dim=0))  # one read of the extremes, not four
            distinct = torch.stack([keys // columns, keys % columns], 1)
            self.layout.clear()
            self.layout.update(positions=positions, distinct=distinct, of_row=of_row, extremes=extremes)
        return self.layout

    def _row_chunks(self, bytes_per_element: int) -> list[slice]:
        """Chunks of the rows for element-wise work (:func:`~lightning_fedshard.verify.ops.chunks.row_chunks`)."""
        return row_chunks(self.values.shape[0], math.prod(self.values.shape[1:]) * bytes_per_element)

    def to_dense(self) -> Tensor:
        """The same coefficients as a dense ``[S, B, C, H, W]`` tensor (one scatter of the window entries inside the
        image; those outside go to one spare element at the end, cut off)."""
        S, B, C, kH, kW = self.values.shape
        (rows, _, _), (cols, _, _) = self._spans()
        _, H, W = self.node_shape
        inside = ((rows >= 0) & (rows < H))[:, :, None] & ((cols >= 0) & (cols < W))[:, None, :]  # [S, kH, kW]
        pixel = (rows[:, :, None] * W + cols[:, None, :]).view(S, 1, kH * kW)
        first = torch.arange(S * B * C, device=rows.device).view(S, B * C, 1) * (H * W)
        spare = S * B * C * H * W
        index = torch.where(inside.view(S, 1, kH * kW), first + pixel, spare).flatten()
        dense = self.values.new_zeros(spare + 1)
        dense = dense.index_put((index,), self.values.reshape(-1))
        return dense[:spare].view(S, B, C, H, W)

    def _zero_outside(self) -> Patches:
        """These patches with the window entries that fall outside the image set to zero, in place: only for
        ``values`` just computed, which nothing else holds."""
        (rows, top, bottom), (cols, left, right) = self._spans()
        if top == bottom == left == right == 0:
            return self
        _, H, W = self.node_shape
        inside_h, inside_w = (rows >= 0) & (rows < H), (cols >= 0) & (cols < W)
        outside = ~(inside_h[:, None, None, :, None] & inside_w[:, None, None, None, :])
        self.values.masked_fill_(outside, 0.0)
        return self

    def __mul__(self, value: Tensor | float) -> Patches:
        """Element-wise product with ``value`` broadcastable to ``[B, C, H, W]`` (per-channel or per-pixel)."""
        if not isinstance(value, Tensor):
            return self._with(self.values * value)
        value = self._as_4d(value)
        if value.shape[-2:] == (1, 1):  # per channel: [B', C', 1, 1] broadcasts onto every window as it is
            return self._with(self.values * value)
        windows, of_row = self._windows(value)
        if torch.is_grad_enabled() and (self.values.requires_grad or windows.requires_grad):
            return self._with(self.values * windows[of_row])  # out= below does not record gradients
        shape = torch.broadcast_shapes(self.values.shape, (self.values.shape[0], *windows.shape[1:]))
        product = self.values.new_empty(shape, dtype=torch.result_type(self.values, windows))
        for rows in self._row_chunks(product.element_size()):
            torch.mul(self.values[rows], windows[of_row[rows]], out=product[rows])
        return self._with(product)

    __rmul__ = __mul__

    def contract(self, value: Tensor, exact: bool = True, magnitudes: bool = False) -> Tensor:
        """``Σ A·value`` over the node, as float64 (summed in float64 if ``exact``, as
        :func:`~lightning_fedshard.verify.ops.base.contract` does for large nodes): ``value`` broadcastable to ``[B, C,
        H, W]`` gives ``[S, B]`` (the image is zero-padded, like a convolution's input). ``magnitudes``: ``Σ |A|·value``
        (without a temporary ``|A|`` of all the rows)."""
        value = self._as_4d(value)
        dtype = torch.float64 if exact else None
        item = 8 if exact else self.values.element_size()

        def rows_of(rows: slice) -> Tensor:
            return self.values[rows].abs() if magnitudes else self.values[rows]

        if value.shape[-2:] == (1, 1):  # entries outside the image are zero, so a per-channel value needs no window
            sums = torch.cat([rows_of(rows).sum((3, 4), dtype=dtype) for rows in self._row_chunks(item)])
            return (sums * value[..., 0, 0]).sum(-1, dtype=dtype).double()
        windows, of_row = self._windows(value)
        parts = [(rows_of(rows) * windows[of_row[rows]]).sum((2, 3, 4), dtype=dtype) for rows in self._row_chunks(item)]
        return torch.cat(parts).double()

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
        same_rows = self.positions is other.positions or torch.equal(self.positions, other.positions)
        if self.stride != other.stride or not same_rows:
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
        once the windows cover :data:`DENSE_FILL` of the image. Rows of ``1 × 1`` windows (the first step of a pass)
        take a matrix product instead of the transposed convolution (3x faster on cifar_biasfield's layers).
        """
        S, B, C, kH, kW = self.values.shape
        if (kH, kW) == (1, 1):  # each row is a vector of C coefficients: one matrix product with the kernel
            windows = _through_kernel(self.values.reshape(S * B, C), weight, dilation, groups)
        else:
            windows = F.conv_transpose2d(
                self.values.reshape(S * B, C, kH, kW), weight, None, stride, 0, 0, groups, dilation
            )
        composed = Patches(
            windows.view(S, B, *windows.shape[1:]),
            self.positions,
            (self.stride[0] * stride[0], self.stride[1] * stride[1]),
            (self.padding[0] * stride[0] + pads[0], self.padding[1] * stride[1] + pads[1]),
            tuple(in_shape),
            self.layout,
        )._zero_outside()
        if windows.shape[2] * windows.shape[3] >= DENSE_FILL * in_shape[1] * in_shape[2]:
            return composed.to_dense()
        return composed

    def __repr__(self) -> str:
        return (
            f"Patches(rows={self.values.shape[0]}, window={tuple(self.values.shape[3:])}, stride={self.stride}, "
            f"padding={self.padding}, node={self.node_shape})"
        )


def _through_kernel(rows: Tensor, weight: Tensor, dilation: tuple[int, int], groups: int) -> Tensor:
    """The transposed convolution of ``rows [N, C_out]`` (``1 × 1`` windows) with ``weight [C_out, C_in / groups, kH,
    kW]``: each row times the kernel, one matrix product per group, ``[N, C_in, d·(kH − 1) + 1, d·(kW − 1) + 1]``."""
    c_out, c_in, kh, kw = weight.shape
    N = rows.shape[0]
    taps = torch.bmm(
        rows.view(N, groups, c_out // groups).transpose(0, 1), weight.reshape(groups, c_out // groups, c_in * kh * kw)
    )  # [groups, N, C_in / groups · kH · kW]
    taps = taps.transpose(0, 1).reshape(N, groups * c_in, kh, kw)
    if dilation == (1, 1):
        return taps
    spread = taps.new_zeros(N, groups * c_in, dilation[0] * (kh - 1) + 1, dilation[1] * (kw - 1) + 1)
    spread[:, :, :: dilation[0], :: dilation[1]] = taps
    return spread
