"""Baseline codecs checked against independent references: hand-worked blocks, torch's own float8 casts,
brute-force nearest-even rounding, explicit Hadamard matrices and the research note's vNMSE numbers."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

import lightning_fedshard.dynamiq.baselines  # noqa: F401  (registers the codecs)
from lightning_fedshard.dynamiq.baselines.mx import E2M1, E2M3, E3M2, E4M3, E5M2, element_codes, round_to_element
from lightning_fedshard.dynamiq.baselines.thc import THCCodec, hadamard_transform, inverse_rht, rht
from lightning_fedshard.dynamiq.bitpack import pack_bits, pack_bits_fast, packed_bytes, unpack_bits_fast
from lightning_fedshard.dynamiq.codec import Message, Transfer, make_codec

BITS_PER_COORD = {
    "none": 32.0,
    "bf16": 16.0,
    "fp16": 16.0,
    "int8": 9.0,
    "int4": 5.0,
    "mxfp8": 8.25,
    "mxfp8_e5m2": 8.25,
    "mxfp6": 6.25,
    "mxfp6_e3m2": 6.25,
    "mxfp4": 4.25,
}
FIXED = list(BITS_PER_COORD)
MX_FORMATS = {"mxfp8": E4M3, "mxfp8_e5m2": E5M2, "mxfp6": E2M3, "mxfp6_e3m2": E3M2, "mxfp4": E2M1}


def vnmse(estimate: torch.Tensor, truth: torch.Tensor) -> float:
    return float((estimate.double() - truth.double()).pow(2).sum() / truth.double().pow(2).sum())


def transfer(world: int, n: int) -> Transfer:
    messages = tuple(Message(n, h) for h in range(1, world + 1))
    return Transfer(world_size=world, messages=messages, reference_coords=2 * (world - 1) / world * n * world)


# -- generic contract ---------------------------------------------------------------------------------


@pytest.mark.parametrize("name", FIXED)
@pytest.mark.parametrize("blocks", [1, 3, 8, 41])
def test_round_trip_and_exact_size(name: str, blocks: int) -> None:
    codec = make_codec(name)
    numel = 32 * blocks
    x = torch.randn(numel, generator=torch.Generator().manual_seed(blocks)) * 3
    msg = codec.encode(x, summands=1)
    assert msg.dtype == torch.uint8 and msg.dim() == 1
    assert msg.numel() == codec.message_bytes(numel, 1)
    y = codec.decode(msg, numel, summands=1)
    assert y.dtype == torch.float32 and y.shape == (numel,)
    if codec.lossless:
        assert torch.equal(y, x)
    else:
        assert vnmse(y, x) < 0.05
        if name not in ("int8", "int4"):
            # float and MX outputs are representable, so re-encoding them reproduces the same bytes
            assert torch.equal(codec.encode(y, 1), msg)
    # the message must not alias the input, which the collective may overwrite
    x.fill_(7.0)
    assert torch.equal(codec.decode(msg, numel, 1), y)


@pytest.mark.parametrize("name", FIXED)
def test_bits_per_coordinate(name: str) -> None:
    codec = make_codec(name)
    for numel in (32, 1024, 32 * 1000):
        assert codec.message_bytes(numel, 1) * 8 / numel == BITS_PER_COORD[name]
        assert codec.message_bytes(numel, 3) == codec.message_bytes(numel, 1)


@pytest.mark.parametrize("name", [*FIXED, "thc", "omnireduce"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_is_rejected(name: str, bad: float) -> None:
    codec = make_codec(name)
    x = torch.zeros(1024)
    x[5] = bad
    with pytest.raises(ValueError, match=name):
        codec.encode(x, summands=1)


def test_fp16_overflow_raises_instead_of_inf() -> None:
    codec = make_codec("fp16")
    ok = torch.full((32,), 65504.0)
    assert torch.equal(codec.decode(codec.encode(ok, 1), 32, 1), ok)
    # 65519 still rounds to 65504; 65520 is the first value that becomes Inf in fp16
    assert float(codec.decode(codec.encode(torch.full((32,), 65519.0), 1), 32, 1)[0]) == 65504.0
    with pytest.raises(ValueError, match="fp16.*65504"):
        codec.encode(torch.full((32,), 65520.0), 1)
    with pytest.raises(ValueError, match="fp16"):
        codec.encode(torch.tensor([1.0, -1e6]), 1)


def test_bf16_is_round_to_nearest_even() -> None:
    # 1 + 2^-8 lies halfway between bf16 neighbours 1 and 1 + 2^-7: ties to the even mantissa (1.0)
    x = torch.tensor([1 + 2**-8, 1 + 3 * 2**-8, -(2**-133)], dtype=torch.float32)
    y = make_codec("bf16").decode(make_codec("bf16").encode(x, 1), 3, 1)
    assert y.tolist() == [1.0, 1 + 2**-6, -(2**-133)]


def test_decode_accepts_unaligned_slices() -> None:
    codec = make_codec("none")
    x = torch.randn(64)
    buffer = torch.cat([torch.zeros(3, dtype=torch.uint8), codec.encode(x, 1)])
    assert torch.equal(codec.decode(buffer[3:], 64, 1), x)


@pytest.mark.parametrize("width", range(1, 17))
def test_pack_bits_fast_matches_pack_bits(width: int) -> None:
    gen = torch.Generator().manual_seed(width)
    for count in (1, 5, 24, 1001):
        codes = torch.randint(0, 1 << width, (count,), generator=gen, dtype=torch.int32)
        packed = pack_bits_fast(codes, width)
        assert torch.equal(packed, pack_bits(codes, width))
        assert packed.numel() == packed_bytes(count, width)
        assert torch.equal(unpack_bits_fast(packed, width, count), codes)


# -- int8 / int4 ------------------------------------------------------------------------------------


def reference_blockint(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Per block in plain Python floats (fp64): q = floor(x/s·L + 0.5), value q·s/L."""
    levels = 2 ** (bits - 1) - 1
    out = []
    for block in x.view(-1, 32).tolist():
        scale = max(abs(v) for v in block)
        for v in block:
            q = 0 if scale == 0 else math.floor(v / scale * levels + 0.5)
            out.append(q * scale / levels)
    return torch.tensor(out, dtype=torch.float32)


def test_int4_hand_made_blocks() -> None:
    codec = make_codec("int4")
    # scale 7 makes level = value: 3.4 → 3, -2.6 → -3, 0.5 → 1 (ties up), -0.5 → 0 (ties up), -7 → -7
    first = [7.0, 3.4, -2.6, 0.49, 0.5, -0.5, -7.0, 6.51] + [0.0] * 24
    second = [0.0] * 32  # all-zero block: scale 0, level 0
    third = [-1.0, 0.3, 0.6] + [0.2] * 29  # scale 1: 0.3·7 = 2.1 → 2; 0.6·7 = 4.2 → 4; 0.2·7 = 1.4 → 1
    x = torch.tensor(first + second + third)
    msg = codec.encode(x, 1)
    scales = msg[:12].view(torch.float32)
    assert scales.tolist() == [7.0, 0.0, 1.0]
    y = codec.decode(msg, 96, 1)
    assert y[:8].tolist() == [7.0, 3.0, -3.0, 0.0, 1.0, 0.0, -7.0, 7.0]
    assert torch.equal(y[32:64], torch.zeros(32))
    assert torch.allclose(y[64:67], torch.tensor([-1.0, 2 / 7, 4 / 7]), rtol=0, atol=1e-7)
    # offset-binary codes, two per byte, low nibble first: levels 7, 3 → codes 14, 10 → byte 0xAE
    assert int(msg[12]) == 14 | (10 << 4)
    assert torch.allclose(y, reference_blockint(x, 4), rtol=1e-6, atol=0)


def test_int8_hand_made_block_and_reference() -> None:
    codec = make_codec("int8")
    x = torch.tensor([127.0, -50.4, 50.5, 0.49, -126.6] + [1.0] * 27)
    msg = codec.encode(x, 1)
    assert msg[4:9].tolist() == [254, 77, 178, 127, 0]  # level + 127
    assert codec.decode(msg, 32, 1)[:5].tolist() == [127.0, -50.0, 51.0, 0.0, -127.0]
    x = torch.randn(32 * 50, generator=torch.Generator().manual_seed(1)) * torch.logspace(-3, 3, 32 * 50)
    for name, bits in (("int8", 8), ("int4", 4)):
        y = make_codec(name).decode(make_codec(name).encode(x, 1), x.numel(), 1)
        assert torch.allclose(y, reference_blockint(x, bits), rtol=1e-6, atol=0)


# -- MX ---------------------------------------------------------------------------------------------


def enumerate_format(ebits: int, mbits: int, bias: int, max_normal: float) -> tuple[list[float], list[int]]:
    """Non-negative values and codes of a small float format, from the textbook definition."""
    values, codes = [], []
    for field in range(2**ebits):
        for mant in range(2**mbits):
            if field == 0:
                value = mant / 2**mbits * 2.0 ** (1 - bias)
            else:
                value = (1 + mant / 2**mbits) * 2.0 ** (field - bias)
            if value <= max_normal:
                values.append(value)
                codes.append((field << mbits) | mant)
    return values, codes


def brute_force_round(x: float, values: list[float], codes: list[int]) -> float:
    """Nearest value by exhaustive search; ties go to the even code; beyond the largest, saturate."""
    best = None
    for value, code in zip(values, codes, strict=True):
        key = (abs(abs(x) - value), code & 1)
        if best is None or key < best[0]:
            best = (key, value)
    return math.copysign(best[1], x)


@pytest.mark.parametrize("fmt", [E4M3, E5M2, E2M3, E3M2, E2M1], ids=lambda f: f.name)
def test_element_rounding_matches_brute_force(fmt) -> None:
    values, codes = enumerate_format(fmt.ebits, fmt.mbits, fmt.bias, fmt.max_normal)
    assert max(values) == fmt.max_normal
    gen = torch.Generator().manual_seed(fmt.width)
    mids = [(a + b) / 2 for a, b in itertools.pairwise(values)]
    randoms = (torch.rand(300, generator=gen) * 2 - 1) * fmt.max_normal * 1.3
    tiny = (torch.rand(100, generator=gen) * 2 - 1) * values[3]
    xs = torch.tensor(values + mids + [-m for m in mids] + randoms.tolist() + tiny.tolist(), dtype=torch.float32)
    expected = torch.tensor([brute_force_round(v, values, codes) for v in xs.tolist()], dtype=torch.float32)
    assert torch.equal(round_to_element(xs, fmt), expected)


@pytest.mark.parametrize(
    ("fmt", "dtype"), [(E4M3, torch.float8_e4m3fn), (E5M2, torch.float8_e5m2)], ids=["e4m3", "e5m2"]
)
def test_element_codes_match_torch_float8(fmt, dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    # every representable value, the midpoints between neighbours (ties) and random values of all binades
    every = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(dtype).to(torch.float32)
    every = every[torch.isfinite(every)].unique()
    mids = (every[1:] + every[:-1]) / 2
    exponents = torch.rand(20000, generator=gen) * (math.log2(fmt.max_normal) + 20) - 20
    signs = torch.where(torch.rand(20000, generator=gen) < 0.5, -1.0, 1.0)
    randoms = (signs * torch.exp2(exponents)).clamp(-fmt.max_normal, fmt.max_normal)
    xs = torch.cat([every, mids, randoms, -randoms, torch.tensor([0.0, -0.0])])
    ours = element_codes(xs, fmt).to(torch.uint8)
    assert torch.equal(ours, xs.to(dtype).view(torch.uint8))
    assert torch.equal(round_to_element(xs, fmt), xs.to(dtype).to(torch.float32))


def test_mxfp8_hand_made_blocks() -> None:
    codec = make_codec("mxfp8")
    # amax 1.0 → X = 2^(0-8): elements are V·256
    a = [1.0, 0.875, -0.5, 2**-17, 2**-18, 3 * 2**-18, 0.0] + [0.25] * 25
    # amax 500 → X = 2^(8-8) = 1: 500 and 470 exceed 448 after scaling and saturate
    b = [500.0, -470.0, 448.0, 1.0] + [0.0] * 28
    c = [0.0] * 32  # zero block: byte 0
    d = [2**-130, -(2**-131)] + [0.0] * 30  # amax below 2^-119: scale clamps at 2^-127 (byte 0)
    x = torch.tensor(a + b + c + d)
    msg = codec.encode(x, 1)
    assert msg[:4].tolist() == [127 - 8, 127, 0, 0]
    assert int(msg[4]) == 0x78  # 256 = 1.0·2^8: sign 0, exponent field 8+7, mantissa 0
    y = codec.decode(msg, 128, 1)
    # 2^-17 is E4M3's smallest subnormal times X; 2^-18 is half of it (tie → 0); 3·2^-18 → 2·2^-18 (even)
    assert y[:8].tolist() == [1.0, 0.875, -0.5, 2**-17, 0.0, 2**-16, 0.0, 0.25]
    assert y[32:36].tolist() == [448.0, -448.0, 448.0, 1.0]
    assert torch.equal(y[64:96], torch.zeros(32))
    assert y[96:98].tolist() == [2**-130, -(2**-131)]


def test_mxfp4_ties_and_saturation() -> None:
    codec = make_codec("mxfp4")
    # amax 6 → X = 2^(2-2) = 1; E2M1 values 0, .5, 1, 1.5, 2, 3, 4, 6
    a = [6.0, 2.5, 5.0, 0.25, 0.75, 1.25, 1.75, 3.5, -2.5, -0.25, 4.9, 5.1] + [0.0] * 20
    # amax 7.9 → X = 1 too, and 7.9 saturates to 6; amax 0.75 → X = 2^(-1-2) = 1/8
    b = [7.9, -6.9, 7.0] + [0.0] * 29
    c = [0.75, 0.3, -0.1, 0.0625] + [0.0] * 28
    x = torch.tensor(a + b + c)
    msg = codec.encode(x, 1)
    assert msg[:3].tolist() == [127, 127, 124]
    y = codec.decode(msg, 96, 1)
    assert y[:12].tolist() == [6.0, 2.0, 4.0, 0.0, 1.0, 1.0, 2.0, 4.0, -2.0, -0.0, 4.0, 6.0]
    assert y[32:35].tolist() == [6.0, -6.0, 6.0]
    # 0.75/X = 6; 0.3/X = 2.4 → 2; -0.1/X = -0.8 → -1; 0.0625/X = 0.5
    assert y[64:68].tolist() == [0.75, 0.25, -0.125, 0.0625]
    # codes 7 (6.0) and 4 (2.0), two per byte, low nibble first
    assert int(msg[3]) == 7 | (4 << 4)


@pytest.mark.parametrize(("name", "dtype"), [("mxfp8", torch.float8_e4m3fn), ("mxfp8_e5m2", torch.float8_e5m2)])
def test_mxfp8_matches_spec_with_torch_casts(name: str, dtype: torch.dtype) -> None:
    fmt = MX_FORMATS[name]
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(64, 32, generator=gen) * torch.logspace(-30, 30, 64)[:, None]
    x[5] = 0.0
    x[7, 3] = 1e-38
    amax = x.abs().amax(dim=1).double()
    # spec sample conversion in fp64 python math
    exps = [-127 if a == 0 else max(-127, min(127, math.floor(math.log2(a)) - fmt.emax)) for a in amax.tolist()]
    scale = torch.tensor([2.0**e for e in exps], dtype=torch.float64)
    p = (x.double() / scale[:, None]).float().clamp(-fmt.max_normal, fmt.max_normal)
    expected = (p.to(dtype).double() * scale[:, None]).float().reshape(-1)
    codec = make_codec(name)
    msg = codec.encode(x.reshape(-1), 1)
    assert msg[:64].tolist() == [e + 127 for e in exps]
    assert torch.equal(codec.decode(msg, x.numel(), 1), expected)


def test_mxfp6_packs_four_elements_in_three_bytes() -> None:
    codec = make_codec("mxfp6")
    # amax 7.5 → X = 1; E2M3 codes: 7.5 = 0b011111, 1.0 = 0b001000, -0.125 = 0b100001, 0 = 0
    x = torch.tensor([7.5, 1.0, -0.125, 0.0] + [0.0] * 28)
    msg = codec.encode(x, 1)
    assert msg.numel() == 1 + 24
    word = 0b011111 | (0b001000 << 6) | (0b100001 << 12)
    assert msg[1:4].tolist() == [word & 0xFF, (word >> 8) & 0xFF, word >> 16]
    assert codec.decode(msg, 32, 1)[:4].tolist() == [7.5, 1.0, -0.125, 0.0]


# research note §5.2 (d = 2^20, single quantization of N(0,1))
GAUSSIAN_VNMSE = {
    "mxfp8": 8.61e-4,
    "mxfp8_e5m2": 2.91e-3,
    "mxfp6": 8.07e-4,
    "mxfp6_e3m2": 2.91e-3,
    "mxfp4": 1.32e-2,
    "int8": 2.86e-5,
    "int4": 9.42e-3,
}


@pytest.mark.parametrize("name", list(GAUSSIAN_VNMSE))
def test_gaussian_vnmse_matches_research_note(name: str) -> None:
    x = torch.randn(1 << 16, generator=torch.Generator().manual_seed(11))
    codec = make_codec(name)
    error = vnmse(codec.decode(codec.encode(x, 1), x.numel(), 1), x)
    assert GAUSSIAN_VNMSE[name] * 0.75 < error < GAUSSIAN_VNMSE[name] * 1.25


# -- THC --------------------------------------------------------------------------------------------


def sylvester(n: int) -> torch.Tensor:
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


def test_hadamard_and_rht_are_orthogonal() -> None:
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(3, 2048, generator=gen, dtype=torch.float64)
    h = sylvester(1024) / 32
    expected = (x.view(3, 2, 1024) @ h.T).view(3, 2048)
    assert torch.allclose(hadamard_transform(x.view(3, 2, 1024)).view(3, 2048), expected, atol=1e-12)
    signs = torch.randint(0, 2, (2048,), generator=gen).double() * 2 - 1
    x32 = x.float()
    y = rht(x32, signs.float())
    assert torch.allclose(y.double(), ((x * signs).view(3, 2, 1024) @ h.T).view(3, 2048), atol=1e-5)
    assert torch.allclose(y.norm(dim=1), x32.norm(dim=1), rtol=1e-6)
    assert torch.allclose(inverse_rht(y, signs.float()), x32, atol=1e-6)


def simulate_thc(codec: THCCodec, data: list[torch.Tensor]) -> torch.Tensor:
    """Every rank's chunks → integer indices → exact sum over ranks → finished fp32 sum."""
    world, n = data[0].shape
    indices = codec.prepare_simulated(data, transfer(world, n))
    return codec.finish(torch.stack(indices).sum(dim=0))


def test_thc_is_unbiased_and_indices_are_integers() -> None:
    world, n = 4, 3000  # n is not a multiple of 1024: padding is added and stripped
    gen = torch.Generator().manual_seed(2)
    data = [torch.randn(world, n, generator=gen) for _ in range(world)]
    truth = torch.stack(data).sum(dim=0)
    codec = THCCodec(bits=4, seed=1)
    indices = codec.prepare_simulated(data, transfer(world, n))
    assert codec.side_bytes == 8 * 3 / 4
    for z in indices:
        assert z.shape == (world, 3072)
        assert torch.equal(z, z.round()) and z.min() >= 0 and z.max() <= 15
    errors = torch.stack([simulate_thc(codec, data) - truth for _ in range(50)])
    assert errors.shape == (50, world, n)
    single = errors.pow(2).mean().sqrt()
    mean = errors.mean(dim=0).pow(2).mean().sqrt()
    # independent seeds: the mean error shrinks like 1/sqrt(50) ≈ 0.14 of a single one
    assert mean < 0.25 * single
    assert vnmse(truth + errors[0], truth) < 0.5


def test_thc_rounding_is_independent_across_ranks() -> None:
    # identical data on all ranks: independent stochastic rounding errors add like sqrt(P) against a
    # signal growing like P, so vNMSE falls as 1/P; shared (or deterministic) rounding would not fall
    chunk = torch.randn(1, 2048, generator=torch.Generator().manual_seed(12))
    single = vnmse(simulate_thc(THCCodec(bits=4, seed=3), [chunk]), chunk)
    world = 8
    summed = simulate_thc(THCCodec(bits=4, seed=3), [chunk.expand(world, -1).contiguous()] * world)
    assert vnmse(summed, world * chunk.expand(world, -1)) < 0.3 * single  # expected 1/8


def test_thc_prepare_matches_simulation_for_one_rank() -> None:
    data = torch.randn(1, 2000, generator=torch.Generator().manual_seed(4))
    a, b = THCCodec(bits=3, seed=9), THCCodec(bits=3, seed=9)
    z = a.prepare(data, transfer(1, 2000), None)
    assert a.side_bytes == 0.0
    assert torch.equal(z, b.prepare_simulated([data], transfer(1, 2000))[0])
    # the same call counter reproduces the same rotation, so finish of the indices approximates the data
    assert vnmse(a.finish(z), data) < 0.2
    # a second call draws fresh signs and rounding
    assert not torch.equal(a.prepare(data, transfer(1, 2000), None), z)


def test_thc_all_zero_gives_exact_zero() -> None:
    codec = THCCodec(bits=4)
    data = [torch.zeros(2, 100) for _ in range(2)]
    assert torch.equal(simulate_thc(codec, data), torch.zeros(2, 100))


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_thc_message_width_grows_with_summands(bits: int) -> None:
    codec = THCCodec(bits=bits)
    q = 2**bits
    gen = torch.Generator().manual_seed(bits)
    numel = 1024
    for h in (1, 2, 3, 7, 8, 16, 300):
        width = math.ceil(math.log2((q - 1) * h + 1))
        assert codec.width(h) == width
        expected = (
            packed_bytes(numel, width) if width <= 16 else packed_bytes(numel, 16) + packed_bytes(numel, width - 16)
        )
        assert codec.message_bytes(numel, h) == expected
        z = torch.randint(0, (q - 1) * h + 1, (numel,), generator=gen).float()
        z[:2] = torch.tensor([0.0, (q - 1) * h])
        msg = codec.encode(z, h)
        assert msg.numel() == expected
        assert torch.equal(codec.decode(msg, numel, h), z)


def test_thc_accumulate_adds_integers_exactly() -> None:
    codec = THCCodec(bits=4)
    gen = torch.Generator().manual_seed(8)
    z = [torch.randint(0, 16, (2048,), generator=gen).float() for _ in range(5)]
    msg = codec.encode(z[0], 1)
    for h in range(1, 5):
        msg = codec.accumulate(msg, z[h], h)
    assert torch.equal(codec.decode(msg, 2048, 5), sum(z))
    with pytest.raises(ValueError, match="integers"):
        codec.encode(torch.full((8,), 0.5), 1)
    with pytest.raises(ValueError, match="integers"):
        codec.encode(torch.full((8,), 16.0), 1)
    for bits in (1, 4.5, 9, float("nan"), float("inf")):  # a whole number of index bits, or a clear error
        with pytest.raises(ValueError, match=rf"thc: bits must be a whole number in \[2, 8\], got {bits}"):
            THCCodec(bits=bits)


def test_thc_prepare_rejects_non_finite() -> None:
    data = torch.zeros(2, 64)
    data[1, 3] = float("nan")
    with pytest.raises(ValueError, match="thc"):
        THCCodec().prepare(data, transfer(2, 64), None)


# -- OmniReduce -------------------------------------------------------------------------------------


def test_omnireduce_is_lossless_and_sized_by_nonzero_blocks() -> None:
    codec = make_codec("omnireduce")
    blocks = 37
    x = torch.zeros(blocks, 256)
    gen = torch.Generator().manual_seed(6)
    live = [0, 5, 6, 20, 36]
    x[live] = torch.randn(len(live), 256, generator=gen)
    x[6] = 0.0
    x[6, 255] = 1e-40  # a single subnormal keeps its block
    x[11, 9] = -0.0  # a negative zero too (bitwise non-zero)
    x = x.reshape(-1)
    msg = codec.encode(x, 1)
    assert msg.numel() == math.ceil(blocks / 8) + 1024 * (len(live) + 1)
    y = codec.decode(msg, x.numel(), 1)
    assert torch.equal(y.view(torch.int32), x.view(torch.int32))
    bitmap = [(int(msg[i // 8]) >> (i % 8)) & 1 for i in range(blocks)]
    assert [i for i, bit in enumerate(bitmap) if bit] == sorted([*live, 11])
    # an all-zero tensor is just the bitmap; a dense one is the bitmap plus every block
    assert codec.encode(torch.zeros(512), 1).numel() == 1
    dense = torch.randn(512, generator=gen)
    assert codec.encode(dense, 1).numel() == 1 + 2048
    # a partial sum's support is the union of its summands'
    other = torch.zeros(blocks * 256)
    other[256 * 30 : 256 * 30 + 3] = 1.0
    summed = codec.accumulate(msg, other, 1)
    assert torch.equal(codec.decode(summed, x.numel(), 2), x + other)
    # block 30 joins; block 11 leaves, since -0.0 + 0.0 is +0.0
    assert summed.numel() == math.ceil(blocks / 8) + 1024 * (len(live) + 1)
