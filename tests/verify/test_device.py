"""Device placement in the verifier, on the CPU: the device names and which GPU a rank takes, ``cuda`` refused on a
machine without CUDA before anything runs, ``device="cpu"``/``auto`` runs identical to the default, and a meta-device
pass (forward, IBP, the CROWN backward pass through every op) that fails wherever an op makes a tensor on a device
other than its inputs' (the GPU tests in test_cuda.py check the same on CUDA)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lightning_fedshard.verify import VerifyConfig, verify_files
from lightning_fedshard.verify.bounds.crown import backward_bound
from lightning_fedshard.verify.device import AUTO_CUDA_FLOPS, bound_pass_flops, resolve_device
from lightning_fedshard.verify.objective import box_tensor
from lightning_fedshard.verify.onnx import load_onnx
from tests.verify.nets import random_mlp, resnet
from tests.verify.test_verify_cli import files, run_cli  # noqa: F401 (fixture)

no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")


@pytest.fixture
def four_gpus(monkeypatch):
    """A machine with 4 GPUs, as far as device selection can tell (nothing is allocated)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)


def test_cpu_and_auto_without_cuda_are_the_cpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("cpu") == resolve_device("auto") == torch.device("cpu")


@pytest.mark.parametrize(
    ("name", "local_rank", "expected"),
    [("cuda", 5, "cuda:1"), ("cuda", 2, "cuda:2"), ("cuda:3", 0, "cuda:3"), ("auto", 6, "cuda:2")],
)
def test_each_rank_takes_its_own_gpu(four_gpus, name, local_rank, expected):
    assert resolve_device(name, local_rank) == torch.device(expected)


def test_one_bound_pass_is_the_forward_products_times_the_widest_bounded_node():
    # 6 -> 8 -> ReLU -> 8 -> ReLU -> 3: 2·(6·8 + 8·8 + 8·3) FLOPs a point, the two 8-wide pre-activations bounded
    assert bound_pass_flops(random_mlp(0, (6, 8, 8, 3))) == 2 * (6 * 8 + 8 * 8 + 8 * 3) * 8


def test_auto_keeps_small_nets_on_the_cpu_and_sends_large_conv_nets_to_cuda(four_gpus):
    small, large = random_mlp(0, (784, 256, 256, 10)), resnet(seed=0)
    assert bound_pass_flops(small) < AUTO_CUDA_FLOPS <= bound_pass_flops(large)
    assert resolve_device("auto", 2, graph=small) == torch.device("cpu")
    assert resolve_device("auto", 2, graph=large) == torch.device("cuda:2")
    assert resolve_device("cuda", 2, graph=small) == torch.device("cuda:2")  # asked for by name: cuda it is


def test_auto_runs_a_small_net_on_the_cpu_where_cuda_is_available(files, monkeypatch):  # noqa: F811
    """With GPUs there (as far as the verifier can tell), ``auto`` still verifies a tiny net on the CPU: placing it
    on the (absent) GPU would fail."""
    expected = verify_files(*files, VerifyConfig(timeout=30, device="cpu"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    placed = verify_files(*files, VerifyConfig(timeout=30, device="auto"))
    assert not placed.reason and (placed.verdict, placed.root_margins) == (expected.verdict, expected.root_margins)


def test_the_rank_comes_from_local_rank(four_gpus, monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "7")
    assert resolve_device("cuda") == torch.device("cuda:3")


@pytest.mark.parametrize(
    ("name", "message"), [("cuda:4", "has 4 CUDA device"), ("mps", "cpu or cuda"), ("gpu0", "unknown device")]
)
def test_devices_the_verifier_cannot_use_are_named(four_gpus, name, message):
    with pytest.raises(ValueError, match=message):
        VerifyConfig(device=name)


@no_cuda
def test_cuda_without_cuda_fails_at_construction():
    with pytest.raises(ValueError, match="CUDA is not available"):
        VerifyConfig(device="cuda")
    assert VerifyConfig(device="auto").device == "auto"  # resolved where the run starts: here, the CPU


@no_cuda
@pytest.mark.parametrize("extra", [[], ["--strategy", "fsdp", "--devices", "2"]])
def test_the_cli_refuses_cuda_before_any_process_starts(files, capsys, monkeypatch, extra):  # noqa: F811
    import lightning_fedshard.verify.lightning.module as module

    monkeypatch.setattr(module, "run_predict", lambda *a, **k: pytest.fail("a run started"))
    code, _, err = run_cli(capsys, *files, "--device", "cuda", *extra)
    assert code == 2 and "--device: device 'cuda': CUDA is not available" in err


def test_cpu_and_auto_answer_as_the_default(files, tmp_path, capsys):  # noqa: F811
    code, out, _ = run_cli(capsys, *files, "--timeout", "30", "--device", "auto")
    assert code == 0 and out.startswith("unsat")
    default = verify_files(*files, VerifyConfig(timeout=30))
    placed = verify_files(*files, VerifyConfig(timeout=30, device="cpu"))
    assert (placed.verdict, placed.root_margins) == (default.verdict, default.root_margins)


def test_graph_to_moves_every_constant_and_keeps_dtypes():
    graph = resnet(seed=2)
    dtypes = [t.dtype for t in graph.constants()]
    graph.to(device="meta")
    assert {t.device.type for t in graph.constants()} == {"meta"}
    assert [t.dtype for t in graph.constants()] == dtypes  # integer tensors too, uncast


@pytest.mark.parametrize("net", ["mlp", "resnet", "onnx"])
def test_ops_make_their_tensors_on_their_inputs_device(net, tmp_path):
    """On the meta device, any tensor an op creates on the CPU instead fails the op (as it would on CUDA)."""
    if net == "onnx":
        from tests.verify.test_verify_cli import tiny_net

        graph = load_onnx(tiny_net(tmp_path / "tiny.onnx"), device="meta")
    else:
        graph = random_mlp(0, (6, 8, 8, 3)) if net == "mlp" else resnet(seed=0)
        graph.to(device="meta")
    lower = np.zeros(graph.input.size)
    box = box_tensor(lower, lower + 0.1, graph.input.shape, graph.dtype, "meta")
    bounds = graph.ibp(box)
    assert graph(box.center).device.type == bounds[graph.output.name].lower.device.type == "meta"
    C = torch.eye(graph.output.size, device="meta").view(graph.output.size, 1, *graph.output.shape)
    assert backward_bound(graph, graph.output.name, C, box, bounds).lower.device.type == "meta"
