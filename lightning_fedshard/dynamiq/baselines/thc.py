"""THC (Tensor Homomorphic Compression, Li et al., NSDI'24), uniform variant: integer partial sums.

``prepare`` rotates every chunk with a randomized Hadamard transform (RHT) in blocks of 1024, agrees a
range with one all-reduce-MAX of the per-rank norm ``‖y‖``, clamps at THC's ``T = Φ⁻¹(1-p)·max‖y‖/√d``
(after the rotation coordinates are close to ``N(0, ‖y‖²/d)``, so only a fraction ``p = 1e-4`` is
clipped), and stochastically rounds ``y`` to one of ``q = 2^b`` levels ``-T + z·Δ`` (``Δ = 2T/(q-1)``), giving the
integer index ``z ∈ [0, q-1]`` (as fp32). Indices add exactly, so hops never re-quantize: a message
holding the sum of ``h`` ranks' indices is packed with ``ceil(log2((q-1)·h + 1))`` bits per
coordinate. ``finish`` turns the integer total ``S`` into ``S·Δ - P·T`` and applies the inverse RHT.

The RHT signs come from a generator seeded with a shared seed plus a per-call counter (every rank's
codec counts its own calls, so all agree); stochastic rounding must be independent across ranks and
is seeded with (seed, counter, rank). Generators live on the chunks' device, so ranks agree as long as
they use the same device type.
"""

from __future__ import annotations

import math
from statistics import NormalDist

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup

from lightning_fedshard.dynamiq.bitpack import pack_bits_fast, packed_bytes, unpack_bits_fast
from lightning_fedshard.dynamiq.codec import Codec, Transfer, check_finite, raise_if_any_non_finite, register_codec

__all__ = ["THCCodec", "hadamard_transform", "inverse_rht", "rht"]

#: Size of the Hadamard blocks (THC's default ``times=10``).
RHT_BLOCK = 1024
#: THC's per-coordinate overflow probability: the range is its Gaussian quantile times the rotated scale.
OVERFLOW_PROBABILITY = 1e-4
_RANGE_QUANTILE = NormalDist().inv_cdf(1 - OVERFLOW_PROBABILITY)
#: Widest integer a pack carries; wider sums are split into a low and a high part.
_MAX_PACK_WIDTH = 16
#: Integer sums must stay exact in fp32.
_MAX_EXACT = 1 << 24


def hadamard_transform(x: Tensor) -> Tensor:
    """Orthonormal Walsh-Hadamard transform ``H·x/√n`` (Sylvester order) along the last dimension, whose
    size ``n`` must be a power of two. It is its own inverse."""
    n = x.shape[-1]
    if n & (n - 1):
        raise ValueError(f"The Hadamard transform needs a power-of-two length, got {n}.")
    shape = x.shape
    y = x.reshape(-1, n)
    h = 1
    # log2(n) butterfly stages, each vectorised over all pairs (i, i + h)
    while h < n:
        pairs = y.view(-1, n // (2 * h), 2, h)
        a, b = pairs[:, :, 0], pairs[:, :, 1]
        y = torch.stack((a + b, a - b), dim=2).view(-1, n)
        h *= 2
    return (y / math.sqrt(n)).view(shape)


def rht(x: Tensor, signs: Tensor) -> Tensor:
    """Randomized Hadamard transform ``H·D·x/√1024`` per block of 1024 along the last dimension; ``signs``
    (±1, length = last dimension, a multiple of 1024) is the diagonal ``D``."""
    blocks = (x * signs).reshape(*x.shape[:-1], -1, RHT_BLOCK)
    return hadamard_transform(blocks).reshape(x.shape)


def inverse_rht(y: Tensor, signs: Tensor) -> Tensor:
    """Inverse of ``rht``: ``D·H·y/√1024`` (``H`` is symmetric and ``D`` its own inverse)."""
    blocks = y.reshape(*y.shape[:-1], -1, RHT_BLOCK)
    return hadamard_transform(blocks).reshape(y.shape) * signs


class THCCodec(Codec):
    """THC uniform: rotate, share one range ``T``, stochastically round to ``2^bits`` levels once, then add
    integers exactly along the ring (``bits`` = 2..8, default 4).

    One instance serves one collective at a time: ``prepare`` stores the call's state (``T``, sizes, RHT
    signs) for ``finish``. ``side_bytes`` is what this rank sent outside messages in the last
    ``prepare`` (the 4-byte scale all-reduce), for the wire accounting.

    Example::

        codec = make_codec("thc", bits=4)
        z = codec.prepare(chunks, transfer, group)       # [P, m] integer-valued fp32 indices
        msg = codec.encode(z[0], summands=1)             # 4 bits per coordinate, + log2(h) at hop h
        ...                                              # ring: msg = codec.accumulate(msg, z[j], h)
        values = codec.finish(total)                     # [k, n] fp32 sum over all ranks
    """

    name = "thc"
    agrees_finite = True

    def __init__(self, bits: float | None = None, seed: int = 0) -> None:
        super().__init__(bits)
        b = 4 if bits is None else bits
        if b not in range(2, 9):  # 8.5, NaN and inf too: the index width is a whole number of bits
            raise ValueError(f"thc: bits must be a whole number in [2, 8], got {bits}.")
        self.levels = 1 << int(b)
        self.seed = seed
        self.side_bytes = 0.0
        self._calls = 0
        self._state: tuple[float, int, int, Tensor] | None = None

    # -- wire format: exact integer sums ---------------------------------------------------------

    def width(self, summands: int) -> int:
        """Bits per coordinate of a sum of ``summands`` indices: ``ceil(log2((q-1)·summands + 1))``."""
        top = (self.levels - 1) * summands
        if top >= _MAX_EXACT:
            raise ValueError(f"thc: sums up to {top} are not exact in fp32; use fewer bits or ranks.")
        return max(top.bit_length(), 1)

    def message_bytes(self, numel: int, summands: int) -> int:
        width = self.width(summands)
        if width <= _MAX_PACK_WIDTH:
            return packed_bytes(numel, width)
        return packed_bytes(numel, _MAX_PACK_WIDTH) + packed_bytes(numel, width - _MAX_PACK_WIDTH)

    def encode(self, x: Tensor, summands: int) -> Tensor:
        check_finite(x, self.name)
        width = self.width(summands)
        codes = torch.round(x.detach().reshape(-1)).to(torch.int32)
        top = (self.levels - 1) * summands
        # a value off the integer grid or out of range would silently wrap in the packing
        if bool((codes < 0).any()) or bool((codes > top).any()) or not bool((codes == x.reshape(-1)).all()):
            raise ValueError(f"thc: a message of {summands} summands must hold integers in [0, {top}].")
        if width <= _MAX_PACK_WIDTH:
            return pack_bits_fast(codes, width)
        low = pack_bits_fast(codes & ((1 << _MAX_PACK_WIDTH) - 1), _MAX_PACK_WIDTH)
        return torch.cat([low, pack_bits_fast(codes >> _MAX_PACK_WIDTH, width - _MAX_PACK_WIDTH)])

    def decode(self, msg: Tensor, numel: int, summands: int) -> Tensor:
        width = self.width(summands)
        msg = msg.reshape(-1)
        if msg.numel() < self.message_bytes(numel, summands):
            raise ValueError(f"thc: a message of {msg.numel()} bytes cannot hold {numel} coordinates.")
        if width <= _MAX_PACK_WIDTH:
            return unpack_bits_fast(msg, width, numel).to(torch.float32)
        split = packed_bytes(numel, _MAX_PACK_WIDTH)
        low = unpack_bits_fast(msg[:split], _MAX_PACK_WIDTH, numel)
        high = unpack_bits_fast(msg[split:], width - _MAX_PACK_WIDTH, numel)
        return (low | (high << _MAX_PACK_WIDTH)).to(torch.float32)

    # -- summation domain ------------------------------------------------------------------------

    def prepare(self, chunks: Tensor, transfer: Transfer, group: ProcessGroup | None) -> Tensor:
        call = self._next_call()
        distributed = dist.is_available() and dist.is_initialized()
        rank = dist.get_rank(group) if distributed else 0
        y, signs = self._rotate(chunks, call)
        # the range all-reduce carries the finite flag too (no pass of its own): a NaN or Inf anywhere makes the
        # norm non-finite, and so does a norm beyond fp32, from which no range could be set either
        norm = y.norm()
        agreed = torch.stack([norm, torch.where(torch.isfinite(norm), 0.0, rank + 1.0)])
        if distributed:
            dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=group)
        norm, flag = agreed.tolist()
        raise_if_any_non_finite(int(flag), self.name, transfer.world_size)
        self._state = (_clamp_range(norm, y.numel()), chunks.shape[-1], transfer.world_size, signs)
        # the scale all-reduce is a ring all-reduce of one fp32: 2·4·(P-1)/P bytes per rank (the flag beside it is
        # control, not counted, as the collectives' own finite agreement is not)
        world = transfer.world_size
        self.side_bytes = 8.0 * (world - 1) / world if distributed else 0.0
        return self._quantize(y, call, rank)

    def prepare_simulated(self, all_ranks_chunks: list[Tensor], transfer: Transfer) -> list[Tensor]:
        """``prepare`` for every rank at once, in one process: ``all_ranks_chunks[i]`` is rank ``i``'s
        ``[P, n]`` chunks. Uses the largest rank's norm and rank ``i``'s rounding seed, so a single-process ring
        simulation produces what the distributed run would (``side_bytes`` included)."""
        world = transfer.world_size
        if len(all_ranks_chunks) != world:
            raise ValueError(f"thc: {len(all_ranks_chunks)} ranks' chunks for a world of {world}.")
        call = self._next_call()
        rotated = [self._rotate(chunks, call) for chunks in all_ranks_chunks]
        norms = [float(y.norm()) for y, _ in rotated]
        raise_if_any_non_finite(
            max((r + 1 for r, n in enumerate(norms) if not math.isfinite(n)), default=0), self.name, world
        )
        norm = max(norms)
        self._state = (_clamp_range(norm, rotated[0][0].numel()), all_ranks_chunks[0].shape[-1], world, rotated[0][1])
        self.side_bytes = 8.0 * (world - 1) / world
        return [self._quantize(y, call, rank) for rank, (y, _) in enumerate(rotated)]

    def finish(self, total: Tensor) -> Tensor:
        if self._state is None:
            raise RuntimeError("thc: finish() called before prepare().")
        top, n, world, signs = self._state
        step = 2 * top / (self.levels - 1)
        # each rank's index z stands for -T + z·Δ, so the sum of P of them is S·Δ - P·T
        rotated = total.to(torch.float32) * step - world * top
        return inverse_rht(rotated, signs)[..., :n]

    def _next_call(self) -> int:
        # every rank's instance counts its own calls, so the counter is shared without communication
        call = self._calls
        self._calls += 1
        return call

    def _rotate(self, chunks: Tensor, call: int) -> tuple[Tensor, Tensor]:
        """Pads ``[P, n]`` chunks to a multiple of 1024 and rotates them with the call's shared signs."""
        n = chunks.shape[-1]
        padded = -(-n // RHT_BLOCK) * RHT_BLOCK
        x = torch.nn.functional.pad(chunks.detach().to(torch.float32), (0, padded - n))
        gen = torch.Generator(device=x.device)
        gen.manual_seed(_mix(self.seed, call, 0))
        signs = torch.randint(0, 2, (padded,), generator=gen, device=x.device).to(torch.float32) * 2 - 1
        return rht(x, signs), signs

    def _quantize(self, y: Tensor, call: int, rank: int) -> Tensor:
        """Unbiased stochastic rounding of ``y ∈ [-T, T]`` to level indices ``0..q-1`` (fp32)."""
        assert self._state is not None
        top = self._state[0]
        if top == 0.0:
            # all-zero input: T = Δ = 0 makes finish return exactly 0 whatever the indices are
            return torch.zeros_like(y)
        step = 2 * top / (self.levels - 1)
        u = ((y + top) / step).clamp_(0, self.levels - 1)
        low = torch.floor(u)
        gen = torch.Generator(device=y.device)
        gen.manual_seed(_mix(self.seed, call, rank + 1))
        up = torch.rand(u.shape, generator=gen, device=y.device) < (u - low)
        return (low + up).clamp_(max=self.levels - 1)


def _clamp_range(max_norm: float, numel: int) -> float:
    """THC's range ``T``: the ``1 - p`` Gaussian quantile of a rotated coordinate of the largest rank's norm."""
    return _RANGE_QUANTILE * max_norm / math.sqrt(numel) if numel else 0.0


def _mix(seed: int, call: int, stream: int) -> int:
    """A 63-bit generator seed for (shared seed, call counter, stream); stream 0 is the shared RHT signs,
    stream ``rank + 1`` the rank's own rounding."""
    return (seed * 0x9E3779B97F4A7C15 + call * 0xBF58476D1CE4E5B9 + stream * 0x94D049BB133111EB) % (1 << 63)


register_codec(THCCodec.name, THCCodec)
