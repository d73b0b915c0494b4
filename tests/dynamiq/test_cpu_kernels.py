"""DynamiQ's C kernels (cpu_kernels.c) give the bytes of the torch reference, built natively and portably, and
the codec falls back to torch where they are off or cannot be built."""

from __future__ import annotations

import shutil

import pytest
import torch

from lightning_fedshard.dynamiq import DynamiQCodec, cpu_kernels
from lightning_fedshard.dynamiq.codec import Codec
from lightning_fedshard.dynamiq.dynamiq_format import MANTISSA_STEPS, scale_table

pytestmark = pytest.mark.skipif(
    not any(shutil.which(c) for c in ("cc", "gcc", "clang")), reason="the C kernels need a C compiler"
)
NUMEL = 1 << 15


def inputs() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    layered = torch.randn(NUMEL, generator=gen) * torch.logspace(-6, 1, NUMEL // 1024).repeat_interleave(1024)
    layered[torch.rand(NUMEL, generator=gen) < 0.05] = 0.0  # exact zeros and all-zero groups
    layered[:64] = -0.0
    heavy = torch.distributions.StudentT(2.0).sample((NUMEL,))
    magnitudes = torch.tensor([1e-40, 1e-30, 1.0, 1e30, 5e37]).repeat_interleave(NUMEL // 5 + 1)[:NUMEL]
    extremes = torch.randn(NUMEL, generator=gen).clamp(-6, 6) * magnitudes  # subnormal to huge groups side by side
    one = torch.zeros(NUMEL)
    one[777] = -2.5
    return {"layered": layered, "heavy": heavy, "extremes": extremes, "one": one, "zeros": torch.zeros(NUMEL)}


def hops(x: torch.Tensor, y: torch.Tensor, bits: float, rounding: str) -> list[torch.Tensor]:
    """A first hop, three accumulations, their decodes, and the base class's decode + add + encode."""
    codec = DynamiQCodec(bits, rounding=rounding, seed=5)
    msg = codec.encode(x, 1)
    out = [msg, Codec.accumulate(codec, msg, y, 1)]
    for summands in (1, 2, 3):
        msg = codec.accumulate(msg, y, summands)
        out += [msg, codec.decode(msg, NUMEL, summands + 1)]
    return out


def torch_and_c(monkeypatch, x, y, bits, rounding) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    monkeypatch.setenv("FEDSHARD_DYNAMIQ_COMPILE", "0")
    assert cpu_kernels.library() is None
    reference = hops(x, y, bits, rounding)
    monkeypatch.setenv("FEDSHARD_DYNAMIQ_COMPILE", "1")
    assert cpu_kernels.library() is not None
    return reference, hops(x, y, bits, rounding)


@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
@pytest.mark.parametrize("bits", [1.5, 5.0, 8.4])
def test_c_kernels_give_the_bytes_of_the_torch_reference(monkeypatch, bits, rounding) -> None:
    data = inputs()
    for name, x in data.items():
        y = data["heavy"] if name != "heavy" else data["layered"]
        reference, c = torch_and_c(monkeypatch, x, y, bits, rounding)
        for step, (a, b) in enumerate(zip(reference, c, strict=True)):
            assert torch.equal(a, b), f"{name}, step {step}"
        assert torch.equal(c[1], c[2])  # the fused decode-and-add is decode + add + encode, to the byte


def test_the_portable_build_gives_the_same_bytes(monkeypatch, tmp_path) -> None:
    x, y = inputs()["layered"], inputs()["heavy"]
    monkeypatch.setattr(cpu_kernels, "_PREBUILT_DIR", tmp_path)  # none installed: compiled at run time
    cpu_kernels._load.cache_clear()
    try:
        reference, native = torch_and_c(monkeypatch, x, y, 5.0, "stochastic")
        assert cpu_kernels.origin().kind == "compiled"
        monkeypatch.setattr(cpu_kernels, "_TUNINGS", ((),))  # no -march=native: plain SSE2 / scalar code
        cpu_kernels._load.cache_clear()
        portable = hops(x, y, 5.0, "stochastic")
    finally:
        cpu_kernels._load.cache_clear()
    assert all(torch.equal(a, b) for a, b in zip(reference, native, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(reference, portable, strict=True))


def test_without_a_compiler_the_codec_runs_in_torch(monkeypatch, tmp_path) -> None:
    x = inputs()["layered"]
    expected = DynamiQCodec(5.0).encode(x, 1)
    monkeypatch.setattr(cpu_kernels.shutil, "which", lambda name: None)
    monkeypatch.setattr(cpu_kernels, "_PREBUILT_DIR", tmp_path)  # and none installed
    cpu_kernels._load.cache_clear()
    try:
        assert cpu_kernels.library() is None
        assert torch.equal(DynamiQCodec(5.0).encode(x, 1), expected)
    finally:
        cpu_kernels._load.cache_clear()


def test_a_corrupt_message_is_rejected_and_nan_is_refused() -> None:
    codec = DynamiQCodec(5.0)
    msg = codec.encode(inputs()["layered"], 1).clone()
    groups = NUMEL // 32
    widths = slice(4 * groups // 8 + groups, 4 * groups // 8 + groups + 3 * groups // 8)
    msg[widths] = 0xFF  # every group claims 8 planes: more payload than the message has
    with pytest.raises(ValueError, match="corrupt"):
        codec.decode(msg, NUMEL, 1)
    x = inputs()["heavy"]
    x[12345] = float("nan")
    with pytest.raises(ValueError, match="NaN or Inf"):
        codec.encode(x, 1)


def kernel_arguments() -> dict:
    """Valid arguments of the three kernels for 512 coordinates (two super-groups) at 36 payload words each."""
    x = torch.randn(512, generator=torch.Generator().manual_seed(1))
    codec = DynamiQCodec(5.0)
    budget = codec.payload_bits(1) * 2
    msg = codec.encode(x, 1)
    return {"x": x, "maxima": cpu_kernels.group_max(x), "budget": budget, "table": scale_table(), "msg": msg}


def _encode(given: dict, **change) -> None:
    a = given | change
    steps = a.get("steps", MANTISSA_STEPS)
    cpu_kernels.encode(a["x"], a["maxima"], a["budget"], a["table"], steps, a.get("key"), False, a.get("scratch"))


def _decode(given: dict, **change) -> None:
    a = given | change
    cpu_kernels.decode_into(a["msg"], a["budget"], a["table"], False, a.get("local"), a.get("out", torch.empty(512)))


#: Each call gives one kernel a length it would read or write past (or, for a remainder, silently drop).
WRONG_LENGTHS = {
    "group_max, x not whole groups": (
        lambda a: cpu_kernels.group_max(a["x"][:100]),
        "100 coordinates, not a multiple of 32",
    ),
    "group_max, out too short": (
        lambda a: cpu_kernels.group_max(a["x"], torch.empty(3)),
        "out has 3 elements, expected 16",
    ),
    "group_max, out of int32": (
        lambda a: cpu_kernels.group_max(a["x"], torch.empty(16, dtype=torch.int32)),
        "out must be",
    ),
    "encode, x not whole super-groups": (
        lambda a: _encode(a, x=a["x"][:288], maxima=a["maxima"][:9]),
        "288 coordinates, not a multiple of 256",
    ),
    "encode, too few maxima": (
        lambda a: _encode(a, maxima=a["maxima"][:15]),
        "group maxima has 15 elements, expected 16",
    ),
    "encode, short table": (lambda a: _encode(a, table=a["table"][:255]), "scale table has 255 elements, expected 256"),
    "encode, short mantissa steps": (lambda a: _encode(a, steps=MANTISSA_STEPS[:6]), "mantissa steps has 6 elements"),
    "encode, negative budget": (lambda a: _encode(a, budget=-1), "budget is a non-negative int, got -1"),
    "encode, negative key": (lambda a: _encode(a, key=-5), "dither key is a non-negative int64, got -5"),
    "encode, int64 width scratch": (
        lambda a: _encode(a, scratch=(torch.empty(16, dtype=torch.int64), torch.empty(16, dtype=torch.int64))),
        "width scratch must be a contiguous torch.int32",
    ),
    "decode, out not whole super-groups": (
        lambda a: _decode(a, out=torch.empty(300)),
        "300 coordinates, not a multiple of 256",
    ),
    "decode, message one byte short": (
        lambda a: _decode(a, msg=a["msg"][:-1]),
        "DynamiQ message of 317 bytes; 512 coordinates",
    ),
    "decode, message for fewer coordinates": (
        lambda a: _decode(a, out=torch.empty(256)),
        "DynamiQ message of 318 bytes; 256 coordinates",
    ),
    "decode, short table": (lambda a: _decode(a, table=a["table"][:200]), "scale table has 200 elements, expected 256"),
    "decode, short local": (lambda a: _decode(a, local=torch.zeros(511)), "local has 511 elements, expected 512"),
    "decode, negative budget": (lambda a: _decode(a, budget=-4), "budget is a non-negative int, got -4"),
}


@pytest.mark.parametrize("case", sorted(WRONG_LENGTHS))
def test_the_wrappers_refuse_every_length_the_kernels_would_overrun(monkeypatch, case) -> None:
    monkeypatch.setenv("FEDSHARD_DYNAMIQ_COMPILE", "1")
    arguments = kernel_arguments()
    call, message = WRONG_LENGTHS[case]
    with pytest.raises(ValueError, match=message):
        call(arguments)
    _encode(arguments)  # the valid arguments pass
    _decode(arguments)


def test_calling_a_kernel_that_is_off_says_so(monkeypatch) -> None:
    monkeypatch.setenv("FEDSHARD_DYNAMIQ_COMPILE", "0")
    with pytest.raises(RuntimeError, match="CPU kernels are turned off"):
        cpu_kernels.group_max(torch.zeros(256))
