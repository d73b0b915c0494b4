"""ONNX's own evaluation of single nodes: :func:`run_node` runs one in the model's opset (onnxruntime, else the
reference evaluator), :func:`fold` stores the outputs of a node whose inputs are all constants. The data-movement
converters trace with :func:`run_node` which input element each output element copies."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import numpy_helper
from onnx.reference import ReferenceEvaluator

from lightning_fedshard.verify.onnx.context import LoadContext, OnnxLoadError

__all__ = ["fold", "run_node"]


def fold(ctx: LoadContext, node: onnx.NodeProto) -> None:
    """Evaluate a node whose inputs are all constants (Constant, shape arithmetic, a transposed weight) in the form
    of the model's own opset (:func:`run_node`)."""
    feeds = {name: ctx.constants[name] for name in node.input if name}
    try:
        values = _constant_value(node) or run_node(node, feeds, ctx.opset)
    except Exception as err:  # onnxruntime and the reference evaluator raise many types for ops they cannot run
        raise OnnxLoadError(f"cannot fold constant operator {node.op_type!r} (opset {ctx.opset}): {err}") from err
    for name, value in zip(node.output, values, strict=False):
        if name:
            ctx.constants[name] = np.asarray(value)


#: A Constant's value attributes (every opset's) and the numpy type of each; ``value`` holds a whole tensor.
_CONSTANT_ATTRIBUTES = {
    "value_float": np.float32,
    "value_floats": np.float32,
    "value_int": np.int64,
    "value_ints": np.int64,
}


def _constant_value(node: onnx.NodeProto) -> list[np.ndarray] | None:
    """A Constant node's value, read directly (models hold hundreds of them; a runtime session each costs ~2 ms);
    ``None`` for any other node or another attribute (strings, sparse), which :func:`run_node` runs."""
    if node.op_type != "Constant" or node.domain not in ("", "ai.onnx") or len(node.attribute) != 1:
        return None
    (attribute,) = node.attribute
    if attribute.name == "value":
        return [numpy_helper.to_array(attribute.t)]
    if attribute.name in _CONSTANT_ATTRIBUTES:
        return [np.array(onnx.helper.get_attribute_value(attribute), dtype=_CONSTANT_ATTRIBUTES[attribute.name])]
    return None


def run_node(node: onnx.NodeProto, feeds: dict[str, np.ndarray], opset: int) -> list[np.ndarray]:
    """``node`` of an opset-``opset`` model run on ``feeds``, one array per output (``None`` for an unnamed one).

    The node is wrapped in a model that imports the same opset, so it runs in that opset's form (Unsqueeze's
    ``axes`` an attribute before 13, an input from 13; Softmax over the flattened trailing axes before 13). Run by
    onnxruntime — the runtime whose results the verifier answers for; onnx's reference evaluator runs Softmax and
    LogSoftmax in their opset-13 form at every opset, BatchNormalization 9–13 with training statistics and Resize
    with ``align_corners`` on other pixels — or by the reference evaluator where onnxruntime has no kernel for the
    types or the opset. (A bare node given to the reference evaluator always runs at the newest opset.)"""
    inputs = [
        onnx.helper.make_tensor_value_info(name, onnx.helper.np_dtype_to_tensor_dtype(value.dtype), value.shape)
        for name, value in feeds.items()
    ]
    outputs = [onnx.helper.make_empty_tensor_value_info(name) for name in node.output if name]
    graph = onnx.helper.make_graph([node], "node", inputs, outputs)
    model = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", opset)])
    try:
        import onnxruntime

        options = onnxruntime.SessionOptions()
        options.log_severity_level = 3  # opsets before 7 are run with a warning
        session = onnxruntime.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
        results = session.run(None, feeds)
    except Exception:  # noqa: BLE001 (not installed, no kernel for these types, an opset it does not run)
        results = ReferenceEvaluator(model).run(None, feeds)
    named = dict(zip([name for name in node.output if name], results, strict=True))
    return [named.get(name) for name in node.output]
