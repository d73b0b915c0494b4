"""VNN-LIB 1.0 reader (the SMT-LIB subset used by VNN-COMP 2022/2024), following the semantics of the official
``read_vnnlib_simple``: input constraints form boxes, output constraints a disjunction of polytopes ``A y <= b``
describing the *unsafe* set.
"""

from __future__ import annotations

import functools
import gzip
import itertools
import operator
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

__all__ = [
    "Case",
    "Disjunct",
    "InputBox",
    "Property",
    "VnnlibError",
    "local_robustness",
    "parse_vnnlib",
    "read_vnnlib",
]

_TOKEN = re.compile(r"\(|\)|[^\s()]+")
_VAR = re.compile(r"([XY])_(0|[1-9]\d*)")
_NUMBER = re.compile(r"[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?")


class VnnlibError(ValueError):
    """A malformed or unsupported VNN-LIB file; the message starts with ``source:line:`` where a line is known."""

    def __init__(self, message: str, source: str = "<string>", line: int | None = None) -> None:
        super().__init__(f"{source}:{line}: {message}" if line is not None else f"{source}: {message}")


@dataclass(frozen=True, eq=False)  # eq=False: generated ==/hash would fail on numpy fields
class InputBox:
    """Axis-aligned input set ``lower <= x <= upper`` (float64 arrays of shape ``[num_inputs]``).

    >>> box = InputBox(np.zeros(2), np.ones(2))
    >>> bool(np.all(box.upper - box.lower == 1.0))
    True
    """

    lower: np.ndarray
    upper: np.ndarray


@dataclass(frozen=True, eq=False)
class Disjunct:
    """One unsafe output polytope ``{y : matrix @ y <= rhs}``; with zero rows every output is unsafe.

    >>> d = Disjunct(np.array([[-1.0, 1.0]]), np.array([0.0]))  # y_1 - y_0 <= 0, i.e. y_0 >= y_1
    >>> bool(np.all(d.matrix @ np.array([2.0, 1.0]) <= d.rhs))
    True
    """

    matrix: np.ndarray
    rhs: np.ndarray


@dataclass(frozen=True, eq=False)
class Case:
    """An input box together with the disjunction of unsafe output sets that applies on it.

    >>> case = Case(InputBox(np.zeros(1), np.ones(1)), (Disjunct(np.zeros((0, 3)), np.zeros(0)),))
    >>> len(case.disjuncts)
    1
    """

    box: InputBox
    disjuncts: tuple[Disjunct, ...]


@dataclass(frozen=True, eq=False)
class Property:
    """A parsed property: violated (``sat``) iff for some case some ``x`` in its box maps into some disjunct.

    >>> prop = parse_vnnlib("(declare-const X_0 Real) (declare-const Y_0 Real)"
    ...                     "(assert (>= X_0 0)) (assert (<= X_0 1)) (assert (>= Y_0 5))")
    >>> prop.num_inputs, prop.num_outputs, prop.cases[0].disjuncts[0].matrix.tolist(), prop.cases[0].disjuncts[0].rhs
    (1, 1, [[-1.0]], array([-5.]))
    """

    num_inputs: int
    num_outputs: int
    cases: tuple[Case, ...]


def local_robustness(
    center: np.ndarray, eps: float, label: int, num_outputs: int, lower: float = 0.0, upper: float = 1.0
) -> Property:
    """The usual robustness property: some ``x`` with ``|x − center|∞ ≤ eps`` (clipped to ``[lower, upper]``)
    does not keep ``label`` the top output, i.e. one disjunct ``y_label − y_j ≤ 0`` per other output ``j``.

    >>> prop = local_robustness(np.full(2, 0.5), 0.1, label=0, num_outputs=3)
    >>> len(prop.cases[0].disjuncts), prop.cases[0].disjuncts[0].matrix.tolist()
    (2, [[1.0, -1.0, 0.0]])
    """
    center = np.asarray(center, dtype=np.float64).ravel()
    disjuncts = []
    for j in range(num_outputs):
        if j != label:
            row = np.zeros((1, num_outputs))
            row[0, label], row[0, j] = 1, -1
            disjuncts.append(Disjunct(row, np.zeros(1)))
    box = InputBox(np.clip(center - eps, lower, upper), np.clip(center + eps, lower, upper))
    return Property(center.size, num_outputs, (Case(box, tuple(disjuncts)),))


class _Node(list):
    """A parenthesised list that remembers the line of its opening parenthesis."""

    def __init__(self, line: int) -> None:
        super().__init__()
        self.line = line


@dataclass
class _Atom:
    """The linear constraint ``sum(xs[i] x_i) + sum(ys[j] y_j) + const <= 0`` from source line ``line``."""

    xs: dict[int, float]
    ys: dict[int, float]
    const: float
    line: int


def read_vnnlib(path: str | Path, num_inputs: int | None = None, num_outputs: int | None = None) -> Property:
    """Read a ``.vnnlib`` (or gzipped ``.vnnlib.gz``) file; see :func:`parse_vnnlib`."""
    path = Path(path)
    raw = path.read_bytes()
    if raw[:2] == b"\x1f\x8b":  # gzip magic, so a misnamed compressed file still reads
        raw = gzip.decompress(raw)
    return parse_vnnlib(raw.decode(), num_inputs, num_outputs, source=str(path))


def parse_vnnlib(
    text: str, num_inputs: int | None = None, num_outputs: int | None = None, source: str = "<string>"
) -> Property:
    """Parse VNN-LIB 1.0 text; ``num_inputs``/``num_outputs``, when given, must match the declarations."""
    decls, asserts = _commands(_read_sexprs(text, source), source)
    n_in = _count(decls, "X", num_inputs, "num_inputs", source)
    n_out = _count(decls, "Y", num_outputs, "num_outputs", source)
    lower, upper = np.full(n_in, -np.inf), np.full(n_in, np.inf)
    output_dnf: list[list[_Atom]] = [[]]
    for node in asserts:
        dnf = _to_dnf(node[1], node.line, decls, source)
        if len(dnf) == 1 and dnf[0] and all(a.xs and not a.ys for a in dnf[0]):
            for atom in dnf[0]:
                _tighten(atom, lower, upper, source)
        else:  # conjunction with the DNF so far: every pair of disjuncts combines
            output_dnf = [left + right for left, right in itertools.product(output_dnf, dnf)]

    cases: dict[tuple[bytes, bytes], tuple[InputBox, list[Disjunct]]] = {}
    for conjunct in output_dnf:
        box, disjunct = _split_conjunct(conjunct, lower, upper, n_out, decls, source)
        cases.setdefault((box.lower.tobytes(), box.upper.tobytes()), (box, []))[1].append(disjunct)
    return Property(n_in, n_out, tuple(Case(box, tuple(ds)) for box, ds in cases.values()))


def _commands(exprs: list, source: str) -> tuple[dict[str, int], list[_Node]]:
    """Split the top-level commands into declarations (name -> line) and asserts."""
    decls: dict[str, int] = {}
    asserts: list[_Node] = []
    for expr in exprs:
        if not isinstance(expr, _Node) or not expr or not isinstance(expr[0], str):
            raise VnnlibError(f"expected a command, got {_show(expr)}", source, getattr(expr, "line", None))
        if expr[0] == "declare-const":
            _declare(expr, decls, source)
        elif expr[0] == "assert":
            if len(expr) != 2:
                raise VnnlibError(f"assert takes exactly one expression, got {_show(expr)}", source, expr.line)
            asserts.append(expr)
        else:
            hint = " (VNN-LIB 2.0 is not supported)" if expr[0] in ("vnnlib-version", "declare-network") else ""
            raise VnnlibError(f"unknown command {_show(expr)}{hint}", source, expr.line)
    if not decls:
        raise VnnlibError(
            "no declare-const: the file declares no variables", source, asserts[0].line if asserts else None
        )
    return decls, asserts


def _split_conjunct(
    conjunct: list[_Atom], lower: np.ndarray, upper: np.ndarray, n_out: int, decls: dict[str, int], source: str
) -> tuple[InputBox, Disjunct]:
    """One output-DNF conjunct -> (top-level box narrowed by its X bounds, its Y rows)."""
    lo, hi = lower.copy(), upper.copy()
    rows = []
    for atom in conjunct:
        if atom.xs and atom.ys:
            raise VnnlibError("a constraint mixes input (X) and output (Y) variables", source, atom.line)
        if atom.xs:
            _tighten(atom, lo, hi, source)
        else:  # Y rows, and Y-free constant rows (0 <= b) that keep the conjunct's truth value
            rows.append(atom)
    _check_bounded(lo, hi, decls, source)
    matrix = np.zeros((len(rows), n_out))
    for r, atom in enumerate(rows):
        for j, coef in atom.ys.items():
            matrix[r, j] = coef
    rhs = np.array([0.0 - atom.const for atom in rows], dtype=np.float64)  # 0.0 - c avoids a -0.0 rhs
    return InputBox(lo, hi), Disjunct(matrix, rhs)


def _read_sexprs(text: str, source: str) -> list:
    stack: list[_Node] = [_Node(line=0)]
    for lineno, line in enumerate(text.splitlines(), start=1):
        for token in _TOKEN.findall(line.split(";", 1)[0]):
            if token == "(":
                node = _Node(line=lineno)
                stack[-1].append(node)
                stack.append(node)
            elif token == ")":
                if len(stack) == 1:
                    raise VnnlibError("unbalanced parentheses: unexpected ')'", source, lineno)
                stack.pop()
            else:
                stack[-1].append(token)
    if len(stack) > 1:
        raise VnnlibError("unbalanced parentheses: '(' is never closed", source, stack[1].line)
    return stack[0]


def _declare(expr: _Node, decls: dict[str, int], source: str) -> None:
    if len(expr) != 3 or not isinstance(expr[1], str) or expr[2] != "Real":
        raise VnnlibError(
            f"expected (declare-const X_i Real) or (declare-const Y_j Real), got {_show(expr)}", source, expr.line
        )
    name = expr[1]
    if not _VAR.fullmatch(name):
        raise VnnlibError(f"unsupported variable name {name!r} (expected X_i or Y_j)", source, expr.line)
    if name in decls:
        raise VnnlibError(f"variable {name} declared twice (first at line {decls[name]})", source, expr.line)
    decls[name] = expr.line


def _count(decls: dict[str, int], kind: str, expected: int | None, what: str, source: str) -> int:
    indices = [int(name[2:]) for name in decls if name[0] == kind]
    n = max(indices) + 1 if indices else 0
    if expected is not None and expected != n:
        raise VnnlibError(f"{what}={expected} but the file declares {n} {kind} variables", source)
    return n


def _to_dnf(expr, line: int, decls: dict[str, int], source: str) -> list[list[_Atom]]:
    if not isinstance(expr, _Node) or not expr or not isinstance(expr[0], str):
        raise VnnlibError(f"expected a boolean expression, got {_show(expr)}", source, line)
    op, args = expr[0], expr[1:]
    if op == "and":
        parts = [_to_dnf(a, expr.line, decls, source) for a in args]
        return [functools.reduce(operator.iadd, combo, []) for combo in itertools.product(*parts)]
    if op == "or":
        return [conj for a in args for conj in _to_dnf(a, expr.line, decls, source)]
    if op in ("<=", "<", ">=", ">"):
        if len(args) != 2:
            raise VnnlibError(f"{op} needs exactly 2 arguments, got {_show(expr)}", source, expr.line)
        small, big = args if op in ("<=", "<") else args[::-1]  # strict and non-strict agree on closed sets
        xs, ys, const = _linear(small, expr.line, decls, source)
        bxs, bys, bconst = _linear(big, expr.line, decls, source)
        return [[_Atom(_add(xs, bxs, -1.0), _add(ys, bys, -1.0), const - bconst, expr.line)]]
    raise VnnlibError(f"unknown operator {op!r}", source, expr.line)


def _linear(term, line: int, decls: dict[str, int], source: str) -> tuple[dict[int, float], dict[int, float], float]:
    """Linearise a term into (X coefficients, Y coefficients, constant)."""
    if isinstance(term, str):
        if _NUMBER.fullmatch(term):
            return {}, {}, float(term)
        if term not in decls:
            raise VnnlibError(f"undeclared variable {term!r}", source, line)
        return ({int(term[2:]): 1.0}, {}, 0.0) if term[0] == "X" else ({}, {int(term[2:]): 1.0}, 0.0)
    if not term or not isinstance(term[0], str):
        raise VnnlibError(f"expected a term, got {_show(term)}", source, line)
    op, parts = term[0], [_linear(t, term.line, decls, source) for t in term[1:]]
    if (op == "+" and parts) or (op == "-" and len(parts) >= 2):
        sign = 1.0 if op == "+" else -1.0
        xs, ys, const = parts[0]
        for pxs, pys, pconst in parts[1:]:
            xs, ys, const = _add(xs, pxs, sign), _add(ys, pys, sign), const + sign * pconst
        return xs, ys, const
    if op == "-" and len(parts) == 1:
        xs, ys, const = parts[0]
        return _add({}, xs, -1.0), _add({}, ys, -1.0), -const
    if op == "*" and parts:
        variable = [p for p in parts if p[0] or p[1]]
        if len(variable) > 1:
            raise VnnlibError(f"non-linear product {_show(term)}", source, term.line)
        scale = float(np.prod([p[2] for p in parts if not (p[0] or p[1])]))
        xs, ys, const = variable[0] if variable else ({}, {}, 1.0)
        return _add({}, xs, scale), _add({}, ys, scale), scale * const
    raise VnnlibError(f"unknown operator {op!r} in term {_show(term)}", source, term.line)


def _add(a: dict[int, float], b: dict[int, float], scale: float) -> dict[int, float]:
    """``a + scale * b``, dropping coefficients that cancel to zero."""
    out = dict(a)
    for k, v in b.items():
        out[k] = out.get(k, 0.0) + scale * v
    return {k: v for k, v in out.items() if v != 0.0}


def _tighten(atom: _Atom, lower: np.ndarray, upper: np.ndarray, source: str) -> None:
    """Intersect the box with the X-only atom ``a x_i + c <= 0``, which must be a bound on one variable."""
    if len(atom.xs) != 1:
        names = ", ".join(f"X_{i}" for i in sorted(atom.xs))
        raise VnnlibError(f"input constraint over {names} is not a bound on a single variable", source, atom.line)
    ((i, a),) = atom.xs.items()
    value = (0.0 - atom.const) / a + 0.0  # + 0.0 turns a -0.0 bound into 0.0, as the official parser reads it
    if a > 0:
        upper[i] = min(upper[i], value)
    else:
        lower[i] = max(lower[i], value)
    if lower[i] > upper[i]:
        raise VnnlibError(f"empty input box: X_{i} in [{float(lower[i])!r}, {float(upper[i])!r}]", source, atom.line)


def _check_bounded(lower: np.ndarray, upper: np.ndarray, decls: dict[str, int], source: str) -> None:
    unbounded = np.flatnonzero(~np.isfinite(lower) | ~np.isfinite(upper))
    if unbounded.size:
        name, side = f"X_{unbounded[0]}", "lower" if not np.isfinite(lower[unbounded[0]]) else "upper"
        raise VnnlibError(f"input {name} has no {side} bound", source, decls.get(name))


def _show(expr) -> str:
    """Render a parsed expression back as (shortened) source text for error messages."""
    text = expr if isinstance(expr, str) else "(" + " ".join(_show(e) for e in expr) + ")"
    return text if len(text) <= 60 else text[:57] + "..."
