"""OCP Microscaling (MX v1.0) formats: ``mxfp8`` (E4M3), ``mxfp8_e5m2``, ``mxfp6`` (E2M3), ``mxfp6_e3m2``,
``mxfp4`` (E2M1).

A block of 32 coordinates shares one E8M0 scale byte ``b`` (``X = 2^(b-127)``), chosen as in the spec's
sample conversion (torchao's ``FLOOR``): ``X = 2^(floor(log2(amax)) - emax_elem)``, exponent clamped to
``[-127, 127]``; an all-zero block gets byte 0. Each element ``V_i / X`` is rounded to nearest-even in
the element format, with subnormals, and saturated to ± the largest normal (FLOOR can overshoot it by
up to 2x, e.g. ``amax/X`` in ``[256, 512)`` against E4M3's 448). Layout of a message: the scale bytes of
all blocks, then the element bit patterns ``sign|exponent|mantissa`` bit-packed (fp6: 4 in 3 bytes,
fp4: 2 per byte): 8.25, 6.25 and 4.25 bits/coordinate. The partial sum is re-quantized at every hop.

The element rounding is computed from the format's parameters alone (no float8 dtypes), so it runs
on any device and for the fp6/fp4 formats that torch has no cast for.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from lightning_fedshard.dynamiq.bitpack import pack_bits_fast, packed_bytes, unpack_bits_fast
from lightning_fedshard.dynamiq.codec import Codec, check_finite, register_codec

__all__ = [
    "E2M1",
    "E2M3",
    "E3M2",
    "E4M3",
    "E5M2",
    "ElementFormat",
    "MXCodec",
    "MXFP4Codec",
    "MXFP6Codec",
    "MXFP6E3M2Codec",
    "MXFP8Codec",
    "MXFP8E5M2Codec",
    "element_codes",
    "element_values",
    "exp2i",
    "round_to_element",
]


@dataclass(frozen=True)
class ElementFormat:
    """A small float format: ``ebits`` exponent bits with ``bias``, ``mbits`` mantissa bits, subnormals,
    and ``max_normal`` the largest finite magnitude (values beyond it saturate).

    Example::

        E4M3 = ElementFormat("e4m3", ebits=4, mbits=3, bias=7, max_normal=448.0)
    """

    name: str
    ebits: int
    mbits: int
    bias: int
    max_normal: float

    @property
    def width(self) -> int:
        """Bits per element: sign, exponent and mantissa."""
        return 1 + self.ebits + self.mbits

    @property
    def emin(self) -> int:
        """Exponent of the smallest normal number (also the exponent subnormals share)."""
        return 1 - self.bias

    @property
    def emax(self) -> int:
        """Exponent of the largest normal number (the spec's ``emax_elem``)."""
        return math.floor(math.log2(self.max_normal))

    @property
    def max_code(self) -> int:
        """Magnitude code (exponent and mantissa fields) of ``max_normal``."""
        significand = self.max_normal / 2.0 ** (self.emax - self.mbits)
        return ((self.emax - self.emin) << self.mbits) + int(significand)


E4M3 = ElementFormat("e4m3", ebits=4, mbits=3, bias=7, max_normal=448.0)
E5M2 = ElementFormat("e5m2", ebits=5, mbits=2, bias=15, max_normal=57344.0)
E2M3 = ElementFormat("e2m3", ebits=2, mbits=3, bias=1, max_normal=7.5)
E3M2 = ElementFormat("e3m2", ebits=3, mbits=2, bias=3, max_normal=28.0)
E2M1 = ElementFormat("e2m1", ebits=2, mbits=1, bias=1, max_normal=6.0)

#: Bias of the E8M0 scale byte.
_SCALE_BIAS = 127


def exp2i(e: Tensor) -> Tensor:
    """``2^e`` as fp32 for integer ``e`` in ``[-149, 127]``, built from the bit pattern.

    Exact by construction, including the subnormal ``2^-127`` of an E8M0 byte 0, whatever the
    device's ``exp2`` does."""
    e = e.to(torch.int32)
    normal = (e.clamp(min=-126) + 127) << 23
    subnormal = torch.ones_like(e) << (e.clamp(-149, -127) + 149)
    return torch.where(e >= -126, normal, subnormal).view(torch.float32)


def _exp2_normal(e: Tensor) -> Tensor:
    """``2^e`` for integer ``e`` in ``[-126, 127]`` (the fp32 normal range): ``exp2i`` without the subnormal
    branch, for the per-element hot paths whose exponents never leave that range."""
    return ((e.to(torch.int32) + 127) << 23).view(torch.float32)


def element_codes(p: Tensor, fmt: ElementFormat) -> Tensor:
    """Rounds fp32 ``p`` to nearest-even in ``fmt`` with saturation; returns the int32 bit patterns.

    The magnitude code ``(e - emin)·2^mbits + round(|p| / 2^(e - mbits))``, with ``e`` the binade of
    ``|p|`` clamped at ``emin``, equals the exponent|mantissa fields for normals and subnormals alike,
    and a round-up that carries into the next binade lands on the right code; so saturation is a clamp."""
    bits = p.to(torch.float32).contiguous().view(torch.int32)
    # the binade is read off the fp32 exponent field; fp32 zeros and subnormals (field 0) sit far below
    # any element's emin, so the clamp covers them too
    binade = (((bits >> 23) & 0xFF) - 127).clamp_(min=fmt.emin)
    mag = (bits & 0x7FFFFFFF).view(torch.float32)
    # scaling by a power of two is exact; torch.round rounds halves to even
    significand = torch.round(mag * _exp2_normal(fmt.mbits - binade)).to(torch.int32)
    code = ((binade - fmt.emin) << fmt.mbits).add_(significand).clamp_(max=fmt.max_code)
    sign = ((bits >> 31) & 1) << (fmt.ebits + fmt.mbits)
    return code.bitwise_or_(sign)


def element_values(codes: Tensor, fmt: ElementFormat) -> Tensor:
    """The fp32 values of ``fmt`` bit patterns (inverse of ``element_codes`` on its outputs)."""
    codes = codes.to(torch.int32)
    sign = (codes >> (fmt.ebits + fmt.mbits)) & 1
    field = (codes >> fmt.mbits) & ((1 << fmt.ebits) - 1)
    mantissa = codes & ((1 << fmt.mbits) - 1)
    significand = torch.where(field > 0, mantissa + (1 << fmt.mbits), mantissa)
    # subnormals (field 0) share the exponent of field 1
    value = significand.to(torch.float32) * _exp2_normal(field.clamp(min=1) - fmt.bias - fmt.mbits)
    return torch.where(sign.bool(), -value, value)


def round_to_element(p: Tensor, fmt: ElementFormat) -> Tensor:
    """``p`` rounded to nearest-even in ``fmt`` and saturated, as fp32."""
    return element_values(element_codes(p, fmt), fmt)


class MXCodec(Codec):
    """An MX format: 32 elements of ``fmt`` sharing one E8M0 scale byte (subclasses set ``fmt``).

    Example::

        codec = make_codec("mxfp4")
        msg = codec.encode(x, summands=1)                # 17 bytes per 32 coordinates
        x_hat = codec.decode(msg, x.numel(), summands=1)
    """

    block = 32
    fmt: ClassVar[ElementFormat] = E4M3

    def message_bytes(self, numel: int, summands: int) -> int:
        return self.blocks_in(numel) + packed_bytes(numel, self.fmt.width)

    def encode(self, x: Tensor, summands: int) -> Tensor:
        check_finite(x, self.name)
        self.blocks_in(x.numel())
        blocks = x.detach().reshape(-1, self.block).to(torch.float32)
        amax = blocks.abs().amax(dim=1)
        _, exponent = torch.frexp(amax)
        floor_log2 = exponent - 1
        scale_exp = torch.where(amax > 0, floor_log2 - self.fmt.emax, torch.full_like(floor_log2, -_SCALE_BIAS))
        scale_exp = scale_exp.clamp(-_SCALE_BIAS, _SCALE_BIAS)
        # V / X is exact: X is a power of two and V / X stays far from fp32's range limits
        codes = element_codes(blocks * exp2i(-scale_exp)[:, None], self.fmt)
        scale_bytes = (scale_exp + _SCALE_BIAS).to(torch.uint8)
        return torch.cat([scale_bytes, pack_bits_fast(codes, self.fmt.width)])

    def decode(self, msg: Tensor, numel: int, summands: int) -> Tensor:
        blocks = self.blocks_in(numel)
        msg = msg.reshape(-1)
        if msg.numel() < self.message_bytes(numel, summands):
            raise ValueError(f"{self.name}: a message of {msg.numel()} bytes cannot hold {numel} coordinates.")
        scale_exp = msg[:blocks].to(torch.int32) - _SCALE_BIAS
        codes = unpack_bits_fast(msg[blocks:], self.fmt.width, numel)
        values = element_values(codes, self.fmt).view(blocks, self.block)
        # element × power of two is exact: even at scale 2^-127 the smallest element quantum stays >= 2^-149
        return (values * exp2i(scale_exp)[:, None]).reshape(-1)


class MXFP8Codec(MXCodec):
    """MXFP8 with E4M3 elements (max 448): 8.25 bits/coordinate.

    Example::

        msg = make_codec("mxfp8").encode(x, summands=1)   # 33 bytes per 32 coordinates
    """

    name = "mxfp8"
    fmt = E4M3


class MXFP8E5M2Codec(MXCodec):
    """MXFP8 with E5M2 elements (max 57344): 8.25 bits/coordinate.

    Example::

        msg = make_codec("mxfp8_e5m2").encode(x, summands=1)
    """

    name = "mxfp8_e5m2"
    fmt = E5M2


class MXFP6Codec(MXCodec):
    """MXFP6 with E2M3 elements (max 7.5), four per three bytes: 6.25 bits/coordinate.

    Example::

        msg = make_codec("mxfp6").encode(x, summands=1)   # 25 bytes per 32 coordinates
    """

    name = "mxfp6"
    fmt = E2M3


class MXFP6E3M2Codec(MXCodec):
    """MXFP6 with E3M2 elements (max 28): 6.25 bits/coordinate.

    Example::

        msg = make_codec("mxfp6_e3m2").encode(x, summands=1)
    """

    name = "mxfp6_e3m2"
    fmt = E3M2


class MXFP4Codec(MXCodec):
    """MXFP4 with E2M1 elements (values 0, 0.5, 1, 1.5, 2, 3, 4, 6), two per byte: 4.25 bits/coordinate.

    Example::

        msg = make_codec("mxfp4").encode(x, summands=1)   # 17 bytes per 32 coordinates
    """

    name = "mxfp4"
    fmt = E2M1


for _cls in (MXFP8Codec, MXFP8E5M2Codec, MXFP6Codec, MXFP6E3M2Codec, MXFP4Codec):
    register_codec(_cls.name, _cls)
