"""DynamiQ-L codec: wire format, exact budget, allocation, rounding, and the headline target."""

from __future__ import annotations

import math
import random
import shutil

import pytest
import torch

import lightning_fedshard.dynamiq
from lightning_fedshard.dynamiq import DynamiQCodec, cpu_kernels, simulate_all_reduce
from lightning_fedshard.dynamiq.codec import Codec, Message, Transfer
from lightning_fedshard.dynamiq.collective import plan_transfer
from lightning_fedshard.dynamiq.dynamiq_codec import MAX_BITS
from lightning_fedshard.dynamiq.dynamiq_format import (
    GROUP,
    SUPER_GROUP,
    WIDTHS,
    allocate_widths,
    dither,
    group_log_scales,
    level_count,
    log2_eighths,
    scale_table,
    split_message,
)
from tests.import_cycles import import_cycle


def inputs(numel: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    gaussian = torch.randn(numel, generator=gen)
    outlier = gaussian * 1e-3
    outlier[numel // 3 : numel // 3 + 1] = 3e38  # none in an empty tensor
    return {
        "gaussian": gaussian,
        "zeros": torch.zeros(numel),
        "outlier": outlier,
        "constant": torch.full((numel,), -2.5),
        "layered": gaussian * torch.logspace(-6, 2, numel),
        "sparse": torch.where(torch.rand(numel, generator=gen) < 0.01, gaussian, 0.0),
    }


@pytest.mark.parametrize("numel", [256, 4096, 65536])
@pytest.mark.parametrize("summands", [1, 2, 5, 8])
def test_message_size_depends_only_on_length_and_summands(numel, summands) -> None:
    codec = DynamiQCodec(5.0)
    expected = numel // 256 * (15 + 4 * codec.payload_bits(summands))
    assert codec.message_bytes(numel, summands) == expected
    for name, x in inputs(numel).items():
        assert codec.encode(x, summands).numel() == expected, name
    # bits per coordinate = payload bits + 4·8/256 (SG scale) + 8/32 (log-scale) + 3/32 (width)
    assert 8 * expected / numel == codec.payload_bits(summands) / 8 + 0.46875


def quantization_bound(codec: DynamiQCodec, msg: torch.Tensor, numel: int, summands: int) -> torch.Tensor:
    """Per coordinate of the message's ``numel`` values (padding cut off), the most its decoded value may differ
    from what was encoded, from the group scale ``s`` and width ``w`` in its header (``L = 2^(w-1)``): half a cell
    ``s/(2L)`` to nearest, under one step ``s/(L - ½)`` stochastically, and ``s`` (≥ the group max) for a group
    sent with no bits, which decodes to 0; plus fp32 rounding."""
    padded = -(-numel // SUPER_GROUP) * SUPER_GROUP
    sg_scale, log_scales, widths, _ = split_message(msg, padded, codec.payload_bits(summands) * padded // 256)
    scale = (sg_scale.repeat_interleave(8) * scale_table()[log_scales]).double()
    levels = level_count(widths).double()
    cell = scale / (levels - 0.5 if codec.rounding == "stochastic" else 2 * levels).clamp(min=0.5)
    bound = torch.where(levels > 0, cell, scale) + 1e-6 * scale
    return bound.repeat_interleave(GROUP)[:numel]


@pytest.mark.parametrize("name", ["gaussian", "outlier", "constant", "layered", "sparse", "zeros"])
def test_rounding_to_nearest_errs_by_at_most_half_a_step(name) -> None:
    codec = DynamiQCodec(5.0)
    x = inputs(8192)[name]
    msg = codec.encode(x, 1)
    x_hat = codec.decode(msg, x.numel(), 1)
    sg_scale, log_scales, widths, _ = split_message(msg, x.numel(), codec.payload_bits(1) * x.numel() // 256)
    group_scale = sg_scale.repeat_interleave(8) * scale_table()[log_scales]
    groups, decoded = x.view(-1, GROUP), x_hat.view(-1, GROUP)
    coded = level_count(widths) > 0
    # midrise: a coordinate decodes to the centre of its cell, at most half a cell away (plus float rounding)
    assert torch.all((x_hat - x).abs().double() <= quantization_bound(codec, msg, x.numel(), 1))
    assert torch.all(decoded.abs() <= group_scale[:, None] * (1 + 1e-6))  # the group scale never clips
    assert torch.all(decoded[~coded] == 0)
    assert torch.all(widths[groups.abs().amax(dim=1) == 0] == 0)  # all-zero groups cost no payload


#: The sizes of issue 32 (unaligned ones once decoded to garbage or to nothing) and random ones, fixed by a seed.
ANY_SIZES = [0, 1, 31, 32, 100, 255, 256, 257, 1056, *random.Random(32).sample(range(2, 5000), 4)]


@pytest.fixture(params=["torch", "c"])
def kernels(request, monkeypatch) -> str:
    """Runs a test on the torch functions, then on the C kernels (where a C compiler builds them)."""
    if request.param == "c" and not any(shutil.which(c) for c in ("cc", "gcc", "clang")):
        pytest.skip("the C kernels need a C compiler")
    monkeypatch.setenv("FEDSHARD_DYNAMIQ_COMPILE", "1" if request.param == "c" else "0")
    assert (cpu_kernels.library() is not None) == (request.param == "c")
    return request.param


def zero_padded(x: torch.Tensor) -> torch.Tensor:
    return torch.cat([x, x.new_zeros(-x.numel() % SUPER_GROUP)])


@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
@pytest.mark.parametrize("numel", ANY_SIZES)
def test_any_size_decodes_to_its_own_size_within_the_quantization_bound(kernels, numel, rounding) -> None:
    for name, x in inputs(numel).items():
        codec = DynamiQCodec(5.0, rounding=rounding, seed=3)
        msg = codec.encode(x, 1)
        assert msg.numel() == codec.message_bytes(numel, 1) == -(-numel // 256) * (15 + 4 * codec.payload_bits(1))
        x_hat = codec.decode(msg, numel, 1)
        assert x_hat.shape == (numel,), name
        error = (x_hat.double() - x.double()).abs()
        assert torch.all(error <= quantization_bound(codec, msg, numel, 1)), name
        # the message of the tensor zero-padded by hand to whole super-groups, whose size the codec always took
        assert torch.equal(msg, codec.encode(zero_padded(x), 1)), name


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("numel", [1, 100, 257, 1056, ANY_SIZES[-1]])
def test_accumulating_any_size_is_decode_add_encode(kernels, numel, dtype) -> None:
    data = inputs(numel)
    x, y = data["layered"], data["gaussian"].to(dtype)
    codec = DynamiQCodec(5.0, rounding="stochastic", seed=3)
    msg = codec.encode(x, 1)
    total = codec.accumulate(msg, y, 1)
    # the base class's decode + add + encode: the sum of the ``numel`` coordinates, zero-padded again (the padding
    # of ``msg`` decodes to ±half a cell, which the sum must not carry)
    assert torch.equal(total, Codec.accumulate(codec, msg, y, 1))
    encoded = codec.decode(msg, numel, 1) + y  # what the accumulation encodes, in the dtype the codec adds in
    error = (codec.decode(total, numel, 2).double() - encoded.to(torch.float32).double()).abs()
    assert torch.all(error <= quantization_bound(codec, total, numel, 2))


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda c, m: c.decode(m, 300, 1), "DynamiQ message of 159 bytes; 512 coordinates"),
        (lambda c, m: c.decode(m, -1, 1), "non-negative integer, got -1"),
        (lambda c, m: c.decode(m, 2.5, 1), "non-negative integer, got 2.5"),
        (lambda c, m: c.message_bytes(-256, 1), "non-negative integer, got -256"),
        (lambda c, m: c.encode(torch.ones(100), 0), "at least 1 chunk, got summands=0"),
        (lambda c, m: c.accumulate(m, torch.ones(257), 1), "DynamiQ message of 159 bytes; 512 coordinates"),
    ],
)
def test_sizes_that_do_not_fit_the_message_are_refused(kernels, call, message) -> None:
    codec = DynamiQCodec(5.0)
    msg = codec.encode(torch.ones(100), 1)
    with pytest.raises(ValueError, match=message):
        call(codec, msg)


def test_group_log_scale_is_the_tightest_sixteenth_octave_above_the_group_max() -> None:
    x = inputs(65536)["layered"].view(-1, GROUP).abs().amax(dim=1)
    sg = x.view(-1, 8).amax(dim=1).repeat_interleave(8)
    table = scale_table()
    c = group_log_scales(x, x.view(-1, 8).amax(dim=1), table)
    assert torch.all(sg * table[c] >= x)
    assert torch.all((c == 255) | (sg * table[(c + 1).clamp(max=255)] < x))


def test_log2_eighths_is_floor_of_eight_log2() -> None:
    x = torch.exp(torch.empty(100_000).uniform_(-60, 60)).float()
    exact = 8 * torch.log2(x.double())
    away_from_boundaries = (exact - exact.round()).abs() > 1e-6
    expected = torch.floor(exact) + 8 * 127
    assert torch.equal(log2_eighths(x)[away_from_boundaries], expected[away_from_boundaries].long())


def greedy_widths(keys: list[int], active: list[bool], budget: int) -> list[int]:
    """Reference: give increments to groups in order of error (the group key minus 8 per bit it already has,
    ties to the lower index) while they fit; the first step of a group costs 2 bits."""
    steps = []
    for g, (key, on) in enumerate(zip(keys, active, strict=True)):
        if on:
            steps += [(key, g, 2)] + [(key - 8 * (w - 1), g, 1) for w in range(2, 8)]
    widths = [0] * len(keys)
    for _, g, cost in sorted(steps, key=lambda s: (-s[0], s[1])):
        if cost > budget:
            break
        widths[g] += cost
        budget -= cost
    return widths


@pytest.mark.parametrize("seed", range(20))
def test_water_filling_equals_the_greedy_reference(seed) -> None:
    gen = torch.Generator().manual_seed(seed)
    groups = 8 * int(torch.randint(1, 12, (1,), generator=gen))
    keys = torch.randint(900, 1100, (groups,), generator=gen)
    active = torch.rand(groups, generator=gen) > 0.1
    budget = int(torch.randint(0, 8 * groups + 1, (1,), generator=gen))
    widths = allocate_widths(keys, active, budget)
    assert widths.tolist() == greedy_widths(keys.tolist(), active.tolist(), budget)
    assert int(widths.sum()) <= budget
    assert set(widths.tolist()) <= set(WIDTHS)


def test_stochastic_rounding_is_unbiased_and_antithetic_across_hops() -> None:
    x = inputs(4096)["gaussian"]
    errors = []
    for seed in range(64):
        codec = DynamiQCodec(5.0, rounding="stochastic", seed=seed)
        errors.append(codec.decode(codec.encode(x, 1), x.numel(), 1) - x)
    errors = torch.stack(errors)
    single = errors.square().sum(dim=1).mean().sqrt()
    assert errors.mean(dim=0).norm() < 0.2 * single  # 1/√64 = 0.125 for an unbiased estimate
    codec = DynamiQCodec(5.0, rounding="stochastic")
    odd, even = codec._dither(4096, 3, x.device), codec._dither(4096, 4, x.device)
    assert torch.equal(odd + even, torch.ones_like(odd))
    u = dither(7, 1 << 16)
    assert 0 < float(u.min()) and float(u.max()) < 1 and abs(float(u.mean()) - 0.5) < 0.01


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_values_are_refused(value) -> None:
    x = torch.zeros(256)
    x[7] = value
    with pytest.raises(ValueError, match="dynamiq: the tensor holds NaN or Inf"):
        DynamiQCodec(5.0).encode(x, 1)


@pytest.mark.parametrize("topology,world_size", [("ring", 2), ("ring", 3), ("ring", 8), ("ring", 16), ("butterfly", 8)])
@pytest.mark.parametrize("numel", [70_001, 1 << 20])
def test_prepare_spends_the_largest_budget_that_fits(topology, world_size, numel) -> None:
    codec = DynamiQCodec(5.0)
    chunk = -(-numel // world_size + 255) // 256 * 256
    transfer = plan_transfer(topology, world_size, chunk, numel, all_gather=True)
    codec.prepare(torch.zeros(world_size, chunk), transfer, None)

    def total_bytes() -> int:
        return sum(codec.message_bytes(m.numel, m.summands) for m in transfer.messages)

    assert total_bytes() <= 5.0 * transfer.reference_coords / 8
    codec.base += 1
    assert total_bytes() > 5.0 * transfer.reference_coords / 8
    # hop h carries ½·log2 h more bits than hop 1; the finished sum gets the base rate
    if world_size > 4:
        assert codec.payload_bits(4) - codec.payload_bits(1) == min(8, 64 - codec.payload_bits(1))
    assert codec.payload_bits(world_size) == codec.base


@pytest.mark.parametrize("bits", [1.2, 8.5, 16.0, float("nan"), float("inf"), -float("inf")])
def test_a_budget_outside_the_codecs_range_is_refused_at_construction(bits) -> None:
    with pytest.raises(ValueError, match=rf"DynamiQ sends 1\.469 to 8\.469 bits per coordinate .* got bits={bits}"):
        DynamiQCodec(bits)


def test_the_largest_budget_gives_every_group_the_widest_codes() -> None:
    codec = DynamiQCodec(MAX_BITS)
    assert codec.message_bytes(1024, 1) * 8 / 1024 == MAX_BITS
    x = torch.randn(1024, generator=torch.Generator().manual_seed(5))
    _, _, widths, _ = split_message(codec.encode(x, 1), 1024, codec.payload_bits(1) * 4)
    assert torch.equal(widths, torch.full_like(widths, 8))


def test_a_budget_below_what_the_collective_needs_is_refused() -> None:
    codec = DynamiQCodec(1.6)
    transfer = Transfer(world_size=16, messages=(Message(256, 15),) * 30, reference_coords=256 * 30)
    with pytest.raises(ValueError, match="raise bits"):
        codec.prepare(torch.zeros(16, 256), transfer, None)


@pytest.fixture(scope="module")
def llama_grads() -> list[torch.Tensor]:
    from lightning_fedshard.bench.gradients import llama_gradients

    return llama_gradients(8)


def test_five_bits_on_real_gradients_beat_mxfp8_through_an_eight_rank_ring(llama_grads) -> None:
    exact = sum(g.double() for g in llama_grads)

    def vnmse(codec: str) -> tuple[float, float]:
        summed, bits = simulate_all_reduce(llama_grads, codec=codec, bits=5.0)
        return float((summed.double() - exact).square().sum() / exact.square().sum()), bits

    dynamiq, dynamiq_bits = vnmse("dynamiq")
    mxfp8, mxfp8_bits = vnmse("mxfp8")
    assert dynamiq_bits <= 5.0 and mxfp8_bits == pytest.approx(8.25, abs=0.01)
    assert dynamiq <= 1.0e-3
    assert dynamiq < mxfp8
    assert math.isfinite(dynamiq)


def test_the_dynamiq_modules_import_each_other_without_a_cycle() -> None:
    """The torch codec and the Triton kernels once imported each other (the kernels at load time, the codec
    lazily)."""
    assert import_cycle(lightning_fedshard.dynamiq) is None
