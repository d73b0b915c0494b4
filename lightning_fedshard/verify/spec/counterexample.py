"""VNN-COMP counterexamples: the result-file format ``sat`` + ``((X_0 v) … (Y_0 v) …)`` and a checker that follows
the official scorer (``SCORING/counterexamples.py``): input inside the box, ONNX replay reproducing the claimed
outputs, and the replayed outputs inside an unsafe disjunct, all with tolerance 1e-4.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from lightning_fedshard.verify.config import Verdict
from lightning_fedshard.verify.spec.vnnlib import Property

__all__ = [
    "REPLAY_TOLERANCE",
    "CheckResult",
    "Counterexample",
    "check_counterexample",
    "format_counterexample",
    "read_counterexample",
    "write_result",
]

_ASSIGNMENT = re.compile(r"\(\s*([XY])_(\d+)\s+([^\s()]+)\s*\)")


# eq=False: generated ==/hash would fail on numpy fields. Not frozen: results carrying one pass through Lightning's
# predict loop, which rebuilds dataclasses field by field (``apply_to_collection``).
@dataclass(eq=False)
class Counterexample:
    """An input ``x`` (float64 ``[num_inputs]``) with the outputs ``y`` (float64 ``[num_outputs]``) claimed for it.

    >>> cex = Counterexample(np.array([0.5]), np.array([1.0, -2.0]))
    >>> print(format_counterexample(cex))
    ((X_0 0.5)
     (Y_0 1.0)
     (Y_1 -2.0))
    """

    x: np.ndarray
    y: np.ndarray


@dataclass(frozen=True)
class CheckResult:
    """Outcome of :func:`check_counterexample`; ``max_output_error`` is NaN when the replay was not reached.

    >>> CheckResult(True, "ok", 0.0, 0, 3).ok
    True
    """

    ok: bool
    reason: str
    max_output_error: float
    case_index: int | None
    disjunct_index: int | None


def format_counterexample(cex: Counterexample) -> str:
    """The VNN-COMP assignment block; ``repr`` of the float64 values makes it round-trip bit-exactly."""
    entries = [f"(X_{i} {float(v)!r})" for i, v in enumerate(np.ravel(cex.x))]
    entries += [f"(Y_{j} {float(v)!r})" for j, v in enumerate(np.ravel(cex.y))]
    return "(" + "\n ".join(entries) + ")"


def write_result(path: str | Path, verdict: Verdict | str, cex: Counterexample | None = None) -> None:
    """Write a VNN-COMP result file: the verdict line, followed for ``sat`` by the counterexample block. An
    ``error`` is no answer: it has no result file."""
    words = [v.value for v in Verdict if v is not Verdict.ERROR]
    if verdict not in words:
        raise ValueError(f"verdict must be one of {words}, got {verdict!r}")
    verdict = Verdict(verdict)
    if (verdict is Verdict.SAT) != (cex is not None):
        raise ValueError("a counterexample is required for 'sat' and not allowed otherwise")
    body = f"{verdict.value}\n" + (format_counterexample(cex) + "\n" if cex is not None else "")
    Path(path).write_text(body)


def read_counterexample(path_or_text: str | Path, num_inputs: int, num_outputs: int) -> Counterexample:
    """Read a bare ``((X_0 v) …)`` block or a ``sat`` result file (from a path, or given as text)."""
    is_text = isinstance(path_or_text, str) and ("(" in path_or_text or "\n" in path_or_text)
    text = path_or_text if is_text else Path(path_or_text).read_text()
    source = "<string>" if is_text else str(path_or_text)
    body = text.strip()
    if body and not body.startswith("("):
        verdict, body = [*body.split(maxsplit=1), ""][:2]
        if verdict != "sat":
            raise ValueError(f"{source}: result {verdict!r} carries no counterexample (expected 'sat')")
    leftover = _ASSIGNMENT.sub("", body).replace("(", "").replace(")", "").strip()
    if leftover:
        raise ValueError(f"{source}: unexpected text {leftover[:40]!r} in the counterexample")
    values = {"X": [None] * num_inputs, "Y": [None] * num_outputs}
    for kind, index, value in _ASSIGNMENT.findall(body):
        slots, i = values[kind], int(index)
        if i >= len(slots):
            raise ValueError(f"{source}: {kind}_{i} is out of range (expected {len(slots)} {kind} variables)")
        if slots[i] is not None:
            raise ValueError(f"{source}: {kind}_{i} is assigned twice")
        try:
            slots[i] = float(value)
        except ValueError:
            raise ValueError(f"{source}: {kind}_{i} has the non-numeric value {value!r}") from None
    for kind, slots in values.items():
        missing = [i for i, v in enumerate(slots) if v is None]
        if missing:
            raise ValueError(f"{source}: {len(missing)} {kind} variables missing, first {kind}_{missing[0]}")
    return Counterexample(np.array(values["X"], dtype=np.float64), np.array(values["Y"], dtype=np.float64))


#: How far (absolute) a row may be above its bound at a counterexample: the VNN-COMP scorer's tolerance.
REPLAY_TOLERANCE = 1e-4


def check_counterexample(
    cex: Counterexample, prop: Property, forward: Callable[[np.ndarray], np.ndarray], tol: float = REPLAY_TOLERANCE
) -> CheckResult:
    """Validate ``cex`` against ``prop`` like the VNN-COMP scorer; ``forward`` maps a flat x to the flat outputs."""
    x, claimed = np.asarray(cex.x, dtype=np.float64), np.asarray(cex.y, dtype=np.float64)
    if x.shape != (prop.num_inputs,) or claimed.shape != (prop.num_outputs,):
        return CheckResult(
            False,
            f"shape x{x.shape}/y{claimed.shape} does not match the property "
            f"({prop.num_inputs} inputs, {prop.num_outputs} outputs)",
            float("nan"),
            None,
            None,
        )
    if not np.all(np.isfinite(x)):
        i = int(np.flatnonzero(~np.isfinite(x))[0])
        return CheckResult(False, f"x[{i}]={float(x[i])!r} is not finite", float("nan"), None, None)
    if not prop.cases:
        return CheckResult(False, "the property has no cases, so nothing can violate it", float("nan"), None, None)
    # Boxes are matched within tol because tools print CEs with rounding at the box edge.
    excess = [np.max(np.maximum(case.box.lower - x, x - case.box.upper), initial=-np.inf) for case in prop.cases]
    inside = [c for c, e in enumerate(excess) if e <= tol]
    if not inside:
        box = prop.cases[int(np.argmin(excess))].box
        i = int(np.argmax(np.maximum(box.lower - x, x - box.upper)))
        reason = f"x[{i}]={float(x[i])!r} outside [{float(box.lower[i])!r}, {float(box.upper[i])!r}]"
        return CheckResult(False, reason, float("nan"), None, None)

    y = np.asarray(forward(x), dtype=np.float64).reshape(-1)
    if y.shape != claimed.shape:
        return CheckResult(
            False, f"forward returned {y.size} outputs, expected {claimed.size}", float("nan"), inside[0], None
        )
    error = float(np.max(np.abs(y - claimed), initial=0.0))
    if not error <= tol:  # also rejects NaN
        return CheckResult(False, f"output mismatch {error:.3g} > {tol:g}", error, inside[0], None)

    # The spec is judged on the replayed outputs, so a CE cannot pass with made-up y values.
    best = np.inf
    for c in inside:
        for d, disjunct in enumerate(prop.cases[c].disjuncts):
            violation = float(np.max(disjunct.matrix @ y - disjunct.rhs, initial=-np.inf))
            if violation <= tol:
                return CheckResult(True, "ok", error, c, d)
            best = min(best, violation)
    return CheckResult(
        False, f"no disjunct satisfied (best row violation {best:.3g} > {tol:g})", error, inside[0], None
    )
