"""The DynamiQ decompress-accumulate-recompress (DAR) hop in Triton, byte for byte equal to ``DynamiQCodec``.

A ring hop turns a received message holding ``h`` chunks into one holding ``h + 1``:
``encode(decode(msg) + local, h + 1)``. The widths of the outgoing message are water-filled over the
*whole* message (``allocate_widths``), so no group can be quantized before every group's max |sum| is
known. One kernel would need a grid-wide barrier for that; instead the hop is two kernels around a
short torch step that works on one float per group (n/32 values, not n):

1. ``_decode_accumulate`` (one program per ``BLOCK_GROUPS`` groups): unpacks each coordinate's
   ``w``-bit code from the payload bytes, dequantizes it, adds the local chunk, writes the fp32 sum
   and each group's max |sum|.
2. torch, reusing the format's functions (``message_fields``, ``payload_offsets``, ``message_header``):
   SG scales, group log-scales, the water-filled widths, the payload offsets and the width codes.
3. ``_quantize_pack`` (one program per ``BLOCK_GROUPS`` groups): re-reads the sum, quantizes it and
   writes each group's ``4·w`` payload bytes at its offset. Groups own disjoint byte ranges, so the
   programs need no atomics.

Bit-exactness with the torch reference rests on three things: every float operation is the reference's,
in its order (no reassociation); the kernels are launched with ``enable_fp_fusion=False`` so that a
GPU build does not contract ``a * b + c`` into an FMA, which rounds once instead of twice; divisions
use ``tl.div_rn`` (IEEE round-to-nearest) because Triton's ``/`` may compile to an approximate
division. The stochastic-rounding dither is the reference's 32-bit integer hash, computed in-kernel in
wrapping uint32 arithmetic. On CPU the kernels run under ``TRITON_INTERPRET=1`` (a correctness tool,
orders of magnitude slower than the torch codec); compiled on a GPU they are the fast path.

Example::

    codec = DynamiQCodec(bits=5.0)
    msg = codec.encode(x, summands=1)
    out = dar(codec, msg, y, summands=1)   # == codec.encode(codec.decode(msg, n, 1) + y, 2)
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl
from torch import Tensor

from lightning_fedshard.dynamiq.codec import check_finite
from lightning_fedshard.dynamiq.dynamiq_format import (
    GROUP,
    GROUPS_PER_SG,
    MAX_WIDTH,
    SUPER_GROUP,
    dither_key,
    message_fields,
    message_header,
    payload_offsets,
    split_message,
)

if TYPE_CHECKING:  # the codec imports this module when it first runs on CUDA
    from lightning_fedshard.dynamiq.dynamiq_codec import DynamiQCodec

__all__ = ["BLOCK_GROUPS", "dar", "encode"]

#: Groups of 32 per program: 16 groups (512 coordinates) keep the packing tile at 4K registers.
BLOCK_GROUPS = 16


@triton.jit
def _levels(width):
    # 2^(w-1) (cells per side of the midrise grid) as fp32; the shift is clamped because 1 << -1 is undefined.
    return tl.where(width > 0, 1 << tl.maximum(width - 1, 0), 0).to(tl.float32)


@triton.jit
def _group_fields(widths, offsets, log_scales, sg_scales, table, num_groups, BLOCK: tl.constexpr, PER_SG: tl.constexpr):
    """This program's groups and their width, payload byte offset, scale and level count."""
    group = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    live = group < num_groups
    width = tl.load(widths + group, mask=live, other=0).to(tl.int32)
    start = tl.load(offsets + group, mask=live, other=0).to(tl.int64)
    scale_index = tl.load(log_scales + group, mask=live, other=0)
    group_scale = tl.load(sg_scales + group // PER_SG, mask=live, other=0.0) * tl.load(table + scale_index, mask=live)
    return group, live, width, start, group_scale, _levels(width)


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
def _decode_accumulate(
    payload,
    sg_scales,
    log_scales,
    widths,
    offsets,
    table,
    local,
    total,
    group_max,
    num_groups,
    BLOCK: tl.constexpr,
    GROUP_SIZE: tl.constexpr,
    PER_SG: tl.constexpr,
    WORDS: tl.constexpr,
    STOCHASTIC: tl.constexpr,
):
    group, live, width, start, group_scale, levels = _group_fields(
        widths, offsets, log_scales, sg_scales, table, num_groups, BLOCK, PER_SG
    )
    step = _step(_steps(levels, STOCHASTIC), levels, group_scale)

    # Plane m of a group is the little-endian 32-bit word at its offset + m; bit j of it is bit m of code j.
    j = tl.arange(0, GROUP_SIZE)
    m = tl.arange(0, WORDS)
    has_plane = live[:, None] & (m[None, :] < width[:, None])
    word = payload + 4 * (start[:, None] + m[None, :])
    plane = tl.zeros((BLOCK, WORDS), dtype=tl.uint32)
    for b in tl.static_range(4):
        plane = plane | (tl.load(word + b, mask=has_plane, other=0).to(tl.uint32) << (8 * b))
    bits = (plane[:, :, None] >> j[None, None, :].to(tl.uint32)) & 1
    code = tl.sum(bits << m[None, :, None].to(tl.uint32), axis=1).to(tl.int32)  # disjoint bits: sum = or

    coord = group[:, None].to(tl.int64) * GROUP_SIZE + j[None, :]
    value = ((code.to(tl.float32) - levels[:, None]) + 0.5) * step[:, None]
    value = value + tl.load(local + coord, mask=live[:, None], other=0.0).to(tl.float32)
    tl.store(total + coord, value, mask=live[:, None])
    tl.store(group_max + group, tl.max(tl.abs(value), axis=1), mask=live)


@triton.jit(do_not_specialize=["key"])
def _quantize_pack(
    total,
    sg_scales,
    log_scales,
    widths,
    offsets,
    table,
    payload,
    num_groups,
    key,
    STOCHASTIC: tl.constexpr,
    ANTITHETIC: tl.constexpr,
    BLOCK: tl.constexpr,
    GROUP_SIZE: tl.constexpr,
    PER_SG: tl.constexpr,
    WORDS: tl.constexpr,
):
    group, live, width, start, group_scale, levels = _group_fields(
        widths, offsets, log_scales, sg_scales, table, num_groups, BLOCK, PER_SG
    )
    inverse_step = _inverse_step(_steps(levels, STOCHASTIC), levels, group_scale)

    j = tl.arange(0, GROUP_SIZE)
    coord = group[:, None].to(tl.int64) * GROUP_SIZE + j[None, :]
    x = tl.load(total + coord, mask=live[:, None], other=0.0)
    if STOCHASTIC:
        offset = _uniform(coord, key, ANTITHETIC) - 0.5
        q = tl.floor(x * inverse_step[:, None] + offset)
    else:
        q = tl.floor(x * inverse_step[:, None])
    q = tl.minimum(tl.maximum(q, -levels[:, None]), levels[:, None] - 1)
    code = (q + levels[:, None]).to(tl.int32).to(tl.uint32)

    # Plane m of a group: bit j is bit m of code j (disjoint bits, so the sum is their or), stored as a
    # little-endian 32-bit word at the group's offset + m; the first w planes of a group are written.
    m = tl.arange(0, WORDS)
    bits = (code[:, None, :] >> m[None, :, None].to(tl.uint32)) & 1
    plane = tl.sum(bits << j[None, None, :].to(tl.uint32), axis=2)
    b = tl.arange(0, 4)
    out = ((plane[:, :, None] >> (8 * b[None, None, :]).to(tl.uint32)) & 0xFF).to(tl.uint8)
    target = payload + 4 * (start[:, None, None] + m[None, :, None]) + b[None, None, :]
    tl.store(target, out, mask=live[:, None, None] & (m[None, :, None] < width[:, None, None]))


def dar(codec: DynamiQCodec, msg: Tensor, local: Tensor, summands: int) -> Tensor:
    """``codec.encode(codec.decode(msg, n, summands) + local, summands + 1)``, byte for byte, with
    ``n = local.numel()`` a multiple of 256. ``local`` may be fp32, fp16 or bf16 (it is added in fp32)."""
    numel = local.numel()
    _check_numel(numel)
    if local.dtype == torch.float64:
        # The reference adds in fp64 and rounds the sum once; the kernel adds in fp32.
        return codec.encode(codec.decode(msg, numel, summands) + local, summands + 1)
    groups = numel // GROUP
    budget = codec.payload_bits(summands) * (numel // SUPER_GROUP)
    sg_scale, log_scales, widths, payload = split_message(msg, numel, budget)
    local = local.detach().reshape(-1).contiguous()
    total = torch.empty(numel, dtype=torch.float32, device=local.device)
    group_max = torch.empty(groups, dtype=torch.float32, device=local.device)
    _decode_accumulate[(triton.cdiv(groups, BLOCK_GROUPS),)](
        payload,
        sg_scale,
        log_scales,
        widths,
        payload_offsets(widths),
        codec._table(local.device),
        local,
        total,
        group_max,
        groups,
        BLOCK=BLOCK_GROUPS,
        GROUP_SIZE=GROUP,
        PER_SG=GROUPS_PER_SG,
        WORDS=MAX_WIDTH,
        STOCHASTIC=codec.rounding == "stochastic",
        enable_fp_fusion=False,
    )
    return _encode_with_max(codec, total, group_max, summands + 1)


def encode(codec: DynamiQCodec, x: Tensor, summands: int) -> Tensor:
    """``codec.encode(x, summands)``, byte for byte (``x.numel()`` a multiple of 256)."""
    _check_numel(x.numel())
    x = x.detach().to(torch.float32).reshape(-1).contiguous()
    return _encode_with_max(codec, x, x.view(-1, GROUP).abs().amax(dim=-1), summands)


def _encode_with_max(codec: DynamiQCodec, x: Tensor, group_max: Tensor, summands: int) -> Tensor:
    check_finite(group_max, codec.name)  # a NaN or Inf anywhere shows in its group's max
    groups, sgs = group_max.numel(), group_max.numel() // GROUPS_PER_SG
    table = codec._table(x.device)
    budget = codec.payload_bits(summands) * sgs
    sg_scale, log_scales, widths = message_fields(group_max, budget, table)
    # The kernel writes the payload in place. Zeros because the water-filling may leave part of the
    # budget unused, and the reference zero-pads the payload.
    header = message_header(sg_scale, log_scales, widths)
    side = header.numel()
    msg = torch.cat([header, header.new_zeros(4 * budget)])
    seed, antithetic = codec._dither_params(summands)
    _quantize_pack[(triton.cdiv(groups, BLOCK_GROUPS),)](
        x,
        sg_scale,
        log_scales,
        widths,
        payload_offsets(widths),
        table,
        msg[side:],
        groups,
        dither_key(seed),
        STOCHASTIC=codec.rounding == "stochastic",
        ANTITHETIC=antithetic,
        BLOCK=BLOCK_GROUPS,
        GROUP_SIZE=GROUP,
        PER_SG=GROUPS_PER_SG,
        WORDS=MAX_WIDTH,
        enable_fp_fusion=False,
    )
    return msg


def _check_numel(numel: int) -> None:
    if numel % SUPER_GROUP:
        raise ValueError(f"DynamiQ encodes chunks of a multiple of {SUPER_GROUP} coordinates, got {numel}.")
