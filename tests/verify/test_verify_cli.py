"""``fedshard verify`` on bad input, in this process on a tiny hand-built network: timeouts no run can keep, a NaN
weight, unwritable outputs, unreadable VNN-LIB files, a property that multiplies out too far; benchmark rows
that fail, and the exit status that says so; the ranks of a sharded group ending a load the same way."""

from __future__ import annotations

import csv
import json
import re
import types
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from lightning_fedshard.verify import Verdict, VerificationResult, VerifyConfig, verify_files
from lightning_fedshard.verify.cli import main as verify_main
from lightning_fedshard.verify.instances import read_expected, read_results, summarise, write_results
from lightning_fedshard.verify.spec import vnnlib
from lightning_fedshard.verify.verifier import InstanceLoadError

HEADER = "".join(f"(declare-const {v} Real)\n" for v in ("X_0", "X_1", "Y_0", "Y_1"))
BOX = "(assert (>= X_0 0))\n(assert (<= X_0 1))\n(assert (>= X_1 0))\n(assert (<= X_1 1))\n"
#: y = W2 relu(W1 x + b1): on [0, 1]², y_0 − y_1 = relu(x_0) ≥ 0, so "y_1 > y_0 + 1" is unsafe and never reached
SAFE = "(assert (>= Y_1 (+ Y_0 1)))\n"


def tiny_net(path: Path, w1: np.ndarray | None = None) -> Path:
    """2 → 2 → 2 ReLU net: ``y_0 = relu(x_0) + relu(x_1)``, ``y_1 = relu(x_1)``."""
    w1 = np.eye(2, dtype=np.float32) if w1 is None else w1
    weights = {"w1": w1, "b1": np.zeros(2, np.float32), "w2": np.float32([[1, 0], [1, 1]])}
    graph = helper.make_graph(
        [
            helper.make_node("Gemm", ["x", "w1", "b1"], ["h"], transB=1),
            helper.make_node("Relu", ["h"], ["r"]),
            helper.make_node("MatMul", ["r", "w2"], ["y"]),
        ],
        "tiny",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 2])],
        [numpy_helper.from_array(value, name) for name, value in weights.items()],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)]), str(path))
    return path


@pytest.fixture
def files(tmp_path: Path) -> tuple[Path, Path]:
    prop = tmp_path / "safe.vnnlib"
    prop.write_text(HEADER + BOX + SAFE)
    return tiny_net(tmp_path / "tiny.onnx"), prop


def run_cli(capsys, *args: str) -> tuple[int, str, str]:
    try:
        code = verify_main([str(a) for a in args])
    except SystemExit as exit_:  # argparse errors
        code = exit_.code
    out, err = capsys.readouterr()
    return code, out, err


def test_the_tiny_net_is_proven_safe(files, tmp_path, capsys):
    code, out, _ = run_cli(capsys, *files, "--timeout", "30", "--result", tmp_path / "out.txt")
    assert code == 0 and out.startswith("unsat") and (tmp_path / "out.txt").read_text() == "unsat\n"


@pytest.mark.parametrize("timeout", ["0", "-5", "nan", "inf", "soon"])
def test_a_timeout_that_no_run_can_keep_is_an_argparse_error(timeout, files, capsys):
    # 0 used to become 120 s (`args.timeout or 120.0`) and nan no deadline at all
    code, _, err = run_cli(capsys, *files, "--timeout", timeout)
    assert code == 2 and f"argument --timeout: must be a positive, finite number of seconds, got '{timeout}'" in err


@pytest.mark.parametrize("timeout", [0.0, float("nan"), float("inf")])
def test_the_config_rejects_such_timeouts_too(timeout):
    with pytest.raises(ValueError, match="positive, finite number of seconds"):
        VerifyConfig(timeout=timeout)


def test_failed_rows_are_written_and_make_the_exit_status_2(files, tmp_path, capsys):
    onnx_path, prop = files
    instances = tmp_path / "instances.csv"
    rows = [f"{onnx_path.name},{prop.name},30", f"{onnx_path.name},{prop.name},nan"]
    rows += [f"{onnx_path.name},{prop.name},0", f"missing.onnx,{prop.name},30"]
    instances.write_text("\n".join(rows) + "\n")
    results = tmp_path / "results.csv"
    code, out, _ = run_cli(capsys, "--instances", instances, "--results", results)
    assert code == 2  # was 0
    table = list(csv.DictReader(results.open()))
    assert [r["verdict"] for r in table] == ["unsat", "error", "error", "error"]
    assert "got nan" in table[1]["error"] and "got 0.0" in table[2]["error"]
    assert "no such ONNX file" in table[3]["error"] and "missing.onnx" in table[3]["error"]
    total = out.splitlines()[-1].split()
    assert total[:7] == ["total", "4", "1", "0", "0", "0", "3"]
    # --summarise of the rows says the same
    assert run_cli(capsys, "--summarise", results)[0] == 2


def test_a_nan_weight_is_an_error_not_a_proof(files, tmp_path, capsys):
    # the NaN weight used to make every bound NaN, and the answer unsat
    net = tiny_net(tmp_path / "nan.onnx", np.float32([[1, 0], [np.nan, 1]]))
    code, out, err = run_cli(capsys, net, files[1], "--result", tmp_path / "out.txt")
    assert code == 2 and out == "" and not (tmp_path / "out.txt").exists()
    assert f"error: OnnxLoadError: {net}: node 'h' (Linear) has 1 non-finite value(s) in its weight" in err


@pytest.mark.parametrize(
    ("option", "where", "message"),
    [
        ("--result", "missing/out.txt", "no such directory"),
        ("--report", "missing/report.json", "no such directory"),
        ("--result", ".", "is a directory"),
    ],
)
def test_an_output_that_cannot_be_written_fails_before_verifying(
    option, where, message, files, tmp_path, capsys, monkeypatch
):
    monkeypatch.setattr("lightning_fedshard.verify.cli.run_instance", lambda *a: pytest.fail("verified first"))
    code, _, err = run_cli(capsys, *files, option, tmp_path / where)
    assert code == 2 and f"{option} {tmp_path / where}: {message}" in err


def test_a_results_file_that_cannot_be_written_fails_before_verifying(files, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("lightning_fedshard.verify.cli.run_instances", lambda *a: pytest.fail("verified first"))
    (tmp_path / "instances.csv").write_text(f"{files[0].name},{files[1].name},30\n")
    code, _, err = run_cli(capsys, "--instances", tmp_path / "instances.csv", "--results", tmp_path / "no/r.csv")
    assert code == 2 and "--results" in err and "no such directory" in err


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (HEADER + BOX.replace("(<= X_1 1)", "(<= X_1 1e400)") + SAFE, r":8: \(<= X_1 1e400\) holds a number beyond"),
        (b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR\xff\xfe", "not a VNN-LIB text file"),
        (HEADER + BOX + "(assert " + "(or " * 20_000 + ")" * 20_001, "parentheses nest deeper than 100 levels"),
    ],
    ids=["bound-1e400", "binary", "nested-20000-deep"],
)
def test_an_unreadable_property_is_an_error_naming_the_file(text, message, files, tmp_path, capsys):
    prop = tmp_path / "bad.vnnlib"
    prop.write_bytes(text.encode() if isinstance(text, str) else text)
    code, _, err = run_cli(capsys, files[0], prop)
    assert code == 2 and err.startswith(f"fedshard verify: error: VnnlibError: {prop}"), err
    assert re.search(message, err), err


def and_of_ors(k: int) -> str:
    return HEADER + BOX + "(assert (and " + " ".join(f"(or (>= Y_0 {i}) (<= Y_1 {-i}))" for i in range(k)) + "))\n"


def test_an_and_of_40_ors_answers_unknown_with_the_reason(files, tmp_path, capsys):
    # 2^40 disjuncts: the expansion ran past --timeout 10 (and k = 20 took 2.5 GB)
    prop = tmp_path / "product.vnnlib"
    prop.write_text(and_of_ors(40))
    out_file, report = tmp_path / "out.txt", tmp_path / "report.json"
    code, out, _ = run_cli(capsys, files[0], prop, "--timeout", "10", "--result", out_file, "--report", report)
    assert code == 0 and out.startswith("unknown") and "1.1e+12 disjuncts" in out
    assert out_file.read_text() == "unknown\n"
    assert "multiply out" in json.loads(report.read_text())["reason"]


def test_an_expansion_that_outlasts_the_timeout_answers_timeout(files, tmp_path, monkeypatch):
    prop = tmp_path / "product.vnnlib"
    prop.write_text(and_of_ors(12))  # within the bound: 4,096 disjuncts
    monkeypatch.setattr(vnnlib, "time", types.SimpleNamespace(monotonic=lambda: float("inf")))  # always too late
    result = verify_files(files[0], prop, VerifyConfig(timeout=10))
    assert result.verdict is Verdict.TIMEOUT and "while expanding the output constraints" in result.reason


def test_results_read_back_score_as_written(tmp_path):
    results = [
        VerificationResult(Verdict.UNSAT, decided_by="crown", onnx="n/a.onnx", vnnlib="p/x.vnnlib", time_s=1.25),
        VerificationResult(Verdict.SAT, counterexample_check="ok", onnx="a.onnx", vnnlib="y.vnnlib", time_s=2.0),
        VerificationResult(Verdict.UNKNOWN, counterexample_check="output mismatch", onnx="a.onnx", vnnlib="z.vnnlib"),
        VerificationResult.failed(FileNotFoundError("gone")),
    ]
    results[3].onnx, results[3].vnnlib = "b.onnx", "w.vnnlib"
    expected = {("a.onnx", "x.vnnlib"): "unsat", ("a.onnx", "y.vnnlib"): "unsat"}  # y: our sat is wrong
    path = tmp_path / "results.csv"
    write_results(path, results, expected)
    rows = list(csv.DictReader(path.open()))
    assert [r["counterexample_ok"] for r in rows] == ["", "yes", "no: output mismatch", ""]
    assert [(r["wrong"], r["score"]) for r in rows] == [("False", "10"), ("True", "-150"), ("False", "0")] + [
        ("False", "0")
    ]
    again = read_results(path)
    assert [(r.verdict, r.counterexample_check, r.error, r.time_s) for r in again] == [
        (r.verdict, r.counterexample_check, r.error, round(r.time_s, 3)) for r in results
    ]
    assert summarise(again, read_expected(path)) == summarise(results, expected)


@pytest.mark.parametrize(
    ("theirs", "verdict"),
    [(("timeout", "slow.vnnlib: the deadline passed"), Verdict.TIMEOUT), (("unknown", "too big"), Verdict.UNKNOWN)],
)
def test_a_sharded_group_answers_what_any_rank_met_while_loading(theirs, verdict, files, monkeypatch):
    # this rank loads fine; rank 1 (its all_gather_object faked) met a deadline or an unsupported property
    monkeypatch.setattr("torch.distributed.get_world_size", lambda group=None: 2)
    monkeypatch.setattr("torch.distributed.all_gather_object", lambda out, mine, group=None: out.__setitem__(1, theirs))
    plan = types.SimpleNamespace(sharded=True, group=None)
    result = verify_files(*files, VerifyConfig(timeout=10), plan)
    assert result.verdict is verdict and result.reason == theirs[1]


def test_a_load_error_on_any_rank_raises_on_every_rank(files, monkeypatch):
    theirs = ("error", "OnnxLoadError: corrupt.onnx is not an ONNX model")
    monkeypatch.setattr("torch.distributed.get_world_size", lambda group=None: 2)
    monkeypatch.setattr("torch.distributed.all_gather_object", lambda out, mine, group=None: out.__setitem__(1, theirs))
    plan = types.SimpleNamespace(sharded=True, group=None)
    with pytest.raises(InstanceLoadError, match="rank 1 of the sharded group could not load the instance: OnnxLoad"):
        verify_files(*files, VerifyConfig(timeout=10), plan)


def test_the_first_attack_on_thousands_of_disjuncts_takes_fewer_restarts(files, tmp_path, monkeypatch):
    # 10,000 restarts × 49,152 rows made one attack step take 47 s of a 5 s timeout
    from lightning_fedshard.verify import verifier

    calls = []

    def recording(graph, spec, box, restarts, *args, **kwargs):
        calls.append((spec.num_rows, restarts))
        return attack(graph, spec, box, restarts, *args, **kwargs)

    attack = verifier.pgd_attack
    monkeypatch.setattr(verifier, "pgd_attack", recording)
    prop = tmp_path / "product.vnnlib"
    prop.write_text(and_of_ors(12))
    config = VerifyConfig(attack_steps=2)
    assert verify_files(files[0], files[1], config).verdict is Verdict.UNSAT
    assert verify_files(files[0], prop, config).verdict is Verdict.UNSAT  # only the OR for i = 0 is ever met
    assert calls == [(1, 10_000), (12 * 4096, verifier.ATTACK_MARGINS // (12 * 4096))]
