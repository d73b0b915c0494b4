"""DynamiQ-L: our reconstruction of DynamiQ's partial-sum codec (the paper's code is not public), in torch.

The message format (hierarchical scales, water-filled group widths, bit-plane payload) is described and
built in ``dynamiq_format``, which the Triton kernels share.

A message carrying the sum of ``h`` chunks gets ``½·log2 h`` more bits per coordinate than the
first hop's, because its error would otherwise grow with the number of hops (research note §6);
the finished sum that the all-gather forwards gets the base rate. ``prepare`` picks the largest
base rate for which all messages of the collective fit in ``bits`` per coordinate.

On CPU, encode and decode(-and-add) run in the C kernels of ``cpu_kernels`` where a C compiler is present
(``FEDSHARD_DYNAMIQ_COMPILE=0`` turns them off); they give the bytes of the torch functions below, which
run everywhere else and are the reference.
"""

from __future__ import annotations

import importlib.util
import math
import operator
import threading

import torch
from torch import Tensor
from torch.distributed import ProcessGroup

from lightning_fedshard.dynamiq import cpu_kernels
from lightning_fedshard.dynamiq.bitpack import view_bytes_as
from lightning_fedshard.dynamiq.codec import Codec, Transfer, check_finite, register_codec
from lightning_fedshard.dynamiq.dynamiq_format import (
    GROUP,
    GROUPS_PER_SG,
    MANTISSA_STEPS,
    MAX_WIDTH,
    SIDE_BYTES_PER_SG,
    SUPER_GROUP,
    device_constants,
    dither,
    dither_key,
    hash_uniform,
    level_count,
    message_fields,
    message_header,
    payload_offsets,
    split_message,
)

__all__ = ["MAX_BITS", "DynamiQCodec"]

_HAS_TRITON = importlib.util.find_spec("triton") is not None
_MIN_BASE = 8  # payload bits per group of 32 = one bit per coordinate on average
_SIDE_BITS = 8 * SIDE_BYTES_PER_SG / SUPER_GROUP  # per coordinate
#: The rate of a message whose every group has the widest codes (8 bits): more bits would buy nothing.
MAX_BITS = MAX_WIDTH + _SIDE_BITS
_MIN_BITS = _MIN_BASE / 8 + _SIDE_BITS


class DynamiQCodec(Codec):
    """DynamiQ-L partial-sum codec: hierarchical scales, variable bit widths, per-hop budget widening.

    ``bits`` is the average number of bits per coordinate the whole collective may send, side
    information and widening included. ``rounding="stochastic"`` rounds with a hashed dither that is
    antithetic across hops (``u`` on odd hops, ``1-u`` on even ones), which halves the error that
    independent stochastic rounding accumulates along a ring.

    A message covers whole super-groups of 256 coordinates: a tensor of any other size is encoded as if
    zero-padded to the next multiple of 256 (the bytes of that padded tensor's message), and ``decode`` returns
    exactly ``numel`` values. Short tensors therefore cost more than ``bits`` per coordinate; the collectives
    pad their chunks to whole super-groups themselves, so their budget is exact.

    Example::

        codec = DynamiQCodec(bits=5.0)
        msg = codec.encode(x, summands=1)               # x: any size; msg has codec.message_bytes(x.numel(), 1) bytes
        x_hat = codec.decode(msg, x.numel(), summands=1)
    """

    name = "dynamiq"
    block = SUPER_GROUP

    def __init__(self, bits: float | None = 5.0, *, rounding: str = "nearest", seed: int = 0) -> None:
        bits = 5.0 if bits is None else float(bits)
        if not _MIN_BITS <= bits <= MAX_BITS:  # NaN too
            wider = " For more precision use a wider format (codec='bf16' or 'none')." if bits > MAX_BITS else ""
            raise ValueError(
                f"DynamiQ sends {_MIN_BITS:.3f} to {MAX_BITS:.3f} bits per coordinate (codes of 1 to 8 bits on "
                f"average plus {_SIDE_BITS:.3f} of side information); got bits={bits}.{wider}"
            )
        if rounding not in ("nearest", "stochastic"):
            raise ValueError(f"rounding must be 'nearest' or 'stochastic', got {rounding!r}.")
        super().__init__(bits)
        self.rounding = rounding
        self.seed = seed
        self.calls = 0
        self.world_size: int | None = None
        # Without a planned collective (a lone encode), one message gets the whole budget.
        self.base = math.floor(8 * (bits - _SIDE_BITS))
        self._buffers: dict[tuple, Tensor] = {}
        self._bases: dict[tuple[Transfer, float], int] = {}

    # ------------------------------------------------------------------ budget
    def payload_bits(self, summands: int) -> int:
        """Payload bits per group of 32 (``B``) of a message carrying ``summands`` chunks."""
        if summands < 1:
            raise ValueError(f"DynamiQ: a message carries the sum of at least 1 chunk, got summands={summands}.")
        if self.world_size is not None and summands >= self.world_size:
            return self.base
        return min(self.base + round(4 * math.log2(summands)), 8 * MAX_WIDTH)

    def message_bytes(self, numel: int, summands: int) -> int:
        """Bytes of the message of ``numel`` coordinates, padded to whole super-groups of 256."""
        return _padded_numel(numel) // SUPER_GROUP * (SIDE_BYTES_PER_SG + 4 * self.payload_bits(summands))

    def prepare(self, chunks: Tensor, transfer: Transfer, group: ProcessGroup | None) -> Tensor:
        """Picks the largest base rate whose messages all fit in ``bits`` per coordinate (from the sizes alone: no
        device value is read; remembered per transfer, as DDP sends the same buckets every step)."""
        self.world_size = transfer.world_size
        self.calls += 1
        key = (transfer, self.bits)
        if key not in self._bases:
            self._bases[key] = self._largest_base(transfer)
        self.base = self._bases[key]
        return chunks

    def _largest_base(self, transfer: Transfer) -> int:
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
        return best

    # ------------------------------------------------------------------ codec
    def _dither_params(self, summands: int) -> tuple[int, bool]:
        """Seed of this call's dither, and whether this hop rounds with the antithetic ``1 - u``."""
        return self.seed * 1_000_003 + self.calls, summands % 2 == 0

    def _dither(self, numel: int, summands: int, device: torch.device) -> Tensor:
        seed, antithetic = self._dither_params(summands)
        u = dither(seed, numel, device)
        return 1.0 - u if antithetic else u

    def _rounding_key(self, summands: int) -> tuple[int | None, bool]:
        """The dither's key and whether it is antithetic; ``None`` for rounding to nearest."""
        if self.rounding != "stochastic":
            return None, False
        seed, antithetic = self._dither_params(summands)
        return dither_key(seed), antithetic

    def _scratch(self, name: str, numel: int, dtype: torch.dtype, device: torch.device) -> Tensor:
        """A buffer reused across calls: a fresh gradient-sized allocation per hop costs more in page faults
        than the hop's arithmetic. One per thread, as ``simulate_all_reduce`` runs its ranks in threads."""
        key = (name, numel, dtype, device, threading.get_ident())
        if key not in self._buffers:
            self._buffers[key] = torch.empty(numel, dtype=dtype, device=device)
        return self._buffers[key]

    def encode(self, x: Tensor, summands: int) -> Tensor:
        """The message of ``x`` (any size, zero-padded to whole super-groups) holding ``summands`` chunks."""
        x = x.detach().reshape(-1).to(torch.float32).contiguous()
        if x.numel() % SUPER_GROUP:
            # zero padding changes no group's maximum and its all-zero groups cost no payload: the real coordinates
            # get the codes they get in the padded tensor
            x = torch.cat([x, x.new_zeros(_padded_numel(x.numel()) - x.numel())])
        if self._in_c(x):
            group_max = cpu_kernels.group_max(x, self._scratch("maxima", x.numel() // GROUP, torch.float32, x.device))
        else:
            group_max = group_max_of(x)
        return self._encode_with_max(x, group_max, summands)

    def _in_c(self, x: Tensor) -> bool:
        """Whether ``x``'s chunk runs through the C kernels (CPU, where they built and are not turned off)."""
        return x.device.type == "cpu" and cpu_kernels.library() is not None

    def _encode_with_max(self, x: Tensor, group_max: Tensor, summands: int) -> Tensor:
        if not self.sums_known_finite:  # a NaN or Inf anywhere shows in its group's max
            check_finite(group_max, self.name)
        table = device_constants(x.device)[0]
        budget = self.payload_bits(summands) * (group_max.numel() // GROUPS_PER_SG)
        key, antithetic = self._rounding_key(summands)
        if self._in_c(x):
            groups = group_max.numel()
            scratch = (
                self._scratch("widths", groups, torch.int32, x.device),
                self._scratch("keys", groups, torch.int64, x.device),
            )
            return cpu_kernels.encode(x, group_max, budget, table, MANTISSA_STEPS, key, antithetic, scratch)
        sg_scale, log_scales, widths = message_fields(group_max, budget, table)
        codes = self._scratch("codes", x.numel(), torch.int32, x.device).view(-1, GROUP)
        # filled on the device: torch.tensor(key, device=...) would copy from the host and wait for the GPU
        key_t = None if key is None else torch.full((), key, dtype=torch.int64, device=x.device)
        quantize(x.view(-1, GROUP), sg_scale, log_scales, widths, table, key_t, antithetic, codes)
        planes = self._scratch("planes", x.numel() // 4, torch.int32, x.device).view(-1, MAX_WIDTH)
        slots = self._scratch("slots", x.numel() // 4, torch.int64, x.device).view(-1, MAX_WIDTH)
        bit_planes(codes, planes)
        plane_slots(widths, budget, slots)
        header = message_header(sg_scale, log_scales, widths)
        side = header.numel()
        # one spare word after the payload takes the planes groups do not have (see plane_slots)
        buffer = torch.empty(side + 4 * (budget + 1), dtype=torch.uint8, device=x.device)
        buffer[:side] = header
        aligned = side % 4 == 0
        words = (
            buffer[side:].view(torch.int32) if aligned else torch.empty(budget + 1, dtype=torch.int32, device=x.device)
        )
        words.zero_().scatter_(0, slots.view(-1), planes.view(-1))
        if not aligned:
            buffer[side:] = words.view(torch.uint8)
        return buffer[: side + 4 * budget]

    def accumulate(self, msg: Tensor, local: Tensor, summands: int) -> Tensor:
        """The fused Triton DAR on CUDA; elsewhere one pass decodes and adds (``decode(msg) + local`` to the
        bit), then the sum is encoded. Both give the bytes of the base class's decode + add + encode."""
        if local.dtype == torch.float64 or local.numel() % SUPER_GROUP:
            # fp64: the reference adds in fp64 and rounds the sum once. A size that is not whole super-groups: the
            # padding decodes to ±half a cell (no grid level at 0), and must be zeros again in the sum it encodes.
            return super().accumulate(msg, local, summands)
        if local.is_cuda and _HAS_TRITON:
            from lightning_fedshard.dynamiq import triton_dar

            return triton_dar.dar(self, msg, local, summands, check_finite=not self.sums_known_finite)
        numel = local.numel()
        total = self._scratch("total", numel, torch.float32, local.device)
        group_max = self._decode_into(msg, numel, summands, local.detach().reshape(-1).to(torch.float32), total)
        return self._encode_with_max(total, group_max, summands + 1)

    def decode(self, msg: Tensor, numel: int, summands: int) -> Tensor:
        """The ``numel`` fp32 values of ``msg`` (the message of ``numel`` coordinates, any size)."""
        values = torch.empty(_padded_numel(numel), dtype=torch.float32, device=msg.device)
        self._decode_into(msg, values.numel(), summands, None, values)
        return values[:numel]

    def _decode_into(self, msg: Tensor, numel: int, summands: int, local: Tensor | None, out: Tensor) -> Tensor:
        """Writes ``decode(msg) (+ local)`` into ``out`` (``numel`` coordinates, whole super-groups); returns its
        group maxima."""
        budget = self.payload_bits(summands) * (numel // SUPER_GROUP)
        table = device_constants(msg.device)[0]
        stochastic = self.rounding == "stochastic"
        if self._in_c(out):  # the wrapper checks the message's size against out's
            # the maxima of a sum are read by the encode that follows: a reused buffer
            maxima = self._scratch("maxima", numel // GROUP, torch.float32, out.device) if local is not None else None
            return cpu_kernels.decode_into(msg.contiguous(), budget, table, stochastic, local, out, maxima)
        sg_scale, log_scales, widths, payload = split_message(msg, numel, budget)
        # the payload followed by zero words, which the planes a group lacks read
        words = self._scratch("received", numel // GROUP * MAX_WIDTH + 1, torch.int32, msg.device)
        words[-1] = 0  # no budget reaches it (at most 8 words per group)
        words[:budget] = view_bytes_as(payload, torch.int32)
        return decode_add(words, sg_scale, log_scales, widths, table, local, stochastic, out)

    def warm_up(self, numel: int, device: torch.device | str = "cpu") -> None:
        """Builds (or loads) the C kernels now, so that the first collective does not wait for the compiler."""
        if torch.device(device).type == "cpu":
            cpu_kernels.library()


def _padded_numel(numel: int) -> int:
    """``numel`` rounded up to whole super-groups of 256: the coordinates a message of ``numel`` carries."""
    try:
        size = operator.index(numel)
    except TypeError:
        size = -1
    if size < 0:
        raise ValueError(f"DynamiQ: a number of coordinates is a non-negative integer, got {numel!r}.")
    return -(-size // SUPER_GROUP) * SUPER_GROUP


# ---------------------------------------------------------------------------------------------- kernels
# Pure tensor functions: the reference, which cpu_kernels.c follows to the bit. Integer bit work is done in int32
# (32 coordinates per plane word).
# Made on the tensors' device where used: copying a host constant to a GPU waits for the GPU.


def _planes(device: torch.device) -> Tensor:
    return torch.arange(MAX_WIDTH, dtype=torch.int32, device=device)


def group_max_of(x: Tensor) -> Tensor:
    """Max |x| of each group of 32."""
    return x.view(-1, GROUP).abs().amax(dim=-1)


def _grid(
    sg_scale: Tensor, log_scales: Tensor, widths: Tensor, table: Tensor, stochastic: bool
) -> tuple[Tensor, Tensor, Tensor]:
    """Each group's codes per side ``L = 2^(w-1)`` (fp32, 0 for width 0), the steps from 0 to its scale
    ``s`` (``L`` for rounding to nearest, ``L - ½`` for stochastic rounding) and ``s``.

    To nearest, the grid is midrise: ``2L`` cells of ``s/L`` and the coordinate decodes to its cell's centre.
    Stochastic rounding puts the outermost points at ``±s`` instead (step ``s/(L - ½)``), so that no value is
    ever clamped and every rounding is unbiased."""
    levels = level_count(widths).to(torch.float32)
    steps = levels - 0.5 if stochastic else levels
    return levels, steps, sg_scale.repeat_interleave(GROUPS_PER_SG) * table[log_scales]


def quantize(
    groups: Tensor,
    sg_scale: Tensor,
    log_scales: Tensor,
    widths: Tensor,
    table: Tensor,
    key: Tensor | None,
    antithetic: bool,
    out: Tensor,
) -> None:
    """Midrise codes in ``[0, 2^w)`` of ``groups [G, 32]`` into ``out [G, 32]`` (int32):
    ``floor(x · L/s + offset)`` clamped to ``[-L, L)``, plus ``L``; offset 0 rounds to nearest, ``u - ½``
    with the hashed dither ``u`` (``½ - u`` when antithetic) rounds stochastically."""
    levels, steps, group_scale = _grid(sg_scale, log_scales, widths, table, key is not None)
    inverse_step = torch.where(levels > 0, steps / group_scale, 0.0)[:, None]
    scaled = groups * inverse_step
    if key is not None:
        index = torch.arange(groups.numel(), dtype=torch.int64, device=groups.device).view_as(groups)
        u = hash_uniform(index, key)
        scaled = scaled + ((0.5 - u) if antithetic else (u - 0.5))
    q = torch.floor(scaled)
    q = torch.minimum(torch.maximum(q, -levels[:, None]), levels[:, None] - 1)
    out.copy_((q + levels[:, None]).to(torch.int32))


def bit_planes(codes: Tensor, out: Tensor) -> None:
    """The 8 bit planes of each group of ``codes [G, 32]`` into ``out [G, 8]`` (int32): bit ``j`` of plane ``m``
    is bit ``m`` of code ``j``."""
    planes = _planes(codes.device)
    packed = ((codes[:, 0, None] >> planes) & 1) << 0
    for j in range(1, GROUP):  # unrolled: one fused pass over 32 lanes per plane, where a reduction would not vectorise
        packed = packed | (((codes[:, j, None] >> planes) & 1) << j)
    out.copy_(packed)


def plane_slots(widths: Tensor, spare: Tensor, out: Tensor) -> None:
    """Where each of the 8 planes of each group goes in the payload (``out [G, 8]``): a group's first ``w`` at
    its offset, the others to the ``spare`` word."""
    planes = _planes(widths.device)
    out.copy_(torch.where(planes < widths[:, None], payload_offsets(widths)[:, None] + planes, spare))


def decode_add(
    words: Tensor,
    sg_scale: Tensor,
    log_scales: Tensor,
    widths: Tensor,
    table: Tensor,
    local: Tensor | None,
    stochastic: bool,
    out: Tensor,
) -> Tensor:
    """Writes ``(code - L + ½) · step`` of every coordinate (``step = s/L``, or ``s/(L - ½)`` for stochastic
    rounding: see ``_grid``), plus ``local`` (an fp32 sum) when given, into ``out``; returns each group's max
    |value|. ``words`` holds the payload followed by at least one zero word, which planes a group lacks read."""
    levels, steps, group_scale = _grid(sg_scale, log_scales, widths, table, stochastic)
    step = torch.where(levels > 0, group_scale / torch.where(levels > 0, steps, 1.0), 0.0)[:, None]
    planes = _planes(words.device)
    slot = torch.where(planes < widths[:, None], payload_offsets(widths)[:, None] + planes, words.numel() - 1)
    plane_words = words[slot]  # [G, 8]
    lanes = torch.arange(GROUP, dtype=torch.int32, device=words.device)
    codes = ((plane_words[:, 0, None] >> lanes) & 1) << 0
    for m in range(1, MAX_WIDTH):
        codes = codes | (((plane_words[:, m, None] >> lanes) & 1) << m)
    values = (((codes.to(torch.float32) - levels[:, None]) + 0.5) * step).reshape(-1)  # step 0 for width 0
    if local is not None:
        values = values + local.to(torch.float32)
    out.copy_(values)
    return values.view(-1, GROUP).abs().amax(dim=-1)


register_codec("dynamiq", lambda bits: DynamiQCodec(bits))
register_codec("dynamiq_sr", lambda bits: DynamiQCodec(bits, rounding="stochastic"))
