"""`fedshard bench quality`: its alignments (equal steps, tokens, wall time) against hand computations and the
cost model called directly, and its training machinery on a micro grid (2 processes, 2 steps)."""

from __future__ import annotations

import json
import math
import sys

import pytest

from lightning_fedshard.bench.costmodel import LEONARDO, paper_workload, step_time
from lightning_fedshard.bench.quality import (
    QualityRun,
    RunSpec,
    at_step,
    at_tokens,
    break_even_speedup,
    equal_time_steps,
    format_tables,
    grid,
    step_seconds,
)
from lightning_fedshard.bench.recipes import RecipeResult, demo_reading
from lightning_fedshard.strategies.dims import FedShardDims
from tests.launching import run_isolated


def _run(world: int, groups: int, outer: str | None, seed: int, losses: list[float], every: int = 4) -> QualityRun:
    curve = [{"step": every * (i + 1), "val_loss": loss} for i, loss in enumerate(losses)]
    return QualityRun(RunSpec(world, groups, outer, seed, 4), tokens_per_step=world * 2 * 128, curve=curve)


def test_the_grid_pairs_every_fl_run_with_a_baseline_of_the_same_world_and_seed():
    specs = grid([4, 16, 64], [0, 1], ["avg", "nesterov"])
    assert {(s.world, s.groups) for s in specs} == {
        (4, 1),
        (4, 2),
        (16, 1),
        (16, 2),
        (16, 4),
        (64, 1),
        (64, 2),
        (64, 4),
    }
    assert {s.accumulate for s in specs if s.world == 64} == {16}  # 4 processes stand for 64 ranks
    for s in specs:
        assert RunSpec(s.world, 1, None, s.seed, s.processes) in specs
    with pytest.raises(ValueError):
        RunSpec(16, 8, "avg", 0, 4)  # more groups than processes


def test_equal_tokens_and_steps_interpolate_the_curve():
    run = _run(16, 2, "avg", 0, [4.0, 3.0, 2.5])  # steps 4, 8, 12
    assert at_step(run, 8) == 3.0
    assert at_step(run, 10) == pytest.approx(2.75)
    assert math.isnan(at_step(run, 2)) and math.isnan(at_step(run, 13))
    # 10 steps of 16 ranks × 2 sequences × 128 tokens
    assert at_tokens(run, 10 * 16 * 2 * 128) == pytest.approx(2.75)
    # W = 4 reaches the same tokens four times later
    small = _run(4, 1, None, 0, [4.0, 3.0, 2.5, 2.4, 2.3, 2.2, 2.1, 2.0, 1.9, 1.8])
    assert at_tokens(small, 10 * 16 * 2 * 128) == at_step(small, 40) == pytest.approx(1.8)


def test_wall_time_comes_from_the_cost_model_at_512_gpus():
    direct = step_time(paper_workload(FedShardDims(16, 8, 4), sync_every=8), LEONARDO).total
    assert step_seconds("fl_hsdp", 16, 8) == direct
    assert (
        step_seconds("hsdp", 1, 8) == step_time(paper_workload(FedShardDims(1, 128, 4), sync_every=8), LEONARDO).total
    )
    assert (
        step_seconds("fl_fsdp", 4, 8)
        == step_time(paper_workload(FedShardDims(4, 1, 128), sync_every=8), LEONARDO).total
    )
    # the faster layout finishes its 32 steps; the slower one is at 32 × (fast / slow) steps then
    assert equal_time_steps(32, fl_seconds=1.0, base_seconds=2.0) == (32, 16)
    assert equal_time_steps(32, fl_seconds=2.0, base_seconds=1.0) == (16, 32)


def test_break_even_speedup_inverts_the_baseline_curve():
    base = _run(16, 1, None, 0, [4.0, 3.0, 2.0, 1.0])  # steps 4..16, loss 5 - step/4
    assert break_even_speedup(_run(16, 2, "avg", 0, [4.0, 3.0, 2.0, 1.5]), base, 16) == pytest.approx(16 / 14)
    assert break_even_speedup(_run(16, 2, "avg", 0, [4.0, 3.0, 2.0, 0.9]), base, 16) == 1.0  # ahead at equal steps
    assert math.isnan(break_even_speedup(_run(16, 2, "avg", 0, [5.0, 5.0, 5.0, 4.5]), base, 16))


def test_the_table_reports_paired_ratios_and_equal_time_values():
    runs = []
    for seed, (base_losses, fl_losses) in enumerate([([3.0, 2.0], [3.2, 2.1]), ([3.0, 2.2], [3.0, 2.1])]):
        runs += [_run(16, 1, None, seed, base_losses), _run(16, 4, "avg", seed, fl_losses)]
    table = format_tables(runs, steps=8, sync_every=4)
    row = next(line for line in table.splitlines() if line.startswith("| 16 | F=4 | FedAvg"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    ratios = [math.exp(2.1 - 2.0), math.exp(2.1 - 2.2)]
    mean = sum(ratios) / 2
    sd = math.sqrt(sum((r - mean) ** 2 for r in ratios))  # n − 1 = 1
    assert cells[4] == f"{mean:.2f} ± {sd:.2f}"
    fl_s, base_s = step_seconds("fl_hsdp", 4, 4), step_seconds("hsdp", 1, 4)
    assert cells[5] == f"{base_s / fl_s:.2f}×"
    fl_steps, base_steps = equal_time_steps(8, fl_s, base_s)
    by_hand = [math.exp(at_step(fl, fl_steps) - at_step(base, base_steps)) for base, fl in (runs[0:2], runs[2:4])]
    mean = sum(by_hand) / 2
    assert cells[6] == f"{mean:.2f} ± {math.sqrt(sum((r - mean) ** 2 for r in by_hand)):.2f}"


def test_the_demo_says_what_its_ratio_compares():
    curve = [{"step": 159.0, "train_seconds": 50.0, "tokens": 655_360.0, "val_loss": 2.2}]
    results = [
        RecipeResult("hsdp", 4, 1e4, 9.452, {}, curve),
        RecipeResult("fl_hsdp", 4, 1e4, 9.806, {}, [dict(curve[0], val_loss=2.3)]),
    ]
    text = demo_reading(results, [1, 2])
    assert "fl_hsdp val ppl ×1.037: one seed, 2 federation groups, matched tokens and optimizer steps" in text
    assert "655,360 tokens in 160 steps" in text
    assert "fedshard bench quality" in text


def test_a_micro_grid_trains_and_aligns_its_curves(tmp_path):
    """hsdp against FedAvg over 2 groups, 4 ranks as 2 processes × 2 accumulated micro-batches, 2 steps."""
    specs = [RunSpec(4, 1, None, 0, 2), RunSpec(4, 2, "avg", 0, 2)]
    settings = {"steps": 2, "sync_every": 2, "val_every": 2, "batch": 1, "val_samples": 4}
    plan = tmp_path / "plan.json"
    out = tmp_path / "runs"
    out.mkdir()
    plan.write_text(json.dumps({"out": str(out), "settings": settings, "specs": [s.__dict__ for s in specs]}))
    done = run_isolated([sys.executable, "-m", "lightning_fedshard.bench.quality", "--worker", str(plan)])
    assert done.returncode == 0, done.stderr[-3000:]
    for spec in specs:
        raw = json.loads((out / f"{spec.name}.json").read_text())
        assert raw["tokens_per_step"] == 4 * 1 * 128  # W · b · seq_len of the tiny recipe
        assert [p["step"] for p in raw["curve"]] == [2]  # optimizer steps, not accumulated micro-batches
        assert 0 < raw["curve"][0]["val_loss"] < math.log(256) + 1  # trained bytes, not worse than chance
