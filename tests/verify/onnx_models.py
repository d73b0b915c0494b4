"""ONNX models for the loader tests: hand-built and exported graphs, onnxruntime as the reference forward pass,
and the adjoint check of every linear op the loader builds."""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper
from torch import nn

from lightning_fedshard.verify.graph import BoundGraph
from lightning_fedshard.verify.onnx import load_onnx, onnx_source
from lightning_fedshard.verify.ops import LinearOp

__all__ = [
    "check_adjoint",
    "check_against_onnxruntime",
    "export",
    "hand_built",
    "onnx_ops",
    "our_ops",
    "reference_outputs",
    "weights",
]


def reference_outputs(path: Path, x: np.ndarray) -> np.ndarray:
    """onnxruntime's output for each row of ``x`` (the models have a fixed batch of 1, or none)."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = options.inter_op_num_threads = 1
    session = ort.InferenceSession(onnx_source(path), options, providers=["CPUExecutionProvider"])
    (value,) = session.get_inputs()
    shape = [d if isinstance(d, int) else 1 for d in value.shape]  # the graph's rows are single ONNX inputs
    return np.stack([session.run(None, {value.name: row.reshape(shape)})[0] for row in x])


def check_against_onnxruntime(path: Path, n: int, low: float = -1.0, seed: int = 0) -> BoundGraph:
    """Load ``path`` and compare its forward pass with onnxruntime on ``n`` points uniform in ``[low, 1]``."""
    graph = load_onnx(path)
    x = np.random.default_rng(seed).uniform(low, 1.0, (n, *graph.input.shape)).astype(np.float32)
    ours = graph(torch.from_numpy(x)).numpy()
    expected = reference_outputs(path, x)
    assert ours.shape[1:] == graph.output.shape
    assert ours.reshape(expected.shape) == pytest.approx(expected, abs=1e-5, rel=1e-6)
    return graph


def check_adjoint(graph: BoundGraph) -> None:
    """Every LinearOp's transpose must be its adjoint on the real node shapes (batch 2, 3 specification rows)."""
    generator = torch.Generator().manual_seed(0)
    for node in graph.nodes[1:]:
        if not isinstance(node.op, LinearOp):
            continue
        (source,) = (graph.by_name[name] for name in node.inputs)
        x = torch.randn(2, *source.shape, generator=generator, dtype=torch.float64)
        A = torch.randn(3, 2, *node.shape, generator=generator, dtype=torch.float64)
        lhs = (A * node.op.linear(x)).sum()
        transposed = node.op.transpose(A)
        assert transposed.shape == (3, 2, *source.shape), node.name
        rhs = (transposed * x).sum()
        assert float(lhs) == pytest.approx(float(rhs), rel=1e-4, abs=1e-8), f"{node.name}: {node.op!r}"


def export(model: nn.Module, shape: tuple[int, ...], path: Path) -> Path:
    """``model`` through torch's TorchScript exporter (opset 13, no constant folding) for a batch of 1."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the legacy exporter's deprecation notice
        torch.onnx.export(
            model.eval(),
            torch.zeros(1, *shape),
            str(path),
            opset_version=13,
            dynamo=False,
            training=torch.onnx.TrainingMode.PRESERVE,
            do_constant_folding=False,
        )
    return path


def onnx_ops(path: Path) -> list[str]:
    return [node.op_type for node in onnx.load(str(path)).graph.node]


def our_ops(graph: BoundGraph) -> set[type]:
    return {type(node.op) for node in graph.nodes[1:]}


def hand_built(
    path: Path,
    nodes: list[onnx.NodeProto],
    in_shape: list[int],
    initializers: dict[str, np.ndarray] | None = None,
    extra_inputs: tuple[onnx.ValueInfoProto, ...] = (),
    opset: int = 13,
) -> Path:
    """A one-input one-output float model ``x -> ... -> y`` (``y``'s shape left to ONNX shape inference)."""
    inits = [numpy_helper.from_array(value, name) for name, value in (initializers or {}).items()]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, in_shape), *extra_inputs],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        inits,
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)]), str(path))
    return path


def weights(*shape: int, seed: int = 0, scale: float = 1.0) -> np.ndarray:
    """Standard normal float32 values times ``scale``."""
    return (np.random.default_rng(seed).standard_normal(shape) * scale).astype(np.float32)
