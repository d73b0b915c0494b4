"""The Triton DAR kernels against the torch reference codec: the same message bytes, for every rounding,
hop count, final message and kind of data. Without CUDA the kernels run on CPU tensors under Triton's
interpreter, so the chunks stay small (interpreted programs cost milliseconds each)."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")

from lightning_fedshard.dynamiq import triton_dar
from lightning_fedshard.dynamiq.collective import plan_transfer
from lightning_fedshard.dynamiq.dynamiq_codec import DynamiQCodec
from lightning_fedshard.dynamiq.dynamiq_format import (
    GROUP,
    SUPER_GROUP,
    WIDTHS,
    dither,
    dither_key,
    level_count,
    scale_table,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ROUNDINGS = ("nearest", "stochastic")


def gaussian(n: int, seed: int) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed))


def heavy_tailed(n: int, seed: int) -> torch.Tensor:
    """Student-t (3 degrees of freedom) times a log-uniform scale per super-group spanning 10^-4..10^2,
    like the layer-to-layer spread of gradient magnitudes."""
    g = torch.Generator().manual_seed(seed)
    chi2 = torch.randn(3, n, generator=g).pow(2).sum(dim=0)
    t = torch.randn(n, generator=g) / (chi2 / 3).sqrt()
    scales = 10 ** (6 * torch.rand(n // SUPER_GROUP, generator=g) - 4)
    return t * scales.repeat_interleave(SUPER_GROUP)


def with_zeros(n: int, seed: int) -> torch.Tensor:
    """Zero groups, and a zero super-group, in both addends: the sum keeps them zero."""
    return zero_out(gaussian(n, seed))


def zero_out(x: torch.Tensor) -> torch.Tensor:
    x = x.clone()
    x[3 * GROUP : 4 * GROUP] = 0
    x[9 * GROUP : 11 * GROUP] = 0
    x[SUPER_GROUP : 2 * SUPER_GROUP] = 0
    return x


def outlier(n: int, seed: int) -> torch.Tensor:
    x = gaussian(n, seed)
    x[n // 3] = 1e30
    return x


DATA = {"gaussian": gaussian, "heavy_tailed": heavy_tailed, "zeros": with_zeros, "outlier": outlier}


def reference_dar(codec: DynamiQCodec, msg: torch.Tensor, local: torch.Tensor, summands: int) -> torch.Tensor:
    return codec.encode(codec.decode(msg, local.numel(), summands) + local, summands + 1)


def assert_same_bytes(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.dtype == torch.uint8 and actual.shape == expected.shape
    differing = int((actual != expected).sum())
    assert torch.equal(actual, expected), f"{differing} of {expected.numel()} bytes differ"


@pytest.mark.parametrize("rounding", ROUNDINGS)
@pytest.mark.parametrize("data", DATA)
def test_dar_matches_reference(data: str, rounding: str) -> None:
    n = 4096
    codec = DynamiQCodec(5.0, rounding=rounding, seed=3)
    received = DATA[data](n, 0).to(DEVICE)
    local = DATA[data](n, 1).to(DEVICE)
    for summands in (1, 2, 3, 7):
        codec.calls = summands  # a new dither per collective call, as ``prepare`` advances it
        msg = codec.encode(received, summands)
        assert_same_bytes(triton_dar.dar(codec, msg, local, summands), reference_dar(codec, msg, local, summands))


@pytest.mark.parametrize("rounding", ROUNDINGS)
@pytest.mark.parametrize(("world_size", "data"), [(4, "gaussian"), (8, "heavy_tailed")])
def test_ring_with_world_size(world_size: int, data: str, rounding: str) -> None:
    """A reduce-scatter ring after ``prepare``: per-hop widening, then the final message at the base rate."""
    n = 1024
    codec = DynamiQCodec(4.0, rounding=rounding)
    chunks = torch.stack([DATA[data](n, rank) for rank in range(world_size)]).to(DEVICE)
    codec.prepare(chunks, plan_transfer("ring", world_size, n, world_size * n, all_gather=True), None)
    assert codec.world_size == world_size and codec.payload_bits(world_size) == codec.base
    msg = codec.encode(chunks[0], 1)
    for hop in range(1, world_size):
        expected = codec.accumulate(msg, chunks[hop], hop)
        assert_same_bytes(triton_dar.dar(codec, msg, chunks[hop], hop), expected)
        msg = expected
    assert msg.numel() == codec.message_bytes(n, world_size)


@pytest.mark.parametrize("bits", [2.0, 3.0, 8.0])
@pytest.mark.parametrize("rounding", ROUNDINGS)
def test_rates_and_partial_last_block(bits: float, rounding: str) -> None:
    """Low rates (many width-0 groups), the top rate (every non-zero group at width 8, budget left unused
    and zero-padded), and 768 coordinates: 24 groups, so the last program of each kernel is partly masked."""
    n = 768
    codec = DynamiQCodec(bits, rounding=rounding)
    received, local = zero_out(heavy_tailed(n, 2)).to(DEVICE), zero_out(heavy_tailed(n, 3)).to(DEVICE)
    assert (n // GROUP) % triton_dar.BLOCK_GROUPS != 0
    for summands in (1, 2):
        msg = codec.encode(received, summands)
        assert_same_bytes(triton_dar.encode(codec, received, summands), msg)
        assert_same_bytes(triton_dar.dar(codec, msg, local, summands), reference_dar(codec, msg, local, summands))


@pytest.mark.parametrize("rounding", ROUNDINGS)
@pytest.mark.parametrize("data", DATA)
def test_encode_matches_reference(data: str, rounding: str) -> None:
    codec = DynamiQCodec(5.0, rounding=rounding, seed=11)
    x = DATA[data](8192, 4).to(DEVICE)
    for summands in (1, 2):
        assert_same_bytes(triton_dar.encode(codec, x, summands), codec.encode(x, summands))


def test_unaligned_message_buffer() -> None:
    """A received message at an odd address (a slice of a larger buffer) is read byte by byte, and an aligned one
    of 768 coordinates (its payload starts at byte 45) is written byte by byte: the same bytes."""
    codec = DynamiQCodec(4.0)
    for n in (1024, 768):
        received, local = heavy_tailed(n, 7).to(DEVICE), heavy_tailed(n, 8).to(DEVICE)
        msg = codec.encode(received, 1)
        shifted = torch.empty(msg.numel() + 1, dtype=torch.uint8, device=DEVICE)[1:]
        shifted.copy_(msg)
        assert shifted.data_ptr() % 4 != 0
        assert_same_bytes(triton_dar.dar(codec, shifted, local, 1), reference_dar(codec, msg, local, 1))


class _HostReads(TorchDispatchMode):
    """Records the aten operations that make the host wait for the device on CUDA: reading a value
    (``.item()``, ``bool()``, ``nonzero``'s data-dependent size) or copying host data to the device
    (``torch.tensor`` of Python numbers, which ``lift_fresh`` marks)."""

    SYNCING = ("aten._local_scalar_dense", "aten.nonzero", "aten.is_nonzero", "aten.equal", "aten.lift_fresh")

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))

    def syncs(self) -> list[int]:
        return [i for i, op in enumerate(self.ops) if op.startswith(self.SYNCING)]


def test_dar_does_not_synchronise() -> None:
    """No host synchronisation between the launches (the old hop had three host-to-device copies of constants and
    a finiteness test before the packing kernel); the NaN/Inf flag is read once, after everything else."""
    codec = DynamiQCodec(5.0, rounding="stochastic")
    received, local = gaussian(1024, 9).to(DEVICE), gaussian(1024, 10).to(DEVICE)
    msg = codec.encode(received, 1)
    triton_dar.dar(codec, msg, local, 1)  # first call: constants moved to the device, buffers made
    with _HostReads() as checked:
        triton_dar.dar(codec, msg, local, 1)
    assert checked.syncs() == [len(checked.ops) - 1]
    with _HostReads() as unchecked:
        triton_dar.dar(codec, msg, local, 1, check_finite=False)
    assert unchecked.syncs() == []


def test_low_precision_and_fp64_local() -> None:
    codec = DynamiQCodec(5.0)
    received = gaussian(2048, 5).to(DEVICE)
    msg = codec.encode(received, 1)
    for dtype in (torch.bfloat16, torch.float16, torch.float64):
        local = gaussian(2048, 6).to(DEVICE, dtype)
        assert_same_bytes(triton_dar.dar(codec, msg, local, 1), reference_dar(codec, msg, local, 1))


def test_rejects_bad_input() -> None:
    codec = DynamiQCodec(5.0)
    with pytest.raises(ValueError, match="multiple of 256"):
        triton_dar.encode(codec, torch.ones(300, device=DEVICE), 1)
    msg = codec.encode(torch.ones(512, device=DEVICE), 1)
    local = torch.ones(512, device=DEVICE)
    local[7] = float("inf")
    with pytest.raises(ValueError, match="NaN or Inf"):
        triton_dar.dar(codec, msg, local, 1)


@triton.jit
def _dither_kernel(out, key, numel, ANTITHETIC: tl.constexpr, BLOCK: tl.constexpr):
    coord = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out + coord, triton_dar._uniform(coord, key, ANTITHETIC), mask=coord < numel)


@pytest.mark.parametrize("seed", [0, 1, 12345, 2**40 + 17])
def test_in_kernel_dither_equals_reference(seed: int) -> None:
    """The uint32 hash in the kernel against the int64 emulation, value for value (both parities)."""
    numel = 1 << 15
    u = dither(seed, numel, DEVICE)
    for antithetic in (False, True):
        out = torch.empty(numel, device=DEVICE)
        _dither_kernel[(numel // 4096,)](out, dither_key(seed), numel, ANTITHETIC=antithetic, BLOCK=4096)
        assert torch.equal(out, 1.0 - u if antithetic else u)


@triton.jit
def _steps_kernel(levels, group_scale, step, inverse_step, BLOCK: tl.constexpr, STOCHASTIC: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    count, scale = tl.load(levels + i), tl.load(group_scale + i)
    steps = triton_dar._steps(count, STOCHASTIC)
    tl.store(step + i, triton_dar._step(steps, count, scale))
    tl.store(inverse_step + i, triton_dar._inverse_step(steps, count, scale))


def test_group_steps_equal_reference_divisions() -> None:
    """Per-group step sizes over scales from 1e-25 to 1e25, every log-scale and width: an approximate or
    reassociated division changes a last bit somewhere here, while random data would rarely expose it
    (a code moves only when its value lies within an ulp of a rounding boundary)."""
    g = torch.Generator().manual_seed(0)
    numel = 1 << 14
    sg_scale = 10 ** (50 * torch.rand(numel, generator=g) - 25)
    group_scale = (sg_scale * scale_table()[torch.randint(0, 256, (numel,), generator=g)]).to(DEVICE)
    levels = level_count(torch.tensor(WIDTHS)[torch.randint(0, len(WIDTHS), (numel,), generator=g)])
    levels = levels.to(DEVICE, torch.float32)
    for stochastic in (False, True):
        step, inverse_step = torch.empty_like(levels), torch.empty_like(levels)
        _steps_kernel[(numel // 4096,)](levels, group_scale, step, inverse_step, BLOCK=4096, STOCHASTIC=stochastic)
        steps = levels - 0.5 if stochastic else levels
        assert torch.equal(step, torch.where(levels > 0, group_scale / torch.where(levels > 0, steps, 1.0), 0.0))
        assert torch.equal(inverse_step, torch.where(levels > 0, steps / group_scale, 0.0))
