"""The VNN-COMP scripts in ``vnncomp/`` run the way the competition's runner runs them (``run_single_instance.sh``):
an ``.onnx.gz`` gunzipped first, ``no_result_in_file`` written into the results file, ``prepare_instance.sh`` under a
timeout, then ``run_instance.sh`` killed at TIMEOUT + 60 s; the first line of the results file is the verdict, and a
``sat`` answer's counterexample is checked as the scorer checks it (replayed on onnxruntime, the box, the property),
independently of the verifier's own checker. On tiny hand-built nets, so each script takes the interpreter's start-up
and little more."""

from __future__ import annotations

import gzip
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from onnx import helper

from lightning_fedshard.bench.vnncomp_scripts import SCRIPTS, runner_env
from lightning_fedshard.verify.cli import UNSUPPORTED_STATUS
from lightning_fedshard.verify.cli import main as verify_main
from tests.verify.onnx_models import hand_built, reference_outputs
from tests.verify.test_verify_cli import BOX, HEADER, SAFE, tiny_net

TIMEOUT = 60
#: y_0 − y_1 = relu(x_0) on tiny_net, so "y_0 ≥ y_1 + 0.5" is reached by every x_0 ≥ 0.5 of the box [0, 1]²
UNSAFE_REACHED = "(assert (>= Y_0 (+ Y_1 0.5)))\n"
LOWER, UPPER = np.zeros(2), np.ones(2)  # BOX
#: the scorer's tolerances (VNN-COMP 2023-2026 settings.py): outputs replayed within RTOL, box and spec within ATOL
RTOL, ATOL = 1e-3, 1e-4


@pytest.fixture(scope="module")
def env() -> dict[str, str]:
    """The runner's environment for the scripts: the ``fedshard`` beside this interpreter first on PATH, this
    checkout first on PYTHONPATH (the scripts take ``fedshard`` from PATH, else the repository's ``.venv``)."""
    env = {**runner_env(), "OMP_NUM_THREADS": "1"}
    if shutil.which("fedshard", path=env["PATH"]) is None:
        pytest.skip(f"no `fedshard` command beside {sys.executable} (pip install -e . installs it)")
    return env


def prepare(env: dict[str, str], onnx: Path, vnnlib: Path) -> subprocess.CompletedProcess:
    return _script(env, 600, "prepare_instance.sh", "v1", "test", onnx, vnnlib)


def run(env: dict[str, str], onnx: Path, vnnlib: Path, results: Path) -> tuple[int, list[str]]:
    """``run_instance.sh`` as the runner calls it: the results file pre-written, killed at TIMEOUT + 60 s; its exit
    status and the results file's lines."""
    results.write_text("no_result_in_file\n")
    done = _script(env, TIMEOUT + 60, "run_instance.sh", "v1", "test", onnx, vnnlib, results, TIMEOUT)
    return done.returncode, results.read_text().splitlines()


def _script(env: dict[str, str], timeout: int, name: str, *args: object) -> subprocess.CompletedProcess:
    done = subprocess.run(
        ["timeout", str(timeout), str(SCRIPTS / name), *map(str, args)],
        env=env,
        capture_output=True,
        text=True,
        check=False,
        timeout=timeout + 30,
    )
    assert done.returncode != 124, f"{name} ran past {timeout} s: {done.stderr[-2000:]}"
    return done


def vnncomp_counterexample(lines: list[str], onnx: Path) -> tuple[np.ndarray, np.ndarray]:
    """X and Y of a ``sat`` results file, checked as VNN-COMP's ``counterexamples.py`` does: every ``X_i`` then every
    ``Y_j`` in index order, parsed as Python floats; onnxruntime's outputs at X must match Y within RTOL
    (relative to ‖Y‖∞, absolute where ‖Y‖∞ < 1e-6)."""
    assignments = re.findall(r"\(\s*([XY])_(\d+)\s+([^\s()]+)\s*\)", "\n".join(lines[1:]))
    xs = [(int(i), float(v)) for kind, i, v in assignments if kind == "X"]
    ys = [(int(i), float(v)) for kind, i, v in assignments if kind == "Y"]
    assert [kind for kind, _, _ in assignments] == ["X"] * len(xs) + ["Y"] * len(ys), "X values before Y values"
    assert [i for i, _ in xs] == list(range(len(xs))) and [i for i, _ in ys] == list(range(len(ys)))
    x, y = np.array([v for _, v in xs]), np.array([v for _, v in ys])
    replayed = reference_outputs(onnx, x[None].astype(np.float32)).ravel().astype(np.float64)
    assert replayed.shape == y.shape
    error = np.max(np.abs(replayed - y))
    norm = np.max(np.abs(y))
    assert (error / norm if norm >= 1e-6 else error) <= RTOL, f"Y does not replay: {y} against onnxruntime {replayed}"
    return x, y


def test_unsat(tmp_path: Path, env: dict[str, str]) -> None:
    onnx, vnnlib = tiny_net(tmp_path / "tiny.onnx"), tmp_path / "safe.vnnlib"
    vnnlib.write_text(HEADER + BOX + SAFE)
    assert prepare(env, onnx, vnnlib).returncode == 0
    status, lines = run(env, onnx, vnnlib, tmp_path / "results.txt")
    assert (status, lines) == (0, ["unsat"])


def test_sat_from_a_gzipped_model(tmp_path: Path, env: dict[str, str]) -> None:
    """The benchmark ships ``tiny.onnx.gz``; the runner gunzips it beside itself and passes ``tiny.onnx``."""
    packed = tmp_path / "tiny.onnx.gz"
    packed.write_bytes(gzip.compress(tiny_net(tmp_path / "made.onnx").read_bytes()))
    onnx = tmp_path / "tiny.onnx"
    onnx.write_bytes(gzip.decompress(packed.read_bytes()))
    vnnlib = tmp_path / "reached.vnnlib"
    vnnlib.write_text(HEADER + BOX + UNSAFE_REACHED)
    assert prepare(env, onnx, vnnlib).returncode == 0
    status, lines = run(env, onnx, vnnlib, tmp_path / "results.txt")
    assert status == 0 and lines[0] == "sat", lines
    x, y = vnncomp_counterexample(lines, onnx)
    assert np.all((LOWER - ATOL <= x) & (x <= UPPER + ATOL)), f"X outside the box: {x}"
    assert y[1] + 0.5 - y[0] <= ATOL, f"Y does not violate the property: {y}"


def test_wrong_version_exits_1(tmp_path: Path, env: dict[str, str]) -> None:
    results = tmp_path / "results.txt"
    results.write_text("no_result_in_file\n")
    for name, args in (
        ("install_tool.sh", ["v2"]),
        ("prepare_instance.sh", ["v2", "test", "a.onnx", "b.vnnlib"]),
        ("run_instance.sh", ["v2", "test", "a.onnx", "b.vnnlib", results, TIMEOUT]),
        ("run_instance.sh", []),
    ):
        done = _script(env, 60, name, *args)
        assert done.returncode == 1 and "expected first argument (version string) 'v1'" in done.stderr, name
    assert results.read_text() == "no_result_in_file\n"  # untouched: nothing ran


def test_malformed_onnx(tmp_path: Path, env: dict[str, str]) -> None:
    """prepare_instance.sh fails (exit 2: the runner scores the instance unknown without running it); run alone,
    run_instance.sh answers ``error`` and exits 0."""
    onnx, vnnlib = tmp_path / "broken.onnx", tmp_path / "safe.vnnlib"
    onnx.write_bytes(b"this is not an ONNX model")
    vnnlib.write_text(HEADER + BOX + SAFE)
    done = prepare(env, onnx, vnnlib)
    assert done.returncode == 2 and "broken.onnx" in done.stderr, done.stderr[-2000:]
    status, lines = run(env, onnx, vnnlib, tmp_path / "results.txt")
    assert (status, lines) == (0, ["error"])


def test_prepare_declines_an_unsupported_model(tmp_path: Path, capsys) -> None:
    """``fedshard verify --prepare`` (what prepare_instance.sh runs, here in this process): a well-formed model with
    an operator the verifier refuses exits UNSUPPORTED_STATUS with the reason; a good instance exits 0."""
    vnnlib = tmp_path / "safe.vnnlib"
    vnnlib.write_text(HEADER + BOX + SAFE)
    hardmax = hand_built(tmp_path / "hardmax.onnx", [helper.make_node("Hardmax", ["x"], ["y"], axis=1)], [1, 2])
    assert verify_main([str(hardmax), str(vnnlib), "--prepare"]) == UNSUPPORTED_STATUS
    assert "Hardmax" in capsys.readouterr().err
    assert verify_main([str(tiny_net(tmp_path / "tiny.onnx")), str(vnnlib), "--prepare"]) == 0
    assert capsys.readouterr().out.startswith("prepared: 2 inputs, 2 outputs")
