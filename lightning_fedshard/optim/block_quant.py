"""Block-wise 8-bit codes for optimizer moments: one fp32 scale per block, log-spaced levels, stochastic rounding.

The blocks tile one flat tensor (a rank's local shard, in its own order), the last one possibly short, so a block
never crosses a shard boundary. Each block's scale is its absolute maximum ``s``; a value ``x`` is coded as the index
of a level ``L[c]`` of ``|x| / s`` on a log-spaced map (:func:`code_levels`), with ``x``'s sign for the first moment:

- :func:`quantize_signed` (the first moment ``m``): int8 ``c`` in ``[-127, 127]``, decoded as ``sign(c)·L[|c|]·s``,
  ``L`` = 0 and 127 levels from ``1e-5`` to 1 (each 9.5 % above the previous).
- :func:`quantize_sqrt` (the second moment ``v ≥ 0``): its square root is coded, uint8 ``c`` in ``[0, 255]``,
  decoded as ``(L[c]·s)²``, ``L`` = 0 and 255 levels from ``1e-7`` to 1 (6.5 % apart). Adam divides by ``√v``, so
  the root is what needs a constant relative precision; 7 decades of ``√v`` are 14 of ``v``.

Why log-spaced: Adam's step ``m̂/√v̂`` is scale-free per coordinate, so a coordinate a thousand times smaller than its
block's largest deserves the same relative precision. A linear code (``round(x/s·127)``) has none left for it: with
one coordinate of gradient 1.0 in a block of 128 and the others at 0.03, each step's increment of their ``m`` was
below half a code and rounded away, and AdamW moved them half as far as fp32 AdamW (issue 32: 0.1265 against 0.2528).

Why stochastic rounding: ``v``'s increments per step are ``(1 - β2) ≈ 1e-3`` of its value, far below any 8-bit
level spacing, so round-to-nearest freezes ``v`` (bitsandbytes' round-to-nearest dynamic map moves those
coordinates by 0.407 in the scenario above). Rounding up with probability equal to the fraction of the gap makes the
decoded value unbiased, ``E[decode(code(x))] = x``, so the moments follow their exact recursion in expectation.

The random numbers are a hash, not a generator's: a block's numbers come from its scale (its top 20 bits, so a last-bit
difference between two reductions of the same gradient does not change them), the caller's ``seed`` (the optimizer
passes the step and which moment) and the position in the block. The same block therefore rounds the same way
whether it is in a whole tensor or in a shard, in one process or eight, before or after a resume, and no generator's
state is consumed or has to be checkpointed. A block of zeros gets scale 0 and decodes to zeros. Example::

    q, s = quantize_signed(torch.randn(300), block=128, seed=0)  # q: int8 (300,), s: float32 (3,)
    x = dequantize_signed(q, s, block=128)
"""

from __future__ import annotations

import functools
import math

import torch
from torch import Tensor

__all__ = [
    "SIGNED_DECADES",
    "SQRT_DECADES",
    "code_levels",
    "dequantize_signed",
    "dequantize_sqrt",
    "num_blocks",
    "quantize_signed",
    "quantize_sqrt",
]

SIGNED_DECADES = 5  # m: 127 levels over 1e-5 .. 1 of the block's max
SQRT_DECADES = 7  # √v: 255 levels over 1e-7 .. 1 of the block's max
_MASK32 = 0xFFFFFFFF
_UNIFORM_BITS = 23  # the dither's resolution: multiples of 2^-23 in [0, 1)
_WEYL_STEP = 5184445  # an odd integer near (√5 - 1)/2 · 2^23: consecutive positions get well-spread numbers


def num_blocks(numel: int, block: int) -> int:
    """How many blocks of ``block`` coordinates tile ``numel`` (the last one possibly short)."""
    return math.ceil(numel / block)


_SIGNED_TOP, _SQRT_TOP = 127, 255  # the largest code of m's magnitude and of √v


def _magnitudes(codes: Tensor, top: int, decades: int) -> Tensor:
    """``L[c]`` for codes ``c`` in ``[0, top]`` (float32 holding integers): 0 for ``c = 0``, else
    ``10^(-decades·(top - c)/(top - 1))``, computed as an exponential (cheaper than looking the level up; exactly 1 at
    ``c = top``). Encoding and decoding both take the levels from here, so they agree to the bit."""
    per_efold = (top - 1) / (decades * math.log(10.0))
    return (codes - top).mul_(1.0 / per_efold).exp_().masked_fill_(codes == 0, 0.0)


def code_levels(signed: bool, device: torch.device | str = "cpu") -> Tensor:
    """The magnitudes the codes stand for, ascending, relative to the block's scale: ``L[0] = 0``, ``L[-1] = 1``
    and ``L[c] = 10^(-D·(n - c)/(n - 1))`` for ``c = 1..n`` (``n = 127``, ``D = 5`` for the signed code of ``m``;
    ``n = 255``, ``D = 7`` for the code of ``√v``)."""
    top, decades = (_SIGNED_TOP, SIGNED_DECADES) if signed else (_SQRT_TOP, SQRT_DECADES)
    return _magnitudes(torch.arange(top + 1, device=device, dtype=torch.float32), top, decades)


def _blocks(flat: Tensor, block: int) -> Tensor:
    """``flat`` zero-padded to whole blocks, one block per row."""
    pad = num_blocks(flat.numel(), block) * block - flat.numel()
    return torch.nn.functional.pad(flat, (0, pad)).view(-1, block)


@functools.cache
def _weyl(block: int, device: torch.device) -> Tensor:
    steps = torch.arange(block, dtype=torch.int64) * _WEYL_STEP & ((1 << _UNIFORM_BITS) - 1)
    return (steps.to(torch.float32) * 2.0**-_UNIFORM_BITS).to(device)


def _dither(scales: Tensor, block: int, seed: int) -> Tensor:
    """One number in ``[0, 1)`` per coordinate of each block: a per-block offset hashed from the scale's top 20 bits
    and ``seed`` (three rounds of a 32-bit multiply-xorshift mix), plus a Weyl sequence along the block, modulo 1.
    Both terms are multiples of ``2^-23`` below 1, so their sum and its fractional part are exact in float32."""
    h = (scales.contiguous().view(torch.int32).to(torch.int64) & _MASK32) >> 12
    h = h ^ ((seed * 0x9E3779B1 + 0x7F4A7C15) & _MASK32)
    for _ in range(3):
        h = ((h >> 16) ^ h) * 0x45D9F3B & _MASK32
    offsets = (((h >> 16) ^ h) >> (32 - _UNIFORM_BITS)).to(torch.float32) * 2.0**-_UNIFORM_BITS
    return (offsets[:, None] + _weyl(block, scales.device)[None, :]).frac_()


def _quantize(magnitudes: Tensor, top: int, decades: int, seed: int) -> tuple[Tensor, Tensor]:
    """Codes (float32 holding integers in ``[0, top]``) of non-negative ``magnitudes`` in blocks (one per row), and
    the per-block scales, stochastically rounded."""
    scales = magnitudes.amax(dim=1)
    ratio = magnitudes / scales.clamp(min=torch.finfo(torch.float32).tiny)[:, None]  # in [0, 1]; a zero block: 0
    # the code below `ratio` in closed form (inverting `_magnitudes`), several times faster than a binary search over
    # the levels; where the log's rounding puts it one off (`ratio` within 1e-4 of a gap from a level), the fraction
    # is a hair outside [0, 1] and the code is that level, as close as a correct bracket would give
    per_efold = (top - 1) / (decades * math.log(10.0))
    low = ratio.log().mul_(per_efold).add_(top).floor_().clamp_(0, top - 1)
    below, above = _magnitudes(low, top, decades), _magnitudes(low + 1, top, decades)
    fraction = ratio.sub_(below).div_(above.sub_(below))  # 1 exactly on a level: kept, as the dither is < 1
    return low.add_(_dither(scales, magnitudes.shape[1], seed) < fraction), scales


def _unblock(rows: Tensor, like: Tensor) -> Tensor:
    return rows.reshape(-1)[: like.numel()].view(like.shape)


def quantize_signed(x: Tensor, block: int, seed: int) -> tuple[Tensor, Tensor]:
    """int8 codes shaped like ``x`` and one fp32 scale per block of ``x.reshape(-1)``; ``seed`` picks the rounding
    (the same ``seed`` and block always round the same way)."""
    rows = _blocks(x.reshape(-1).float(), block)
    codes, scales = _quantize(rows.abs(), _SIGNED_TOP, SIGNED_DECADES, seed)
    return _unblock(codes.copysign_(rows), x).to(torch.int8), scales


def dequantize_signed(codes: Tensor, scales: Tensor, block: int) -> Tensor:
    """fp32 values of :func:`quantize_signed`'s codes, shaped like ``codes``."""
    rows = _blocks(codes.reshape(-1).float(), block)
    magnitudes = _magnitudes(rows.abs(), _SIGNED_TOP, SIGNED_DECADES).mul_(scales[: rows.shape[0], None])
    return _unblock(magnitudes.copysign_(rows), codes)


def quantize_sqrt(v: Tensor, block: int, seed: int) -> tuple[Tensor, Tensor]:
    """uint8 codes of ``√v`` shaped like ``v`` (``v ≥ 0``) and one fp32 scale per block; ``seed`` as for
    :func:`quantize_signed`."""
    codes, scales = _quantize(_blocks(v.reshape(-1).float().sqrt(), block), _SQRT_TOP, SQRT_DECADES, seed)
    return _unblock(codes, v).to(torch.uint8), scales


def dequantize_sqrt(codes: Tensor, scales: Tensor, block: int) -> Tensor:
    """fp32 ``v`` (the square of the decoded root) of :func:`quantize_sqrt`'s codes, shaped like ``codes``."""
    rows = _blocks(codes.reshape(-1).float(), block)
    return _unblock(_magnitudes(rows, _SQRT_TOP, SQRT_DECADES).mul_(scales[: rows.shape[0], None]), codes).square_()
