"""Plain floating-point wire formats: ``none`` (fp32, lossless), ``bf16`` and ``fp16``.

Each hop casts the partial sum to the wire dtype and sends its raw bytes, so ``bf16``/``fp16`` round
the partial sum again at every hop (the default decode-add-encode ``accumulate``).
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import Tensor

from lightning_fedshard.dynamiq.bitpack import as_bytes, view_bytes_as
from lightning_fedshard.dynamiq.codec import Codec, check_finite, register_codec

__all__ = ["BF16Codec", "FP16Codec", "FloatCodec", "NoneCodec"]


class FloatCodec(Codec):
    """Sends the partial sum cast to ``wire_dtype``, as raw bytes (the registered codecs are its subclasses).

    Example::

        codec = make_codec("bf16")
        msg = codec.encode(x, summands=1)          # 2 bytes per coordinate
        y = codec.decode(msg, x.numel(), summands=1)
    """

    wire_dtype: ClassVar[torch.dtype] = torch.float32

    def message_bytes(self, numel: int, summands: int) -> int:
        return numel * torch.empty((), dtype=self.wire_dtype).element_size()

    def encode(self, x: Tensor, summands: int) -> Tensor:
        check_finite(x, self.name)
        # copy=True: the message must not alias the caller's buffer, which the collective may reuse
        wire = x.detach().reshape(-1).to(self.wire_dtype, copy=True)
        return as_bytes(wire)

    def decode(self, msg: Tensor, numel: int, summands: int) -> Tensor:
        size = self.message_bytes(numel, summands)
        if msg.numel() < size:
            raise ValueError(f"{self.name}: a message of {msg.numel()} bytes cannot hold {numel} coordinates.")
        return view_bytes_as(msg.reshape(-1)[:size], self.wire_dtype).to(torch.float32)


class NoneCodec(FloatCodec):
    """Uncompressed fp32 (32 bits/coordinate): the exact reference.

    Example::

        codec = make_codec("none")
        assert torch.equal(codec.decode(codec.encode(x, 1), x.numel(), 1), x)
    """

    name = "none"
    wire_dtype = torch.float32
    lossless = True


class BF16Codec(FloatCodec):
    """bfloat16 on the wire (16 bits/coordinate, round-to-nearest-even at every hop).

    Example::

        msg = make_codec("bf16").encode(x, summands=1)   # 2·x.numel() bytes
    """

    name = "bf16"
    wire_dtype = torch.bfloat16


class FP16Codec(FloatCodec):
    """float16 on the wire (16 bits/coordinate). A partial sum beyond ±65504 raises instead of becoming
    Inf, which every rank would then receive.

    Example::

        msg = make_codec("fp16").encode(x, summands=1)   # ValueError if |x| rounds beyond 65504
    """

    name = "fp16"
    wire_dtype = torch.float16

    def encode(self, x: Tensor, summands: int) -> Tensor:
        check_finite(x, self.name)
        wire = x.detach().reshape(-1).to(torch.float16, copy=True)
        # checking after the cast catches exactly the values that round to Inf (|x| >= 65520)
        if not bool(torch.isfinite(wire).all()):
            big = float(x.detach().abs().max())
            raise ValueError(
                f"fp16: a partial sum reaches {big:.6g}, beyond the fp16 range (±65504), and would be sent "
                "as Inf; scale the gradients down or use codec='bf16' or 'none'."
            )
        return as_bytes(wire)


for _cls in (NoneCodec, BF16Codec, FP16Codec):
    register_codec(_cls.name, _cls)
