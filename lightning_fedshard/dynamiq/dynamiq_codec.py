"""DynamiQ-L: our reconstruction of DynamiQ's partial-sum codec (the paper's code is not public).

Wire format of a chunk of ``n`` coordinates (``n`` a multiple of 256), struct-of-arrays so that
every field is a contiguous, vectorisable slice:

====================  ========================  ==============================================
field                 size                      meaning
====================  ========================  ==============================================
super-group scales    4 bytes × n/256           fp32 max |x| of each super-group (SG) of 256
group log-scales      1 byte × n/32             ``c``: group scale = SG scale · 2^(-c/8) ≥ group max
group widths          3 bits × n/32             bits per coordinate of each group of 32, in {0, 2..8}
payload               4·B bytes × n/256         offset-binary integers, group after group
====================  ========================  ==============================================

A message spends exactly ``B`` payload bits per 32 coordinates on average (``B/8`` bits per
coordinate), so its size depends only on ``n`` and ``B``: receivers allocate before data arrives.
The payload is split between the groups by reverse water-filling on each group's distortion, which
for an absmax quantiser is ``max² · 4^-bits``: bits go to the groups with the largest error first.
The split spans the whole message, not each super-group: gradient magnitudes differ most between
layers, and on tiny-Llama gradients a per-super-group budget leaves 7× more error at 4.5 bits
(docs/benchmarks.md). The ranking uses ``floor(8·log2 max)`` read from the float's bits, so the
allocation is exact and identical in the torch and Triton implementations (an allocation from sums
of squares would depend on summation order).

A message carrying the sum of ``h`` chunks gets ``½·log2 h`` more bits per coordinate than the
first hop's, because its error would otherwise grow with the number of hops (research note §6);
the finished sum that the all-gather forwards gets the base rate. ``prepare`` picks the largest
base rate for which all messages of the collective fit in ``bits`` per coordinate.
"""

from __future__ import annotations

import importlib.util
import math

import torch
from torch import Tensor
from torch.distributed import ProcessGroup

from lightning_fedshard.dynamiq.bitpack import as_bytes, pack_bits, unpack_bits, view_bytes_as
from lightning_fedshard.dynamiq.codec import Codec, Transfer, check_finite, register_codec

__all__ = ["GROUP", "SUPER_GROUP", "WIDTHS", "DynamiQCodec", "allocate_widths", "dither", "log2_eighths", "scale_table"]

SUPER_GROUP = 256
GROUP = 32
GROUPS_PER_SG = SUPER_GROUP // GROUP
#: Widths a group can take; the 3-bit width code is the index into this tuple.
WIDTHS = (0, 2, 3, 4, 5, 6, 7, 8)
MAX_WIDTH = 8
SIDE_BYTES_PER_SG = 4 + GROUPS_PER_SG + 3 * GROUPS_PER_SG // 8
_WIDTH_CODE = {width: code for code, width in enumerate(WIDTHS)}
_HAS_TRITON = importlib.util.find_spec("triton") is not None
_MIN_BASE = 8  # payload bits per group of 32 = one bit per coordinate on average


def scale_table(device: torch.device | str = "cpu") -> Tensor:
    """``2^(-c/8)`` for ``c = 0..255`` in fp32: the group scales relative to their super-group's."""
    return torch.tensor([2.0 ** (-c / 8) for c in range(256)], dtype=torch.float32, device=device)


def dither(seed: int, numel: int, device: torch.device | str = "cpu") -> Tensor:
    """Uniform dither in (0, 1) for stochastic rounding: a 32-bit integer hash of ``(seed, index)``,
    so the Triton kernel can compute the same values from the same integers."""
    mask = 0xFFFFFFFF
    x = torch.arange(numel, dtype=torch.int64, device=device) ^ dither_key(seed)
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
    """Largest magnitude ``2^(w-1) - 1`` of the symmetric integers of each width (0 for width 0)."""
    return torch.where(widths > 0, (1 << (widths - 1).clamp(min=0)) - 1, 0)


def group_log_scales(group_max: Tensor, sg_scale: Tensor, table: Tensor) -> Tensor:
    """``c = max{k : sg_scale · 2^(-k/8) ≥ group_max}`` per group, so that the group scale never clips."""
    ratio = group_max / sg_scale.repeat_interleave(GROUPS_PER_SG)
    estimate = torch.where(group_max > 0, torch.floor(-8 * torch.log2(ratio)), torch.full_like(group_max, 255))
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
    width_codes = torch.searchsorted(torch.tensor(WIDTHS, device=widths.device), widths)
    return torch.cat([as_bytes(sg_scale), log_scales.to(torch.uint8), pack_bits(width_codes, 3)])


def log2_eighths(x: Tensor) -> Tensor:
    """``floor(8·log2 x)`` + 1016 for positive normal fp32 ``x``, from its exponent and mantissa bits
    (exact, no transcendental functions): an integer in [0, 2047]."""
    bits = x.contiguous().view(torch.int32)
    exponent = (bits >> 23) & 0xFF
    mantissa = ((bits & 0x7FFFFF) | 0x3F800000).view(torch.float32)
    eighths = (mantissa[..., None] >= _MANTISSA_STEPS.to(x.device)).sum(dim=-1)
    return 8 * exponent.to(torch.int64) + eighths


_MANTISSA_STEPS = torch.tensor([2.0 ** (k / 8) for k in range(1, 8)], dtype=torch.float32)
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
    at_least = torch.bincount(keys[active], minlength=_KEYS).flip(0).cumsum(0).flip(0)  # [k] = #keys ≥ k
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


class DynamiQCodec(Codec):
    """DynamiQ-L partial-sum codec: hierarchical scales, variable bit widths, per-hop budget widening.

    ``bits`` is the average number of bits per coordinate the whole collective may send, side
    information and widening included. ``rounding="stochastic"`` rounds with a hashed dither that is
    antithetic across hops (``u`` on odd hops, ``1-u`` on even ones), which halves the error that
    independent stochastic rounding accumulates along a ring.

    Example::

        codec = DynamiQCodec(bits=5.0)
        msg = codec.encode(x, summands=1)               # x: fp32, numel a multiple of 256
        x_hat = codec.decode(msg, x.numel(), summands=1)
    """

    name = "dynamiq"
    block = SUPER_GROUP

    def __init__(self, bits: float | None = 5.0, *, rounding: str = "nearest", seed: int = 0) -> None:
        bits = 5.0 if bits is None else float(bits)
        if rounding not in ("nearest", "stochastic"):
            raise ValueError(f"rounding must be 'nearest' or 'stochastic', got {rounding!r}.")
        super().__init__(bits)
        self.rounding = rounding
        self.seed = seed
        self.calls = 0
        self.world_size: int | None = None
        # Without a planned collective (a lone encode), one message gets the whole budget.
        self.base = self._check_base(math.floor(8 * (bits - 8 * SIDE_BYTES_PER_SG / SUPER_GROUP)), bits)
        self._tables: dict[torch.device, Tensor] = {}

    def _check_base(self, base: int, bits: float) -> int:
        if base < _MIN_BASE:
            side = 8 * SIDE_BYTES_PER_SG / SUPER_GROUP
            raise ValueError(
                f"DynamiQ needs at least {1 + side:.3f} bits per coordinate plus its per-hop widening "
                f"(side information alone is {side:.3f}); got bits={bits}."
            )
        return min(base, 8 * MAX_WIDTH)

    # ------------------------------------------------------------------ budget
    def payload_bits(self, summands: int) -> int:
        """Payload bits per group of 32 (``B``) of a message carrying ``summands`` chunks."""
        if self.world_size is not None and summands >= self.world_size:
            return self.base
        return min(self.base + round(4 * math.log2(summands)), 8 * MAX_WIDTH)

    def message_bytes(self, numel: int, summands: int) -> int:
        return numel // SUPER_GROUP * (SIDE_BYTES_PER_SG + 4 * self.payload_bits(summands))

    def prepare(self, chunks: Tensor, transfer: Transfer, group: ProcessGroup | None) -> Tensor:
        """Picks the largest base rate whose messages all fit in ``bits`` per coordinate."""
        self.world_size = transfer.world_size
        self.calls += 1
        budget_bytes = self.bits * transfer.reference_coords / 8
        best = None
        for base in range(_MIN_BASE, 8 * MAX_WIDTH + 1):
            self.base = base
            if sum(self.message_bytes(m.numel, m.summands) for m in transfer.messages) > budget_bytes:
                break
            best = base
        if best is None:
            self.base = 8 * MAX_WIDTH
            raise ValueError(
                f"DynamiQ cannot send {transfer.reference_coords:.0f} coordinates' worth of partial sums in "
                f"bits={self.bits} per coordinate over {transfer.world_size} ranks; raise bits."
            )
        self.base = best
        return chunks

    # ------------------------------------------------------------------ codec
    def _table(self, device: torch.device) -> Tensor:
        if device not in self._tables:
            self._tables[device] = scale_table(device)
        return self._tables[device]

    def _dither_params(self, summands: int) -> tuple[int, bool]:
        """Seed of this call's dither, and whether this hop rounds with the antithetic ``1 - u``."""
        return self.seed * 1_000_003 + self.calls, summands % 2 == 0

    def _dither(self, numel: int, summands: int, device: torch.device) -> Tensor:
        seed, antithetic = self._dither_params(summands)
        u = dither(seed, numel, device)
        return 1.0 - u if antithetic else u

    def encode(self, x: Tensor, summands: int) -> Tensor:
        check_finite(x, self.name)
        groups = x.detach().to(torch.float32).reshape(-1, GROUP)
        group_max = groups.abs().amax(dim=-1)
        table = self._table(x.device)
        budget = self.payload_bits(summands) * (group_max.numel() // GROUPS_PER_SG)
        sg_scale, log_scales, widths = message_fields(group_max, budget, table)
        levels = level_count(widths).to(torch.float32)[:, None]
        group_scale = sg_scale.repeat_interleave(GROUPS_PER_SG)[:, None] * table[log_scales][:, None]
        inverse_step = torch.where(levels > 0, levels / group_scale, 0.0)
        offset = self._dither(x.numel(), summands, x.device).view_as(groups) if self.rounding == "stochastic" else 0.5
        q = torch.floor(groups * inverse_step + offset)
        q = torch.minimum(torch.maximum(q, -levels), levels)
        payload = _pack_payload((q + levels).to(torch.int32), widths, 4 * budget)
        return torch.cat([message_header(sg_scale, log_scales, widths), payload])

    def accumulate(self, msg: Tensor, local: Tensor, summands: int) -> Tensor:
        """On CUDA the fused Triton DAR (bit-identical to this reference); elsewhere decode + add + encode."""
        if local.is_cuda and _HAS_TRITON:
            from lightning_fedshard.dynamiq import triton_dar

            return triton_dar.dar(self, msg, local, summands)
        return super().accumulate(msg, local, summands)

    def decode(self, msg: Tensor, numel: int, summands: int) -> Tensor:
        sgs = numel // SUPER_GROUP
        budget = self.payload_bits(summands) * sgs
        sg_scale, log_scales, widths, payload = split_message(msg, numel, budget)
        codes = _unpack_payload(payload, widths)
        levels = level_count(widths).to(torch.float32)
        group_scale = sg_scale.repeat_interleave(GROUPS_PER_SG) * self._table(msg.device)[log_scales]
        step = torch.where(levels > 0, group_scale / levels, 0.0)
        return ((codes.to(torch.float32) - levels[:, None]) * step[:, None]).reshape(-1)


def split_message(msg: Tensor, numel: int, budget: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The four fields of a message: SG scales, group log-scales, group widths and the payload bytes."""
    sgs, groups = numel // SUPER_GROUP, numel // GROUP
    expected = sgs * SIDE_BYTES_PER_SG + 4 * budget
    if msg.numel() != expected:
        raise ValueError(
            f"DynamiQ message of {msg.numel()} bytes; {numel} coordinates at {budget} width units need {expected}."
        )
    ends = (4 * sgs, 4 * sgs + groups, 4 * sgs + groups + 3 * groups // 8)
    sg_scale = view_bytes_as(msg[: ends[0]], torch.float32)
    log_scales = msg[ends[0] : ends[1]].to(torch.int64)
    width_codes = unpack_bits(msg[ends[1] : ends[2]], 3, groups)
    widths = torch.tensor(WIDTHS, device=msg.device)[width_codes.long()]
    return sg_scale, log_scales, widths, msg[ends[2] :]


def payload_offsets(widths: Tensor) -> Tensor:
    """Byte offset of each group in the payload: 32 coordinates of ``w`` bits take ``4·w`` bytes."""
    return 4 * (torch.cumsum(widths, dim=0) - widths)


def _pack_payload(codes: Tensor, widths: Tensor, nbytes: int) -> Tensor:
    payload = torch.zeros(nbytes, dtype=torch.uint8, device=codes.device)
    offsets = payload_offsets(widths)
    for width in WIDTHS[1:]:
        (group,) = torch.nonzero(widths == width, as_tuple=True)
        if group.numel():
            columns = offsets[group][:, None] + torch.arange(4 * width, device=codes.device)
            payload[columns.reshape(-1)] = pack_bits(codes[group], width)
    return payload


def _unpack_payload(payload: Tensor, widths: Tensor) -> Tensor:
    codes = torch.zeros(widths.numel(), GROUP, dtype=torch.int32, device=payload.device)
    offsets = payload_offsets(widths)
    for width in WIDTHS[1:]:
        (group,) = torch.nonzero(widths == width, as_tuple=True)
        if group.numel():
            columns = offsets[group][:, None] + torch.arange(4 * width, device=payload.device)
            codes[group] = unpack_bits(payload[columns.reshape(-1)], width, group.numel() * GROUP).view(-1, GROUP)
    return codes


register_codec("dynamiq", lambda bits: DynamiQCodec(bits))
register_codec("dynamiq_sr", lambda bits: DynamiQCodec(bits, rounding="stochastic"))
