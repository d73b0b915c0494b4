"""The verify-memory benchmark's pieces: the random MLP, one rank's measurement, and the summary arithmetic."""

from __future__ import annotations

import pytest
import torch

from lightning_fedshard.bench.verify_memory import MIB, format_table, measure, random_mlp, summarise
from lightning_fedshard.verify.memory import tensor_bytes
from lightning_fedshard.verify.ops import Linear, ReLU
from lightning_fedshard.verify.shard.plan import ShardPlan


def test_random_mlp_has_the_asked_widths_and_fan_in_scaled_weights():
    graph = random_mlp((300, 200), inputs=784, outputs=10, seed=1)
    linears = [node for node in graph.nodes if isinstance(node.op, Linear)]
    assert [tuple(node.op.weight.shape) for node in linears] == [(300, 784), (200, 300), (10, 200)]
    assert sum(isinstance(node.op, ReLU) for node in graph.nodes) == 2
    for node in linears:
        fan_in = node.op.weight.shape[1]
        assert abs(float(node.op.weight.std()) * fan_in**0.5 - 1) < 0.05
    assert graph(torch.rand(3, 784)).shape == (3, 10)


def test_one_rank_measurement_counts_the_weights_as_baseline_and_more_at_every_peak():
    graph = random_mlp((64, 64), seed=2)
    row = measure("tiny", graph, "single", ShardPlan(), 1, 0)
    assert row.baseline == tensor_bytes(graph.constants())
    assert row.crown_peak > row.baseline
    assert row.alpha_peak > row.crown_peak  # slopes, optimiser state and the autograd graph come on top
    assert row.bab_peak > row.baseline


def _row(strategy: str, ranks: int, rank: int, scale: float) -> dict:
    return {
        "network": "net",
        "strategy": strategy,
        "ranks": ranks,
        "rank": rank,
        "baseline": int(100 * MIB * scale),
        "crown_peak": int(200 * MIB * scale),
        "alpha_peak": int(400 * MIB * scale),
        "bab_peak": int(300 * MIB * scale),
        "root_time": 1.0 * scale,
        "bab_time": 1.0 * scale,
    }


def test_summary_takes_the_largest_rank_and_divides_by_single():
    rows = [_row("single", 1, 0, 1.0), _row("fsdp", 2, 0, 0.5), _row("fsdp", 2, 1, 0.25)]
    table = summarise(rows)
    fsdp = next(r for r in table if r["strategy"] == "fsdp")
    assert fsdp["baseline"] == 50 * MIB and fsdp["baseline_ratio"] == 0.5
    assert fsdp["alpha_peak_ratio"] == 0.5 and fsdp["time_ratio"] == 0.5
    text = format_table(table)
    assert "| net | fsdp | 2 | 50.0 | 0.50 |" in text and text.count("\n") == 3


def test_the_auto_lirpa_model_computes_the_graph_with_its_weights():
    from lightning_fedshard.bench.lirpa_reference import as_sequential
    from tests.verify.nets import resnet

    graph = random_mlp((32, 16), seed=3)
    x = torch.rand(5, 784, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(as_sequential(graph)(x), graph(x), rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match="only dense ReLU MLPs"):
        as_sequential(resnet((3, 8, 8), width=2))


def test_auto_lirpa_comparison_without_auto_lirpa_is_an_argparse_error_before_any_run(monkeypatch, tmp_path, capsys):
    import importlib.util

    from lightning_fedshard.bench import verify_memory

    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    monkeypatch.setattr(verify_memory, "run", lambda *a: pytest.fail("it ran"))
    with pytest.raises(SystemExit) as exit_:
        verify_memory.main(["--auto-lirpa", "--out", str(tmp_path)])
    assert exit_.value.code == 2
    assert "auto_LiRPA is not importable" in capsys.readouterr().err
