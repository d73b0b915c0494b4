import gzip
import re
import time
from pathlib import Path

import numpy as np
import pytest

from lightning_fedshard.verify.spec import UnsupportedPropertyError, VnnlibError, parse_vnnlib, read_vnnlib
from lightning_fedshard.verify.spec.vnnlib import MAX_DNF_CONSTRAINTS, MAX_NESTING

MNIST = Path(__file__).resolve().parents[2].parent / "shared" / "vnncomp" / "mnist_fc_2022"
VNNLIB_FILES = sorted((MNIST / "vnnlib").glob("*.vnnlib"))


@pytest.fixture(scope="module")
def mnist_files() -> list[Path]:
    if len(VNNLIB_FILES) != 30:
        pytest.skip(f"mnist_fc_2022 vnnlib files not found under {MNIST}")
    return VNNLIB_FILES


# An independent re-implementation of the official read_vnnlib_simple, valid only for the mnist_fc line pattern.
_REF_BOUND = re.compile(r"\(assert \((<=|>=) X_(\d+) (\S+)\)\)")
_REF_SPEC = re.compile(r"\(and \(>= Y_(\d+) Y_(\d+)\)\)")


def reference_mnist(path: Path) -> tuple[np.ndarray, np.ndarray, list[np.ndarray]]:
    lower, upper, rows = np.full(784, np.nan), np.full(784, np.nan), []
    for line in path.read_text().splitlines():
        if m := _REF_BOUND.fullmatch(line.strip()):
            (upper if m[1] == "<=" else lower)[int(m[2])] = float(m[3])
        elif m := _REF_SPEC.fullmatch(line.strip()):
            row = np.zeros(10)
            row[int(m[2])], row[int(m[1])] = 1.0, -1.0  # Y_j >= Y_k  <=>  Y_k - Y_j <= 0
            rows.append(row)
    assert not np.isnan(lower).any() and not np.isnan(upper).any() and len(rows) == 9
    return lower, upper, rows


def label_of(path: Path) -> int:
    return int(re.search(r"label: (\d+)", path.read_text().splitlines()[0])[1])


def test_mnist_properties_match_reference_parser(mnist_files):
    for path in mnist_files:
        prop = read_vnnlib(path, num_inputs=784, num_outputs=10)
        assert (prop.num_inputs, prop.num_outputs, len(prop.cases)) == (784, 10, 1)
        (case,) = prop.cases
        ref_lower, ref_upper, rows = reference_mnist(path)
        assert np.array_equal(case.box.lower, ref_lower) and np.array_equal(case.box.upper, ref_upper), path.name
        assert case.box.lower.dtype == np.float64 and case.box.lower.shape == (784,)
        assert len(case.disjuncts) == 9
        label = label_of(path)
        for disjunct, row in zip(case.disjuncts, rows):
            assert disjunct.matrix.shape == (1, 10) and disjunct.matrix.dtype == np.float64
            assert np.array_equal(disjunct.matrix[0], row) and np.array_equal(disjunct.rhs, [0.0])
            assert disjunct.matrix[0, label] == 1.0 and np.flatnonzero(disjunct.matrix[0] == 1.0).tolist() == [label]
        eps = float(re.fullmatch(r"prop_\d+_(\S+)\.vnnlib", path.name)[1])
        # clip(x +- eps, 0, 1) computed in float32: widths exceed 2 eps by up to ~2.4e-8 of rounding, not 1e-9
        lower, upper = case.box.lower, case.box.upper
        assert np.all(lower >= 0.0) and np.all(upper <= 1.0) and np.all(lower.astype(np.float32) == lower)
        width_ok = np.abs(upper - lower - 2 * eps) <= 1e-7
        assert np.all(upper - lower <= 2 * eps + 1e-7) and np.all(width_ok | (lower == 0.0) | (upper == 1.0))


def test_prop_0_003_details(mnist_files):
    prop = read_vnnlib(MNIST / "vnnlib" / "prop_0_0.03.vnnlib")
    (case,) = prop.cases
    assert case.box.lower[0] == 0.0 and case.box.upper[0] == 0.029999999329447746
    assert label_of(MNIST / "vnnlib" / "prop_0_0.03.vnnlib") == 4
    expected = np.zeros(10)
    expected[4], expected[0] = 1.0, -1.0
    assert np.array_equal(case.disjuncts[0].matrix, [expected]) and case.disjuncts[0].rhs.tolist() == [0.0]


def test_gzipped_files_parse_identically(mnist_files, tmp_path):
    for path in mnist_files:
        gz = tmp_path / (path.name + ".gz")
        gz.write_bytes(gzip.compress(path.read_bytes()))
        plain, packed = read_vnnlib(path), read_vnnlib(gz)
        assert np.array_equal(plain.cases[0].box.lower, packed.cases[0].box.lower)
        assert np.array_equal(plain.cases[0].box.upper, packed.cases[0].box.upper)
        for a, b in zip(plain.cases[0].disjuncts, packed.cases[0].disjuncts, strict=True):
            assert np.array_equal(a.matrix, b.matrix) and np.array_equal(a.rhs, b.rhs)


HEADER = "(declare-const X_0 Real)\n(declare-const Y_0 Real)\n(declare-const Y_1 Real)\n"
BOX = "(assert (>= X_0 -1))\n(assert (<= X_0 1))\n"


def single_rows(text: str) -> tuple[np.ndarray, np.ndarray]:
    """Matrix and rhs of a property with exactly one case and one disjunct."""
    prop = parse_vnnlib(HEADER + BOX + text)
    ((disjunct,),) = [case.disjuncts for case in prop.cases]
    return disjunct.matrix, disjunct.rhs


def test_comments_blank_lines_and_multiline_statements():
    text = (
        "; leading comment\n\n(declare-const X_0 Real) ; trailing comment\n(declare-const Y_0 Real)\n\n(assert\n"
        "  (<=\n    X_0 ; inside a statement\n    1.0))\n(assert (>= X_0 0))\n(assert (or\n  (and (>= Y_0 2))\n))\n"
    )
    prop = parse_vnnlib(text)
    assert prop.cases[0].box.lower.tolist() == [0.0] and prop.cases[0].box.upper.tolist() == [1.0]
    assert prop.cases[0].disjuncts[0].matrix.tolist() == [[-1.0]] and prop.cases[0].disjuncts[0].rhs.tolist() == [-2.0]


@pytest.mark.parametrize(
    ("constraint", "row", "rhs"),
    [
        ("(>= Y_0 Y_1)", [-1.0, 1.0], 0.0),
        ("(<= Y_1 Y_0)", [-1.0, 1.0], 0.0),
        ("(> Y_0 Y_1)", [-1.0, 1.0], 0.0),
        ("(< Y_0 3)", [1.0, 0.0], 3.0),
        ("(<= (+ Y_0 (* 2 Y_1)) 3)", [1.0, 2.0], 3.0),
        ("(<= (+ Y_0 (* Y_1 -2.5) 1.5) 2)", [1.0, -2.5], 0.5),
        ("(>= (- Y_0 Y_1) -1)", [-1.0, 1.0], 1.0),
        ("(<= (- Y_0) 2)", [-1.0, 0.0], 2.0),
        ("(<= (- (- Y_1)) 1e-3)", [0.0, 1.0], 1e-3),
        ("(>= Y_0 -2.5E+2)", [-1.0, 0.0], 250.0),
        ("(<= Y_0 .5)", [1.0, 0.0], 0.5),
    ],
)
def test_linear_terms(constraint, row, rhs):
    matrix, b = single_rows(f"(assert {constraint})")
    assert matrix.tolist() == [row] and b.tolist() == [rhs]


def test_scientific_and_signed_zero_bounds():
    text = (
        "(declare-const X_0 Real)\n(declare-const X_1 Real)\n(declare-const Y_0 Real)\n"
        "(assert (>= X_0 -0.0))\n(assert (<= X_0 1e-3))\n(assert (>= X_1 -2.5e-1))\n(assert (<= X_1 3E2))\n"
    )
    box = parse_vnnlib(text).cases[0].box
    assert box.lower.tolist() == [0.0, -0.25] and box.upper.tolist() == [1e-3, 300.0]


def test_variables_are_ordered_by_index_not_declaration():
    text = (
        "(declare-const Y_1 Real)\n(declare-const X_1 Real)\n(declare-const Y_0 Real)\n(declare-const X_0 Real)\n"
        "(assert (<= X_1 3))\n(assert (>= X_1 2))\n(assert (<= X_0 1))\n(assert (>= X_0 0))\n(assert (<= Y_1 5))\n"
    )
    prop = parse_vnnlib(text)
    assert (prop.num_inputs, prop.num_outputs) == (2, 2)
    assert prop.cases[0].box.lower.tolist() == [0.0, 2.0] and prop.cases[0].box.upper.tolist() == [1.0, 3.0]
    assert prop.cases[0].disjuncts[0].matrix.tolist() == [[0.0, 1.0]]


def test_disjunction_with_two_input_boxes_gives_two_cases():
    prop = parse_vnnlib(
        HEADER + BOX + "(assert (or (and (<= X_0 0) (>= Y_0 Y_1))\n            (and (>= X_0 0) (<= Y_0 0.5))))\n"
    )
    assert len(prop.cases) == 2
    first, second = prop.cases
    assert first.box.lower.tolist() == [-1.0] and first.box.upper.tolist() == [0.0]
    assert second.box.lower.tolist() == [0.0] and second.box.upper.tolist() == [1.0]
    assert first.disjuncts[0].matrix.tolist() == [[-1.0, 1.0]] and first.disjuncts[0].rhs.tolist() == [0.0]
    assert second.disjuncts[0].matrix.tolist() == [[1.0, 0.0]] and second.disjuncts[0].rhs.tolist() == [0.5]


def test_identical_boxes_merge_into_one_case():
    prop = parse_vnnlib(HEADER + BOX + "(assert (or (and (<= X_0 0.5) (>= Y_0 1)) (and (<= X_0 0.5) (<= Y_1 2))))")
    (case,) = prop.cases
    assert case.box.upper.tolist() == [0.5] and len(case.disjuncts) == 2
    assert [d.matrix.tolist() for d in case.disjuncts] == [[[-1.0, 0.0]], [[0.0, 1.0]]]


def test_disjunct_without_output_constraint_is_always_unsafe():
    prop = parse_vnnlib(HEADER + BOX + "(assert (or (and (<= X_0 0)) (and (>= X_0 0) (<= Y_0 1))))")
    assert [len(c.disjuncts) for c in prop.cases] == [1, 1]
    assert prop.cases[0].disjuncts[0].matrix.shape == (0, 2) and prop.cases[0].disjuncts[0].rhs.shape == (0,)


def test_conjunction_of_output_asserts_stacks_rows():
    outputs = "(assert (<= Y_0 1))\n(assert (or (>= Y_1 2) (>= Y_1 3)))\n(assert (<= Y_0 Y_1))"
    prop = parse_vnnlib(HEADER + BOX + outputs)
    (case,) = prop.cases
    assert [d.matrix.tolist() for d in case.disjuncts] == [
        [[1.0, 0.0], [0.0, -1.0], [1.0, -1.0]],
        [[1.0, 0.0], [0.0, -1.0], [1.0, -1.0]],
    ]
    assert [d.rhs.tolist() for d in case.disjuncts] == [[1.0, -2.0, 0.0], [1.0, -3.0, 0.0]]


def test_num_inputs_and_outputs_must_match():
    assert parse_vnnlib(HEADER + BOX, num_inputs=1, num_outputs=2).num_outputs == 2
    with pytest.raises(VnnlibError, match="num_inputs=3"):
        parse_vnnlib(HEADER + BOX, num_inputs=3)
    with pytest.raises(VnnlibError, match="num_outputs=1"):
        parse_vnnlib(HEADER + BOX, num_outputs=1)


@pytest.mark.parametrize(
    ("text", "line", "names"),
    [
        (HEADER + BOX + "(assert (<= Y_0 1)))\n", 6, ["unbalanced", "')'"]),
        (HEADER + "(assert (<= X_0 1)\n" + BOX, 4, ["unbalanced", "'('"]),
        (HEADER + BOX + "(check-sat)\n", 6, ["unknown command", "check-sat"]),
        ("(vnnlib-version <2.0>)\n", 1, ["unknown command", "2.0"]),
        (HEADER + BOX + "(assert (<= X_7 1))\n", 6, ["undeclared", "X_7"]),
        (HEADER + BOX + "(assert (= Y_0 1))\n", 6, ["unknown operator", "'='"]),
        (HEADER + BOX + "(assert (<= (/ Y_0 2) 1))\n", 6, ["unknown operator", "'/'"]),
        (HEADER + BOX + "(assert (<= (* Y_0 Y_1) 1))\n", 6, ["non-linear"]),
        (HEADER + "(assert (<= X_0 1))\n", 1, ["X_0", "no lower bound"]),
        (HEADER + "(assert (>= X_0 1))\n", 1, ["X_0", "no upper bound"]),
        (HEADER + BOX + "\n(assert (>= X_0 2))\n", 7, ["empty input box: X_0 in [2.0, 1.0]"]),
        ("(declare-const X_0 Real)\n(declare-const X_1 Real)\n(assert (<= X_0 X_1))\n", 3, ["X_0, X_1", "bound"]),
        (HEADER + BOX + "(assert (or (<= X_0 Y_0) (<= Y_0 1)))\n", 6, ["mixes", "X", "Y"]),
        ("; nothing declared\n(assert (<= X_0 1))\n", 2, ["declare-const"]),
        (HEADER + "(declare-const X_0 Real)\n", 4, ["X_0", "twice"]),
    ],
)
def test_errors_name_line_and_culprit(text, line, names):
    with pytest.raises(VnnlibError) as info:
        parse_vnnlib(text, source="spec.vnnlib")
    message = str(info.value)
    assert message.startswith(f"spec.vnnlib:{line}:"), message
    for name in names:
        assert name in message, message


def test_read_vnnlib_reports_the_file_name(tmp_path):
    path = tmp_path / "broken.vnnlib"
    path.write_text(HEADER + "(assert (<= X_0 1))\n")
    with pytest.raises(VnnlibError, match=r"broken\.vnnlib:1: input X_0 has no lower bound"):
        read_vnnlib(path)


def and_of_ors(k: int) -> str:
    """An AND of ``k`` two-way ORs: ``2^k`` disjuncts of ``k`` rows once multiplied out."""
    ors = " ".join(f"(or (>= Y_0 {i}) (<= Y_1 {-i}))" for i in range(k))
    return HEADER + BOX + f"(assert (and {ors}))\n"


def test_an_and_of_ors_expands_up_to_the_bound_and_is_refused_beyond_it():
    (case,) = parse_vnnlib(and_of_ors(12)).cases
    assert len(case.disjuncts) == 2**12 and {len(d.rhs) for d in case.disjuncts} == {12}
    assert 12 * 2**12 <= MAX_DNF_CONSTRAINTS < 13 * 2**13
    for k in (13, 40, 400):  # 40 ran past a 10 s timeout, 20 took 2.5 GB, before the bound
        with pytest.raises(UnsupportedPropertyError, match=r"spec\.vnnlib:6: the output constraints multiply out"):
            parse_vnnlib(and_of_ors(k), source="spec.vnnlib")
    with pytest.raises(UnsupportedPropertyError, match=r"1\.1e\+12 disjuncts of 4\.4e\+13 constraints"):
        parse_vnnlib(and_of_ors(40))


def test_separate_asserts_multiply_out_too():
    asserts = "".join(f"(assert (or (>= Y_0 {i}) (<= Y_1 {-i})))\n" for i in range(20))
    # refused at the 13th assert (line 18), before the product of the first 13 is built
    with pytest.raises(UnsupportedPropertyError, match="^<string>:18: .* to 8,192 disjuncts of 106,496 constraints"):
        parse_vnnlib(HEADER + BOX + asserts)


def test_an_expansion_past_its_deadline_stops():
    with pytest.raises(TimeoutError, match="deadline passed while expanding"):
        parse_vnnlib(and_of_ors(12), deadline=time.monotonic() - 1)


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ((HEADER + "(assert (>= X_0 0))\n(assert (<= X_0 1e400))\n").encode(), r":5: \(<= X_0 1e400\) holds a number"),
        ((HEADER + BOX + "(assert (<= (* 1e300 1e300 Y_0) 1))\n").encode(), ":6: .* beyond the range of float64"),
        (b"\x7fELF\x02\x01\x01\x00" + bytes(range(256)), "not a VNN-LIB text file: byte 0x80 at offset 136"),
        (gzip.compress((HEADER + BOX).encode())[:20], "not a readable gzip file"),
        ((HEADER + BOX + "(assert " + "(and " * 20_000 + ")" * 20_001).encode(), f"deeper than {MAX_NESTING} levels"),
    ],
    ids=["bound-1e400", "overflowing-product", "binary", "truncated-gzip", "nested-20000-deep"],
)
def test_unreadable_files_name_the_file_and_the_problem(content, message, tmp_path):
    path = tmp_path / "bad.vnnlib"
    path.write_bytes(content)
    with pytest.raises(VnnlibError, match=f"^{re.escape(str(path))}.*{message}"):
        read_vnnlib(path)


def test_nesting_up_to_the_limit_parses():
    depth = MAX_NESTING - 2  # (assert (<= …) …) adds two levels
    term = "(- " * depth + "Y_0" + ")" * depth
    ((disjunct,),) = [case.disjuncts for case in parse_vnnlib(HEADER + BOX + f"(assert (<= {term} 1))\n").cases]
    assert disjunct.matrix.tolist() == [[1.0, 0.0]] and disjunct.rhs.tolist() == [1.0]
