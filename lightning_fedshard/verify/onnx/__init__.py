"""ONNX models as :class:`~lightning_fedshard.verify.graph.BoundGraph`s, read directly with ``onnx``.

* :mod:`.loader`: :func:`load_onnx` walks the graph, folds constants and hands every other node to its converter;
* :mod:`.context`: :class:`~.context.LoadContext`, the graph built so far, and the errors a load raises;
* :mod:`.evaluate`: ONNX's own evaluation of one node (:func:`run_node`), for folding and tracing;
* :mod:`.converters`: the accepted operators, by family: :mod:`.linear`, :mod:`.elementwise`, :mod:`.reductions`,
  :mod:`.movement`, :mod:`.discrete` (what they share: :mod:`.common`).

Example::

    from lightning_fedshard.verify.onnx import load_onnx

    graph = load_onnx("mnist-net_256x2.onnx")   # or "mnist-net_256x2.onnx.gz"
    logits = graph(torch.rand(64, 784))          # [64, 10]; the ONNX input is [1, 784, 1]
"""

from lightning_fedshard.verify.onnx.context import FLOAT_TYPES, OnnxLoadError, UnsupportedModelError
from lightning_fedshard.verify.onnx.evaluate import run_node
from lightning_fedshard.verify.onnx.loader import load_onnx, model_dtype, onnx_source

__all__ = [
    "FLOAT_TYPES",
    "OnnxLoadError",
    "UnsupportedModelError",
    "load_onnx",
    "model_dtype",
    "onnx_source",
    "run_node",
]
