"""Verification in Lightning's predict loop: real gloo processes (2 and 4 ranks) against single-process runs."""

from __future__ import annotations

import functools
import json
import pickle
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from lightning_fedshard.verify.cli import main as verify_main
from lightning_fedshard.verify.config import Verdict, VerifyConfig
from lightning_fedshard.verify.instances import Instance
from lightning_fedshard.verify.lightning import (
    InstanceDataset,
    InstanceSampler,
    VnncompInstances,
    merge_rank_outputs,
    predict_layout,
    run_predict,
)
from lightning_fedshard.verify.result import RankReport, VerificationResult
from lightning_fedshard.verify.spec import check_counterexample, read_vnnlib
from lightning_fedshard.verify.verifier import model_forward, verify_files
from tests.launching import run_isolated

MNIST = Path(__file__).resolve().parents[2].parent / "shared" / "vnncomp" / "mnist_fc_2022"
needs_mnist = pytest.mark.skipif(not MNIST.is_dir(), reason="../shared/vnncomp/mnist_fc_2022 is absent")
WORKER = Path(__file__).with_name("predict_worker.py")
NET2, NET4 = MNIST / "onnx" / "mnist-net_256x2.onnx", MNIST / "onnx" / "mnist-net_256x4.onnx"
#: Instances of the general-graph sets: a sigmoid MLP (unsat by CROWN), Pensieve's parallel net without a batch
#: dimension, with Split, Pow and a computed denominator (unsat), an AC-OPF proxy with products of two tensors (sat).
GENERAL = [
    (MNIST.parent / folder / "onnx" / net, MNIST.parent / folder / "vnnlib" / prop)
    for folder, net, prop in (
        ("eran_sigmoid_2021", "ffnnSIGMOID__Point_6x200.onnx.gz", "mnist_spec_idx_7167_eps_0.01200.vnnlib"),
        ("nn4sys_pensieve_2023", "pensieve_small_parallel.onnx.gz", "pensieve_parallel_4.vnnlib"),
        ("ml4acopf_linear_2024", "14_ieee_ml4acopf-linear-nonresidual.onnx.gz", "14_ieee_prop1.vnnlib"),
    )
]
needs_general = pytest.mark.skipif(
    not all(onnx.is_file() for onnx, _ in GENERAL), reason="the general-graph sets of ../shared/vnncomp are absent"
)
TIMEOUT = 60.0
LAUNCH_TIMEOUT_S = 150


def prop(name: str) -> Path:
    return MNIST / "vnnlib" / f"prop_{name}.vnnlib"


@functools.cache
def reference(onnx: Path, vnnlib: Path):
    """The single-process answer (this process has one torch thread: tests/verify/conftest.py)."""
    return verify_files(onnx, vnnlib, VerifyConfig(timeout=TIMEOUT, measure_memory=True))


@pytest.fixture(scope="module")
def corrupt_onnx(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("bad") / "corrupt.onnx"
    path.write_bytes(b"\x08\x07this is not a protobuf model\xff\xfe")
    return path


def scenarios(corrupt: Path) -> dict[str, dict]:
    missing = MNIST / "onnx" / "no-such-net.onnx"
    return {
        # the bad instance in the middle; then bab unsat, sat, alpha-crown unsat
        "fsdp": {
            "strategy": "fsdp",
            "devices": 2,
            "config": {"measure_memory": True},
            "instances": [
                (NET2, prop("6_0.03")),
                (corrupt, prop("0_0.03")),
                (NET2, prop("0_0.05")),
                (NET2, prop("4_0.03")),
            ],
        },
        "tp": {
            "strategy": "tp",
            "devices": 2,
            "config": {"measure_memory": True},
            "instances": [(NET2, prop("6_0.03")), (missing, prop("0_0.03")), (NET2, prop("0_0.05"))],
        },
        "fsdp+rows": {
            "strategy": "fsdp+rows",
            "devices": 2,
            "config": {"measure_memory": True},
            "instances": [(NET2, prop("6_0.03")), (NET2, prop("0_0.05"))],
        },
        "dp": {
            "strategy": "single",
            "devices": 2,
            "config": {"measure_memory": True},
            "instances": [
                (NET2, prop("4_0.03")),
                (missing, prop("0_0.03")),
                (NET2, prop("0_0.05")),
                (NET4, prop("2_0.03")),
                (NET2, prop("1_0.03")),
            ],
        },
        # operators beyond ReLU, FSDP-sharded (absent sets: the mnist instance alone)
        "general": {
            "strategy": "fsdp",
            "devices": 2,
            "instances": [pair for pair in GENERAL if pair[0].is_file()] or [(NET2, prop("4_0.03"))],
        },
        # 2 × 2 mesh: instances over the data-parallel dim, each sharded over a tensor-parallel pair
        "fsdp_2x2": {
            "strategy": "fsdp",
            "devices": 4,
            "group_size": 2,
            "instances": [(NET2, prop("4_0.03")), (NET4, prop("2_0.03")), (NET2, prop("1_0.03"))],
        },
    }


@pytest.fixture(scope="module")
def launch(tmp_path_factory, corrupt_onnx):
    """``launch(name)`` → that scenario's results; its first call runs every scenario with as many devices in one
    launch (the interpreters start once)."""
    cache: dict[str, list[VerificationResult]] = {}

    def run(name: str) -> list[VerificationResult]:
        if name not in cache:
            scenarios_ = scenarios(corrupt_onnx)
            batch = [other for other, s in scenarios_.items() if s["devices"] == scenarios_[name]["devices"]]
            out = tmp_path_factory.mktemp(name)
            specs = []
            for scenario in batch:
                spec = dict(scenarios_[scenario])
                spec["instances"] = [[str(onnx), str(vnnlib), TIMEOUT] for onnx, vnnlib in spec["instances"]]
                spec["out"] = str(out / f"{scenario}.pickle")
                specs.append(spec)
            (out / "spec.json").write_text(json.dumps({"runs": specs}))
            timeout = LAUNCH_TIMEOUT_S + 60 * (len(specs) - 1)
            result = run_isolated([sys.executable, str(WORKER), str(out / "spec.json")], timeout)
            assert result.returncode == 0, result.stderr[-6000:]
            for scenario, spec in zip(batch, specs, strict=True):
                cache[scenario] = pickle.loads((out / f"{scenario}.pickle").read_bytes())  # this test's worker's
                assert [r.index for r in cache[scenario]] == list(range(len(spec["instances"])))
        return cache[name]

    return run


def decided(results: list[VerificationResult]) -> list[VerificationResult]:
    return [r for r in results if r.verdict is not Verdict.ERROR]


def assert_group_agrees(entry: VerificationResult, size: int, bitwise: bool) -> None:
    ranks = entry.per_rank
    assert len(ranks) == size and len({r.dp_rank for r in ranks}) == 1, ranks
    assert sorted(r.tp_rank for r in ranks) == list(range(size))
    for other in ranks[1:]:
        assert other.verdict == ranks[0].verdict
        if bitwise:
            assert other.root_margins == ranks[0].root_margins
        else:
            for a, b in zip(other.root_margins, ranks[0].root_margins, strict=True):
                np.testing.assert_allclose(a, b, rtol=0, atol=1e-5)


def assert_counterexample_replays(entry: VerificationResult) -> None:
    assert entry.verdict is Verdict.SAT and entry.counterexample is not None
    assert entry.counterexample_check == "ok"
    onnx, vnnlib = Path(entry.onnx), Path(entry.vnnlib)
    prop_ = read_vnnlib(vnnlib, entry.counterexample.x.size, entry.counterexample.y.size)
    assert check_counterexample(entry.counterexample, prop_, model_forward(onnx)).ok


# --- without processes -------------------------------------------------------------------------------------------


def test_the_sampler_deals_instances_round_robin_over_the_data_parallel_ranks_without_repeats():
    dataset = InstanceDataset([Instance(Path(f"n{i}.onnx"), Path(f"p{i}.vnnlib"), 1.0) for i in range(5)])
    dealt = [list(InstanceSampler(dataset, 2, rank)) for rank in range(2)]
    assert dealt == [[0, 2, 4], [1, 3]]
    assert [len(InstanceSampler(dataset, 2, rank)) for rank in range(2)] == [3, 2]
    assert list(InstanceSampler(dataset, 8, 6)) == []  # more ranks than instances: an empty share, no assert
    # the ranks of one tensor-parallel group share their data-parallel rank, so they get the same sequence
    assert list(InstanceSampler(dataset, 1, 0)) == list(range(5))
    assert dataset[3] == {"index": 3, "onnx": "n3.onnx", "vnnlib": "p3.vnnlib", "timeout": 1.0}


@needs_mnist
def test_the_data_module_reads_and_filters_instances_csv():
    data = VnncompInstances(MNIST / "instances.csv", networks=["mnist-net_256x4.onnx"], limit=3, timeout=5)
    assert [(i.onnx.name, i.vnnlib.name, i.timeout) for i in data.instances] == [
        ("mnist-net_256x4.onnx", f"prop_{k}_0.03.vnnlib", 5) for k in range(3)
    ]
    with pytest.raises(ValueError, match="no-such"):
        VnncompInstances(MNIST / "instances.csv", networks=["no-such.onnx"])


def test_layouts_and_merging_flag_ranks_that_disagree():
    assert predict_layout("single", 2) == (2, 1)
    assert predict_layout("fsdp", 4) == (1, 4)
    assert predict_layout("tp", 4, 2) == (2, 2)
    for bad in (("fsdp", 4, 3), ("tp", 2, 1), ("single", 2, 2)):
        with pytest.raises(ValueError):
            predict_layout(*bad)

    def out(rank: int, verdict: str, index: int = 0) -> VerificationResult:
        result = VerificationResult(Verdict(verdict), onnx="a.onnx", vnnlib="p.vnnlib", index=index, time_s=rank + 1.0)
        result.per_rank = [RankReport.of(result, rank, 0, rank)]
        return result

    (same,) = merge_rank_outputs([out(1, "unsat"), out(0, "unsat")], 2)
    assert same.verdict is Verdict.UNSAT and [r.rank for r in same.per_rank] == [0, 1] and same.time_s == 2.0
    (split,) = merge_rank_outputs([out(0, "unsat"), out(1, "unknown")], 2)
    assert split.verdict is Verdict.ERROR and "disagree" in split.error and split.per_rank[1].verdict == "unknown"
    lonely, missing = merge_rank_outputs([out(0, "sat")], 2, [("a.onnx", "p.vnnlib", 1), ("b.onnx", "q.vnnlib", 1)])
    assert lonely.verdict is Verdict.ERROR and "not one group" in lonely.error
    assert missing.verdict is Verdict.ERROR and missing.onnx == "b.onnx" and missing.index == 1
    assert missing.per_rank == []


@needs_mnist
def test_one_device_runs_the_loop_in_this_process(corrupt_onnx):
    instances = VnncompInstances(MNIST / "instances.csv", networks=["mnist-net_256x2.onnx"], limit=2).instances
    instances.insert(1, Instance(corrupt_onnx, prop("0_0.03"), TIMEOUT))
    results = run_predict(instances, VerifyConfig(timeout=TIMEOUT, measure_memory=True))
    assert [r.verdict for r in results] == ["unsat", "error", "sat"]
    assert results[1].error.startswith("OnnxLoadError")
    assert results[0].root_margins == reference(NET2, prop("0_0.03")).root_margins
    assert_counterexample_replays(results[2])
    assert all(r.per_rank[0].peak_memory_bytes > 0 for r in decided(results))


# --- real processes ----------------------------------------------------------------------------------------------


@needs_mnist
@pytest.mark.multiproc
def test_fsdp_ranks_agree_and_match_the_single_process_run_bitwise(launch):
    results = launch("fsdp")
    assert [r.verdict for r in results] == ["unsat", "error", "sat", "unsat"]
    for entry in decided(results):
        assert_group_agrees(entry, 2, bitwise=True)
        ref = reference(Path(entry.onnx), Path(entry.vnnlib))
        assert entry.verdict == ref.verdict.value and entry.decided_by == ref.decided_by
        assert entry.root_margins == ref.root_margins  # bitwise: pickle round-trips floats exactly
    assert results[0].decided_by == "bab" and results[3].decided_by == "alpha-crown"
    assert_counterexample_replays(results[2])


@needs_mnist
@needs_general
@pytest.mark.multiproc
def test_general_graphs_run_sharded_in_the_loop_as_in_one_process(launch):
    results = launch("general")
    assert [r.verdict for r in results] == ["unsat", "unsat", "sat"]
    for entry in results:
        assert_group_agrees(entry, 2, bitwise=True)
        ref = reference(Path(entry.onnx), Path(entry.vnnlib))
        assert (entry.verdict, entry.decided_by, entry.root_margins) == (
            ref.verdict.value,
            ref.decided_by,
            ref.root_margins,
        )
    assert_counterexample_replays(results[2])


@needs_mnist
@pytest.mark.multiproc
def test_fsdp_shards_the_weights_over_the_ranks(launch):
    for entry in decided(launch("fsdp")):
        single = reference(Path(entry.onnx), Path(entry.vnnlib))
        for rank in entry.per_rank:
            assert rank.baseline_memory_bytes > 0 and rank.peak_memory_bytes > 0 and rank.time_s > 0
            assert rank.rss_peak_bytes > 0
            assert rank.baseline_memory_bytes < 0.6 * single.baseline_memory_bytes


@needs_mnist
@pytest.mark.multiproc
def test_tensor_parallel_rows_match_the_single_process_run_within_rounding(launch):
    results = launch("tp")
    assert [r.verdict for r in results] == ["unsat", "error", "sat"]
    for entry in decided(results):
        assert_group_agrees(entry, 2, bitwise=False)
        ref = reference(Path(entry.onnx), Path(entry.vnnlib))
        assert entry.verdict == ref.verdict.value
        for ours, theirs in zip(entry.root_margins, ref.root_margins, strict=True):
            np.testing.assert_allclose(ours, theirs, rtol=0, atol=1e-5)
        assert all(r.baseline_memory_bytes > 0 and r.peak_memory_bytes > 0 for r in entry.per_rank)
    assert_counterexample_replays(results[2])


@needs_mnist
@pytest.mark.multiproc
def test_fsdp_rows_answers_as_tensor_parallel_rows_on_half_the_weights(launch):
    rows = decided(launch("tp"))
    both = launch("fsdp+rows")
    assert [r.verdict for r in both] == ["unsat", "sat"]
    for ours, theirs in zip(both, rows, strict=True):
        assert_group_agrees(ours, 2, bitwise=True)
        assert (ours.verdict, ours.root_margins, ours.domains_bounded) == (
            theirs.verdict,
            theirs.root_margins,
            theirs.domains_bounded,
        )
        for mine, whole in zip(ours.per_rank, theirs.per_rank, strict=True):
            assert mine.baseline_memory_bytes < 0.55 * whole.baseline_memory_bytes  # weights sharded, biases whole
    np.testing.assert_array_equal(both[1].counterexample.x, rows[1].counterexample.x)
    assert_counterexample_replays(both[1])


@needs_mnist
@pytest.mark.multiproc
@pytest.mark.parametrize("name", ["fsdp", "tp", "dp"])
def test_a_bad_instance_reports_its_error_on_every_rank_and_the_next_ones_are_decided(launch, name):
    results = launch(name)
    bad = results[1]
    assert bad.verdict == "error" and bad.per_rank
    assert all(r.error and r.verdict == "error" for r in bad.per_rank)
    assert all("OnnxLoadError" in r.error for r in bad.per_rank)
    assert all(r.verdict in ("sat", "unsat") for r in results[2:])


@needs_mnist
@pytest.mark.multiproc
def test_data_parallel_ranks_decide_each_instance_exactly_once(launch):
    results = launch("dp")
    assert len(results) == 5
    for entry in results:
        (only,) = entry.per_rank
        assert only.rank == entry.index % 2 and only.tp_rank == 0
    for entry in decided(results):
        ref = reference(Path(entry.onnx), Path(entry.vnnlib))
        assert entry.verdict == ref.verdict.value and entry.root_margins == ref.root_margins
        assert entry.per_rank[0].baseline_memory_bytes == ref.baseline_memory_bytes


@needs_mnist
@pytest.mark.multiproc
def test_a_2x2_mesh_spreads_instances_over_data_parallel_and_shards_each_over_tensor_parallel(launch):
    results = launch("fsdp_2x2")
    assert [r.verdict for r in results] == ["unsat", "unsat", "sat"]
    for entry in results:
        assert_group_agrees(entry, 2, bitwise=True)
        dp = entry.index % 2
        assert {r.rank for r in entry.per_rank} == {2 * dp, 2 * dp + 1}
        assert all(r.dp_rank == dp for r in entry.per_rank)
        ref = reference(Path(entry.onnx), Path(entry.vnnlib))
        assert entry.verdict == ref.verdict.value and entry.root_margins == ref.root_margins


@needs_mnist
@pytest.mark.multiproc
# a failing launched rank repeats the launching rank's case (~60 s): with the benchmarks (-m slow), for CI's 20 minutes
@pytest.mark.parametrize("fail_rank", [0, pytest.param(1, marks=pytest.mark.slow)])
def test_a_rank_failing_mid_run_fails_the_whole_group_without_hanging(tmp_path, fail_rank):
    from tests.verify.predict_worker import INJECTED

    spec = {
        "strategy": "fsdp",
        "devices": 2,
        "fail_rank": fail_rank,
        "out": str(tmp_path / "results.pickle"),
        # The first instance reaches α-CROWN; the second would be decided if the loop went on.
        "instances": [[str(NET2), str(prop("6_0.03")), TIMEOUT], [str(NET2), str(prop("4_0.03")), TIMEOUT]],
    }
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    result = run_isolated([sys.executable, str(WORKER), str(tmp_path / "spec.json")], LAUNCH_TIMEOUT_S)
    assert result.returncode != 0 and "killed after" not in result.stderr, result.stderr[-3000:]
    assert INJECTED in result.stderr
    assert not (tmp_path / "results.pickle").exists()


# --- the command line --------------------------------------------------------------------------------------------


@needs_mnist
# ~100 s; the launch fixture above runs this predict loop on two ranks: with the benchmarks (-m slow), for CI
@pytest.mark.slow
@pytest.mark.multiproc
def test_the_cli_runs_fsdp_on_two_ranks_and_reports_every_rank(tmp_path):
    report, result_file = tmp_path / "r.json", tmp_path / "out.txt"
    command = [sys.executable, "-m", "lightning_fedshard.cli", "verify", str(NET2), str(prop("0_0.05"))]
    command += ["--strategy", "fsdp", "--devices", "2", "--threads", "1", "--timeout", str(TIMEOUT)]
    result = run_isolated([*command, "--report", str(report), "--result", str(result_file)], LAUNCH_TIMEOUT_S)
    assert result.returncode == 0, result.stderr[-6000:]
    assert result.stdout.startswith("sat") and "[fsdp, 2 devices]" in result.stdout
    assert result_file.read_text().startswith("sat\n((X_0 ")
    data = json.loads(report.read_text())
    ref = reference(NET2, prop("0_0.05"))
    assert data["verdict"] == "sat" and data["root_margins"] == ref.root_margins
    assert data["counterexample_check"] == "ok" and data["total_time_s"] > 0
    assert [r["rank"] for r in data["per_rank"]] == [0, 1]
    for rank in data["per_rank"]:
        assert 0 < rank["baseline_memory_bytes"] < 0.6 * ref.baseline_memory_bytes
        assert rank["peak_memory_bytes"] > rank["baseline_memory_bytes"] and rank["time_s"] > 0


@needs_mnist
def test_the_cli_instances_form_goes_through_the_predict_loop(tmp_path, monkeypatch, capsys):
    calls = []

    def in_this_process(instances, config, strategy, devices, *args):
        calls.append((strategy, devices, args))
        return run_predict(instances, config)  # the same loop on one device: no processes from pytest

    monkeypatch.setattr("lightning_fedshard.verify.lightning.module.run_predict", in_this_process)
    results = tmp_path / "results.csv"
    command = ["--instances", str(MNIST / "instances.csv"), "--networks", "mnist-net_256x2.onnx", "--limit", "2"]
    assert verify_main([*command, "--strategy", "tp", "--devices", "2", "--results", str(results)]) == 0
    assert calls == [("tp", 2, ("rows", None, None, "cpu"))]
    lines = results.read_text().splitlines()
    assert lines[1].startswith("mnist-net_256x2.onnx,prop_0_0.03.vnnlib,unsat,")
    assert lines[2].startswith("mnist-net_256x2.onnx,prop_1_0.03.vnnlib,sat,") and ",yes,sat,False,10," in lines[2]
    assert "total" in capsys.readouterr().out


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available here")
def test_asking_for_a_gpu_without_cuda_is_an_argparse_error(capsys):
    with pytest.raises(SystemExit) as exit_:
        verify_main(["net.onnx", "prop.vnnlib", "--devices", "2", "--accelerator", "gpu"])
    assert exit_.value.code == 2 and "CUDA is not available" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--devices", "0"], "--devices must be"),
        (["--strategy", "fsdp"], "--devices ≥ 2"),
        (["--strategy", "tp", "--devices", "1"], "--devices ≥ 2"),
        (["--strategy", "tp", "--devices", "2", "--zones", "2"], "--zones needs --tp-mode zones"),
        (["--strategy", "tp", "--devices", "2", "--tp-mode", "rows", "--zones", "1"], "--zones needs"),
        (["--strategy", "fsdp", "--devices", "2", "--tp-mode", "zones"], "--tp-mode applies to --strategy tp"),
        (["--strategy", "fsdp", "--devices", "4", "--group-size", "3"], "does not divide"),
        (["--devices", "2", "--group-size", "2"], "must be 1"),
    ],
)
def test_bad_parallel_options_are_argparse_errors(args, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        verify_main(["net.onnx", "prop.vnnlib", *args])
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err
