"""``fedshard bench multitier``: its view of the recipes and of this machine, the link counter callback, the
report, and one real run on a namespace cluster (root and iproute2 only)."""

from __future__ import annotations

import dataclasses
import json
import sys
from types import SimpleNamespace

import pytest
from lightning.pytorch.trainer.states import TrainerFn

from lightning_fedshard.bench import multitier
from lightning_fedshard.bench.costmodel import mean_step_bytes
from lightning_fedshard.bench.netns import ClusterUnavailable, unavailable_reason
from lightning_fedshard.recipes import RECIPES
from tests.launching import run_isolated

TINY = RECIPES / "tiny"


@pytest.mark.parametrize(
    ("recipe", "ledger"),
    [  # bytes per rank per step the strategies' ledger logged for these recipes (docs/benchmarks.md)
        ("hsdp", {"shard": 4_989_440, "replicate": 1_707_264, "fed": 0}),
        ("fsdp2", {"shard": 7_487_232, "replicate": 0, "fed": 0}),
        ("fl_fsdp", {"shard": 4_989_440, "replicate": 0, "fed": 213_408}),
        ("fl_hsdp", {"shard": 0, "replicate": 3_413_504, "fed": 426_688}),
    ],
)
def test_recipe_workloads_predict_the_logged_ledger(recipe, ledger):
    workload = multitier.recipe_workload(TINY / f"{recipe}.yaml")
    assert workload.dims.world_size == multitier.NODES * multitier.RANKS_PER_NODE
    assert mean_step_bytes(workload) == pytest.approx(ledger, abs=1e-6)


def test_machine_cluster_takes_the_link_rate_less_headers():
    calibration = {"flops_per_s": 1e10, "loopback_bytes_per_s": 5e8, "inter_node_hop_s": 1e-5, "call_s": 1e-4,
                   "codec_s_per_coord": 1e-7}  # fmt: skip
    cluster = multitier.machine_cluster(calibration, rate_mbit=100.0, mtu=1500)
    assert cluster.inter_node_bandwidth == pytest.approx(100e6 / 8 * 1448 / 1514)
    assert cluster.reduce_scatter_factor == 2.0 and cluster.devices_per_node == multitier.RANKS_PER_NODE


def test_link_monitor_counts_training_steps_only(tmp_path, monkeypatch):
    counter = tmp_path / "tx_bytes"
    monitor = multitier.LinkBytesMonitor(str(tmp_path / "out"))
    monitor.counter = counter
    barriers = []
    trainer = SimpleNamespace(local_rank=0, node_rank=1, global_step=4, state=SimpleNamespace(fn=TrainerFn.FITTING),
                              strategy=SimpleNamespace(barrier=lambda: barriers.append(1)))  # fmt: skip
    for value, hook in [
        (100, monitor.on_train_start),
        (300, monitor.on_validation_start),  # 200 bytes of training
        (1300, monitor.on_validation_end),  # 1000 bytes of validation: left out
        (1350, monitor.on_train_end),  # 50 more bytes of training
    ]:
        counter.write_text(str(value))
        hook(trainer, None)
    assert json.loads((tmp_path / "out" / "node1.json").read_text()) == {"bytes": 250, "steps": 4}
    assert len(barriers) == 4  # every rank meets at each mark, so no rank's bytes straddle it


def run(name: str, rate: float, measured: float, predicted: float) -> multitier.Run:
    ledger = {"shard": 1.0, "replicate": 2.0, "fed": 0.0}
    return multitier.Run(name, rate, tokens_per_s=4096 / measured, val_loss=3.0, ledger_bytes=ledger,
                         node_egress_bytes=1e6, measured_step_s=measured, predicted_step_s=predicted,
                         predicted_egress_bytes=1e6, predicted_ledger_bytes=ledger)  # fmt: skip


def test_report_gives_ratios_to_hsdp_and_the_model_error(tmp_path):
    runs = [run("hsdp", 50, 0.5, 0.45), run("fl_fsdp", 50, 0.25, 0.3), run("hsdp", 200, 0.3, 0.3)]
    table = multitier.format_table(runs)
    fl_row = next(line for line in table.splitlines() if line.startswith("fl_fsdp"))
    assert " 2.00 " in fl_row and "+20.0%" in fl_row
    assert "largest step-time error of the cost model: 20.0%" in table
    assert "fl_fsdp          tokens/s ×2.00   val loss ×1.000   ledger bytes/step ×1.000" in table
    assert all(p.stat().st_size > 0 for p in multitier.plot(runs, tmp_path))


def test_a_saved_run_is_reported_again_without_running(tmp_path, capsys):
    runs = [run("hsdp", 50, 0.5, 0.45), run("fl_hsdp", 50, 0.4, 0.4)]
    results = tmp_path / "results.json"
    results.write_text(json.dumps({"calibration": {}, "runs": [dataclasses.asdict(r) for r in runs]}))
    multitier.main(["--from-results", str(results)])
    assert multitier.format_table(runs) in capsys.readouterr().out
    assert (tmp_path / "multitier_measured_vs_model.png").is_file()


def test_bad_arguments_and_a_missing_network_are_reported_before_anything_starts(monkeypatch, capsys):
    with pytest.raises(SystemExit):
        multitier.main(["--steps", "20"])
    with pytest.raises(SystemExit):
        multitier.main(["--runs", "fsdp2"])  # no hsdp baseline
    monkeypatch.setattr(multitier, "check_available", lambda: (_ for _ in ()).throw(ClusterUnavailable("not root")))
    with pytest.raises(SystemExit, match="cannot build its network here: not root"):
        multitier.main([])


@pytest.mark.multiproc
@pytest.mark.slow  # the benchmark itself (calibration + a shaped 4-rank run, ~100 s): with the benchmarks, for CI's 20 min
@pytest.mark.skipif(unavailable_reason() is not None, reason=str(unavailable_reason()))
def test_one_shaped_run_end_to_end(tmp_path):
    out = tmp_path / "multitier"
    command = [sys.executable, "-m", "lightning_fedshard.bench", "multitier", "--rates", "400", "--runs", "hsdp",
               "--steps", "16", "--out", str(out)]  # fmt: skip
    result = run_isolated(command, timeout=400)
    assert result.returncode == 0, result.stderr[-4000:]
    record = json.loads((out / "results.json").read_text())
    (hsdp,) = record["runs"]
    assert hsdp["ledger_bytes"] == pytest.approx(hsdp["predicted_ledger_bytes"], abs=1e-6)
    # what left node 0 during training: the replicate all-reduces of both rings, plus TCP/IP headers
    assert 1.0 <= hsdp["node_egress_bytes"] / hsdp["predicted_egress_bytes"] < 1.1
    assert hsdp["measured_step_s"] > 0 and hsdp["predicted_step_s"] > 0
    assert (out / "multitier_throughput.png").stat().st_size > 0
    assert "largest step-time error" in result.stdout
