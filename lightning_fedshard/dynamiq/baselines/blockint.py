"""Block-wise symmetric integer quantization: ``int8`` and ``int4`` (blocks of 32, fp32 absmax scale).

Per block of 32 coordinates the wire holds the fp32 scale ``s = max|x|`` and, per coordinate, the level
``q = floor(x / s · L + 0.5)`` clamped to ``[-L, L]`` with ``L = 2^(b-1) - 1`` (round to nearest, ties
up), sent as the offset-binary code ``q + L`` in ``b`` bits. Decoding gives ``q · s / L``. Layout of a
message: all block scales (fp32, native byte order), then the bit-packed codes. That is
``32·b + 32`` bits per block: 9.0 bits/coordinate for int8, 5.0 for int4. The partial sum is
re-quantized at every hop (default ``accumulate``).
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import Tensor

from lightning_fedshard.dynamiq.bitpack import as_bytes, pack_bits_fast, packed_bytes, unpack_bits_fast, view_bytes_as
from lightning_fedshard.dynamiq.codec import Codec, check_finite, register_codec

__all__ = ["BlockIntCodec", "Int4Codec", "Int8Codec"]


class BlockIntCodec(Codec):
    """Symmetric ``width``-bit integers with one fp32 absmax scale per block of 32 (subclasses set ``width``).

    Example::

        codec = make_codec("int4")
        msg = codec.encode(x, summands=1)                # codec.message_bytes(x.numel(), 1) = 20 per 32 coords
        x_hat = codec.decode(msg, x.numel(), summands=1)
    """

    block = 32
    width: ClassVar[int] = 8

    @property
    def levels(self) -> int:
        """``L``: the largest level magnitude, ``2^(width-1) - 1``."""
        return (1 << (self.width - 1)) - 1

    def message_bytes(self, numel: int, summands: int) -> int:
        blocks = self.blocks_in(numel)
        return 4 * blocks + packed_bytes(numel, self.width)

    def encode(self, x: Tensor, summands: int) -> Tensor:
        check_finite(x, self.name)
        self.blocks_in(x.numel())
        blocks = x.detach().reshape(-1, self.block).to(torch.float32)
        scale = blocks.abs().amax(dim=1)
        # an all-zero block keeps scale 0 on the wire; dividing by 1 instead maps it to level 0
        safe = torch.where(scale > 0, scale, torch.ones_like(scale))
        levels = self.levels
        q = torch.floor(blocks / safe[:, None] * levels + 0.5).clamp_(-levels, levels)
        codes = (q + levels).to(torch.int32)
        return torch.cat([as_bytes(scale), pack_bits_fast(codes, self.width)])

    def decode(self, msg: Tensor, numel: int, summands: int) -> Tensor:
        blocks = self.blocks_in(numel)
        msg = msg.reshape(-1)
        if msg.numel() < self.message_bytes(numel, summands):
            raise ValueError(f"{self.name}: a message of {msg.numel()} bytes cannot hold {numel} coordinates.")
        scale = view_bytes_as(msg[: 4 * blocks], torch.float32)
        codes = unpack_bits_fast(msg[4 * blocks :], self.width, numel)
        q = (codes - self.levels).to(torch.float32).view(blocks, self.block)
        return (q * scale[:, None] / self.levels).reshape(-1)


class Int8Codec(BlockIntCodec):
    """int8 levels ``[-127, 127]`` with an fp32 scale per 32 coordinates: 9.0 bits/coordinate.

    Example::

        msg = make_codec("int8").encode(x, summands=1)   # 36 bytes per 32 coordinates
    """

    name = "int8"
    width = 8


class Int4Codec(BlockIntCodec):
    """int4 levels ``[-7, 7]`` (two codes per byte) with an fp32 scale per 32 coordinates: 5.0 bits/coordinate.

    Example::

        msg = make_codec("int4").encode(x, summands=1)   # 20 bytes per 32 coordinates
    """

    name = "int4"
    width = 4


for _cls in (Int8Codec, Int4Codec):
    register_codec(_cls.name, _cls)
