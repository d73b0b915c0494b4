"""DynamiQ's compiled CPU kernels (torch.compile, inductor's C++ backend) give the bytes of the eager ones."""

from __future__ import annotations

import shutil

import pytest
import torch

from lightning_fedshard.dynamiq import DynamiQCodec
from lightning_fedshard.dynamiq.codec import Codec
from lightning_fedshard.dynamiq.dynamiq_codec import COMPILE_MIN_NUMEL

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="inductor's C++ backend needs a compiler")


def layered(numel: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    scales = torch.logspace(-6, 1, numel // 4096).repeat_interleave(4096)
    x = torch.randn(numel, generator=gen) * scales
    x[torch.rand(numel, generator=gen) < 0.05] = 0.0  # some exact zeros and all-zero groups
    x[:64] = 0.0
    return x


@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_compiled_kernels_give_the_bytes_of_the_eager_ones(monkeypatch, rounding) -> None:
    numel = COMPILE_MIN_NUMEL * 2
    x, y = layered(numel, 0), layered(numel, 1)

    def hop(setting: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        monkeypatch.setenv("FEDSHARD_DYNAMIQ_COMPILE", setting)
        codec = DynamiQCodec(5.0, rounding=rounding, seed=3)
        first = codec.encode(x, 1)
        second = codec.accumulate(first, y, 1)
        return first, second, codec.decode(second, numel, 2), Codec.accumulate(codec, first, y, 1)

    eager, compiled = hop("0"), hop("1")
    for name, a, b in zip(("encode", "accumulate", "decode"), eager, compiled, strict=False):
        assert torch.equal(a, b), name
    # the fused decode-and-add is the base class's decode + add + encode, to the byte
    assert torch.equal(compiled[1], compiled[3])
