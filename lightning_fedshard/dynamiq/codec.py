"""What a codec is to the multi-hop collectives, and the registry of codecs by name.

A ring (or butterfly) all-reduce moves *partial sums*: a message carries the sum of ``summands``
ranks' chunks. Each codec says how such a message looks on the wire (``encode``/``decode``), how
a hop folds its own chunk into a received one (``accumulate``, the decompress-accumulate-recompress
step) and, for codecs that sum in a transformed domain (THC's rotated integers), how to enter and
leave that domain (``prepare``/``finish``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor
from torch.distributed import ProcessGroup

__all__ = [
    "CODECS",
    "Codec",
    "Message",
    "Transfer",
    "check_finite",
    "make_codec",
    "non_finite_error",
    "non_finite_flag",
    "raise_if_any_non_finite",
    "register_codec",
]


@dataclass(frozen=True)
class Message:
    """One message a rank sends: ``numel`` (padded) coordinates holding a sum of ``summands`` ranks' chunks.
    ``summands == world_size`` is the finished sum that the all-gather forwards unchanged."""

    numel: int
    summands: int


@dataclass(frozen=True)
class Transfer:
    """Everything one rank sends in one collective call, so that a rate-adaptive codec can split its budget.

    ``reference_coords`` is what an exact ring sends per rank for the unpadded tensor
    (``2(P-1)/P·numel`` for an all-reduce, ``(P-1)/P·numel`` for a reduce-scatter): the denominator
    of "bits per coordinate on the wire".
    """

    world_size: int
    messages: tuple[Message, ...]
    reference_coords: float


class Codec:
    """Base class: a codec that re-quantizes the partial sum at every hop.

    Subclasses implement ``message_bytes``, ``encode`` and ``decode``; the default ``accumulate`` is
    decode + add + encode, which a fused kernel may replace as long as it returns the same bytes.
    Fixed-size codecs must return exactly ``message_bytes(numel, summands)`` bytes from ``encode``,
    because the receiver allocates its buffer before the data arrives; variable-size ones
    (``fixed_size = False``) are sent behind a length header.

    Example::

        codec = make_codec("int8")
        msg = codec.encode(x, summands=1)              # uint8 tensor of codec.message_bytes(x.numel(), 1) bytes
        msg = codec.accumulate(msg, y, summands=1)     # now carries x + y
        total = codec.decode(msg, x.numel(), summands=2)
    """

    name: ClassVar[str] = ""
    #: Chunks are padded to a multiple of this many coordinates.
    block: ClassVar[int] = 1
    fixed_size: ClassVar[bool] = True
    #: True when ``decode(encode(x)) == x`` for every finite fp32 ``x``.
    lossless: ClassVar[bool] = False
    #: Bytes this rank sent outside the messages in the last ``prepare`` (THC's range agreement).
    side_bytes: float = 0.0
    #: True when ``prepare`` itself makes every rank raise alike on NaN or Inf in any rank's chunks, by folding
    #: ``non_finite_flag`` into a collective it runs anyway; for the others the collectives agree on the flag first.
    agrees_finite: ClassVar[bool] = False
    #: Set by the collectives while every rank has agreed that no chunk holds NaN or Inf and that no partial sum can
    #: overflow (``non_finite_flag`` with ``headroom``): a codec may then skip its own check of each message, which
    #: reads a flag back to the host, a synchronisation per hop on a GPU.
    sums_known_finite: bool = False

    def __init__(self, bits: float | None = None) -> None:
        self.bits = bits

    def prepare(self, chunks: Tensor, transfer: Transfer, group: ProcessGroup | None) -> Tensor:
        """Maps this rank's ``[P, n]`` fp32 chunks into the domain where partial sums are added.
        May run small collectives on ``group`` (all ranks call it in the same order)."""
        return chunks

    def warm_up(self, numel: int, device: torch.device | str = "cpu") -> None:
        """Prepares for chunks of ``numel`` coordinates before the first collective (DynamiQ builds its C
        kernels); nothing to do for most codecs."""

    def prepare_simulated(self, chunks_per_rank: list[Tensor], transfer: Transfer) -> list[Tensor]:
        """``prepare`` for all ranks at once, in one process (``simulate_all_reduce``). The default suits
        codecs whose ``prepare`` leaves the data as it is; codecs that transform it override this."""
        return [self.prepare(chunks_per_rank[0], transfer, None), *chunks_per_rank[1:]]

    def finish(self, total: Tensor) -> Tensor:
        """Maps ``[k, m]`` summed chunks from the summation domain back to ``[k, n]`` fp32 values."""
        return total

    def blocks_in(self, numel: int) -> int:
        """How many blocks ``numel`` coordinates make; the collective pads chunks so this never fails there."""
        if numel % self.block:
            raise ValueError(f"{self.name}: {numel} coordinates are not a multiple of the block size {self.block}.")
        return numel // self.block

    def message_bytes(self, numel: int, summands: int) -> int:
        raise NotImplementedError

    def encode(self, x: Tensor, summands: int) -> Tensor:
        raise NotImplementedError

    def decode(self, msg: Tensor, numel: int, summands: int) -> Tensor:
        raise NotImplementedError

    def accumulate(self, msg: Tensor, local: Tensor, summands: int) -> Tensor:
        """Decompress-accumulate-recompress: ``msg`` holds ``summands`` chunks; the result holds one more."""
        return self.encode(self.decode(msg, local.numel(), summands) + local, summands + 1)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, bits={self.bits})"


CODECS: dict[str, Callable[[float | None], Codec]] = {}


def register_codec(name: str, factory: Callable[[float | None], Codec]) -> None:
    """Makes ``make_codec(name, bits)`` return ``factory(bits)``."""
    if name in CODECS:
        raise ValueError(f"A codec named {name!r} is already registered.")
    CODECS[name] = factory


def make_codec(name: str | Codec, bits: float | None = None) -> Codec:
    """The codec registered as ``name``. ``bits`` sets the rate of rate-adaptive codecs (``dynamiq``,
    ``thc``); fixed formats (``bf16``, ``mxfp8``, ...) send what their format defines and ignore it."""
    if isinstance(name, Codec):
        return name
    if name not in CODECS:
        raise ValueError(f"Unknown codec {name!r}; expected one of {sorted(CODECS)}.")
    return CODECS[name](bits)


def check_finite(x: Tensor, codec: str) -> None:
    """Quantizers have no code for NaN or Inf: fail loudly instead of sending garbage to every rank."""
    if not bool(torch.isfinite(x).all()):
        raise non_finite_error(codec)


def non_finite_error(codec: str) -> ValueError:
    """The error of ``check_finite`` (also raised by kernels that detect NaN or Inf on the device)."""
    return ValueError(
        f"{codec}: the tensor holds NaN or Inf values, which the codec cannot encode "
        "(a diverged step or an fp16 overflow); skip the step."
    )


def non_finite_flag(x: Tensor, rank: int, headroom: int = 1) -> Tensor:
    """``[rank + 1]`` when the non-empty ``x`` holds a NaN or an Inf, or a value so large that a sum of ``headroom``
    values of its size overflows fp32, else ``[0]``: an int64 tensor on ``x``'s device, so no host synchronisation.
    Reduced with MAX over a group, it names the highest-numbered rank with one. One reading pass (NaN propagates
    through min and max), a small fraction of an encode."""
    low, high = torch.aminmax(x)
    fits = torch.isfinite(low * headroom) & torch.isfinite(high * headroom)
    return torch.where(fits, 0, rank + 1).reshape(1)


def raise_if_any_non_finite(flag: int, codec: str, world_size: int) -> None:
    """What every rank of a collective raises when the MAX-reduced ``non_finite_flag`` is set: all of them, at
    once, before any message is sent, instead of the one rank whose encoder meets the NaN while the others wait
    for its message until the process group times out."""
    if flag:
        raise ValueError(
            f"{codec}: the tensor holds NaN or Inf values on rank {flag - 1} of {world_size} (the highest-numbered "
            "rank with any), which the codec cannot encode (a diverged step or an fp16 overflow). Every rank of the "
            "collective raises this error before sending anything and leaves its tensor unchanged, so all of them "
            "can skip the step; dist.all_reduce would pass the NaN on instead. (The compressed ring also counts finite "
            "values above the fp32 maximum / 2P as Inf: a partial sum of them could overflow between its hops.)"
        )
