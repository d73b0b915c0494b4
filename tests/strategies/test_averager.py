"""FedAverager's outer state stays in fp32 under a bf16 wire: 2 gloo ranks (averager_worker.py) against fp64 replays.

Each round moves the weights by ~1e-4 of their size, 40x below bf16's spacing: a global copy, momentum or mix kept in
bf16 rounds those steps away. The fp64 replays below are written from the algorithms' definitions, not from the code.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from tests.launching import run_isolated
from tests.strategies.averager_worker import (
    OUTER_LR,
    OUTER_MOMENTUM,
    ROUNDS,
    RUNS,
    SHAPES,
    initial_params,
    local_step,
)

pytestmark = pytest.mark.multiproc

WORKER = Path(__file__).with_name("averager_worker.py")
GROUPS = 2
EPS_BF16 = 2.0**-8  # bf16's relative spacing; round to nearest errs by half of it
EPS_FP32 = 2.0**-23


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("averager")
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={GROUPS}"]
    result = run_isolated([*launch, str(WORKER), str(out)], timeout=180)
    assert result.returncode == 0, result.stderr[-6000:]
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(GROUPS)]


def fp64(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: t.double() for name, t in tensors.items()}


def steps(round_: int) -> list[dict[str, torch.Tensor]]:
    return [fp64(local_step(group, round_)) for group in range(GROUPS)]


def diloco_fp64(wire_eps: float) -> tuple[dict, dict, dict]:
    """DiLoCo in fp64: each group adds its step to the global copy, the pseudo-gradient ``global - local`` is averaged
    and SGD with Nesterov momentum (``b = m·b + g``, ``x -= lr·(g + m·b)``) steps the global copy, which every group
    adopts. Returns the global copy, the total movement and an elementwise bound on what a run whose wire rounds
    each pseudo-gradient (and their sum) to relative ``wire_eps / 2`` and whose state is fp32 may differ by."""
    w0 = fp64(initial_params())
    x = dict(w0)
    buf = {n: torch.zeros_like(t) for n, t in x.items()}
    wire_errors = []
    for k in range(ROUNDS):
        pseudo = [{n: x[n] - (x[n] + s[n]) for n in x} for s in steps(k)]
        g = {n: sum(p[n] for p in pseudo) / GROUPS for n in x}
        # each group's value rounded on the wire, then their sum: 2 half-spacings of the mean magnitude, plus the
        # fp32 rounding of ``local = global + step`` and of ``global - local`` (2 each of the weight's size)
        wire_errors.append(
            {n: wire_eps * sum(p[n].abs() for p in pseudo) / GROUPS + 4 * EPS_FP32 * x[n].abs() for n in x}
        )
        for n in SHAPES:
            buf[n] = OUTER_MOMENTUM * buf[n] + g[n]
            x[n] = x[n] - OUTER_LR * (g[n] + OUTER_MOMENTUM * buf[n])
    # pseudo-gradient j enters the final weights with lr·(1 + m + m² + … + m^(K-j)); each step also rounds x in fp32
    bound = {n: 4 * ROUNDS * EPS_FP32 * w0[n].abs() for n in x}
    for j, err in enumerate(wire_errors):
        weight = OUTER_LR * (1 + sum(OUTER_MOMENTUM**i for i in range(1, ROUNDS - j + 1)))
        for n in x:
            bound[n] = bound[n] + weight * err[n]
    return x, {n: x[n] - w0[n] for n in x}, bound


def fedavg_fp64(alpha: float, wire_eps: float) -> tuple[list[dict], dict, dict]:
    """FedAvg with mixing in fp64: the global copy becomes the groups' mean, each group's shards become
    ``alpha·local + (1-alpha)·global``. Every round is a convex combination of the state, so each round's rounding
    carries forward without growing: the bound is their sum. Returns each group's shards, the mean movement, the
    bound."""
    w0 = fp64(initial_params())
    x = dict(w0)
    local = [dict(w0) for _ in range(GROUPS)]
    bound = {n: torch.zeros_like(t) for n, t in x.items()}
    for k in range(ROUNDS):
        local = [{n: ell[n] + s[n] for n in x} for ell, s in zip(local, steps(k), strict=True)]
        pseudo = [{n: x[n] - ell[n] for n in x} for ell in local]
        for n in SHAPES:
            bound[n] = bound[n] + wire_eps * sum(p[n].abs() for p in pseudo) / GROUPS + 8 * EPS_FP32 * x[n].abs()
        x = {n: sum(ell[n] for ell in local) / GROUPS for n in x}
        local = [{n: alpha * ell[n] + (1 - alpha) * x[n] for n in x} for ell in local]
    return local, {n: x[n] - w0[n] for n in x}, bound


def assert_within(actual: dict, expected: dict, bound: dict, what: str) -> None:
    for n in SHAPES:
        err = (actual[n].double() - expected[n]).abs()
        worst = int((err - bound[n]).argmax())
        assert bool((err <= bound[n]).all()), (
            f"{what} {n}: error {err.flatten()[worst]:.3g} above its bound {bound[n].flatten()[worst]:.3g}"
        )


def assert_bound_is_tight(bound: dict, movement: dict) -> None:
    """The tests can tell: the bound is a small part of what the rounds moved the weights, and below a tenth of the
    rounding a bf16 global copy makes every round (half a bf16 spacing of each weight)."""
    w0 = fp64(initial_params())
    for n in SHAPES:
        assert float((bound[n] / movement[n].abs()).median()) < 0.2, n
        assert bool((bound[n] < 0.1 * EPS_BF16 / 2 * w0[n].abs()).all()), n


def test_diloco_under_a_bf16_wire_keeps_every_small_outer_step(ranks):
    """The bf16-synced run equals fp64 DiLoCo within the bf16 rounding of the pseudo-gradients; the fp32-synced one
    within fp32's."""
    expected, movement, bound_bf16 = diloco_fp64(EPS_BF16)
    _, _, bound_fp32 = diloco_fp64(EPS_FP32)
    for record in ranks:
        bf16, fp32 = record["runs"]["diloco_bf16"]["final"], record["runs"]["diloco_fp32"]["final"]
        assert_within(bf16, expected, bound_bf16, "bf16 sync vs fp64")
        assert_within(fp32, expected, bound_fp32, "fp32 sync vs fp64")
        assert_within(record["runs"]["diloco_fp64"]["final"], expected, bound_fp32, "fp64 sync vs fp64")
        assert_within(bf16, fp64(fp32), {n: bound_bf16[n] + bound_fp32[n] for n in bound_bf16}, "bf16 vs fp32 sync")
    assert_bound_is_tight(bound_bf16, movement)


def test_fedavg_under_a_bf16_wire_averages_and_mixes_in_fp32(ranks):
    """FedAvg with half-and-half mixing: a bf16 wire rounds only the change since the last sync, never the weights."""
    alpha = RUNS["fedavg_bf16"][2]
    expected, movement, bound_bf16 = fedavg_fp64(alpha, EPS_BF16)
    _, _, bound_fp32 = fedavg_fp64(alpha, EPS_FP32)
    for record in ranks:
        group = record["group"]
        assert_within(record["runs"]["fedavg_bf16"]["final"], expected[group], bound_bf16, "bf16 sync vs fp64")
        assert_within(record["runs"]["fedavg_fp32"]["final"], expected[group], bound_fp32, "fp32 sync vs fp64")
    assert_bound_is_tight(bound_bf16, movement)


def test_only_the_wire_is_bf16(ranks):
    numel = sum(torch.Size(shape).numel() for shape in SHAPES.values())
    for record in ranks:
        runs = record["runs"]
        fp32_state = ["torch.float32"] * len(SHAPES)
        assert runs["diloco_bf16"]["state_dtypes"] == {"reference": fp32_state, "momentum": fp32_state}
        assert runs["fedavg_bf16"]["state_dtypes"] == {"reference": fp32_state}  # the global copy a delta needs
        assert runs["fedavg_fp32"]["state_dtypes"] == {}  # an fp32 wire averages the fp32 weights themselves
        fp64_state = ["torch.float64"] * len(SHAPES)
        assert runs["diloco_fp64"]["state_dtypes"] == {"reference": fp64_state, "momentum": fp64_state}
        # 2 groups: a ring all-reduce sends its buffer once per round
        for name, (_, sync_dtype, _) in RUNS.items():
            assert runs[name]["fed_bytes"] == ROUNDS * numel * sync_dtype.itemsize, name


def test_a_bf16_outer_checkpoint_loads_upcast_and_an_fp32_one_resumes_exactly(ranks):
    for record in ranks:
        ckpt = record["checkpoint"]
        saved = ckpt["saved"]
        for name in ("from_bf16", "from_fp32"):
            assert all(d == "torch.float32" for dtypes in ckpt[name]["dtypes"].values() for d in dtypes)
        for part in ("reference", "momentum"):
            for n in SHAPES:
                upcast = saved[part][n].to(torch.bfloat16).float()
                assert torch.equal(ckpt["from_bf16"]["loaded"][part][n], upcast), (part, n)
                assert torch.equal(ckpt["from_fp32"]["loaded"][part][n], saved[part][n]), (part, n)
        for n in SHAPES:
            assert torch.equal(ckpt["from_fp32"]["resumed"][n], ckpt["uninterrupted"][n]), n
