import re
from functools import cache
from pathlib import Path

import numpy as np
import pytest

from lightning_fedshard.verify.spec import (
    Case,
    Counterexample,
    Property,
    check_counterexample,
    format_counterexample,
    read_counterexample,
    read_vnnlib,
    write_result,
)

MNIST = Path(__file__).resolve().parents[2].parent / "shared" / "vnncomp" / "mnist_fc_2022"
CEX_FILES = sorted((MNIST / "counterexamples").glob("*.counterexample"))


def instance_of(cex_path: Path) -> tuple[Path, Path]:
    """``mnist-net_256x2_prop_1_0.03.counterexample`` -> (onnx/mnist-net_256x2.onnx, vnnlib/prop_1_0.03.vnnlib)."""
    net, prop = re.fullmatch(r"(.+)_(prop_.+)\.counterexample", cex_path.name).groups()
    return MNIST / "onnx" / f"{net}.onnx", MNIST / "vnnlib" / f"{prop}.vnnlib"


@cache
def onnx_forward(onnx_path: Path):
    ort = pytest.importorskip("onnxruntime")
    options = ort.SessionOptions()
    options.intra_op_num_threads = options.inter_op_num_threads = 1  # the CI machine's cores are shared
    session = ort.InferenceSession(str(onnx_path), options, providers=["CPUExecutionProvider"])
    return lambda x: session.run(None, {"0": np.asarray(x, dtype=np.float32).reshape(1, 784, 1)})[0].reshape(-1)


@pytest.fixture(scope="module")
def cex_files() -> list[Path]:
    if not CEX_FILES:
        pytest.skip(f"mnist_fc_2022 counterexamples not found under {MNIST}")
    return CEX_FILES


@pytest.fixture(scope="module")
def instance(cex_files):
    """The first 256x2 counterexample with its property and ONNX forward."""
    path = next(p for p in cex_files if "256x2_prop_1_0.03" in p.name)
    onnx_path, vnnlib_path = instance_of(path)
    return read_counterexample(path, 784, 10), read_vnnlib(vnnlib_path), onnx_forward(onnx_path)


def test_format_read_round_trip_is_bit_exact():
    rng = np.random.default_rng(0)
    x = np.concatenate([rng.standard_normal(5), [1 / 3, -0.0, 5e-324, 1e300, np.float32(0.1)]])
    y = rng.standard_normal(3) * 1e-7
    back = read_counterexample(format_counterexample(Counterexample(x, y)), len(x), len(y))
    assert back.x.dtype == np.float64 and back.x.view(np.uint64).tolist() == x.view(np.uint64).tolist()
    assert back.y.view(np.uint64).tolist() == y.view(np.uint64).tolist()


def test_format_layout():
    text = format_counterexample(Counterexample(np.array([0.5, 1.0]), np.array([-2.0])))
    assert text == "((X_0 0.5)\n (X_1 1.0)\n (Y_0 -2.0))"


def test_write_result(tmp_path):
    write_result(tmp_path / "unsat.txt", "unsat")
    assert (tmp_path / "unsat.txt").read_text() == "unsat\n"
    cex = Counterexample(np.array([0.25, 0.75]), np.array([1.5]))
    write_result(tmp_path / "sat.txt", "sat", cex)
    assert (tmp_path / "sat.txt").read_text().startswith("sat\n((X_0 0.25)\n (X_1 0.75)\n (Y_0 1.5))")
    back = read_counterexample(tmp_path / "sat.txt", 2, 1)
    assert back.x.tolist() == [0.25, 0.75] and back.y.tolist() == [1.5]
    with pytest.raises(ValueError, match="verdict"):
        write_result(tmp_path / "bad.txt", "safe")
    with pytest.raises(ValueError, match="counterexample"):
        write_result(tmp_path / "bad.txt", "sat")
    with pytest.raises(ValueError, match="'unsat' carries no counterexample"):
        read_counterexample(tmp_path / "unsat.txt", 2, 1)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("((X_0 1.0) (Y_0 2.0))", "X_1"),
        ("((X_0 1.0) (X_1 1.0) (X_0 3.0) (Y_0 2.0))", "X_0 is assigned twice"),
        ("((X_0 1.0) (X_1 1.0) (X_2 1.0) (Y_0 2.0))", "X_2 is out of range"),
        ("((X_0 1.0) (X_1 abc) (Y_0 2.0))", "X_1 has the non-numeric value"),
        ("((X_0 1.0) (X_1 1.0) (Z_0 2.0) (Y_0 2.0))", "unexpected text"),
        ("sat\n", "X variables missing"),
    ],
)
def test_read_counterexample_errors(text, message):
    with pytest.raises(ValueError, match=message):
        read_counterexample(text, 2, 1)


def test_all_shipped_counterexamples_check_out(cex_files):
    for path in cex_files:
        onnx_path, vnnlib_path = instance_of(path)
        cex = read_counterexample(path, 784, 10)
        assert cex.x.shape == (784,) and cex.y.shape == (10,)
        result = check_counterexample(cex, read_vnnlib(vnnlib_path), onnx_forward(onnx_path))
        assert result.ok, (path.name, result.reason)
        assert result.max_output_error <= 1e-4 and result.case_index == 0 and result.disjunct_index is not None


def test_perturbed_output_fails(instance):
    cex, prop, forward = instance
    y = cex.y.copy()
    y[3] += 3e-3
    result = check_counterexample(Counterexample(cex.x, y), prop, forward)
    assert not result.ok and "output mismatch 0.003 > 0.0001" in result.reason
    assert result.max_output_error == pytest.approx(3e-3, rel=1e-3)


def test_input_outside_the_box_fails(instance):
    cex, prop, forward = instance
    x = cex.x.copy()
    x[17] = prop.cases[0].box.upper[17] + 2e-4
    result = check_counterexample(Counterexample(x, cex.y), prop, forward)
    box = prop.cases[0].box
    lo, hi = float(box.lower[17]), float(box.upper[17])
    assert not result.ok and result.reason == f"x[17]={float(x[17])!r} outside [{lo!r}, {hi!r}]"
    assert result.case_index is None
    x[17] = prop.cases[0].box.upper[17] + 5e-5  # inside the 1e-4 tolerance
    assert check_counterexample(Counterexample(x, forward(x).astype(np.float64)), prop, forward).ok


def test_result_for_another_property_fails(instance):
    cex, prop, forward = instance
    # The same input box, but the disjuncts of a property whose label is the class the network predicts here.
    predicted = int(np.argmax(forward(cex.x)))
    other = next(
        p
        for p in sorted((MNIST / "vnnlib").glob("*.vnnlib"))
        if f"label: {predicted}." in p.read_text().splitlines()[0]
    )
    swapped = Property(784, 10, (Case(prop.cases[0].box, read_vnnlib(other).cases[0].disjuncts),))
    result = check_counterexample(cex, swapped, forward)
    assert not result.ok and result.reason.startswith("no disjunct satisfied (best row violation")
    assert result.case_index == 0 and result.disjunct_index is None
