"""End-to-end verdicts: VNN-COMP mnist_fc instances against the competition's consensus, and small random nets
against exhaustive sampling (BaB must never prove what a sample refutes)."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from lightning_fedshard.cli import main as fedshard_main
from lightning_fedshard.verify import (
    BoundGraph,
    Method,
    Verdict,
    VerifyConfig,
    check_counterexample,
    read_vnnlib,
    verify,
    verify_files,
)
from lightning_fedshard.verify.cli import main as verify_main
from lightning_fedshard.verify.instances import read_instances, run_instance, summarise
from lightning_fedshard.verify.spec import Case, Disjunct, InputBox, Property
from lightning_fedshard.verify.verifier import model_forward
from tests.verify.nets import random_mlp

MNIST = Path(__file__).resolve().parents[2].parent / "shared" / "vnncomp" / "mnist_fc_2022"
needs_mnist = pytest.mark.skipif(not MNIST.is_dir(), reason="../shared/vnncomp/mnist_fc_2022 is absent")


def expected_verdicts() -> dict[tuple[str, str], str]:
    if not MNIST.is_dir():
        return {}
    with (MNIST / "expected_verdicts.csv").open() as f:
        return {(r["onnx"], r["vnnlib"]): r["expected"] for r in csv.DictReader(f)}


# Instances of expected_verdicts.csv that take this engine long branch-and-bound or time out (all of ε = 0.05 on
# the deeper nets): `fedshard verify --instances` runs them, see docs/benchmarks.md. Every other one is decided
# here, each in well under a second.
SLOW = {("mnist-net_256x4.onnx", "prop_6_0.03.vnnlib")} | {
    ("mnist-net_256x6.onnx", f"prop_{i}_0.03.vnnlib") for i in (1, 7, 9)
}
FAST = sorted(
    key
    for key in expected_verdicts()
    if key not in SLOW and not (key[0] != "mnist-net_256x2.onnx" and "0.05" in key[1])
)


@needs_mnist
@pytest.mark.parametrize(("onnx", "vnnlib"), FAST)
def test_mnist_verdicts_match_the_competition(onnx, vnnlib):
    expected = expected_verdicts()[(onnx, vnnlib)]
    result = verify_files(MNIST / "onnx" / onnx, MNIST / "vnnlib" / vnnlib, VerifyConfig(timeout=60))
    assert result.verdict.value == expected
    if result.verdict is Verdict.SAT:
        prop = read_vnnlib(MNIST / "vnnlib" / vnnlib)
        check = check_counterexample(result.counterexample, prop, model_forward(MNIST / "onnx" / onnx))
        assert check.ok, check.reason
    else:
        assert result.counterexample is None
        assert all(len(rows) == 9 for rows in result.root_margins)


@needs_mnist
def test_a_counterexample_that_does_not_replay_is_not_reported(monkeypatch):
    from lightning_fedshard.verify import verifier

    def shifted(onnx_path, graph=None):
        forward = model_forward(onnx_path, graph)
        # a model that computes 1 % more than our graph: its outputs leave our bounds at the counterexample
        return lambda x: forward(x) * 1.01

    monkeypatch.setattr(verifier, "model_forward", shifted)
    onnx, vnnlib = MNIST / "onnx" / "mnist-net_256x2.onnx", MNIST / "vnnlib" / "prop_1_0.03.vnnlib"
    result = verify_files(onnx, vnnlib, VerifyConfig(timeout=30))
    assert result.verdict is Verdict.UNKNOWN and result.counterexample is None
    assert "outside our bounds" in result.counterexample_check  # our graph computes another function: a loader bug


@needs_mnist
def test_branch_and_bound_proves_what_alpha_crown_cannot():
    onnx, vnnlib = MNIST / "onnx" / "mnist-net_256x2.onnx", MNIST / "vnnlib" / "prop_6_0.03.vnnlib"
    alpha = verify_files(onnx, vnnlib, VerifyConfig(method=Method.ALPHA_CROWN, timeout=60))
    assert alpha.verdict is Verdict.UNKNOWN and min(alpha.root_margins[0]) < 0
    full = verify_files(onnx, vnnlib, VerifyConfig(timeout=60))
    assert full.verdict is Verdict.UNSAT and full.decided_by == "bab" and full.domains_bounded > 0


@needs_mnist
def test_a_short_timeout_answers_timeout_not_unsat():
    result = verify_files(
        MNIST / "onnx" / "mnist-net_256x6.onnx", MNIST / "vnnlib" / "prop_2_0.05.vnnlib", VerifyConfig(timeout=2.0)
    )
    assert result.verdict in (Verdict.TIMEOUT, Verdict.UNKNOWN)


def _random_net(seed: int, widths=(2, 12, 12, 2)) -> BoundGraph:
    return random_mlp(seed, widths)


@pytest.mark.parametrize("bab", ["neuron", "input"])
@pytest.mark.parametrize("seed", range(12))
def test_random_nets_agree_with_exhaustive_sampling(seed, bab):
    """y_0 − y_1 ≥ threshold over a 2-D box, with the threshold near the sampled minimum so that both
    verdicts occur; an answer of unsat must survive a dense grid, a sat must carry a real counterexample."""
    graph = _random_net(seed)
    grid = torch.stack(torch.meshgrid(torch.linspace(-1, 1, 401), torch.linspace(-1, 1, 401), indexing="ij"), -1)
    with torch.no_grad():
        y = graph(grid.reshape(-1, 2))
    margin = (y[:, 0] - y[:, 1]).min().item()
    threshold = margin - 0.02 if seed % 2 else margin + 0.02  # odd seeds: safe, even seeds: violated
    # unsafe set: y_0 − y_1 ≤ threshold, i.e. [1, −1]·y ≤ threshold
    case = Case(InputBox(-np.ones(2), np.ones(2)), (Disjunct(np.array([[1.0, -1.0]]), np.array([threshold])),))
    prop = Property(2, 2, (case,))
    config = VerifyConfig(timeout=30, attack_restarts=2, attack_steps=5, batch_size=32, bab=bab)
    result = verify(graph, prop, config)
    assert result.bab_modes in ([], [bab])
    if seed % 2 == 0:
        assert result.verdict is Verdict.SAT
        x = torch.tensor(result.counterexample.x, dtype=torch.float32)
        out = graph(x.view(1, 2))[0]
        assert (out[0] - out[1]).item() <= threshold
    else:
        # 401² samples bound the true minimum to within the net's Lipschitz constant × grid step; 0.02 is far
        # more than that on these nets, so the property holds and a complete verifier must prove it.
        assert result.verdict is Verdict.UNSAT


def test_property_of_the_wrong_size_is_rejected():
    graph = _random_net(0)
    case = Case(InputBox(np.zeros(3), np.ones(3)), (Disjunct(np.array([[1.0, -1.0]]), np.array([0.0])),))
    with pytest.raises(ValueError, match="3 inputs"):
        verify(graph, Property(3, 2, (case,)))


def test_an_unconstrained_disjunct_is_sat_at_once():
    graph = _random_net(1)
    case = Case(InputBox(-np.ones(2), np.ones(2)), (Disjunct(np.zeros((0, 2)), np.zeros(0)),))
    assert verify(graph, Property(2, 2, (case,))).verdict is Verdict.SAT


@pytest.mark.parametrize(
    ("field", "value"), [("timeout", 0), ("batch_size", 0), ("alpha_iterations", -1), ("method", "dreams")]
)
def test_bad_config_is_rejected(field, value):
    with pytest.raises(ValueError):
        VerifyConfig(**{field: value})


@needs_mnist
def test_cli_writes_result_and_report(tmp_path, capsys):
    result, report = tmp_path / "out.txt", tmp_path / "report.json"
    onnx, vnnlib = MNIST / "onnx" / "mnist-net_256x2.onnx", MNIST / "vnnlib" / "prop_1_0.03.vnnlib"
    with pytest.raises(SystemExit) as exit_info:
        fedshard_main(
            ["verify", str(onnx), str(vnnlib), "--timeout", "30", "--result", str(result), "--report", str(report)]
        )
    assert exit_info.value.code == 0
    lines = result.read_text().splitlines()
    assert lines[0] == "sat" and lines[1].startswith("((X_0 ")
    data = json.loads(report.read_text())
    assert data["verdict"] == "sat" and data["counterexample_check"] == "ok" and data["peak_memory_bytes"] > 0
    assert set(data["times_s"]) >= {"load", "attack"}


@needs_mnist
def test_cli_instances_scores_a_benchmark(tmp_path, capsys):
    instances = tmp_path / "instances.csv"
    rows = [
        "onnx/mnist-net_256x2.onnx,vnnlib/prop_0_0.03.vnnlib,60",
        "onnx/mnist-net_256x2.onnx,vnnlib/prop_1_0.03.vnnlib,60",
    ]
    instances.write_text("\n".join(rows) + "\n")
    for sub in ("onnx", "vnnlib"):
        (tmp_path / sub).symlink_to(MNIST / sub)
    results = tmp_path / "results.csv"
    with pytest.raises(SystemExit) as exit_info:
        fedshard_main(
            [
                "verify",
                "--instances",
                str(instances),
                "--results",
                str(results),
                "--expected",
                str(MNIST / "expected_verdicts.csv"),
            ]
        )
    assert exit_info.value.code == 0
    table = list(csv.DictReader(results.open()))
    assert [r["verdict"] for r in table] == ["unsat", "sat"]
    assert [r["score"] for r in table] == ["10", "10"] and table[1]["counterexample_ok"] == "yes"
    out = capsys.readouterr().out
    assert "total" in out and "α,β-CROWN (VNN-COMP 2022)" in out
    # The tables can be printed again from the results file alone.
    assert verify_main(["--summarise", str(results), "--expected", str(MNIST / "expected_verdicts.csv")]) == 0
    again = capsys.readouterr().out
    total = again.splitlines()[-1].split()
    assert total[:8] == ["total", "2", "1", "1", "0", "0", "0", "0"] and total[-1] == "20"


def test_bad_files_give_clear_errors(tmp_path, capsys):
    bad_onnx = tmp_path / "net.onnx"
    bad_onnx.write_bytes(b"not a model")
    prop = tmp_path / "p.vnnlib"
    prop.write_text("(declare-const X_0 Real)\n(assert (<= X_0 1.0))\n")
    with pytest.raises(SystemExit) as exit_info:
        fedshard_main(["verify", str(bad_onnx), str(prop)])
    assert exit_info.value.code == 2
    assert "not an ONNX model" in capsys.readouterr().err


def test_an_unsupported_model_answers_unknown_with_the_reason(tmp_path, capsys):
    import onnx
    from onnx import TensorProto, helper

    graph = helper.make_graph(
        [helper.make_node("Erf", ["x"], ["y"], name="squash")],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 2])],
    )
    model = tmp_path / "erf.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)]), str(model))
    prop = tmp_path / "p.vnnlib"
    prop.write_text(
        "(declare-const X_0 Real)\n(declare-const X_1 Real)\n(declare-const Y_0 Real)\n(declare-const Y_1 Real)\n"
        "(assert (>= X_0 0))\n(assert (<= X_0 1))\n(assert (>= X_1 0))\n(assert (<= X_1 1))\n(assert (>= Y_0 Y_1))\n"
    )
    result = verify_files(model, prop)
    assert result.verdict is Verdict.UNKNOWN and "'Erf' at node 'squash'" in result.reason
    out, report = tmp_path / "out.txt", tmp_path / "report.json"
    assert verify_main([str(model), str(prop), "--result", str(out), "--report", str(report)]) == 0
    assert out.read_text() == "unknown\n"
    assert "Erf" in json.loads(report.read_text())["reason"]
    assert "Erf" in capsys.readouterr().out


@needs_mnist
def test_an_internal_error_is_unknown_with_the_reason_not_a_crash(monkeypatch):
    from lightning_fedshard.verify import verifier

    def broken(*args, **kwargs):
        raise RuntimeError("a bug")

    monkeypatch.setattr(verifier, "intermediate_bounds", broken)
    onnx, vnnlib = MNIST / "onnx" / "mnist-net_256x2.onnx", MNIST / "vnnlib" / "prop_0_0.03.vnnlib"
    config = VerifyConfig(attack_restarts=1, attack_steps=1)
    with pytest.raises(RuntimeError, match="a bug"):  # the library call raises ...
        verify(verifier.load_onnx(onnx), read_vnnlib(onnx.parent.parent / "vnnlib" / vnnlib.name), config)
    result = verify_files(onnx, vnnlib, config)  # ... the file-level call, whose answer goes to a result file
    assert result.verdict is Verdict.UNKNOWN and result.reason == "internal error: RuntimeError: a bug"


def test_a_bad_instance_is_reported_and_the_run_goes_on(tmp_path):
    instances = tmp_path / "instances.csv"
    instances.write_text("missing.onnx,missing.vnnlib,5\n")
    (instance,) = read_instances(instances)
    result = run_instance(instance, VerifyConfig())
    assert result.verdict is Verdict.ERROR and "missing.onnx" in result.error and result.onnx.endswith("missing.onnx")
    assert summarise([result]).splitlines()[-1].split()[:7] == ["total", "1", "0", "0", "0", "0", "1"]


@needs_mnist
def test_cli_instances_rejects_a_network_the_csv_lacks(capsys):
    code = verify_main(["--instances", str(MNIST / "instances.csv"), "--networks", "resnet.onnx"])
    assert code == 2 and "no rows for ['resnet.onnx']" in capsys.readouterr().err


def test_malformed_instances_csv(tmp_path):
    bad = tmp_path / "instances.csv"
    bad.write_text("a.onnx,b.vnnlib\n")
    with pytest.raises(ValueError, match="instances.csv:1"):
        read_instances(bad)


def test_a_long_crown_pass_stops_at_the_deadline():
    # A ResNet whose root CROWN takes ~10 s here (one pass alone ~8 s): the deadline is checked between the
    # operator steps of a pass, so a 2 s budget ends within a step of it, not after the pass.
    import time

    from lightning_fedshard.verify.spec import local_robustness
    from tests.verify.nets import resnet

    graph = resnet((3, 32, 32), width=32)
    x = torch.rand(1, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    y = graph(x)[0]
    prop = local_robustness(x.flatten().numpy(), 0.002, int(y.argmax()), y.numel())
    start = time.monotonic()
    result = verify(graph, prop, VerifyConfig(timeout=2.0, attack_restarts=5, attack_steps=5))
    assert result.verdict is Verdict.TIMEOUT
    assert time.monotonic() - start < 2.0 + 1.5
