"""Wire-level byte handling: little-endian bit packing of unsigned integer codes of a fixed width (1–16 bits),
and raw bytes of float tensors."""

from __future__ import annotations

import math

import torch
from torch import Tensor

__all__ = [
    "as_bytes",
    "pack_bits",
    "pack_bits_fast",
    "packed_bytes",
    "unpack_bits",
    "unpack_bits_fast",
    "view_bytes_as",
]


def packed_bytes(count: int, width: int) -> int:
    """Bytes that ``count`` codes of ``width`` bits take (the last byte zero-padded)."""
    return (count * width + 7) // 8


def pack_bits(codes: Tensor, width: int) -> Tensor:
    """Packs ``codes`` (any integer dtype, values in ``[0, 2**width)``) into a uint8 stream: code ``i``
    occupies bits ``[i·width, (i+1)·width)``, bit 0 being the least significant bit of byte 0."""
    _check_width(width)
    codes = codes.reshape(-1).to(torch.int32)
    shifts = torch.arange(width, device=codes.device, dtype=torch.int32)
    bits = ((codes[:, None] >> shifts) & 1).reshape(-1)
    pad = (-bits.numel()) % 8
    if pad:
        bits = torch.cat([bits, bits.new_zeros(pad)])
    weights = 1 << torch.arange(8, device=codes.device, dtype=torch.int32)
    return (bits.view(-1, 8) * weights).sum(dim=1).to(torch.uint8)


def unpack_bits(packed: Tensor, width: int, count: int) -> Tensor:
    """Inverse of ``pack_bits``: the first ``count`` codes of ``width`` bits, as int32."""
    _check_width(width)
    if packed.numel() < packed_bytes(count, width):
        raise ValueError(f"{packed.numel()} bytes cannot hold {count} codes of {width} bits.")
    shifts = torch.arange(8, device=packed.device, dtype=torch.int32)
    bits = ((packed.reshape(-1).to(torch.int32)[:, None] >> shifts) & 1).reshape(-1)[: count * width]
    weights = 1 << torch.arange(width, device=packed.device, dtype=torch.int32)
    return (bits.view(count, width) * weights).sum(dim=1, dtype=torch.int32)


def pack_bits_fast(codes: Tensor, width: int) -> Tensor:
    """The same bytes as ``pack_bits``, built from whole bytes instead of one int32 per bit.

    For widths up to 8, ``8 / gcd(width, 8)`` codes fill a whole number of bytes (at most 56 bits), so a
    group is assembled in one int64 and cut into bytes: 4-8x less temporary memory than ``pack_bits``,
    which matters for gradient-sized messages. Wider codes fall back to ``pack_bits``."""
    _check_width(width)
    if width > 8:
        return pack_bits(codes, width)
    codes = codes.reshape(-1)
    count = codes.numel()
    if width == 8:
        return (codes & 0xFF).to(torch.uint8)
    group = 8 // math.gcd(width, 8)
    group_bytes = width * group // 8
    # pack_bits keeps only the low ``width`` bits of each code; mask so neighbours are never touched
    codes = codes.to(torch.int64) & ((1 << width) - 1)
    pad = (-count) % group
    if pad:
        codes = torch.cat([codes, codes.new_zeros(pad)])
    shifts = torch.arange(group, device=codes.device, dtype=torch.int64) * width
    words = (codes.view(-1, group) << shifts).sum(dim=1)
    byte_shifts = torch.arange(group_bytes, device=codes.device, dtype=torch.int64) * 8
    packed = ((words[:, None] >> byte_shifts) & 0xFF).to(torch.uint8).reshape(-1)
    return packed[: packed_bytes(count, width)]


def unpack_bits_fast(packed: Tensor, width: int, count: int) -> Tensor:
    """Inverse of ``pack_bits_fast`` (and of ``pack_bits``): the first ``count`` codes, as int32."""
    _check_width(width)
    if width > 8:
        return unpack_bits(packed, width, count)
    needed = packed_bytes(count, width)
    if packed.numel() < needed:
        raise ValueError(f"{packed.numel()} bytes cannot hold {count} codes of {width} bits.")
    data = packed.reshape(-1)[:needed]
    if width == 8:
        return data.to(torch.int32)
    group = 8 // math.gcd(width, 8)
    group_bytes = width * group // 8
    data = data.to(torch.int64)
    pad = (-needed) % group_bytes
    if pad:
        data = torch.cat([data, data.new_zeros(pad)])
    byte_shifts = torch.arange(group_bytes, device=data.device, dtype=torch.int64) * 8
    words = (data.view(-1, group_bytes) << byte_shifts).sum(dim=1)
    shifts = torch.arange(group, device=data.device, dtype=torch.int64) * width
    codes = (words[:, None] >> shifts) & ((1 << width) - 1)
    return codes.reshape(-1)[:count].to(torch.int32)


def _check_width(width: int) -> None:
    if not 1 <= width <= 16:
        raise ValueError(f"Bit width must be in [1, 16], got {width}.")


def as_bytes(t: Tensor) -> Tensor:
    """The raw bytes of ``t`` (native byte order) as a 1-D uint8 tensor."""
    return t.contiguous().reshape(-1).view(torch.uint8)


def view_bytes_as(data: Tensor, dtype: torch.dtype) -> Tensor:
    """Reinterprets a 1-D uint8 tensor as ``dtype``.

    ``Tensor.view(dtype)`` needs the storage offset to be a multiple of the item size; a slice of a
    message (e.g. the payload after a bitmap) may not be, and then it is copied first."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    if data.numel() % itemsize:
        raise ValueError(f"{data.numel()} bytes are not a whole number of {dtype} values.")
    data = data.reshape(-1)
    if not data.is_contiguous() or (data.storage_offset() % itemsize):
        data = data.clone()
    return data.view(dtype)
