"""The four general-graph VNN-COMP sets of ``../shared/vnncomp`` (MaxPool/Pad CNNs, a sigmoid MLP, Pensieve's
Slice/Gather/Split/Pow/Div graphs without a batch dimension, AC-OPF proxies with products of two tensors and
Floor): every net loads and computes what onnxruntime computes inside its properties' boxes, and instances of
each set get their consensus verdict, a ``sat`` with a counterexample that replays on onnxruntime."""

from __future__ import annotations

import csv
from pathlib import Path

import numpy as np
import pytest
import torch

from lightning_fedshard.verify import Verdict, VerifyConfig, load_onnx, read_vnnlib, verify_files
from tests.verify.onnx_models import reference_outputs

pytest.importorskip("onnxruntime")

VNNCOMP = Path(__file__).resolve().parents[2].parent / "shared" / "vnncomp"
SETS = ("verivital_2021", "eran_sigmoid_2021", "nn4sys_pensieve_2023", "ml4acopf_linear_2024")
pytestmark = pytest.mark.skipif(
    not all((VNNCOMP / name).is_dir() for name in SETS), reason="the general-graph sets of ../shared/vnncomp are absent"
)


def _nets() -> list[tuple[str, str, str]]:
    """``(set, onnx, vnnlib)``: every net of the four sets with the first property it is verified against."""
    found: dict[tuple[str, str], str] = {}
    for name in SETS:
        path = VNNCOMP / name / "instances.csv"
        if path.is_file():
            for onnx_file, vnnlib_file, _ in csv.reader(path.open()):
                found.setdefault((name, onnx_file), vnnlib_file)
    return [(name, onnx_file, vnnlib_file) for (name, onnx_file), vnnlib_file in found.items()]


@pytest.mark.parametrize(("name", "onnx_file", "vnnlib_file"), _nets(), ids=lambda v: Path(v).name.split(".")[0])
def test_every_net_matches_onnxruntime_inside_its_box(name: str, onnx_file: str, vnnlib_file: str) -> None:
    folder = VNNCOMP / name
    graph = load_onnx(folder / onnx_file)
    box = read_vnnlib(folder / vnnlib_file, graph.input.size, graph.output.size).cases[0].box
    rng = np.random.default_rng(0)
    x = (box.lower + rng.random((8, box.lower.size)) * (box.upper - box.lower)).astype(np.float32)
    expected = reference_outputs(folder / onnx_file, x).reshape(len(x), -1)
    ours = graph(torch.from_numpy(x)).reshape(len(x), -1).numpy()
    # float32 sums in another order: a few ulps of the largest output (power flows reach 10^4)
    scale = np.abs(expected).max(axis=1, keepdims=True)
    assert np.abs(ours - expected).max() <= 1e-5 * (1 + scale).max()


INSTANCES = [
    ("verivital_2021", "onnx/Convnet_avgpool.onnx.gz", "vnnlib/avgpool_specs/prop_0_0.02.vnnlib", "unsat"),
    ("verivital_2021", "onnx/Convnet_maxpool.onnx.gz", "vnnlib/maxpool_specs/prop_0_0.004.vnnlib", "unsat"),
    (
        "eran_sigmoid_2021",
        "onnx/ffnnSIGMOID__Point_6x200.onnx.gz",
        "vnnlib/mnist_spec_idx_7167_eps_0.01200.vnnlib",
        "unsat",
    ),
    ("nn4sys_pensieve_2023", "onnx/pensieve_small_parallel.onnx.gz", "vnnlib/pensieve_parallel_4.vnnlib", "unsat"),
    ("nn4sys_pensieve_2023", "onnx/pensieve_big_parallel.onnx.gz", "vnnlib/pensieve_parallel_0.vnnlib", "unsat"),
    ("nn4sys_pensieve_2023", "onnx/pensieve_mid_simple.onnx.gz", "vnnlib/pensieve_simple_10.vnnlib", "unsat"),
    ("ml4acopf_linear_2024", "onnx/14_ieee_ml4acopf-linear-residual.onnx.gz", "vnnlib/14_ieee_prop2.vnnlib", "unsat"),
    ("ml4acopf_linear_2024", "onnx/14_ieee_ml4acopf-linear-nonresidual.onnx.gz", "vnnlib/14_ieee_prop1.vnnlib", "sat"),
    # Its outputs reach 4,000: our float32 sums differ from onnxruntime's by an ulp (5e-4), so the outputs the
    # counterexample claims must be onnxruntime's own.
    (
        "ml4acopf_linear_2024",
        "onnx/118_ieee_ml4acopf-linear-nonresidual.onnx.gz",
        "vnnlib/118_ieee_prop5.vnnlib",
        "sat",
    ),
]


@pytest.mark.parametrize(
    ("name", "onnx_file", "vnnlib_file", "expected"),
    INSTANCES,
    ids=[f"{Path(o).name.split('.')[0]}-{Path(v).stem}" for _, o, v, _ in INSTANCES],
)
def test_instances_get_their_consensus_verdict(name: str, onnx_file: str, vnnlib_file: str, expected: str) -> None:
    folder = VNNCOMP / name
    assert [onnx_file, vnnlib_file, expected] in [
        list(row.values()) for row in csv.DictReader((folder / "expected_verdicts.csv").open())
    ]
    timeouts = {(o, v): float(t) for o, v, t in csv.reader((folder / "instances.csv").open())}
    result = verify_files(
        folder / onnx_file, folder / vnnlib_file, VerifyConfig(timeout=timeouts[onnx_file, vnnlib_file])
    )
    assert result.verdict is Verdict(expected), (result.verdict, result.reason, result.counterexample_check)
    if result.verdict is Verdict.SAT:
        assert result.counterexample_check == "ok"
        prop = read_vnnlib(folder / vnnlib_file, result.counterexample.x.size, result.counterexample.y.size)
        y = reference_outputs(folder / onnx_file, result.counterexample.x[None].astype(np.float32)).ravel()
        assert np.array_equal(result.counterexample.y, y.astype(np.float64))
        assert any(np.all(d.matrix @ y - d.rhs <= 1e-4) for case in prop.cases for d in case.disjuncts)
