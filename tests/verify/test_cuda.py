"""The verifier on CUDA against the same run on the CPU: bounds (IBP, CROWN, α-CROWN) within 1e-5 for mnist_fc and a
ResNet, and the same verdicts end to end (the attack, CROWN at the root, input splitting).
Marked ``cuda``: they run with ``pytest -m cuda`` (``make gpu-check``) on a machine with a GPU, and skip elsewhere."""

from __future__ import annotations

import pytest
import torch

from lightning_fedshard.bench.gpu_check import vnncomp_root
from lightning_fedshard.verify import (
    CasePhases,
    Verdict,
    VerifyConfig,
    load_onnx,
    local_robustness,
    read_vnnlib,
    verify_files,
)
from tests.verify.nets import resnet

pytestmark = pytest.mark.cuda

ROOT = vnncomp_root()
needs_data = pytest.mark.skipif(ROOT is None, reason="the VNN-COMP files (../shared/vnncomp or ./.vnncomp) are absent")
TOLERANCE = {"rtol": 1e-5, "atol": 1e-5}


def _case(graph, vnnlib):
    return read_vnnlib(vnnlib, graph.input.size, graph.output.size).cases[0]


def _bounds(graph, case) -> dict[str, torch.Tensor]:
    """IBP of the output, CROWN's and α-CROWN's spec margins, on the graph's device, returned on the CPU."""
    phases = CasePhases(graph, case)
    with torch.no_grad():
        out = graph.ibp(phases.box)[graph.output.name]
    return {
        "ibp lower": out.lower.cpu(),
        "ibp upper": out.upper.cpu(),
        "crown": phases.crown().cpu(),
        "alpha-crown": (phases.alpha(iterations=20).lower[:, 0] - phases.spec.rhs).detach().cpu(),
    }


@needs_data
@pytest.mark.parametrize("prop", ["prop_0_0.03", "prop_5_0.05"])
def test_mnist_fc_bounds_on_cuda_equal_the_cpu_bounds(prop: str) -> None:
    folder = ROOT / "mnist_fc_2022"
    onnx, vnnlib = folder / "onnx" / "mnist-net_256x2.onnx", folder / "vnnlib" / f"{prop}.vnnlib"
    cpu, cuda = load_onnx(onnx), load_onnx(onnx, device="cuda")
    assert {t.device.type for t in cuda.constants()} == {"cuda"}
    case = _case(cpu, vnnlib)
    expected, actual = _bounds(cpu, case), _bounds(cuda, case)
    for name in expected:
        torch.testing.assert_close(actual[name], expected[name], **TOLERANCE, msg=lambda m, n=name: f"{n}: {m}")


def test_resnet_bounds_on_cuda_equal_the_cpu_bounds() -> None:
    cpu, cuda = resnet(seed=3), resnet(seed=3).to(device="cuda")
    assert {t.device.type for t in cuda.constants()} == {"cuda"}
    centre = torch.rand(cpu.input.size, generator=torch.Generator().manual_seed(0))
    label = int(cpu(centre.view(1, -1)).argmax())
    (case,) = local_robustness(centre.double().numpy(), 0.002, label, cpu.output.size).cases
    expected, actual = _bounds(cpu, case), _bounds(cuda, case)
    for name in expected:
        torch.testing.assert_close(actual[name], expected[name], **TOLERANCE, msg=lambda m, n=name: f"{n}: {m}")


@needs_data
@pytest.mark.parametrize(
    ("vnncomp_set", "onnx", "vnnlib"),
    [
        ("mnist_fc_2022", "mnist-net_256x6.onnx", "prop_0_0.03.vnnlib"),  # unsat by CROWN
        ("mnist_fc_2022", "mnist-net_256x6.onnx", "prop_6_0.03.vnnlib"),  # sat by PGD
        ("acasxu_2022", "ACASXU_run2a_1_1_batch_2000.onnx.gz", "prop_4.vnnlib"),  # input splitting
        ("acasxu_2022", "ACASXU_run2a_1_9_batch_2000.onnx.gz", "prop_7.vnnlib"),  # sat found by the search
    ],
)
def test_verdicts_on_cuda_equal_the_cpu_verdicts(vnncomp_set: str, onnx: str, vnnlib: str) -> None:
    # not named `benchmark`: pytest-benchmark (on the GPU image) claims that argument name as its fixture
    files = ROOT / vnncomp_set / "onnx" / onnx, ROOT / vnncomp_set / "vnnlib" / vnnlib
    answers = {device: verify_files(*files, VerifyConfig(timeout=60, device=device)) for device in ("cpu", "cuda")}
    assert answers["cuda"].verdict == answers["cpu"].verdict, answers
    assert answers["cuda"].verdict in (Verdict.SAT, Verdict.UNSAT), answers["cuda"]
    if answers["cuda"].verdict is Verdict.SAT:  # replayed on the ONNX model inside verify_files
        assert answers["cuda"].counterexample is not None and answers["cuda"].counterexample_check
