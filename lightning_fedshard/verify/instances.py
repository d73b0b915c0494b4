"""VNN-COMP benchmark folders: read ``instances.csv``, run every instance, check and score the answers."""

from __future__ import annotations

import csv
import statistics
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from lightning_fedshard.verify.config import VerifyConfig
from lightning_fedshard.verify.verifier import VerificationResult, verify_files

__all__ = [
    "Instance",
    "InstanceResult",
    "read_instances",
    "read_results",
    "reference_results",
    "run_instances",
    "score_answer",
    "select_instances",
    "summarise",
    "write_results",
]

#: VNN-COMP 2022 scoring: a correct answer earns 10 points, a wrong one costs 150.
CORRECT_POINTS, WRONG_PENALTY = 10, -150


@dataclass(frozen=True)
class Instance:
    """One row of ``instances.csv``: paths resolved against the CSV's folder, and the timeout in seconds."""

    onnx: Path
    vnnlib: Path
    timeout: float


@dataclass
class InstanceResult:
    """One result row: the verdict, wall time (load included), whether the counterexample replayed, the
    expected verdict where known, and the points scored."""

    onnx: str
    vnnlib: str
    verdict: str
    time_s: float
    decided_by: str = ""
    counterexample_ok: str = ""
    expected: str = ""
    wrong: bool = False
    score: int = 0
    error: str = ""
    #: Why an ``unknown`` was not even tried (an operator the verifier cannot represent), as the report says.
    reason: str = ""


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


def reference_results(path: str | Path, rows: list[InstanceResult]) -> list[InstanceResult]:
    """The published α,β-CROWN result (columns ``abcrown_result``, ``abcrown_time_s`` of the expected-verdicts
    CSV) for each of ``rows`` that has one, scored like ours, to print next to our table."""
    with Path(path).open(newline="") as f:
        published = {(Path(r["onnx"]).name, Path(r["vnnlib"]).name): r for r in csv.DictReader(f)}
    reference = []
    for row in rows:
        entry = published.get((row.onnx, row.vnnlib))
        if entry is None or "abcrown_result" not in entry:
            continue
        verdict = entry["abcrown_result"]
        # Its counterexamples were validated by the organisers; a sat that contradicts the consensus is wrong.
        wrong, score = score_answer(verdict, entry["expected"], "yes")
        reference.append(
            InstanceResult(
                row.onnx,
                row.vnnlib,
                verdict,
                float(entry["abcrown_time_s"]),
                expected=entry["expected"],
                wrong=wrong,
                score=score,
            )
        )
    return reference


def score_answer(verdict: str, expected: str, counterexample_ok: str) -> tuple[bool, int]:
    """(wrong, points): a ``sat`` must carry a counterexample that replays; an answer contradicting a known
    verdict is wrong."""
    if verdict not in ("sat", "unsat"):
        return False, 0
    wrong = (verdict == "sat" and counterexample_ok != "yes") or (expected in ("sat", "unsat") and verdict != expected)
    return wrong, WRONG_PENALTY if wrong else CORRECT_POINTS


def run_instance(
    instance: Instance, config: VerifyConfig, expected: str = ""
) -> tuple[InstanceResult, VerificationResult | None]:
    """Verify one instance under its own timeout; a bad file becomes a row with its error, not an exception."""
    start = time.monotonic()
    row = InstanceResult(instance.onnx.name, instance.vnnlib.name, "error", 0.0, expected=expected)
    result = None
    try:
        result = verify_files(instance.onnx, instance.vnnlib, replace(config, timeout=instance.timeout))
        row.verdict, row.decided_by, row.reason = result.verdict.value, result.decided_by or "", result.reason
        if result.counterexample_check:
            row.counterexample_ok = (
                "yes" if result.counterexample_check == "ok" else f"no: {result.counterexample_check}"
            )
    except (OSError, ValueError) as error:
        row.error = f"{type(error).__name__}: {error}"
    row.time_s = round(time.monotonic() - start, 3)
    row.wrong, row.score = score_answer(row.verdict, expected, row.counterexample_ok)
    return row, result


def run_instances(
    instances: list[Instance], config: VerifyConfig, expected: dict[tuple[str, str], str] | None = None
) -> Iterator[InstanceResult]:
    """Run each instance in turn (yielding its row as soon as it is decided)."""
    for instance in instances:
        known = (expected or {}).get((instance.onnx.name, instance.vnnlib.name), "")
        yield run_instance(instance, config, known)[0]


def write_results(path: str | Path, rows: list[InstanceResult]) -> None:
    with Path(path).open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(asdict(rows[0]) if rows else InstanceResult.__annotations__))
        writer.writeheader()
        writer.writerows(asdict(row) for row in rows)


def read_results(path: str | Path) -> list[InstanceResult]:
    """Rows written by :func:`write_results` (to summarise runs again, or several shards of one benchmark)."""
    with Path(path).open(newline="") as f:
        return [
            InstanceResult(
                **{**r, "time_s": float(r["time_s"]), "wrong": r["wrong"] == "True", "score": int(r["score"])}
            )
            for r in csv.DictReader(f)
        ]


def summarise(rows: list[InstanceResult], by: str = "network") -> str:
    """Per network (``by="property"``: per VNN-LIB file): verified, falsified, unknown, timeouts, errors, wrong
    answers, the median time over all instances and over the decided ones; then the score."""
    if by not in ("network", "property"):
        raise ValueError(f"by must be 'network' or 'property', got {by!r}")
    lines = [
        (
            f"{by:<24} {'n':>3} {'verified':>8} {'falsified':>9} {'unknown':>7} {'timeout':>7} {'error':>5} "
            f"{'wrong':>5} {'median s':>8} {'decided':>7} {'score':>6}"
        )
    ]
    groups: dict[str, list[InstanceResult]] = {}
    for row in rows:
        groups.setdefault(row.onnx if by == "network" else row.vnnlib, []).append(row)
    for name, group in [*groups.items(), ("total", rows)]:
        count = {v: sum(r.verdict == v for r in group) for v in ("unsat", "sat", "unknown", "timeout", "error")}
        median = statistics.median(r.time_s for r in group) if group else 0.0
        decided = [r.time_s for r in group if r.verdict in ("sat", "unsat")]
        median_decided = statistics.median(decided) if decided else 0.0
        lines.append(
            f"{name:<24} {len(group):>3} {count['unsat']:>8} {count['sat']:>9} {count['unknown']:>7} "
            f"{count['timeout']:>7} {count['error']:>5} {sum(r.wrong for r in group):>5} {median:>8.2f} "
            f"{median_decided:>7.2f} {sum(r.score for r in group):>6}"
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
