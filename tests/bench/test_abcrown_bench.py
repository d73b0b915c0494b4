"""``fedshard bench abcrown``: α,β-CROWN's CSV scored as ours are — its ``sat`` counts only where the counterexample
it wrote replays on the ONNX model (onnxruntime) — the instances only one tool decides, and the time ratio."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

from lightning_fedshard.bench import abcrown
from lightning_fedshard.verify import Counterexample, Verdict, VerifyConfig, verify_files, write_result
from lightning_fedshard.verify.instances import read_expected, read_results, summarise, write_results

MNIST = Path(__file__).resolve().parents[2].parent / "shared" / "vnncomp" / "mnist_fc_2022"
pytestmark = pytest.mark.skipif(not MNIST.is_dir(), reason="needs ../shared/vnncomp/mnist_fc_2022")
NET = "onnx/mnist-net_256x2.onnx"
SAT, UNSAT = "vnnlib/prop_1_0.03.vnnlib", "vnnlib/prop_0_0.03.vnnlib"  # expected: sat, unsat


def _runner_output(folder: Path, rows: list[tuple[str, str, str, float]], files: dict[str, str]) -> Path:
    """What ``run_abcrown.py --out folder/ab.csv`` leaves: the CSV, and a result file per instance in
    ``ab.csv.logs/`` (``files[vnnlib]``: its text)."""
    folder.mkdir(exist_ok=True)
    path, logs = folder / "ab.csv", folder / "ab.csv.logs"
    logs.mkdir()
    with path.open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["onnx", "vnnlib", "result", "wall_s"])
        for i, row in enumerate(rows):
            writer.writerow(row)
            if row[1] in files:
                (logs / f"{i:04d}_{Path(row[0]).name}_{Path(row[1]).name}.results.txt").write_text(files[row[1]])
    return path


def test_a_sat_counts_only_where_its_counterexample_replays(tmp_path):
    found = verify_files(MNIST / NET, MNIST / SAT, VerifyConfig(timeout=30))
    assert found.verdict is Verdict.SAT
    outputs = found.counterexample.y.copy()
    outputs[0] += 0.5  # not what the network computes at x
    expected = read_expected(MNIST / "expected_verdicts.csv")
    for name, cex, wrong in (
        ("good", found.counterexample, 0),
        ("bad", Counterexample(found.counterexample.x, outputs), 1),
    ):
        write_result(tmp_path / f"{name}.txt", Verdict.SAT, cex)
        rows = [(NET, SAT, "sat", 7.0), (NET, UNSAT, "unsat", 8.0)]
        path = _runner_output(tmp_path / name, rows, {SAT: (tmp_path / f"{name}.txt").read_text()})
        theirs = abcrown.read_abcrown(path, MNIST)
        assert [r.verdict for r in theirs] == [Verdict.SAT, Verdict.UNSAT]
        assert (theirs[0].counterexample_check == "ok") is not bool(wrong)
        total = summarise(theirs, expected).splitlines()[-1].split()
        assert (int(total[7]), int(total[-1])) == (wrong, -140 if wrong else 20)


def test_a_sat_without_its_result_file_is_wrong(tmp_path):
    path = _runner_output(tmp_path, [(NET, SAT, "sat", 7.0)], {})
    (result,) = abcrown.read_abcrown(path, MNIST)
    assert result.counterexample_check.startswith("0 result files")


def test_the_instances_only_one_tool_decides_and_the_time_ratio(tmp_path):
    expected = read_expected(MNIST / "expected_verdicts.csv")
    ours = []
    for vnnlib, seconds in ((UNSAT, 0.5), ("vnnlib/prop_3_0.03.vnnlib", 2.0)):
        result = verify_files(MNIST / NET, MNIST / vnnlib, VerifyConfig(timeout=30))
        assert result.verdict is Verdict.UNSAT
        result.onnx, result.vnnlib, result.time_s = NET, vnnlib, seconds
        ours.append(result)
    write_results(tmp_path / "ours.csv", ours, expected)
    rows = [(NET, UNSAT, "timeout", 120.5), (NET, "vnnlib/prop_3_0.03.vnnlib", "unsat", 8.0)]
    text = abcrown.compare(
        read_results(tmp_path / "ours.csv"), abcrown.read_abcrown(_runner_output(tmp_path, rows, {}), MNIST), expected
    )
    assert "decided by one tool only (1):" in text
    assert "ours       mnist-net_256x2.onnx prop_0_0.03.vnnlib: ours unsat 0.5 s, α,β-CROWN timeout 120.5 s" in text
    assert "both decide 1: wall time ours / α,β-CROWN median 0.25 (min 0.25, max 0.25)" in text
