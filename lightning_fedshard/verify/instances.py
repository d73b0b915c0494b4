"""VNN-COMP benchmark folders: read ``instances.csv``, run every instance, check and score the answers."""

from __future__ import annotations

import csv
import logging
import statistics
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from lightning_fedshard.verify.config import Verdict, VerifyConfig
from lightning_fedshard.verify.result import VerificationResult
from lightning_fedshard.verify.shard.plan import ShardPlan
from lightning_fedshard.verify.verifier import InstanceLoadError, verify_files

__all__ = [
    "RESULT_COLUMNS",
    "Instance",
    "read_expected",
    "read_instances",
    "read_results",
    "reference_results",
    "result_key",
    "run_instance",
    "run_instances",
    "score_answer",
    "select_instances",
    "summarise",
    "write_results",
]

#: VNN-COMP 2022 scoring: a correct answer earns 10 points, a wrong one costs 150.
CORRECT_POINTS, WRONG_PENALTY = 10, -150
#: The columns of a results CSV (:func:`write_results`): one row per instance, scored against its expected verdict.
RESULT_COLUMNS = (
    "onnx",
    "vnnlib",
    "verdict",
    "time_s",
    "decided_by",
    "counterexample_ok",
    "expected",
    "wrong",
    "score",
    "error",
    "reason",
)


@dataclass(frozen=True)
class Instance:
    """One row of ``instances.csv``: paths resolved against the CSV's folder, and the timeout in seconds."""

    onnx: Path
    vnnlib: Path
    timeout: float


def read_instances(path: str | Path) -> list[Instance]:
    """Rows ``onnx,vnnlib,timeout`` (no header), paths relative to the CSV's folder."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no instances file {path}")
    rows = []
    with path.open(newline="") as f:
        for line_no, row in enumerate(csv.reader(f), 1):
            if not row or row[0].startswith("#"):
                continue
            if len(row) != 3:
                raise ValueError(f"{path}:{line_no}: expected 'onnx,vnnlib,timeout', got {row}")
            try:
                timeout = float(row[2])
            except ValueError:
                raise ValueError(f"{path}:{line_no}: timeout {row[2]!r} is not a number") from None
            rows.append(Instance(path.parent / row[0].strip(), path.parent / row[1].strip(), timeout))
    return rows


def read_expected(path: str | Path) -> dict[tuple[str, str], str]:
    """``expected_verdicts.csv`` (header ``onnx,vnnlib,…,expected``) keyed by file names."""
    with Path(path).open(newline="") as f:
        return {(Path(r["onnx"]).name, Path(r["vnnlib"]).name): r["expected"] for r in csv.DictReader(f)}


def reference_results(path: str | Path, results: Sequence[VerificationResult]) -> list[VerificationResult]:
    """The published α,β-CROWN result (columns ``abcrown_result``, ``abcrown_time_s`` of the expected-verdicts
    CSV) for each of ``results`` that has one, to print and score next to our table."""
    with Path(path).open(newline="") as f:
        published = {(Path(r["onnx"]).name, Path(r["vnnlib"]).name): r for r in csv.DictReader(f)}
    reference = []
    for result in results:
        entry = published.get(result_key(result))
        if entry is None or "abcrown_result" not in entry:
            continue
        # Its counterexamples were validated by the organisers; a sat that contradicts the consensus is wrong.
        reference.append(
            VerificationResult(
                _verdict(entry["abcrown_result"], path),
                counterexample_check="ok",
                onnx=result.onnx,
                vnnlib=result.vnnlib,
                time_s=float(entry["abcrown_time_s"]),
            )
        )
    return reference


def score_answer(result: VerificationResult, expected: str = "") -> tuple[bool, int]:
    """(wrong, points) of ``result`` against the ``expected`` verdict (``""``: not known): a ``sat`` must carry a
    counterexample that replays; an answer contradicting a known verdict is wrong."""
    if result.verdict not in (Verdict.SAT, Verdict.UNSAT):
        return False, 0
    wrong = (result.verdict is Verdict.SAT and result.counterexample_check != "ok") or (
        expected in ("sat", "unsat") and result.verdict.value != expected
    )
    return wrong, WRONG_PENALTY if wrong else CORRECT_POINTS


def run_instance(
    instance: Instance, config: VerifyConfig, plan: ShardPlan | None = None, index: int = 0
) -> VerificationResult:
    """Verify one instance under its own timeout: :func:`~lightning_fedshard.verify.verifier.verify_files` with
    the instance's files, ``index`` and wall time (loading included) filled in.

    An instance that cannot be verified at all is an ``error`` result naming the error, not an exception: a
    timeout that is not a positive, finite number of seconds, and a file that cannot be read. In a sharded run
    (``plan``) only errors that every rank of the group raises are (those of loading, and of the timeout); any
    other ends the run, see :func:`~lightning_fedshard.verify.verifier.verify_files`.

    Example::

        result = run_instance(Instance(Path("net.onnx"), Path("prop.vnnlib"), 60.0), VerifyConfig())
        result.verdict, result.time_s, result.error
    """
    plan = plan or ShardPlan()
    start = time.monotonic()
    try:
        budget = replace(config, timeout=instance.timeout)
    except ValueError as error:  # a timeout that no run can keep, the same on every rank of a group
        result = VerificationResult.failed(error)
    else:
        result = _verify_files(instance, budget, plan)
    result.onnx, result.vnnlib, result.index = str(instance.onnx), str(instance.vnnlib), index
    result.time_s = time.monotonic() - start
    return result


def _verify_files(instance: Instance, config: VerifyConfig, plan: ShardPlan) -> VerificationResult:
    try:
        return verify_files(instance.onnx, instance.vnnlib, config, plan)
    except InstanceLoadError as error:  # raised on every rank of the group, before any collective
        return VerificationResult.failed(error)
    except Exception as error:
        if plan.sharded:
            # Mid-run, the other ranks wait in a collective of this instance: carrying on would mismatch them.
            # Failing ends their wait too (a peer's exit breaks their collective): all fail, none hang.
            raise
        if not isinstance(error, (OSError, ValueError)):  # not a bad file: keep the traceback for the bug report
            logging.getLogger(__name__).exception("verifying %s against %s failed", instance.onnx, instance.vnnlib)
        return VerificationResult.failed(error)


def run_instances(instances: Sequence[Instance], config: VerifyConfig) -> Iterator[VerificationResult]:
    """Run each instance in turn (yielding its result as soon as it is decided)."""
    for index, instance in enumerate(instances):
        yield run_instance(instance, config, index=index)


def result_key(result: VerificationResult) -> tuple[str, str]:
    """``(onnx file name, vnnlib file name)``: how results, expected verdicts and other tools' rows are matched."""
    return Path(result.onnx).name, Path(result.vnnlib).name


def _verdict(word: str, source: str | Path) -> Verdict:
    try:
        return Verdict(word)
    except ValueError:
        raise ValueError(f"{source}: unknown verdict {word!r}") from None


def write_results(
    path: str | Path, results: Sequence[VerificationResult], expected: dict[tuple[str, str], str] | None = None
) -> None:
    """One CSV row (:data:`RESULT_COLUMNS`) per result: file names, verdict, wall time, whether a counterexample
    replayed (``yes``, or ``no: why``), the expected verdict (from ``expected``, keyed by file names) and the
    points scored against it."""
    with Path(path).open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=RESULT_COLUMNS)
        writer.writeheader()
        for result in results:
            known = (expected or {}).get(result_key(result), "")
            wrong, score = score_answer(result, known)
            check = result.counterexample_check
            writer.writerow(
                {
                    "onnx": result_key(result)[0],
                    "vnnlib": result_key(result)[1],
                    "verdict": result.verdict.value,
                    "time_s": round(result.time_s, 3),
                    "decided_by": result.decided_by or "",
                    "counterexample_ok": ("yes" if check == "ok" else f"no: {check}") if check else "",
                    "expected": known,
                    "wrong": wrong,
                    "score": score,
                    "error": result.error,
                    "reason": result.reason,
                }
            )


def read_results(path: str | Path) -> list[VerificationResult]:
    """The results of a CSV written by :func:`write_results` (to summarise runs again, or several shards of one
    benchmark; the expected verdicts it was scored against: :func:`read_expected` of the same file)."""
    results = []
    with Path(path).open(newline="") as f:
        for row in csv.DictReader(f):
            check = row["counterexample_ok"]
            results.append(
                VerificationResult(
                    _verdict(row["verdict"], path),
                    decided_by=row["decided_by"] or None,
                    counterexample_check="ok" if check == "yes" else check.removeprefix("no: "),
                    reason=row["reason"],
                    error=row["error"],
                    onnx=row["onnx"],
                    vnnlib=row["vnnlib"],
                    time_s=float(row["time_s"]),
                )
            )
    return results


def summarise(
    results: Sequence[VerificationResult],
    expected: dict[tuple[str, str], str] | None = None,
    by: str = "network",
) -> str:
    """Per network (``by="property"``: per VNN-LIB file): verified, falsified, unknown, timeouts, errors, wrong
    answers (against ``expected``, keyed by file names), the median time over all instances and over the decided
    ones; then the score."""
    if by not in ("network", "property"):
        raise ValueError(f"by must be 'network' or 'property', got {by!r}")
    lines = [
        (
            f"{by:<24} {'n':>3} {'verified':>8} {'falsified':>9} {'unknown':>7} {'timeout':>7} {'error':>5} "
            f"{'wrong':>5} {'median s':>8} {'decided':>7} {'score':>6}"
        )
    ]
    groups: dict[str, list[VerificationResult]] = {}
    for result in results:
        groups.setdefault(result_key(result)[0 if by == "network" else 1], []).append(result)
    for name, group in [*groups.items(), ("total", list(results))]:
        count = {v: sum(r.verdict is v for r in group) for v in Verdict}
        scores = [score_answer(r, (expected or {}).get(result_key(r), "")) for r in group]
        median = statistics.median(r.time_s for r in group) if group else 0.0
        decided = [r.time_s for r in group if r.verdict in (Verdict.SAT, Verdict.UNSAT)]
        median_decided = statistics.median(decided) if decided else 0.0
        lines.append(
            f"{name:<24} {len(group):>3} {count[Verdict.UNSAT]:>8} {count[Verdict.SAT]:>9} "
            f"{count[Verdict.UNKNOWN]:>7} {count[Verdict.TIMEOUT]:>7} {count[Verdict.ERROR]:>5} "
            f"{sum(wrong for wrong, _ in scores):>5} {median:>8.2f} {median_decided:>7.2f} "
            f"{sum(points for _, points in scores):>6}"
        )
    return "\n".join(lines)


def select_instances(
    instances: Sequence[Instance],
    networks: Sequence[str] | None = None,
    limit: int | None = None,
    timeout: float | None = None,
) -> list[Instance]:
    """The rows of these ONNX file names (all when ``None``; a name without rows is an error), the first
    ``limit`` of them, each with ``timeout`` in place of its own where given (as ``fedshard verify --instances``
    does with ``--networks``, ``--limit`` and ``--timeout``)."""
    if networks:
        unknown = set(networks) - {i.onnx.name for i in instances}
        if unknown:
            raise ValueError(f"no rows for {sorted(unknown)}")
        instances = [i for i in instances if i.onnx.name in networks]
    if limit is not None:
        instances = instances[:limit]
    if timeout is not None:
        instances = [Instance(i.onnx, i.vnnlib, timeout) for i in instances]
    return instances
