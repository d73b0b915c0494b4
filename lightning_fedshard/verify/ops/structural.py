"""Operators that only move, copy, sum or join values: their bounds are exact and their backward step is the adjoint.

:class:`Select` is every pure data movement at once — Slice, Gather with constant indices, Split, Expand, Tile,
Pad, nearest-neighbour Resize/Upsample, DepthToSpace and the like — as "output element ``i`` is input element
``index[i]``" (−1: a constant, the padding value). The loader finds the indices by running the ONNX operator
itself on the input's flat positions, so each one has ONNX's exact semantics; the adjoint adds the coefficients of
the outputs back onto the elements they copy (an element copied twice gets both). :class:`Transpose`,
:class:`Reduce` (ReduceSum, ReduceMean) and :class:`Concat` (of any number of computed tensors and constants) are
the others.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from lightning_fedshard.verify.ops.base import BoundOp, Interval, LinearOp, contract, contract_abs, contract_error, flat

__all__ = ["Concat", "Reduce", "Select", "Transpose"]


class Select(LinearOp):
    """``y.flat[i] = x.flat[index[i]]``, or ``fill.flat[i]`` where ``index[i] = −1`` (node shapes without the
    batch dimension).

    Example::

        # x[:, 1:3] of a (2, 4) node
        pick = Select(torch.tensor([1, 2, 5, 6]), in_shape=(2, 4), out_shape=(2, 2), label="Slice")
    """

    onnx_types = ("Slice", "Gather", "Split", "Expand", "Tile", "Pad", "Resize", "Upsample", "DepthToSpace")

    def __init__(
        self,
        index: Tensor,
        in_shape: tuple[int, ...],
        out_shape: tuple[int, ...],
        fill: Tensor | None = None,
        label: str = "Select",
    ) -> None:
        self.in_shape, self.out_shape, self.label = tuple(in_shape), tuple(out_shape), label
        size = int(torch.Size(self.in_shape).numel())
        if index.shape != (int(torch.Size(self.out_shape).numel()),):
            raise ValueError(f"{label}: {index.numel()} indices for an output of shape {self.out_shape}")
        if bool(((index < -1) | (index >= size)).any()):
            raise ValueError(f"{label}: an index outside the input's {size} elements")
        self.index = index
        #: The output positions that copy an input element, and those elements (fixed: found once here, not at
        #: every transpose, where a boolean mask would be a host sync per pass on a GPU).
        self.copying = (index >= 0).nonzero().flatten()
        kept = self.sources = index[self.copying]
        #: The most outputs that copy one input element (Expand, Tile, Resize): the transpose sums that many.
        self.copies = int(torch.bincount(kept).max()) if kept.numel() else 1
        padded = index < 0
        self.fill = None if fill is None or not bool(padded.any()) else torch.where(padded, fill.reshape(-1), 0.0)

    def linear(self, x: Tensor) -> Tensor:
        rows = flat(x, 1)
        taken = rows[:, self.index.clamp(min=0)].masked_fill(self.index < 0, 0.0)
        return taken.reshape(x.shape[0], *self.out_shape)

    abs_linear = linear

    def constant(self) -> Tensor | None:
        return None if self.fill is None else self.fill.reshape(self.out_shape)

    def transpose(self, A: Tensor) -> Tensor:
        S, B = A.shape[:2]
        columns = flat(A, 2)  # also with no rows (a rank's empty share of a row partition)
        A_in = columns.new_zeros(S, B, int(torch.Size(self.in_shape).numel()))
        A_in.index_add_(2, self.sources, columns[:, :, self.copying])
        return A_in.reshape(S, B, *self.in_shape)

    def terms(self) -> tuple[int, int]:
        return 0, self.copies

    def __repr__(self) -> str:
        return f"{self.label}({list(self.in_shape)}→{list(self.out_shape)})"


class Transpose(LinearOp):
    """Permute the node dimensions (``perm`` over the node shape, batch excluded).

    Example::

        Transpose((1, 0), in_shape=(3, 5))   # (3, 5) → (5, 3)
    """

    onnx_types = ("Transpose",)

    def __init__(self, perm: Sequence[int], in_shape: tuple[int, ...]) -> None:
        if sorted(perm) != list(range(len(in_shape))):
            raise ValueError(f"Transpose perm {list(perm)} is not a permutation of {len(in_shape)} dimensions")
        self.perm, self.in_shape = tuple(perm), tuple(in_shape)
        self.inverse = tuple(sorted(range(len(perm)), key=lambda i: perm[i]))

    def linear(self, x: Tensor) -> Tensor:
        return x.permute(0, *(p + 1 for p in self.perm))

    abs_linear = linear

    def transpose(self, A: Tensor) -> Tensor:
        return A.permute(0, 1, *(p + 2 for p in self.inverse))

    def terms(self) -> tuple[int, int]:
        return 0, 1

    def __repr__(self) -> str:
        return f"Transpose{self.perm}"


class Reduce(LinearOp):
    """Sum (or mean) over ``axes`` of the node shape, keeping them as size 1 or dropping them (ONNX ReduceSum,
    ReduceMean).

    Example::

        Reduce((1,), in_shape=(4, 6), keepdims=True)   # (4, 6) → (4, 1)
    """

    onnx_types = ("ReduceSum", "ReduceMean")

    def __init__(
        self, axes: Sequence[int], in_shape: tuple[int, ...], keepdims: bool = True, mean: bool = False
    ) -> None:
        self.axes, self.in_shape, self.keepdims, self.mean = tuple(sorted(axes)), tuple(in_shape), keepdims, mean
        if any(not 0 <= a < len(in_shape) for a in self.axes):
            raise ValueError(f"Reduce axes {list(axes)} outside a node of {len(in_shape)} dimensions")
        count = math.prod(in_shape[a] for a in self.axes)
        self.scale = 1 / count if mean else 1.0

    def linear(self, x: Tensor) -> Tensor:
        total = x.sum(dim=[a + 1 for a in self.axes], keepdim=self.keepdims)
        return total * self.scale if self.mean else total

    abs_linear = linear

    def transpose(self, A: Tensor) -> Tensor:
        if not self.keepdims:
            for a in self.axes:
                A = A.unsqueeze(a + 2)
        A = A.expand(*A.shape[:2], *self.in_shape)
        return A * self.scale if self.mean else A

    def terms(self) -> tuple[int, int]:
        count = math.prod(self.in_shape[a] for a in self.axes)
        return count + 1, 1  # the sum, and the mean's division

    def __repr__(self) -> str:
        return f"Reduce{'Mean' if self.mean else 'Sum'}{self.axes}"


class Concat(BoundOp):
    """Join computed tensors and constants along ``axis`` of the node shape (ONNX Concat). ``parts`` lists each
    piece in order: ``None`` for the next computed input, or a constant ``[*piece shape]``.

    Example::

        join = Concat(axis=0, parts=[None, torch.zeros(3), None], sizes=[5, 3, 5])   # two inputs and a constant
    """

    onnx_types = ("Concat",)
    accepts_patches = False

    def __init__(self, axis: int, parts: Sequence[Tensor | None], sizes: Sequence[int]) -> None:
        if len(parts) != len(sizes):
            raise ValueError("Concat needs one size per part")
        self.axis, self.parts, self.sizes = axis, list(parts), list(sizes)

    def to(self, dtype=None, device=None):
        self.parts = [None if p is None else p.to(device=device, dtype=dtype or p.dtype) for p in self.parts]
        return self

    def _join(self, inputs: Sequence[Tensor]) -> Tensor:
        # Inputs may hold one batch entry or one per domain (bounds that branch-and-bound refined next to bounds of
        # the whole box): every piece is broadcast to the largest.
        batch = max(x.shape[0] for x in inputs)
        computed = iter(inputs)
        pieces = [next(computed) if p is None else p[None] for p in self.parts]
        return torch.cat([piece.expand(batch, *piece.shape[1:]) for piece in pieces], dim=self.axis + 1)

    def forward(self, *inputs: Tensor) -> Tensor:
        return self._join(inputs)

    def ibp(self, *inputs: Interval) -> Interval:
        return Interval(self._join([x.lower for x in inputs]), self._join([x.upper for x in inputs]))

    def backward(self, A, inputs, alpha=None):
        pieces = torch.split(A, self.sizes, dim=self.axis + 2)
        coefficients, bias = [], None
        for part, piece in zip(self.parts, pieces, strict=True):
            if part is None:
                coefficients.append(piece)
            else:  # its products round, relative u each (the float64 sum is charged along)
                charge = contract_error(math.prod(piece.shape[2:]), piece.dtype) * part.abs()
                term = contract(piece, part) - contract_abs(piece, charge)
                bias = term if bias is None else bias + term
        return coefficients, bias

    def __repr__(self) -> str:
        return f"Concat(axis={self.axis}, {len(self.parts)} parts)"
