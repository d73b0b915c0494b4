"""OmniReduce-style lossless block sparsity (Fei et al., SIGCOMM'21), as a ring codec: ``omnireduce``.

A message is a bitmap with one bit per block of 256 coordinates (set when any coordinate's bits are
non-zero), bit-packed, followed by the raw fp32 bytes of the set blocks in order. All-zero blocks cost
one bit; everything else is sent exactly, so the codec is lossless. As partial sums grow along the ring
their support is the union of the summands' supports. Messages vary in size (``fixed_size = False``):
the collective sends a length header.
"""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_fedshard.dynamiq.bitpack import as_bytes, pack_bits_fast, packed_bytes, unpack_bits_fast, view_bytes_as
from lightning_fedshard.dynamiq.codec import Codec, check_finite, register_codec

__all__ = ["OmniReduceCodec"]


class OmniReduceCodec(Codec):
    """Bitmap of non-zero 256-blocks plus those blocks in fp32; exact.

    Example::

        codec = make_codec("omnireduce")
        msg = codec.encode(x, summands=1)      # ceil(numel/256/8) + 1024·(non-zero blocks) bytes
        assert torch.equal(codec.decode(msg, x.numel(), summands=1), x)
    """

    name = "omnireduce"
    block = 256
    fixed_size = False
    lossless = True

    def message_bytes(self, numel: int, summands: int) -> int:
        raise NotImplementedError("omnireduce messages vary in size with the data; see encode().")

    def encode(self, x: Tensor, summands: int) -> Tensor:
        check_finite(x, self.name)
        self.blocks_in(x.numel())
        blocks = x.detach().reshape(-1, self.block).to(torch.float32).contiguous()
        # test the bits, not the values: a block of -0.0 is sent, so decode reproduces it bit for bit
        nonzero = (blocks.view(torch.int32) != 0).any(dim=1)
        bitmap = pack_bits_fast(nonzero.to(torch.int32), 1)
        return torch.cat([bitmap, as_bytes(blocks[nonzero])])

    def decode(self, msg: Tensor, numel: int, summands: int) -> Tensor:
        blocks = self.blocks_in(numel)
        msg = msg.reshape(-1)
        header = packed_bytes(blocks, 1)
        nonzero = unpack_bits_fast(msg[:header], 1, blocks).bool()
        payload = msg[header:]
        expected = int(nonzero.sum()) * self.block * 4
        if payload.numel() != expected:
            raise ValueError(
                f"{self.name}: the bitmap announces {expected} payload bytes but the message carries {payload.numel()}."
            )
        out = torch.zeros(blocks, self.block, dtype=torch.float32, device=msg.device)
        out[nonzero] = view_bytes_as(payload, torch.float32).view(-1, self.block)
        return out.reshape(-1)


register_codec(OmniReduceCodec.name, OmniReduceCodec)
