"""Side by side with α,β-CROWN on the same instances: ``fedshard verify --instances`` results next to those of
``../shared/peers/abcrown/run_abcrown.py`` (its ``onnx,vnnlib,result,wall_s`` CSVs), scored the same way.

    fedshard bench abcrown --set ../shared/vnncomp/cifar_biasfield_2022 --ours ours.csv --abcrown ab.csv [ab2.csv]

Prints each tool's table (the columns of ``fedshard verify --summarise``, per network), the instances one tool
decides and the other does not, and, where both decide, the median ratio of their wall times (ours / theirs). Every
``sat`` of α,β-CROWN is checked as ours are: its counterexample, from the result file the runner keeps in
``CSV.logs/``, replays on the ONNX model with onnxruntime (tolerance 1e-4) or the answer scores as wrong. Without
``--ours`` it prints α,β-CROWN's table alone (for a set whose own run is recorded elsewhere).
"""

from __future__ import annotations

import argparse
import csv
import statistics
from collections.abc import Sequence
from pathlib import Path

from lightning_fedshard.verify import Verdict, VerificationResult, check_counterexample, read_vnnlib
from lightning_fedshard.verify.instances import read_expected, read_results, result_key, score_answer, summarise
from lightning_fedshard.verify.spec.counterexample import read_counterexample
from lightning_fedshard.verify.verifier import model_forward

__all__ = ["compare", "main", "read_abcrown"]

_DECIDED = (Verdict.SAT, Verdict.UNSAT)


def _replay(logs: Path, folder: Path, onnx: str, vnnlib: str) -> str:
    """``"ok"`` if the counterexample of α,β-CROWN's ``sat`` on this instance replays, else why not."""
    suffix = f"_{Path(onnx).name}_{Path(vnnlib).name}.results.txt"
    found = sorted(p for p in logs.glob("*.results.txt") if p.name.endswith(suffix)) if logs.is_dir() else []
    if len(found) != 1:
        return f"{len(found)} result files *{suffix} in {logs}"
    prop = read_vnnlib(folder / vnnlib)
    try:
        cex = read_counterexample(found[0], prop.num_inputs, prop.num_outputs)
    except ValueError as error:
        return str(error)
    return check_counterexample(cex, prop, model_forward(folder / onnx)).reason


def read_abcrown(path: str | Path, folder: str | Path) -> list[VerificationResult]:
    """The rows of a ``run_abcrown.py`` CSV as results (paths relative to the set ``folder``), every ``sat``'s
    counterexample replayed (:attr:`VerificationResult.counterexample_check`)."""
    path, folder = Path(path), Path(folder)
    logs = path.with_name(path.name + ".logs")
    results = []
    with path.open(newline="") as handle:
        for row in csv.DictReader(handle):
            try:
                verdict = Verdict(row["result"])
            except ValueError:
                raise ValueError(f"{path}: unknown result {row['result']!r}") from None
            check = _replay(logs, folder, row["onnx"], row["vnnlib"]) if verdict is Verdict.SAT else ""
            results.append(
                VerificationResult(
                    verdict,
                    onnx=row["onnx"],
                    vnnlib=row["vnnlib"],
                    time_s=float(row["wall_s"]),
                    counterexample_check=check,
                )
            )
    return results


def compare(
    ours: Sequence[VerificationResult], theirs: Sequence[VerificationResult], expected: dict[tuple[str, str], str]
) -> str:
    """Both tables, the instances only one tool decides (correctly), and the wall-time ratio where both do."""
    lines = ["ours", summarise(ours, expected), "", "α,β-CROWN", summarise(theirs, expected), ""]
    mine = {result_key(r): r for r in ours}

    def decided(result: VerificationResult) -> bool:
        return result.verdict in _DECIDED and not score_answer(result, expected.get(result_key(result), ""))[0]

    only, ratios = [], []
    for other in theirs:
        own = mine.get(result_key(other))
        if own is None:
            continue
        if decided(own) and decided(other):
            ratios.append(own.time_s / other.time_s)
        elif decided(own) or decided(other):
            only.append(
                f"  {'ours' if decided(own) else 'α,β-CROWN':<10} {result_key(own)[0]} {result_key(own)[1]}: ours "
                f"{own.verdict.value} {own.time_s:.1f} s, α,β-CROWN {other.verdict.value} {other.time_s:.1f} s"
            )
    lines.append(f"decided by one tool only ({len(only)}):")
    lines.extend(only or ["  none"])
    if ratios:
        lines.append(
            f"both decide {len(ratios)}: wall time ours / α,β-CROWN median {statistics.median(ratios):.2f} "
            f"(min {min(ratios):.2f}, max {max(ratios):.2f})"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="fedshard bench abcrown", description=__doc__.split("\n\n")[0])
    parser.add_argument("--set", type=Path, required=True, help="the VNN-COMP set folder the CSVs' paths are in")
    parser.add_argument("--ours", type=Path, nargs="*", default=[], help="fedshard verify --results CSVs")
    parser.add_argument("--abcrown", type=Path, nargs="+", required=True, help="run_abcrown.py --out CSVs")
    parser.add_argument("--expected", type=Path, help="expected verdicts (default: expected_verdicts.csv of --set)")
    args = parser.parse_args(argv)
    expected_path = args.expected or args.set / "expected_verdicts.csv"
    expected = read_expected(expected_path) if expected_path.is_file() else {}
    theirs = [result for path in args.abcrown for result in read_abcrown(path, args.set)]
    if not args.ours:
        print("α,β-CROWN", summarise(theirs, expected), sep="\n")
        return
    ours = [result for path in args.ours for result in read_results(path)]
    print(compare(ours, theirs, expected))


if __name__ == "__main__":
    main()
