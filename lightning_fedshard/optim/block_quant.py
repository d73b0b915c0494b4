"""Block-wise 8-bit quantisers for optimizer moments: one fp32 scale per block of consecutive coordinates.

The blocks tile one flat tensor (a rank's local shard, in its own order), the last one possibly short, so a block
never crosses a shard boundary. Two codes, both round-to-nearest with a per-block absolute-maximum scale:

- :func:`quantize_signed` (the first moment): ``q = round(x / s)`` in int8 ``[-127, 127]``, ``s = max|x| / 127``.
- :func:`quantize_sqrt` (the second moment, ≥ 0): the square root is coded, ``q = round(√v / s)`` in uint8
  ``[0, 255]`` with ``s = max√v / 255``, and decoded as ``(q·s)²``. Coding the root halves the dynamic range in
  bits (an 8-bit linear code of ``v`` itself would flush everything below ``max v / 510`` to zero, which would
  make Adam's denominator vanish), and Adam divides by ``√v`` anyway.

A block of zeros gets scale 0 and decodes to zeros. Example::

    q, s = quantize_signed(torch.randn(300), block=128)  # q: int8 (300,), s: float32 (3,)
    x = dequantize_signed(q, s, block=128)
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

__all__ = ["dequantize_signed", "dequantize_sqrt", "num_blocks", "quantize_signed", "quantize_sqrt"]


def num_blocks(numel: int, block: int) -> int:
    return math.ceil(numel / block)


def _blocks(flat: Tensor, block: int) -> Tensor:
    """``flat`` zero-padded to whole blocks, one block per row."""
    pad = num_blocks(flat.numel(), block) * block - flat.numel()
    return torch.nn.functional.pad(flat, (0, pad)).view(-1, block)


def _quantize(values: Tensor, block: int, levels: int, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    rows = _blocks(values.reshape(-1).float(), block)
    scales = rows.abs().amax(dim=1) / levels
    codes = torch.where(scales[:, None] > 0, rows / scales.clamp(min=torch.finfo(torch.float32).tiny)[:, None], 0.0)
    codes = codes.round_().clamp_(-levels if dtype == torch.int8 else 0, levels).to(dtype)
    return codes.view(-1)[: values.numel()].view(values.shape), scales


def _dequantize(codes: Tensor, scales: Tensor, block: int) -> Tensor:
    rows = _blocks(codes.reshape(-1).float(), block)
    return (rows * scales[: rows.shape[0], None]).view(-1)[: codes.numel()].view(codes.shape)


def quantize_signed(x: Tensor, block: int) -> tuple[Tensor, Tensor]:
    """int8 codes shaped like ``x`` and one fp32 scale per block of ``x.reshape(-1)``."""
    return _quantize(x, block, 127, torch.int8)


def dequantize_signed(codes: Tensor, scales: Tensor, block: int) -> Tensor:
    return _dequantize(codes, scales, block)


def quantize_sqrt(v: Tensor, block: int) -> tuple[Tensor, Tensor]:
    """uint8 codes of ``√v`` shaped like ``v`` (``v ≥ 0``) and one fp32 scale per block."""
    return _quantize(v.sqrt(), block, 255, torch.uint8)


def dequantize_sqrt(codes: Tensor, scales: Tensor, block: int) -> Tensor:
    return _dequantize(codes, scales, block).square_()
