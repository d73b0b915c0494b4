"""The DynamiQ decompress-accumulate-recompress (DAR) hop in Triton, byte for byte equal to ``DynamiQCodec``.

A ring hop turns a received message holding ``h`` chunks into one holding ``h + 1``:
``encode(decode(msg) + local, h + 1)``. The widths of the outgoing message are water-filled over the
*whole* message (``allocate_widths``), so no group can be quantized before every group's max |sum| is
known, and every group's payload offset is a prefix sum over the groups before it. Without a grid-wide
barrier that takes a few launches, all of fixed size and with no host synchronisation (the shapes depend
on ``n`` alone, so the sequence can be captured in a CUDA graph). Programs own ``BLOCK_GROUPS`` groups of 32:

1. ``_block_widths_in`` (per block): the width sum of each block of the received message (its 3-bit
   codes only); program 0 also clears the key histogram and the non-finite flag.
2. ``_scan_blocks`` (one program): exclusive prefix of those sums, the blocks' first payload words.
3. ``_decode_fields`` (per block): decodes each coordinate, adds the local chunk, takes each group's
   max |sum|, its super-group's scale and log-scale (written into the outgoing header), the group's
   water-filling key (``log2_eighths``, kept as int16) and adds the keys to a 2048-bin histogram with
   one atomic per distinct key of the block; sets the flag on NaN or Inf. Nothing coordinate-sized is written.
4. ``_water_level`` (one program): the water level from the histogram's suffix counts
   (``allocate_widths``'s formula, 2097 levels at once).
5. ``_block_widths_out`` (per block): each block's width sum at that level and the extra width units
   its groups would take one level lower.
6. ``_place_blocks`` (one program): prefix sums of both, and how far the leftover units reach
   (the ``cumsum(extra) <= budget - widths.sum()`` rule, settled inside the one block it ends in).
7. ``_quantize_pack`` (per block): decodes and adds again (re-reading ~4.6 bytes per coordinate is cheaper
   than writing and re-reading an fp32 sum, 8), quantizes, writes the width codes and the bit planes,
   and zeros the payload words the budget leaves unused.

``encode`` runs steps 3–7 on a plain tensor (no message to decode). The plane words are loaded and stored
as 32-bit words where the payload is 4-byte aligned (``n`` a multiple of 1024 and an aligned buffer),
byte by byte otherwise.

Bit-exactness with the torch reference rests on three things: every float operation is the reference's,
in its order (no reassociation); the kernels are launched with ``enable_fp_fusion=False`` so that a
GPU build does not contract ``a * b + c`` into an FMA, which rounds once instead of twice; divisions
use ``tl.div_rn`` (IEEE round-to-nearest) because Triton's ``/`` may compile to an approximate
division. Integer rules (keys, log-scales by an exact search of the scale table, widths, offsets) need
no float rounding to agree. The stochastic-rounding dither is the reference's 32-bit integer hash,
computed in-kernel in wrapping uint32 arithmetic. On CPU the kernels run under ``TRITON_INTERPRET=1``
(a correctness tool, orders of magnitude slower than the torch codec); compiled on a GPU they are the fast path.

NaN or Inf: the reference raises. ``dar`` and ``encode`` raise the same error by reading the flag once,
after the last launch (the only host synchronisation, which ``check_finite=False`` leaves out: the
collectives agree on finite inputs before the first hop, so only a sum overflowing fp32 could set it).

Example::

    codec = DynamiQCodec(bits=5.0)
    msg = codec.encode(x, summands=1)
    out = dar(codec, msg, y, summands=1)   # == codec.encode(codec.decode(msg, n, 1) + y, 2)
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, NamedTuple

import torch
import triton
import triton.language as tl
from torch import Tensor

from lightning_fedshard.dynamiq.codec import non_finite_error
from lightning_fedshard.dynamiq.dynamiq_format import (
    GROUP,
    GROUPS_PER_SG,
    MAX_WIDTH,
    SIDE_BYTES_PER_SG,
    SUPER_GROUP,
    check_message_size,
    device_constants,
    dither_key,
)

if TYPE_CHECKING:  # the codec imports this module when it first runs on CUDA
    from lightning_fedshard.dynamiq.dynamiq_codec import DynamiQCodec

__all__ = ["BLOCK_GROUPS", "dar", "encode"]

#: Groups of 32 per program: 64 groups (2048 coordinates, 8 super-groups), tiles of [64, 32].
BLOCK_GROUPS = 64
_KEYS = 2048  # log2_eighths keys lie in [0, 2047]
_LEVEL_OFFSET = 8 * (MAX_WIDTH - 2)  # allocate_widths' lowest level is 48 below the smallest key
_LEVELS = _KEYS + _LEVEL_OFFSET + 1
_INACTIVE = -32768  # the key of a group whose max is 0: below every level, so its width is 0
_SCAN = 1024  # blocks per step of the one-program scans


# ---------------------------------------------------------------------------------------------- element rules
@triton.jit
def _levels(width):
    # 2^(w-1) (cells per side of the midrise grid) as fp32; the shift is clamped because 1 << -1 is undefined.
    return tl.where(width > 0, 1 << tl.maximum(width - 1, 0), 0).to(tl.float32)


@triton.jit
def _steps(levels, STOCHASTIC: tl.constexpr):
    """Steps from 0 to the group scale: ``L`` (midrise, to nearest) or ``L - ½`` (stochastic; ``_grid``)."""
    if STOCHASTIC:
        return levels - 0.5
    return levels


@triton.jit
def _step(steps, levels, group_scale):
    """Decode's ``group_scale / steps`` (0 for width 0), IEEE-rounded like torch's division."""
    return tl.where(levels > 0, tl.div_rn(group_scale, tl.where(levels > 0, steps, 1.0)), 0.0)


@triton.jit
def _inverse_step(steps, levels, group_scale):
    """Encode's ``steps / group_scale`` (0 for width 0): a division, not ``steps * (1 / group_scale)``,
    which differs in the last bit and would move codes that lie near a rounding boundary."""
    return tl.where(levels > 0, tl.div_rn(steps, tl.where(levels > 0, group_scale, 1.0)), 0.0)


@triton.jit
def _uniform(coord, key, ANTITHETIC: tl.constexpr):
    """``dither`` of the reference at ``coord``: its int64 emulation masks every product to 32 bits,
    which is what uint32 multiplication wraps to."""
    h = coord.to(tl.uint32) ^ key.to(tl.uint32)
    h = (h ^ (h >> 16)) * 0x45D9F3B
    h = (h ^ (h >> 16)) * 0x45D9F3B
    h = h ^ (h >> 16)
    u = ((h >> 9).to(tl.float32) + 0.5) * 1.1920928955078125e-07  # 2^-23
    if ANTITHETIC:
        u = 1.0 - u
    return u


@triton.jit
def _width_at(key, level):
    """``_widths_at``: 0 below the level (and for inactive groups), else ``min(8, 2 + (key - level) // 8)``."""
    return tl.where(key >= level, tl.minimum(2 + (key - level) // 8, 8), 0)


# ---------------------------------------------------------------------------------------------- memory access
@triton.jit
def _load_word(base, index, mask, ALIGNED: tl.constexpr):
    """The little-endian 32-bit word ``index`` after the uint8 pointer ``base``: one load where aligned."""
    if ALIGNED:
        return tl.load(base.to(tl.pointer_type(tl.uint32)) + index, mask=mask, other=0)
    word = tl.load(base + 4 * index, mask=mask, other=0).to(tl.uint32)
    for b in tl.static_range(1, 4):
        word = word | (tl.load(base + 4 * index + b, mask=mask, other=0).to(tl.uint32) << (8 * b))
    return word


@triton.jit
def _store_word(base, index, word, mask, ALIGNED: tl.constexpr):
    if ALIGNED:
        tl.store(base.to(tl.pointer_type(tl.uint32)) + index, word, mask=mask)
    else:
        for b in tl.static_range(4):
            tl.store(base + 4 * index + b, ((word >> (8 * b)) & 0xFF).to(tl.uint8), mask=mask)


@triton.jit
def _width_codes(header, sg, live_sg, BLOCK: tl.constexpr, PER_SG: tl.constexpr):
    """The 3-bit width codes of this block's groups: 3 bytes per super-group, code ``i`` at bit ``3i``."""
    word = tl.load(header + 3 * sg, mask=live_sg, other=0).to(tl.int32)
    word = word | (tl.load(header + 3 * sg + 1, mask=live_sg, other=0).to(tl.int32) << 8)
    word = word | (tl.load(header + 3 * sg + 2, mask=live_sg, other=0).to(tl.int32) << 16)
    i = tl.arange(0, PER_SG)
    return tl.reshape((word[:, None] >> (3 * i[None, :])) & 7, (BLOCK,))


@triton.jit
def _decoded_sum(
    msg,
    local,
    block_base,
    group,
    live,
    sg,
    live_sg,
    table,
    sgs,
    groups,
    BLOCK: tl.constexpr,
    GROUP_SIZE: tl.constexpr,
    PER_SG: tl.constexpr,
    MAX_W: tl.constexpr,
    HAS_MSG: tl.constexpr,
    MSG_ALIGNED: tl.constexpr,
    STOCHASTIC: tl.constexpr,
):
    """``decode(msg) + local`` of this block's ``[BLOCK, 32]`` coordinates in fp32 (``local`` alone without a
    message), with the reference's operations in its order."""
    j = tl.arange(0, GROUP_SIZE)
    coord = group[:, None].to(tl.int64) * GROUP_SIZE + j[None, :]
    mask = live[:, None]
    value = tl.load(local + coord, mask=mask, other=0.0).to(tl.float32)
    if HAS_MSG:
        if MSG_ALIGNED:
            sg_scale = tl.load(msg.to(tl.pointer_type(tl.float32)) + sg, mask=live_sg, other=0.0)
        else:
            sg_scale = _load_word(msg, sg, live_sg, False).to(tl.float32, bitcast=True)
        sg_scale = tl.reshape(tl.broadcast_to(sg_scale[:, None], (BLOCK // PER_SG, PER_SG)), (BLOCK,))
        log_scale = tl.load(msg + 4 * sgs + group, mask=live, other=0).to(tl.int32)
        code3 = _width_codes(msg + 4 * sgs + groups, sg, live_sg, BLOCK, PER_SG)
        width = tl.where(code3 > 0, code3 + 1, 0)
        start = block_base + tl.cumsum(width, axis=0) - width
        levels = _levels(width)
        group_scale = sg_scale * tl.load(table + log_scale, mask=live, other=0.0)
        step = _step(_steps(levels, STOCHASTIC), levels, group_scale)
        payload = msg + sgs * (4 + PER_SG + 3 * PER_SG // 8)
        code = tl.zeros((BLOCK, GROUP_SIZE), dtype=tl.uint32)
        for m in tl.static_range(MAX_W):
            plane = _load_word(payload, start + m, live & (m < width), MSG_ALIGNED)
            code = code | (((plane[:, None] >> j[None, :].to(tl.uint32)) & 1) << m)
        decoded = ((code.to(tl.int32).to(tl.float32) - levels[:, None]) + 0.5) * step[:, None]
        value = decoded + value
    return value, coord


@triton.jit
def _block_groups(BLOCK: tl.constexpr, PER_SG: tl.constexpr, groups):
    """This program's groups and super-groups, and which of them exist (blocks are whole super-groups)."""
    group = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    sg = tl.program_id(0) * (BLOCK // PER_SG) + tl.arange(0, BLOCK // PER_SG)
    return group, group < groups, sg, sg * PER_SG < groups


# ---------------------------------------------------------------------------------------------- kernels
@triton.jit
def _block_widths_in(
    msg, block_units, histogram, flag, sgs, groups, BLOCK: tl.constexpr, PER_SG: tl.constexpr, KEYS: tl.constexpr
):
    group, live, sg, live_sg = _block_groups(BLOCK, PER_SG, groups)
    code3 = _width_codes(msg + 4 * sgs + groups, sg, live_sg, BLOCK, PER_SG)
    tl.store(block_units + tl.program_id(0), tl.sum(tl.where(code3 > 0, code3 + 1, 0), axis=0))
    if tl.program_id(0) == 0:  # the other programs never touch them, and step 3 runs after this launch
        tl.store(histogram + tl.arange(0, KEYS), tl.zeros((KEYS,), dtype=tl.int32))
        tl.store(flag, 0)


@triton.jit
def _scan_blocks(units, starts, blocks, SCAN: tl.constexpr):
    """``starts`` = exclusive prefix sum of ``units`` (one program, ``SCAN`` blocks per step)."""
    carry = 0
    for first in range(0, blocks, SCAN):
        b = first + tl.arange(0, SCAN)
        count = tl.load(units + b, mask=b < blocks, other=0)
        tl.store(starts + b, carry + tl.cumsum(count, axis=0) - count, mask=b < blocks)
        carry += tl.sum(count, axis=0)


@triton.jit
def _decode_fields(
    msg,
    local,
    starts_in,
    table,
    mantissa_steps,
    out,
    keys,
    histogram,
    flag,
    sgs,
    groups,
    BLOCK: tl.constexpr,
    GROUP_SIZE: tl.constexpr,
    PER_SG: tl.constexpr,
    MAX_W: tl.constexpr,
    HAS_MSG: tl.constexpr,
    MSG_ALIGNED: tl.constexpr,
    STOCHASTIC: tl.constexpr,
):
    group, live, sg, live_sg = _block_groups(BLOCK, PER_SG, groups)
    block_base = 0
    if HAS_MSG:
        block_base = tl.load(starts_in + tl.program_id(0))
    value, coord = _decoded_sum(
        msg, local, block_base, group, live, sg, live_sg, table, sgs, groups,
        BLOCK, GROUP_SIZE, PER_SG, MAX_W, HAS_MSG, MSG_ALIGNED, STOCHASTIC,
    )  # fmt: skip
    magnitude = tl.abs(value)
    # NaN fails every comparison: counts NaN and ±Inf (the max below would not show a NaN)
    non_finite = tl.sum(tl.sum(tl.where(magnitude < float("inf"), 0, 1), axis=1), axis=0)
    tl.atomic_max(flag, non_finite, mask=non_finite > 0)
    group_max = tl.max(magnitude, axis=1)
    sg_scale = tl.max(tl.reshape(group_max, (BLOCK // PER_SG, PER_SG)), axis=1)
    tl.store(out.to(tl.pointer_type(tl.float32)) + sg, sg_scale, mask=live_sg)
    sg_scale = tl.reshape(tl.broadcast_to(sg_scale[:, None], (BLOCK // PER_SG, PER_SG)), (BLOCK,))

    # group_log_scales: the largest c with sg_scale · 2^(-c/16) ≥ group_max, by binary search of the table
    # (the scale is monotone in c); the reference's log2 estimate and its corrections settle on the same c
    log_scale = tl.zeros((BLOCK,), dtype=tl.int32)
    for i in tl.static_range(8):
        candidate = log_scale + (128 >> i)
        fits = sg_scale * tl.load(table + candidate, mask=live, other=0.0) >= group_max
        log_scale = tl.where(fits, candidate, log_scale)
    tl.store(out + 4 * sgs + group, log_scale.to(tl.uint8), mask=live)

    # log2_eighths: 8 · biased exponent + how many of 2^(k/8), k = 1..7, the mantissa (in [1, 2)) reaches
    bits = group_max.to(tl.int32, bitcast=True)
    mantissa = ((bits & 0x7FFFFF) | 0x3F800000).to(tl.float32, bitcast=True)
    k = tl.arange(0, 8)
    threshold = tl.load(mantissa_steps + k, mask=k < 7, other=float("inf"))
    eighths = tl.sum((mantissa[:, None] >= threshold[None, :]).to(tl.int32), axis=1)
    key = tl.where(group_max > 0, 8 * ((bits >> 23) & 0xFF) + eighths, _INACTIVE)
    tl.store(keys + group, key.to(tl.int16), mask=live)
    # one atomic per distinct key of the block: its first group adds how many groups share it
    same = key[:, None] == key[None, :]
    earlier = tl.arange(0, BLOCK)[None, :] < tl.arange(0, BLOCK)[:, None]
    count = tl.sum(same.to(tl.int32), axis=1)
    first = tl.sum((same & earlier).to(tl.int32), axis=1) == 0
    tl.atomic_add(histogram + key, count, mask=live & first & (key >= 0))


@triton.jit
def _water_level(
    histogram, scalars, budget, KEYS: tl.constexpr, OFFSET: tl.constexpr, LEVELS: tl.constexpr, WIDTH: tl.constexpr
):
    """``allocate_widths``' level: ``used[i] = 2·S(i - 48) + Σ_{j=1..6} S(i - 48 + 8j)`` with ``S(k)`` = #keys ≥ k,
    and the first ``i`` (of 2097) whose units fit the budget. ``S`` at each shift is the total less a prefix sum."""
    i = tl.arange(0, WIDTH)
    total = tl.sum(tl.load(histogram + tl.arange(0, KEYS)), axis=0)
    used = tl.zeros((WIDTH,), dtype=tl.int32)
    for j in tl.static_range(7):
        k = i + (8 * j - OFFSET)
        count = tl.load(histogram + k, mask=(k >= 0) & (k < KEYS), other=0)
        at_least = total - (tl.cumsum(count, axis=0) - count)
        used += at_least
        if j == 0:  # the two bits every active group above the level has
            used += at_least
    fits = (used <= budget) & (i < LEVELS)
    first = tl.min(tl.where(fits, i, LEVELS), axis=0)
    tl.store(scalars + 0, first - OFFSET)
    tl.store(scalars + 1, tl.sum(tl.where(i == first, used, 0), axis=0))


@triton.jit
def _block_widths_out(keys, scalars, block_units, block_extra, groups, BLOCK: tl.constexpr):
    group = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    key = tl.load(keys + group, mask=group < groups, other=_INACTIVE).to(tl.int32)
    level = tl.load(scalars + 0)
    width = _width_at(key, level)
    tl.store(block_units + tl.program_id(0), tl.sum(width, axis=0))
    tl.store(block_extra + tl.program_id(0), tl.sum(_width_at(key, level - 1) - width, axis=0))


@triton.jit
def _place_blocks(
    keys, scalars, block_units, block_extra, starts, extra_starts, budget, blocks, groups,
    BLOCK: tl.constexpr, SCAN: tl.constexpr,
):  # fmt: skip
    """Prefix sums of the blocks' units and extras, and the reach of the leftover units: the largest prefix sum of
    the groups' extras that stays within ``budget - units`` (the groups up to there take one level lower)."""
    left = budget - tl.load(scalars + 1)
    carry, extra_carry, crossed, reach = 0, 0, 0, 0
    for first in range(0, blocks, SCAN):
        b = first + tl.arange(0, SCAN)
        live = b < blocks
        units = tl.load(block_units + b, mask=live, other=0)
        extra = tl.load(block_extra + b, mask=live, other=0)
        tl.store(starts + b, carry + tl.cumsum(units, axis=0) - units, mask=live)
        through = extra_carry + tl.cumsum(extra, axis=0)
        tl.store(extra_starts + b, through - extra, mask=live)
        within = live & (through <= left)
        crossed += tl.sum(within.to(tl.int32), axis=0)  # the prefix sums grow: the blocks before the crossing
        reach = tl.maximum(reach, tl.max(tl.where(within, through, 0), axis=0))
        carry += tl.sum(units, axis=0)
        extra_carry += tl.sum(extra, axis=0)
    # inside the block where the extras cross ``left`` (none when every extra fits), whose extras start where
    # the reach of the blocks before it ends
    group = crossed * BLOCK + tl.arange(0, BLOCK)
    key = tl.load(keys + group, mask=group < groups, other=_INACTIVE).to(tl.int32)
    level = tl.load(scalars + 0)
    extra = _width_at(key, level - 1) - _width_at(key, level)
    through = reach + tl.cumsum(extra, axis=0)
    reach = tl.maximum(reach, tl.max(tl.where(through <= left, through, 0), axis=0))
    tl.store(scalars + 2, reach)
    tl.store(scalars + 3, tl.load(scalars + 1) + reach)


@triton.jit(do_not_specialize=["dither"])
def _quantize_pack(
    msg,
    local,
    starts_in,
    table,
    keys,
    scalars,
    starts,
    extra_starts,
    out,
    sgs,
    groups,
    budget,
    dither,
    BLOCK: tl.constexpr,
    GROUP_SIZE: tl.constexpr,
    PER_SG: tl.constexpr,
    MAX_W: tl.constexpr,
    HAS_MSG: tl.constexpr,
    MSG_ALIGNED: tl.constexpr,
    OUT_ALIGNED: tl.constexpr,
    STOCHASTIC: tl.constexpr,
    ANTITHETIC: tl.constexpr,
):
    group, live, sg, live_sg = _block_groups(BLOCK, PER_SG, groups)
    block_base = 0
    if HAS_MSG:
        block_base = tl.load(starts_in + tl.program_id(0))
    x, coord = _decoded_sum(
        msg, local, block_base, group, live, sg, live_sg, table, sgs, groups,
        BLOCK, GROUP_SIZE, PER_SG, MAX_W, HAS_MSG, MSG_ALIGNED, STOCHASTIC,
    )  # fmt: skip

    # the group's width: the level's, or one level lower's for the groups within the leftover's reach
    key = tl.load(keys + group, mask=live, other=_INACTIVE).to(tl.int32)
    level, reach = tl.load(scalars + 0), tl.load(scalars + 2)
    base = _width_at(key, level)
    extra = _width_at(key, level - 1) - base
    through = tl.load(extra_starts + tl.program_id(0)) + tl.cumsum(extra, axis=0)
    width = base + tl.where((extra > 0) & (through <= reach), extra, 0)
    start = tl.load(starts + tl.program_id(0)) + tl.cumsum(base, axis=0) - base + tl.minimum(through - extra, reach)
    word = tl.sum(
        tl.reshape(tl.where(width > 0, width - 1, 0), (BLOCK // PER_SG, PER_SG)) << (3 * tl.arange(0, PER_SG))[None, :],
        axis=1,
    )
    codes = out + sgs * (4 + PER_SG) + 3 * sg
    for b in tl.static_range(3):
        tl.store(codes + b, ((word >> (8 * b)) & 0xFF).to(tl.uint8), mask=live_sg)

    sg_scale = tl.load(out.to(tl.pointer_type(tl.float32)) + sg, mask=live_sg, other=0.0)
    sg_scale = tl.reshape(tl.broadcast_to(sg_scale[:, None], (BLOCK // PER_SG, PER_SG)), (BLOCK,))
    log_scale = tl.load(out + 4 * sgs + group, mask=live, other=0).to(tl.int32)
    group_scale = sg_scale * tl.load(table + log_scale, mask=live, other=0.0)
    levels = _levels(width)
    inverse_step = _inverse_step(_steps(levels, STOCHASTIC), levels, group_scale)
    if STOCHASTIC:
        q = tl.floor(x * inverse_step[:, None] + (_uniform(coord, dither, ANTITHETIC) - 0.5))
    else:
        q = tl.floor(x * inverse_step[:, None])
    q = tl.minimum(tl.maximum(q, -levels[:, None]), levels[:, None] - 1)
    code = (q + levels[:, None]).to(tl.int32).to(tl.uint32)

    # plane m of a group: bit j is bit m of code j (disjoint bits, so the sum is their or), a little-endian
    # 32-bit word at the group's start + m; the first ``width`` planes are written
    payload = out + sgs * (4 + PER_SG + 3 * PER_SG // 8)
    lane = tl.arange(0, GROUP_SIZE).to(tl.uint32)[None, :]
    for m in tl.static_range(MAX_W):
        plane = tl.sum(((code >> m) & 1) << lane, axis=1)
        _store_word(payload, start + m, plane, live & (m < width), OUT_ALIGNED)
    # the words after the last group's planes are zeros; each program clears its share of [used, budget)
    spare = tl.program_id(0) * BLOCK * MAX_W + tl.arange(0, BLOCK * MAX_W)
    used = tl.load(scalars + 3)
    _store_word(
        payload, spare, tl.zeros((BLOCK * MAX_W,), dtype=tl.uint32), (spare >= used) & (spare < budget), OUT_ALIGNED
    )


# ---------------------------------------------------------------------------------------------- host side
class _Workspace(NamedTuple):
    """The small steps' buffers for one chunk size: made once (per device and thread) and reused, so that a call
    allocates only its message."""

    keys: Tensor  # int16 per group
    units_in: Tensor  # int32 per block from here on
    starts_in: Tensor
    units: Tensor
    extras: Tensor
    starts: Tensor
    extra_starts: Tensor
    histogram: Tensor  # 2048 bins
    scalars: Tensor  # level, units at it, reach of the leftover, units used
    flag: Tensor  # NaN or Inf seen
    counters: Tensor  # the last three, one after the other

    @staticmethod
    def of(groups: int, device: torch.device) -> _Workspace:
        key = (groups, device, threading.get_ident())
        if key not in _WORKSPACES:
            blocks = triton.cdiv(groups, BLOCK_GROUPS)
            ints = torch.empty(6 * blocks + _KEYS + 5, dtype=torch.int32, device=device)
            per_block = [ints[i * blocks : (i + 1) * blocks] for i in range(6)]
            tail = ints[6 * blocks :]
            _WORKSPACES[key] = _Workspace(
                torch.empty(groups, dtype=torch.int16, device=device),
                *per_block,
                tail[:_KEYS],
                tail[_KEYS : _KEYS + 4],
                tail[_KEYS + 4 :],
                tail,
            )
        return _WORKSPACES[key]


_WORKSPACES: dict[tuple, _Workspace] = {}


def dar(codec: DynamiQCodec, msg: Tensor, local: Tensor, summands: int, *, check_finite: bool = True) -> Tensor:
    """``codec.encode(codec.decode(msg, n, summands) + local, summands + 1)``, byte for byte, with
    ``n = local.numel()`` a multiple of 256. ``local`` may be fp32, fp16 or bf16 (it is added in fp32).
    ``check_finite=False`` skips the one host synchronisation (reading the NaN/Inf flag)."""
    numel = local.numel()
    _check_numel(numel)
    if local.dtype == torch.float64:
        # The reference adds in fp64 and rounds the sum once; the kernel adds in fp32.
        return codec.encode(codec.decode(msg, numel, summands) + local, summands + 1)
    check_message_size(msg, numel, codec.payload_bits(summands) * (numel // SUPER_GROUP))
    return _run(codec, msg.contiguous(), local.detach().reshape(-1).contiguous(), summands + 1, check_finite)


def encode(codec: DynamiQCodec, x: Tensor, summands: int, *, check_finite: bool = True) -> Tensor:
    """``codec.encode(x, summands)``, byte for byte (``x.numel()`` a multiple of 256)."""
    _check_numel(x.numel())
    return _run(codec, None, x.detach().reshape(-1).contiguous(), summands, check_finite)


def _run(codec: DynamiQCodec, msg: Tensor | None, local: Tensor, summands: int, check_finite: bool) -> Tensor:
    numel, device = local.numel(), local.device
    sgs, groups = numel // SUPER_GROUP, numel // GROUP
    blocks = triton.cdiv(groups, BLOCK_GROUPS)
    budget = codec.payload_bits(summands) * sgs
    side = sgs * SIDE_BYTES_PER_SG
    out = torch.empty(side + 4 * budget, dtype=torch.uint8, device=device)
    table, mantissa_steps, _ = device_constants(device)
    keys, units_in, starts_in, units, extras, starts, extra_starts, histogram, scalars, flag, counters = _Workspace.of(
        groups, device
    )
    shape = {"BLOCK": BLOCK_GROUPS, "GROUP_SIZE": GROUP, "PER_SG": GROUPS_PER_SG, "MAX_W": MAX_WIDTH}
    stochastic = codec.rounding == "stochastic"
    has_msg = msg is not None
    msg_aligned = has_msg and side % 4 == 0 and msg.data_ptr() % 4 == 0
    grid = (blocks,)
    if has_msg:
        _block_widths_in[grid](
            msg, units_in, histogram, flag, sgs, groups, BLOCK=BLOCK_GROUPS, PER_SG=GROUPS_PER_SG, KEYS=_KEYS
        )
        _scan_blocks[(1,)](units_in, starts_in, blocks, SCAN=_SCAN)
    else:
        msg = local  # never read
        counters.zero_()
    common = {
        **shape,
        "HAS_MSG": has_msg,
        "MSG_ALIGNED": msg_aligned,
        "STOCHASTIC": stochastic,
        "enable_fp_fusion": False,
    }
    _decode_fields[grid](
        msg, local, starts_in, table, mantissa_steps, out, keys, histogram, flag, sgs, groups, **common
    )
    _water_level[(1,)](histogram, scalars, budget, KEYS=_KEYS, OFFSET=_LEVEL_OFFSET, LEVELS=_LEVELS, WIDTH=4096)
    _block_widths_out[grid](keys, scalars, units, extras, groups, BLOCK=BLOCK_GROUPS)
    _place_blocks[(1,)](
        keys, scalars, units, extras, starts, extra_starts, budget, blocks, groups, BLOCK=BLOCK_GROUPS, SCAN=_SCAN
    )
    seed, antithetic = codec._dither_params(summands)
    _quantize_pack[grid](
        msg, local, starts_in, table, keys, scalars, starts, extra_starts, out, sgs, groups, budget,
        dither_key(seed), OUT_ALIGNED=side % 4 == 0, ANTITHETIC=antithetic, **common,
    )  # fmt: skip
    if check_finite and bool(flag):  # the one host synchronisation, after the last launch
        raise non_finite_error(codec.name)
    return out


def _check_numel(numel: int) -> None:
    if numel % SUPER_GROUP:
        raise ValueError(f"DynamiQ encodes chunks of a multiple of {SUPER_GROUP} coordinates, got {numel}.")
