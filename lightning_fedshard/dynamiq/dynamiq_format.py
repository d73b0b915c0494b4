"""The DynamiQ-L message: its fields, and the rules by which both encoders (the torch codec in
``dynamiq_codec`` and the Triton kernels in ``triton_dar``) derive them, so that the two produce the same
bytes. Both import this module; neither imports the other at load time.

Wire format of a chunk of ``n`` coordinates (``n`` a multiple of 256), struct-of-arrays so that
every field is a contiguous, vectorisable slice:

====================  ========================  ==============================================
field                 size                      meaning
====================  ========================  ==============================================
super-group scales    4 bytes × n/256           fp32 max |x| of each super-group (SG) of 256
group log-scales      1 byte × n/32             ``c``: group scale = SG scale · 2^(-c/16) ≥ group max
group widths          3 bits × n/32             bits per coordinate of each group of 32, in {0, 2..8}
payload               4·B bytes × n/256         ``w`` bit planes per group, one after the other
====================  ========================  ==============================================

A group of width ``w`` is quantised *midrise*: its scale ``s`` is cut into ``2^w`` equal cells and a
coordinate is sent as the index of its cell, decoded to the cell's centre. Every code is used (a
midtread grid with a level at 0 wastes one of ``2^w`` codes: 3 levels instead of 4 at 2 bits, a 4×
larger error there). The ``w`` codes bits are sent as bit planes: plane ``m`` is one little-endian
32-bit word whose bit ``j`` is bit ``m`` of coordinate ``j``'s code, so packing and unpacking are the
same 32-lane shifts for every width, which vectorises (and compiles) without a per-width gather.

A message spends exactly ``B`` payload bits per 32 coordinates on average (``B/8`` bits per
coordinate), so its size depends only on ``n`` and ``B``: receivers allocate before data arrives.
The payload is split between the groups by reverse water-filling on each group's distortion, which
for a uniform quantiser over the group's scale is ``scale² · 4^-bits``: bits go to the groups with the
largest error first. The split spans the whole message, not each super-group: gradient magnitudes
differ most between layers, and on tiny-Llama gradients a per-super-group budget leaves 7× more error
at 4.5 bits (docs/benchmarks.md). The ranking uses ``floor(8·log2 max)`` read from the float's bits,
so the allocation is exact and identical in the torch and Triton implementations (an allocation from
sums of squares would depend on summation order).

The stochastic-rounding dither is a 32-bit integer hash of the coordinate's index (``dither``), so that
every implementation computes the same values from the same integers.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from lightning_fedshard.dynamiq.bitpack import as_bytes, pack_bits_fast, unpack_bits_fast, view_bytes_as

__all__ = [
    "GROUP",
    "GROUPS_PER_SG",
    "MANTISSA_STEPS",
    "MAX_WIDTH",
    "SCALE_STEPS",
    "SIDE_BYTES_PER_SG",
    "SUPER_GROUP",
    "WIDTHS",
    "allocate_widths",
    "check_message_size",
    "device_constants",
    "dither",
    "dither_key",
    "group_log_scales",
    "hash_uniform",
    "level_count",
    "log2_eighths",
    "message_fields",
    "message_header",
    "payload_offsets",
    "scale_table",
    "split_message",
]

SUPER_GROUP = 256
GROUP = 32
GROUPS_PER_SG = SUPER_GROUP // GROUP
#: Widths a group can take; the 3-bit width code is the index into this tuple.
WIDTHS = (0, 2, 3, 4, 5, 6, 7, 8)
MAX_WIDTH = 8
SIDE_BYTES_PER_SG = 4 + GROUPS_PER_SG + 3 * GROUPS_PER_SG // 8
#: Group scales are ``2^(-c/SCALE_STEPS)`` of their super-group's: at most 2^(1/16) = 4.4 % above the group max.
SCALE_STEPS = 16


def scale_table(device: torch.device | str = "cpu") -> Tensor:
    """``2^(-c/16)`` for ``c = 0..255`` in fp32: the group scales relative to their super-group's."""
    return torch.tensor([2.0 ** (-c / SCALE_STEPS) for c in range(256)], dtype=torch.float32, device=device)


@functools.cache
def device_constants(device: torch.device) -> tuple[Tensor, Tensor, Tensor]:
    """The format's constant tables on ``device``, made once per device (a host-to-device copy, which synchronises
    with the GPU, must not happen per message): ``scale_table``, ``MANTISSA_STEPS`` and ``WIDTHS`` (int64).
    Shared by the torch codec and the Triton kernels; ``device`` is a ``torch.device``."""
    return (
        scale_table(device),
        MANTISSA_STEPS.to(device),
        torch.tensor(WIDTHS, device=device),
    )


def dither(seed: int, numel: int, device: torch.device | str = "cpu") -> Tensor:
    """Uniform dither in (0, 1) for stochastic rounding: a 32-bit integer hash of ``(seed, index)``,
    so the Triton kernel can compute the same values from the same integers."""
    return hash_uniform(torch.arange(numel, dtype=torch.int64, device=device), dither_key(seed))


def hash_uniform(index: Tensor, key: int | Tensor) -> Tensor:
    mask = 0xFFFFFFFF
    x = index ^ key
    for _ in range(2):  # the "lowbias32"-style finaliser; multipliers < 2^31 keep int64 products exact
        x = ((x ^ (x >> 16)) * 0x45D9F3B) & mask
    x = x ^ (x >> 16)
    return ((x >> 9).to(torch.float32) + 0.5) * 2.0**-23


def dither_key(seed: int) -> int:
    """The 31-bit key that ``dither`` XORs into the coordinate index (shared with the Triton kernel)."""
    return _mix32(seed) & 0x7FFFFFFF


def _mix32(value: int) -> int:
    value = (value * 0x9E3779B1 + 0x7F4A7C15) & 0xFFFFFFFF
    return value ^ (value >> 15)


def level_count(widths: Tensor) -> Tensor:
    """Cells on each side of zero of the midrise grid of each width: ``2^(w-1)`` (0 for width 0)."""
    return torch.where(widths > 0, 1 << (widths - 1).clamp(min=0), 0)


def group_log_scales(group_max: Tensor, sg_scale: Tensor, table: Tensor) -> Tensor:
    """``c = max{k : sg_scale · 2^(-k/16) ≥ group_max}`` per group, so that the group scale never clips."""
    ratio = group_max / sg_scale.repeat_interleave(GROUPS_PER_SG)
    estimate = torch.where(
        group_max > 0, torch.floor(-SCALE_STEPS * torch.log2(ratio)), torch.full_like(group_max, 255)
    )
    c = estimate.clamp(0, 255).to(torch.int64)
    sg = sg_scale.repeat_interleave(GROUPS_PER_SG)
    # log2 can be off by an ulp: settle the exact predicate with integer steps.
    for _ in range(2):
        c = torch.where(sg * table[c] < group_max, c - 1, c).clamp(min=0)
        up = (c + 1).clamp(max=255)
        c = torch.where((c < 255) & (sg * table[up] >= group_max), up, c)
    return c


def message_fields(group_max: Tensor, budget: int, table: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """SG scales, group log-scales and group widths of a message, from its groups' max |x| alone
    (shared with the Triton DAR, whose kernels compute ``group_max`` and quantize with these fields)."""
    sg_scale = group_max.view(-1, GROUPS_PER_SG).amax(dim=-1)
    log_scales = group_log_scales(group_max, sg_scale, table)
    widths = allocate_widths(log2_eighths(group_max), group_max > 0, budget)
    return sg_scale, log_scales, widths


def message_header(sg_scale: Tensor, log_scales: Tensor, widths: Tensor) -> Tensor:
    """The fields before the payload: SG scales, group log-scales and 3-bit width codes (indices into ``WIDTHS``)."""
    width_codes = torch.searchsorted(device_constants(widths.device)[2], widths)
    return torch.cat([as_bytes(sg_scale), log_scales.to(torch.uint8), pack_bits_fast(width_codes, 3)])


def log2_eighths(x: Tensor) -> Tensor:
    """``floor(8·log2 x)`` + 1016 for positive normal fp32 ``x``, from its exponent and mantissa bits
    (exact, no transcendental functions): an integer in [0, 2047]."""
    bits = x.contiguous().view(torch.int32)
    exponent = (bits >> 23) & 0xFF
    mantissa = ((bits & 0x7FFFFF) | 0x3F800000).view(torch.float32)
    eighths = (mantissa[..., None] >= device_constants(x.device)[1]).sum(dim=-1)
    return 8 * exponent.to(torch.int64) + eighths


#: ``2^(k/8)`` for k = 1..7 in fp32: the mantissa thresholds of ``log2_eighths``.
MANTISSA_STEPS = torch.tensor([2.0 ** (k / 8) for k in range(1, 8)], dtype=torch.float32)
_KEYS = 2048
# Water levels below every key leave all groups at the maximum width.
_LEVEL_OFFSET = 8 * (MAX_WIDTH - 2)


def allocate_widths(keys: Tensor, active: Tensor, budget: int) -> Tensor:
    """Reverse water-filling of ``budget`` width units (bits per coordinate, summed over the groups).

    At water level ``t`` group ``g`` gets width 0 if ``key_g < t``, else ``min(8, 2 + (key_g - t) // 8)``:
    each extra bit halves a group's error, so groups end with equal error as far as widths allow. The
    level is the lowest whose widths fit; the units left over go, in group order and while they fit, to
    the groups whose next step lies one level lower. Computed from suffix counts of the keys, with no
    search and no host synchronisation.
    """
    # a histogram of fixed size (bincount's size depends on the data: a host synchronisation on a GPU);
    # inactive groups are counted in a spare bin
    counted = torch.zeros(_KEYS + 1, dtype=torch.int64, device=keys.device)
    counted = counted.scatter_add_(0, torch.where(active, keys, _KEYS), torch.ones_like(keys))[:_KEYS]
    at_least = counted.flip(0).cumsum(0).flip(0)  # [k] = #keys ≥ k
    # counts[i] = #keys ≥ i - _LEVEL_OFFSET, for levels from _LEVEL_OFFSET below the smallest key up.
    counts = torch.cat([at_least[:1].expand(_LEVEL_OFFSET), at_least, at_least.new_zeros(_LEVEL_OFFSET + 1)])
    levels = _KEYS + _LEVEL_OFFSET + 1
    used = 2 * counts[:levels] + sum(counts[8 * j : 8 * j + levels] for j in range(1, MAX_WIDTH - 1))
    level = (used <= budget).to(torch.int8).argmax() - _LEVEL_OFFSET
    widths = _widths_at(keys, active, level)
    lower = _widths_at(keys, active, level - 1)
    extra = lower - widths
    take = (extra > 0) & (torch.cumsum(extra, 0) <= budget - widths.sum())
    return torch.where(take, lower, widths)


def _widths_at(keys: Tensor, active: Tensor, level: Tensor) -> Tensor:
    above = active & (keys >= level)
    return torch.where(above, torch.clamp(2 + torch.div(keys - level, 8, rounding_mode="floor"), max=MAX_WIDTH), 0)


def split_message(msg: Tensor, numel: int, budget: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The four fields of a message: SG scales, group log-scales, group widths and the payload bytes."""
    check_message_size(msg, numel, budget)
    sgs, groups = numel // SUPER_GROUP, numel // GROUP
    ends = (4 * sgs, 4 * sgs + groups, 4 * sgs + groups + 3 * groups // 8)
    sg_scale = view_bytes_as(msg[: ends[0]], torch.float32)
    log_scales = msg[ends[0] : ends[1]].to(torch.int64)
    width_codes = unpack_bits_fast(msg[ends[1] : ends[2]], 3, groups)
    widths = device_constants(msg.device)[2][width_codes.long()]
    return sg_scale, log_scales, widths, msg[ends[2] :]


def check_message_size(msg: Tensor, numel: int, budget: int) -> None:
    """Raises unless ``msg`` has the size of ``numel`` coordinates (whole super-groups) at ``budget`` width units."""
    if numel % SUPER_GROUP:
        raise ValueError(
            f"DynamiQ messages hold whole super-groups of {SUPER_GROUP} coordinates, got {numel} "
            "(DynamiQCodec pads tensors of other sizes)."
        )
    expected = numel // SUPER_GROUP * SIDE_BYTES_PER_SG + 4 * budget
    if msg.numel() != expected:
        raise ValueError(
            f"DynamiQ message of {msg.numel()} bytes; {numel} coordinates at {budget} width units need {expected}."
        )


def payload_offsets(widths: Tensor) -> Tensor:
    """Index of each group's first bit plane (32-bit word) in the payload: a group of width ``w`` has ``w``."""
    return torch.cumsum(widths, dim=0) - widths
