"""The instance budget: passes that do not fit the memory run in chunks that do, with the same bounds; a pass that
cannot fit answers ``unknown`` with the reason; a chunk the measured pace puts past the deadline is not started."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest
import torch

from lightning_fedshard.verify.bounds.alpha import alpha_crown, iteration_bytes
from lightning_fedshard.verify.bounds.crown import intermediate_bounds, spec_lower
from lightning_fedshard.verify.budget import Budget, MemoryBudgetExceeded, _cgroup_free, available_memory, run_in_chunks
from lightning_fedshard.verify.config import Verdict, VerifyConfig
from lightning_fedshard.verify.memory import PeakMemoryMeter
from lightning_fedshard.verify.objective import box_tensor
from lightning_fedshard.verify.shard.lockstep import DeadlineExceeded
from lightning_fedshard.verify.spec import Case, Disjunct, InputBox, Property
from lightning_fedshard.verify.verifier import verify
from tests.verify.nets import random_mlp, resnet

MiB = 1 << 20


def _wide_mlp():
    """Three hidden layers of 1,024 ReLUs over 64 inputs: each intermediate CROWN pass starts from ~2,000 rows."""
    graph = random_mlp(0, (64, 1024, 1024, 1024, 10))
    centre = torch.rand(64, generator=torch.Generator().manual_seed(1))
    box = box_tensor(centre - 0.05, centre + 0.05, graph.input.shape, graph.dtype, graph.device)
    return graph, box


def _peak(fn) -> tuple[object, int]:
    meter = PeakMemoryMeter("cpu")
    with meter:
        out = fn()
    return out, meter.peak_bytes


def test_a_pass_several_times_the_budget_runs_within_it_with_the_same_bounds():
    graph, box = _wide_mlp()
    with torch.no_grad():
        whole, whole_peak = _peak(lambda: intermediate_bounds(graph, box))
    budget = Budget.start(timeout=600, memory_gib=whole_peak / 4 / 2**30)
    with budget.using(), torch.no_grad():
        chunked, chunked_peak = _peak(lambda: intermediate_bounds(graph, box))
    assert whole_peak > 40 * MiB  # the unchunked pass needs four times the budget
    assert any(what.startswith("crown:") for what in budget._tight), "the passes were not cut"
    # Chunks are sized to 80 % of what the budget leaves; the bounds' own tensors and the refinement add a little.
    assert chunked_peak <= 1.1 * budget.memory, (chunked_peak / MiB, budget.memory / MiB)
    for name, interval in whole.items():
        # Every neuron's backward pass is the same computation whichever chunk it is in, up to the order in which
        # the matrix products of a different row count sum (an ulp here and there; each one's rounding is charged).
        torch.testing.assert_close(chunked[name].lower, interval.lower, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(chunked[name].upper, interval.upper, rtol=1e-6, atol=1e-6)


def test_the_measured_bytes_per_row_predict_a_chunks_peak_within_30_percent():
    graph, box = _wide_mlp()
    with torch.no_grad():
        bounds = intermediate_bounds(graph, box)
    spec_rows = torch.eye(10).unsqueeze(1).repeat(400, 1, 1)  # 4,000 spec rows over the 10 outputs
    budget = Budget.start(timeout=600, memory_gib=64 * MiB / 2**30)
    with budget.using(), torch.no_grad():
        lower = spec_lower(graph, spec_rows, box, bounds)
    chunks = budget._paces["crown:output"]
    with torch.no_grad():  # a chunk of 500 rows alone, counted by the live-tensor meter (an independent count)
        _, measured = _peak(lambda: spec_lower(graph, spec_rows[:500], box, bounds))
    predicted = 500 * chunks.bytes_per_item
    assert 0.7 * measured <= predicted <= 1.3 * measured, (predicted / MiB, measured / MiB)
    with torch.no_grad():
        torch.testing.assert_close(lower, spec_lower(graph, spec_rows, box, bounds), rtol=1e-6, atol=1e-6)


def _undecided_by_intervals(graph, box) -> Property:
    """``y_0 − y_1 ≤ t`` with ``t`` a tenth of the way from interval propagation's lower bound of ``y_0 − y_1`` to
    its least value at 1,000 random points: no attack comes close, interval bounds do not rule it out."""
    with torch.no_grad():
        out = graph.ibp(box)[graph.output.name]
        points = box.lower + (box.upper - box.lower) * torch.rand(1000, *graph.input.shape)
        values = graph(points)
    ibp = float(out.lower[0, 0] - out.upper[0, 1])
    sampled = float((values[:, 0] - values[:, 1]).min())
    lower, upper = box.lower.flatten().double().numpy(), box.upper.flatten().double().numpy()
    row = np.zeros((1, graph.output.size))
    row[0, 0], row[0, 1] = 1.0, -1.0
    case = Case(InputBox(lower, upper), (Disjunct(row, np.array([ibp + 0.1 * (sampled - ibp)])),))
    return Property(graph.input.size, graph.output.size, (case,))


def test_a_net_that_cannot_fit_answers_unknown_with_the_reason():
    graph, box = _wide_mlp()
    prop = _undecided_by_intervals(graph, box)
    budget = Budget.start(timeout=60, memory_gib=1e-4)  # 100 KiB: not one backward row of 3,000 neurons
    result = verify(graph, prop, VerifyConfig(timeout=60, attack_restarts=1, attack_steps=1), budget=budget)
    assert result.verdict is Verdict.UNKNOWN
    assert "needs" in result.reason and "memory budget 0.0 GiB" in result.reason, result.reason
    assert result.memory_budget_bytes == budget.memory


def test_a_chunk_the_pace_puts_past_the_deadline_is_not_started():
    budget = Budget(deadline=time.monotonic() + 0.5, memory=16 * MiB, baseline=Budget.start(1.0).baseline)
    calls = []

    def bound(part: slice) -> list[int]:
        calls.append(part)
        time.sleep(0.3)
        return list(range(part.start, part.stop))

    start = time.monotonic()
    with budget.using(), pytest.raises(DeadlineExceeded):
        run_in_chunks("slow", 10, estimate=4 * MiB, bound=bound)  # three items fit at a time
    assert len(calls) == 1  # 0.3 s per chunk, 0.2 s left after the first: the second would end past it
    assert time.monotonic() - start < 0.45


def test_an_item_larger_than_the_budget_raises_before_allocating():
    budget = Budget.start(timeout=60, memory_gib=1 / 1024)
    with budget.using(), pytest.raises(MemoryBudgetExceeded, match=r"needs 1\.0 GiB at crown:big"):
        run_in_chunks("crown:big", 4, estimate=2**30, bound=lambda part: pytest.fail("ran a chunk that cannot fit"))


def test_the_default_budget_is_a_share_of_the_free_memory(tmp_path: Path):
    free = available_memory(torch.device("cpu"))
    meminfo = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in open("/proc/meminfo")}
    assert free <= meminfo["MemAvailable"] * 1.05
    budget = Budget.from_config(VerifyConfig(memory_fraction=0.25))
    assert budget.memory == pytest.approx(0.25 * free, rel=0.05)
    assert Budget.from_config(VerifyConfig(memory=1.5)).memory == int(1.5 * 2**30)
    (tmp_path / "memory.max").write_text("1000000\n")
    (tmp_path / "memory.current").write_text("250000\n")
    assert _cgroup_free(tmp_path) == 750_000
    (tmp_path / "memory.max").write_text("max\n")
    assert _cgroup_free(tmp_path) is None


@pytest.mark.parametrize("bad", [0.0, -1.0, float("nan"), float("inf")])
def test_a_memory_budget_must_be_positive_and_finite(bad):
    with pytest.raises(ValueError, match="memory"):
        VerifyConfig(memory=bad)


def test_the_chunks_of_a_run_come_back_in_order():
    chunks = []

    def bound(part: slice) -> torch.Tensor:
        chunks.append(part)
        return torch.arange(part.start, part.stop)

    budget = Budget.start(timeout=60, memory_gib=8 * MiB / 2**30)
    with budget.using():
        out = torch.cat(run_in_chunks("rows", 100, estimate=MiB, bound=bound))
    assert len(chunks) > 1 and torch.equal(out, torch.arange(100))


@pytest.mark.parametrize("net", ["mlp", "resnet"])
def test_the_alpha_crown_estimate_is_within_30_percent_of_its_measured_peak(net):
    """``iteration_bytes`` — α with gradient and Adam states, and what autograd keeps of every pass — against the
    live-tensor peak of three α-CROWN iterations (measured: 1.16× and 1.09×)."""
    graph = random_mlp(0, (64, 512, 512, 512, 10)) if net == "mlp" else resnet()
    centre = torch.rand(graph.input.size, generator=torch.Generator().manual_seed(1))
    box = box_tensor(centre - 0.02, centre + 0.02, graph.input.shape, graph.dtype, graph.device)
    rows = (torch.eye(10)[:9] - torch.eye(10)[9]).view(9, 1, 10)
    refined = {}
    with torch.no_grad():
        intermediate_bounds(graph, box, used_rows=refined)
    estimate = iteration_bytes(graph, graph.output.name, 9, 1, graph.dtype)
    estimate += sum(iteration_bytes(graph, pre, 2 * index.numel(), 1, graph.dtype) for pre, index in refined.items())
    _, measured = _peak(lambda: alpha_crown(graph, box, rows, iterations=3))
    assert 0.7 * measured <= estimate <= 1.3 * measured, (estimate / MiB, measured / MiB)


def test_alpha_crown_leaves_out_the_alpha_that_does_not_fit_the_budget():
    """The ResNet's α-CROWN holds ~850 MiB with α on every pass; under 256 MiB it optimises the output pass's α
    alone and stays within the budget, and its bound is still at least CROWN's."""
    graph = resnet()
    centre = torch.rand(graph.input.size, generator=torch.Generator().manual_seed(1))
    box = box_tensor(centre - 0.02, centre + 0.02, graph.input.shape, graph.dtype, graph.device)
    rows = (torch.eye(10)[:9] - torch.eye(10)[9]).view(9, 1, 10)
    with torch.no_grad():
        crown = spec_lower(graph, rows, box, intermediate_bounds(graph, box))
    _, whole = _peak(lambda: alpha_crown(graph, box, rows, iterations=3))
    budget = Budget.start(timeout=600, memory_gib=0.25)
    with budget.using():
        result, peak = _peak(lambda: alpha_crown(graph, box, rows, iterations=3))
    assert whole > 3 * budget.memory and peak <= budget.memory, (whole / MiB, peak / MiB)
    assert result.iterations == 3 and result.alphas  # the output pass's α, optimised
    assert bool((result.lower >= crown - 1e-6).all())
