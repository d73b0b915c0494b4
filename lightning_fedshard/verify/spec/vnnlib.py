"""VNN-LIB 1.0 reader (the SMT-LIB subset used by VNN-COMP 2022/2024), following the semantics of the official
``read_vnnlib_simple``: input constraints form boxes, output constraints a disjunction of polytopes ``A y <= b``
describing the *unsafe* set.

Output constraints are brought into disjunctive normal form, which an AND of ORs multiplies out (``k`` two-way ORs
make ``2^k`` disjuncts): beyond :data:`MAX_DNF_CONSTRAINTS` constraints the property is rejected with
:class:`UnsupportedPropertyError` before anything is expanded, and ``deadline`` bounds the time the expansion
may take.
"""

from __future__ import annotations

import functools
import gzip
import itertools
import math
import operator
import re
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

__all__ = [
    "MAX_DNF_CONSTRAINTS",
    "MAX_NESTING",
    "Case",
    "Disjunct",
    "InputBox",
    "Property",
    "UnsupportedPropertyError",
    "VnnlibError",
    "local_robustness",
    "parse_vnnlib",
    "read_vnnlib",
]

_TOKEN = re.compile(r"\(|\)|[^\s()]+")
_VAR = re.compile(r"([XY])_(0|[1-9]\d*)")
_NUMBER = re.compile(r"[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?")

#: The most linear constraints (and disjuncts) the output constraints may hold once multiplied out into disjunctive
#: normal form, every disjunct's constraints counted: 100,000 parse in about 0.15 s, and every one becomes a spec
#: row that each attack step and bound pass pays for. VNN-COMP properties hold a few dozen.
MAX_DNF_CONSTRAINTS = 100_000
#: The deepest nesting of parentheses read: the expressions are walked recursively, and VNN-COMP files nest
#: fewer than ten deep.
MAX_NESTING = 100


class VnnlibError(ValueError):
    """A malformed or unsupported VNN-LIB file; the message starts with ``source:line:`` where a line is known."""

    def __init__(self, message: str, source: str = "<string>", line: int | None = None) -> None:
        super().__init__(f"{source}:{line}: {message}" if line is not None else f"{source}: {message}")


class UnsupportedPropertyError(VnnlibError):
    """A well-formed property that the verifier does not take on: its output constraints would multiply out to
    more than :data:`MAX_DNF_CONSTRAINTS` constraints. The instance is answered ``unknown`` with this reason."""


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


def read_vnnlib(
    path: str | Path, num_inputs: int | None = None, num_outputs: int | None = None, deadline: float | None = None
) -> Property:
    """Read a ``.vnnlib`` (or gzipped ``.vnnlib.gz``) file; see :func:`parse_vnnlib`."""
    path = Path(path)
    raw = path.read_bytes()
    if raw[:2] == b"\x1f\x8b":  # gzip magic, so a misnamed compressed file still reads
        try:
            raw = gzip.decompress(raw)
        except (OSError, EOFError) as error:
            raise VnnlibError(f"not a readable gzip file ({error})", str(path)) from None
    try:
        text = raw.decode()
    except UnicodeDecodeError as error:
        raise VnnlibError(
            f"not a VNN-LIB text file: byte {raw[error.start]:#04x} at offset {error.start} is not UTF-8", str(path)
        ) from None
    return parse_vnnlib(text, num_inputs, num_outputs, source=str(path), deadline=deadline)


def parse_vnnlib(
    text: str,
    num_inputs: int | None = None,
    num_outputs: int | None = None,
    source: str = "<string>",
    deadline: float | None = None,
) -> Property:
    """Parse VNN-LIB 1.0 text; ``num_inputs``/``num_outputs``, when given, must match the declarations.

    Output constraints that would multiply out to more than :data:`MAX_DNF_CONSTRAINTS` constraints raise
    :class:`UnsupportedPropertyError`; ``TimeoutError`` if the ``time.monotonic()`` ``deadline`` passes while
    they are expanded."""
    decls, asserts = _commands(_read_sexprs(text, source), source)
    n_in = _count(decls, "X", num_inputs, "num_inputs", source)
    n_out = _count(decls, "Y", num_outputs, "num_outputs", source)
    lower, upper = np.full(n_in, -np.inf), np.full(n_in, np.inf)
    output_dnf: list[list[_Atom]] = [[]]
    output_size = _DnfSize(1, 0)
    for node in asserts:
        size = _dnf_size(node[1], node.line, source)
        dnf = _to_dnf(node[1], node.line, decls, source, deadline)
        if len(dnf) == 1 and dnf[0] and all(a.xs and not a.ys for a in dnf[0]):
            for atom in dnf[0]:
                _tighten(atom, lower, upper, source)
        else:  # conjunction with the DNF so far: every pair of disjuncts combines
            output_size = _DnfSize.conjunction([output_size, size]).check(node.line, source)
            output_dnf = _conjoin([output_dnf, dnf], deadline, source)

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
                if len(stack) > MAX_NESTING:
                    raise VnnlibError(f"parentheses nest deeper than {MAX_NESTING} levels", source, lineno)
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


@dataclass(frozen=True)
class _DnfSize:
    """How big an expression's disjunctive normal form is: its disjuncts, and the constraints of all of them
    (both saturating at :data:`_HUGE`, so that a file of many ORs does not make huge integers)."""

    disjuncts: int
    constraints: int

    def check(self, line: int, source: str) -> _DnfSize:
        if max(self.disjuncts, self.constraints) > MAX_DNF_CONSTRAINTS:  # empty disjuncts cost memory too
            raise UnsupportedPropertyError(
                f"the output constraints multiply out to {_amount(self.disjuncts)} disjuncts of "
                f"{_amount(self.constraints)} constraints in all (an AND of ORs), more than the "
                f"{MAX_DNF_CONSTRAINTS:,} this verifier expands",
                source,
                line,
            )
        return self

    @classmethod
    def disjunction(cls, parts: list[_DnfSize]) -> _DnfSize:
        return cls(min(sum(p.disjuncts for p in parts), _HUGE), min(sum(p.constraints for p in parts), _HUGE))

    @classmethod
    def conjunction(cls, parts: list[_DnfSize]) -> _DnfSize:
        """The size of an AND: one disjunct per choice of a disjunct of every part, each holding the constraints
        of its choices."""
        disjuncts, constraints = 1, 0
        for part in parts:
            disjuncts, constraints = (
                min(disjuncts * part.disjuncts, _HUGE),
                min(constraints * part.disjuncts + part.constraints * disjuncts, _HUGE),
            )
        return cls(disjuncts, constraints)


_HUGE = 10**30


def _amount(count: int) -> str:
    if count >= _HUGE:
        return f"more than {float(_HUGE):.0e}"
    return f"{count:,}" if count < 10**9 else f"{float(count):.3g}"


def _dnf_size(expr, line: int, source: str) -> _DnfSize:
    """The size of ``expr``'s disjunctive normal form, found without building it (:func:`_to_dnf` checks the
    expression itself); raises :class:`UnsupportedPropertyError` where it is too big."""
    if not isinstance(expr, _Node) or not expr or expr[0] not in ("and", "or"):
        return _DnfSize(1, 1)
    parts = [_dnf_size(a, expr.line, source) for a in expr[1:]]
    size = _DnfSize.disjunction(parts) if expr[0] == "or" else _DnfSize.conjunction(parts)
    return size.check(expr.line, source)


def _conjoin(parts: list[list[list[_Atom]]], deadline: float | None, source: str) -> list[list[_Atom]]:
    """The DNF of the AND of DNFs: a disjunct for every choice of one disjunct of each part."""
    out = []
    for count, combo in enumerate(itertools.product(*parts)):
        if count % 1024 == 0 and deadline is not None and time.monotonic() > deadline:
            raise TimeoutError(f"{source}: the deadline passed while expanding the output constraints")
        out.append(functools.reduce(operator.iadd, combo, []))
    return out


def _to_dnf(expr, line: int, decls: dict[str, int], source: str, deadline: float | None) -> list[list[_Atom]]:
    if not isinstance(expr, _Node) or not expr or not isinstance(expr[0], str):
        raise VnnlibError(f"expected a boolean expression, got {_show(expr)}", source, line)
    op, args = expr[0], expr[1:]
    if op == "and":
        return _conjoin([_to_dnf(a, expr.line, decls, source, deadline) for a in args], deadline, source)
    if op == "or":
        return [conj for a in args for conj in _to_dnf(a, expr.line, decls, source, deadline)]
    if op in ("<=", "<", ">=", ">"):
        if len(args) != 2:
            raise VnnlibError(f"{op} needs exactly 2 arguments, got {_show(expr)}", source, expr.line)
        small, big = args if op in ("<=", "<") else args[::-1]  # strict and non-strict agree on closed sets
        xs, ys, const = _linear(small, expr.line, decls, source)
        bxs, bys, bconst = _linear(big, expr.line, decls, source)
        atom = _Atom(_add(xs, bxs, -1.0), _add(ys, bys, -1.0), const - bconst, expr.line)
        if not all(np.isfinite([*atom.xs.values(), *atom.ys.values(), atom.const])):
            raise VnnlibError(f"{_show(expr)} holds a number beyond the range of float64", source, expr.line)
        return [[atom]]
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
        scale = math.prod(p[2] for p in parts if not (p[0] or p[1]))
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
    if not np.isfinite(value):
        raise VnnlibError(f"the bound on X_{i} is beyond the range of float64", source, atom.line)
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
