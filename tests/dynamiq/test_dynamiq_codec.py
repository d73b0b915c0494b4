"""DynamiQ-L codec: wire format, exact budget, allocation, rounding, and the headline target."""

from __future__ import annotations

import ast
import math
from pathlib import Path

import pytest
import torch

import lightning_fedshard.dynamiq
from lightning_fedshard.dynamiq import DynamiQCodec, simulate_all_reduce
from lightning_fedshard.dynamiq.codec import Message, Transfer
from lightning_fedshard.dynamiq.collective import plan_transfer
from lightning_fedshard.dynamiq.dynamiq_codec import MAX_BITS
from lightning_fedshard.dynamiq.dynamiq_format import (
    GROUP,
    WIDTHS,
    allocate_widths,
    dither,
    group_log_scales,
    level_count,
    log2_eighths,
    scale_table,
    split_message,
)


def inputs(numel: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    gaussian = torch.randn(numel, generator=gen)
    outlier = gaussian * 1e-3
    outlier[numel // 3] = 3e38
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


@pytest.mark.parametrize("name", ["gaussian", "outlier", "constant", "layered", "sparse", "zeros"])
def test_rounding_to_nearest_errs_by_at_most_half_a_step(name) -> None:
    codec = DynamiQCodec(5.0)
    x = inputs(8192)[name]
    msg = codec.encode(x, 1)
    x_hat = codec.decode(msg, x.numel(), 1)
    sg_scale, log_scales, widths, _ = split_message(msg, x.numel(), codec.payload_bits(1) * x.numel() // 256)
    group_scale = sg_scale.repeat_interleave(8) * scale_table()[log_scales]
    levels = level_count(widths).to(torch.float32)
    groups, decoded = x.view(-1, GROUP), x_hat.view(-1, GROUP)
    coded = levels > 0
    step = (group_scale / levels.clamp(min=1))[:, None]
    # midrise: a coordinate decodes to the centre of its cell, at most half a cell away (plus float rounding)
    tolerance = 0.5 * step + 1e-6 * group_scale[:, None]
    assert torch.all((decoded - groups).abs()[coded] <= tolerance.expand_as(groups)[coded])
    assert torch.all(decoded.abs() <= group_scale[:, None] * (1 + 1e-6))  # the group scale never clips
    assert torch.all(decoded[~coded] == 0)
    assert torch.all(widths[groups.abs().amax(dim=1) == 0] == 0)  # all-zero groups cost no payload


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
    """Every import counts, lazy ones inside functions too; only ``if TYPE_CHECKING:`` blocks do not. The torch
    codec and the Triton kernels once imported each other (the kernels at load time, the codec lazily)."""
    package = Path(lightning_fedshard.dynamiq.__file__).parent
    modules = {
        f"lightning_fedshard.{'.'.join(p.relative_to(package.parent).with_suffix('').parts)}": p
        for p in package.rglob("*.py")
        if p.name != "__init__.py"
    }
    graph = {name: _imported_modules(ast.parse(path.read_text()), modules) - {name} for name, path in modules.items()}
    done: set[str] = set()

    def visit(name: str, path: tuple[str, ...]) -> None:
        assert name not in path, f"import cycle: {' -> '.join((*path[path.index(name) :], name))}"
        if name not in done:
            for target in graph[name]:
                visit(target, (*path, name))
            done.add(name)

    for name in graph:
        visit(name, ())


def _imported_modules(tree: ast.Module, modules: dict[str, Path]) -> set[str]:
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            node.body = []
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            found |= {
                f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module for a in node.names
            }
    return found & set(modules)
