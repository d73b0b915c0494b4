"""``fedshard bench fuzz``: its judge on hand-made answers, its determinism, and fixed-seed runs of it that the
verifier must pass — every operator, every in-process method, and the sharded strategies on a small batch."""

from __future__ import annotations

import json
import os

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from lightning_fedshard.bench import fuzz
from lightning_fedshard.bench.fuzz import CaseJob, Failure, OnnxForward, Row, float64_outputs, judge, vnnlib_text
from lightning_fedshard.bench.fuzz_graphs import OPERATORS
from lightning_fedshard.verify import Counterexample, Verdict, VerificationResult, read_vnnlib

pytest.importorskip("onnxruntime")

TIMEOUT = 2.0


@pytest.fixture
def affine(tmp_path):
    """``y = 2·x0 − x1 + 0.5`` on ``[0, 1]²`` with the unsafe set ``y ≥ 2``, which ``x = (1, 0)`` reaches (2.5)."""
    weight = numpy_helper.from_array(np.array([[2.0], [-1.0]], dtype=np.float32), "W")
    bias = numpy_helper.from_array(np.array([0.5], dtype=np.float32), "b")
    graph = helper.make_graph(
        [helper.make_node("Gemm", ["x", "W", "b"], ["y"])],
        "affine",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 1])],
        [weight, bias],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)]), tmp_path / "model.onnx")
    text = vnnlib_text(np.zeros(2), np.ones(2), 1, [[Row(((0, 1.0),), ">=", 2.0)]], "test")
    (tmp_path / "prop.vnnlib").write_text(text)
    return read_vnnlib(tmp_path / "prop.vnnlib"), OnnxForward(tmp_path / "model.onnx")


def kinds(failures: list[Failure]) -> list[str]:
    return [f.kind for f in failures]


def test_the_judge_flags_unsat_where_a_known_witness_violates_the_property(affine):
    prop, forward = affine
    witness_y = forward(np.array([1.0, 0.0]))
    assert witness_y.tolist() == [2.5]
    unsat = VerificationResult(Verdict.UNSAT, decided_by="crown")
    assert kinds(judge(unsat, "", 0.1, TIMEOUT, prop, forward, witness_y)) == ["wrong-unsat"]
    # On the boundary (y = 2 exactly) the witness still violates: the unsafe set is closed.
    assert kinds(judge(unsat, "", 0.1, TIMEOUT, prop, forward, np.array([2.0]))) == ["wrong-unsat"]
    # No witness known, or one that is safe: nothing to say about unsat.
    assert judge(unsat, "", 0.1, TIMEOUT, prop, forward) == []
    assert judge(unsat, "", 0.1, TIMEOUT, prop, forward, np.array([1.99])) == []


def test_a_wrong_unsat_says_whether_a_bound_is_unsound_or_onnxruntime_rounded(affine):
    prop, forward = affine
    unsat = VerificationResult(Verdict.UNSAT)
    (unsound,) = judge(unsat, "", 0.1, TIMEOUT, prop, forward, np.array([2.5]), np.array([2.5]))
    (rounded,) = judge(unsat, "", 0.1, TIMEOUT, prop, forward, np.array([2.0]), np.array([1.9999999]))
    assert unsound.real is True and "a bound is unsound" in unsound.detail
    assert rounded.real is False and "onnxruntime's rounding" in rounded.detail


def test_the_float64_twin_computes_in_float64_but_keeps_the_models_float16_casts(tmp_path):
    """``y = [x + 1e-8, float16(x)]``: float32 drops the 1e-8, float64 keeps it; the Cast to float16 rounds in
    both (a rounding of the model's own, not onnxruntime's)."""
    nodes = [
        helper.make_node("Add", ["x", "tiny"], ["a"]),
        helper.make_node("Cast", ["x"], ["h"], to=TensorProto.FLOAT16),
        helper.make_node("Cast", ["h"], ["b"], to=TensorProto.FLOAT),
        helper.make_node("Concat", ["a", "b"], ["y"], axis=1),
    ]
    graph = helper.make_graph(
        nodes,
        "twin",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 1])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 2])],
        [numpy_helper.from_array(np.array([1e-8], dtype=np.float32), "tiny")],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)]), tmp_path / "m.onnx")
    x = np.array([np.float32(1000.3)], dtype=np.float64)  # a witness is a point of the input's type
    rounded, exact = OnnxForward(tmp_path / "m.onnx")(x), float64_outputs(tmp_path / "m.onnx", x)
    assert rounded[0] == x[0] and exact[0] == x[0] + float(np.float32(1e-8))
    assert rounded[1] == exact[1] == 1000.5  # float16's spacing at 1000 is 0.5


def test_the_judge_passes_a_sat_that_replays_and_flags_one_that_does_not(affine):
    prop, forward = affine
    good = np.array([1.0, 0.0])
    correct = VerificationResult(Verdict.SAT, Counterexample(good, forward(good)), counterexample_check="ok")
    assert judge(correct, "", 0.1, TIMEOUT, prop, forward) == []
    safe_point = np.array([0.0, 1.0])  # y = −0.5: not in the unsafe set
    wrong_point = VerificationResult(Verdict.SAT, Counterexample(safe_point, forward(safe_point)))
    assert kinds(judge(wrong_point, "", 0.1, TIMEOUT, prop, forward)) == ["bad-counterexample"]
    made_up_outputs = VerificationResult(Verdict.SAT, Counterexample(safe_point, np.array([3.0])))
    assert kinds(judge(made_up_outputs, "", 0.1, TIMEOUT, prop, forward)) == ["bad-counterexample"]
    outside_the_box = VerificationResult(Verdict.SAT, Counterexample(np.array([1.5, 0.0]), np.array([3.5])))
    assert kinds(judge(outside_the_box, "", 0.1, TIMEOUT, prop, forward)) == ["bad-counterexample"]
    # The verifier's own replay failed (it then answers unknown): a bug all the same.
    replay_failed = VerificationResult(Verdict.UNKNOWN, counterexample_check="output mismatch 0.3 > 0.0001")
    assert kinds(judge(replay_failed, "", 0.1, TIMEOUT, prop, forward)) == ["bad-counterexample"]


def test_the_judge_flags_internal_errors_and_overtime(affine):
    prop, forward = affine
    crashed = VerificationResult(Verdict.UNKNOWN, reason="internal error: IndexError: out of range")
    assert kinds(judge(crashed, "", 0.1, TIMEOUT, prop, forward)) == ["internal-error"]
    raised = judge(None, "Traceback (most recent call last):\nValueError: boom\n", 0.1, TIMEOUT, prop, forward)
    assert raised == [Failure("internal-error", "ValueError: boom")]
    group_error = VerificationResult(Verdict.ERROR, error="ranks disagree on the verdict")
    assert kinds(judge(group_error, "", 0.1, TIMEOUT, prop, forward)) == ["internal-error"]
    assert kinds(judge(VerificationResult(Verdict.TIMEOUT), "", TIMEOUT + 1.5, TIMEOUT, prop, forward)) == ["overtime"]
    # Answers that are allowed: unknown, a timeout kept, unsat without a witness.
    for verdict in (Verdict.UNKNOWN, Verdict.TIMEOUT, Verdict.UNSAT):
        assert judge(VerificationResult(verdict), "", TIMEOUT + 0.5, TIMEOUT, prop, forward) == []


def test_cases_are_the_same_for_the_same_seed_and_cover_every_operator(tmp_path):
    """Models, boxes, witnesses and properties depend on the seed alone (no method runs here)."""
    drawn = {}
    for run in ("first", "second"):
        for index in (0, 19, 53):  # Gemm, Sign, Cast: case i starts with operator i mod 57
            job = CaseJob(seed=7, index=index, work=tmp_path / run, out=tmp_path / "out", methods=(), timeout=TIMEOUT)
            case = fuzz.fuzz_case(job)
            files = [case.folder / "model.onnx", *(p.path for p in case.properties)]
            drawn.setdefault(index, []).append([f.read_bytes() for f in files])
            assert case.model.operators[0] == list(OPERATORS)[index] and len(case.properties) == 3
            assert all(p.witnessed for p in case.properties if p.kind in ("at", "inside"))
    assert all(first == second for first, second in drawn.values())


def test_a_draw_with_an_empty_output_is_discarded(tmp_path, monkeypatch):
    """Seed 1002's case 1286 first drew a Slice to nothing: the property of zero outputs, ``(+ )``, ended the run.
    (Drawn from the 57 layers before the counting head: case ``i`` starts with layer ``i`` mod their number.)"""
    monkeypatch.setattr(fuzz, "OPERATORS", {k: v for k, v in fuzz.OPERATORS.items() if k != "ArgMax/ArgMin(count)"})
    job = CaseJob(seed=1002, index=1286, work=tmp_path, out=tmp_path / "out", methods=(), timeout=TIMEOUT)
    case = fuzz.fuzz_case(job)
    assert case.discarded[0] == "no outputs" and len(case.properties) == 3


def _crash_on_case_one(job: CaseJob) -> fuzz.Case:
    """A worker's job that dies as a segfault in onnxruntime would (seed 2005 lost a chunk of 2,500 cases to one)."""
    if job.index == 1:
        os.abort()
    return fuzz.Case(job.index, job.seed, 1, [], job.work)


@pytest.mark.multiproc  # worker processes
def test_a_worker_that_dies_costs_its_case_not_the_run(tmp_path):
    jobs = [CaseJob(0, i, tmp_path / "work", tmp_path / "out", (), TIMEOUT) for i in range(4)]
    cases = list(fuzz._cases(jobs, 2, _crash_on_case_one))
    assert [case.index for case in cases] == [0, 1, 2, 3]  # the bystander in flight beside it done again
    assert [[f.kind for f in run.failures] for run in cases[1].runs] == [["worker-crash"]]
    assert not any(case.runs for case in cases if case.index != 1)
    assert json.loads((tmp_path / "out" / "failures" / "case00001-worker-crash" / "case.json").read_text())["case"] == 1
    summary = fuzz.summarise(cases, [], 1.0, [])
    assert summary["failed_runs"] == 1 and summary["failures_by_kind"]["worker-crash"]["runs"] == 1


def _fuzz(tmp_path, capsys, *args: str) -> tuple[int, dict, str]:
    """``fedshard bench fuzz ARGS`` with seed 0: its exit status, ``summary.json`` and printed table."""
    status = fuzz.main(["--seed", "0", "--out", str(tmp_path), *args])
    return status, json.loads((tmp_path / "summary.json").read_text()), capsys.readouterr().out


@pytest.mark.multiproc  # two worker processes
def test_a_fixed_seed_fuzz_run_finds_no_failure(tmp_path, capsys):
    """90 cases (every operator at least once), 540 runs: each property by two of the in-process methods in turn,
    so that each method verifies about 80 properties, of every kind. About a minute on two cores."""
    args = ("--cases", "90", "--timeout", "0.5", "--methods-per-property", "2", "--workers", "2")
    status, summary, report = _fuzz(tmp_path, capsys, *args)
    assert summary["cases"] >= 85 and all(e["cases"] for e in summary["operators"].values()), report
    assert status == 0 and summary["failed_runs"] == 0, report


@pytest.mark.multiproc  # two ranks
def test_the_sharded_strategies_find_no_failure_on_a_small_batch(tmp_path, capsys):
    """Two cases' six properties with each of fsdp, tp and fsdp+rows on two ranks, in one launch (≤ 30 s; the first
    group that dies ends the run, and fails the test). In process, IBP alone (its failures are the other test's)."""
    sharded = ("--sharded", "--sharded-cases", "2", "--sharded-relaunches", "0", "--timeout", "0.5")
    _, summary, report = _fuzz(tmp_path, capsys, "--cases", "6", "--methods", "ibp", "--workers", "1", *sharded)
    runs = {
        strategy: summary["methods"].get(strategy, {"runs": 0, "failed": 0}) for strategy in ("fsdp", "tp", "fsdp+rows")
    }
    assert summary["sharded_skipped"] == 0 and all(r["runs"] == 6 for r in runs.values()), report
    assert all(r["failed"] == 0 for r in runs.values()), report
