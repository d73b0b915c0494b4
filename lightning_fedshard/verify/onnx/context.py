"""What a load builds and reads: :class:`LoadContext` (the graph so far, the constants, how ONNX shapes map onto
node shapes), the ONNX float types, and the errors a load raises (:class:`NeedsUnbatched` restarts it unbatched)."""

from __future__ import annotations

import numpy as np
import onnx
import torch
from torch import Tensor

from lightning_fedshard.verify.graph import Node
from lightning_fedshard.verify.ops import BoundOp, ElementwiseAffine, Reshape

__all__ = ["FLOAT_TYPES", "LoadContext", "NeedsUnbatched", "OnnxLoadError", "UnsupportedModelError"]

#: The ONNX float types and the torch dtypes they are computed in.
FLOAT_TYPES = {
    onnx.TensorProto.FLOAT: torch.float32,
    onnx.TensorProto.DOUBLE: torch.float64,
    onnx.TensorProto.FLOAT16: torch.float16,
    onnx.TensorProto.BFLOAT16: torch.bfloat16,
}


class OnnxLoadError(ValueError):
    """The file is missing, is not an ONNX model, or uses something the verifier cannot represent.

    Example::

        try:
            graph = load_onnx(path)
        except OnnxLoadError as err:
            print(f"cannot verify {path}: {err}")
    """


class UnsupportedModelError(OnnxLoadError):
    """A well-formed ONNX model that uses something the verifier cannot represent (an operator, an attribute, a
    signature): the instance is answered ``unknown`` with this reason, not failed."""


class NeedsUnbatched(Exception):
    """A node moves or mixes the leading dimension: the graph must be loaded without a batch dimension."""


class LoadContext:
    """The graph built so far: computed tensors (graph nodes) and constants (numpy), keyed by ONNX tensor name,
    and how ONNX shapes and axes map onto node shapes (``batched``: the leading ONNX dimension is the batch).

    Example (what a converter does with it)::

        ctx = LoadContext(torch.float32, opset=13, batched=True)
        ...                                           # the input node and the constants, by the loader
        ctx.emit("y", ReLU(), "x")                    # node "y" reads tensor "x"; its shape found by running it
        ctx.affine("y", None, ctx.weight("b", "bias"), "z")   # z = y + b, broadcast as ONNX does
    """

    def __init__(self, dtype: torch.dtype, opset: int, batched: bool) -> None:
        self.dtype, self.opset, self.batched = dtype, opset, batched
        self.constants: dict[str, np.ndarray] = {}
        self.variables: dict[str, Node] = {}  # Identity makes several tensor names point at one node
        self.nodes: list[Node] = []
        self._names: set[str] = set()
        #: The float type the model computes each computed tensor in (by ONNX tensor name).
        self.types: dict[str, torch.dtype] = {}
        #: The float type of the ONNX node being converted: the precision of the ops it becomes.
        self.precision: torch.dtype | None = None
        #: The one-hot node of each ArgMax's index node (by node name): what a OneHot of that index copies.
        self.one_hots: dict[str, str] = {}

    # -- tensors -----------------------------------------------------------------------------------------------

    def is_constant(self, name: str) -> bool:
        return name in self.constants

    def tensor_type(self, name: str) -> torch.dtype:
        """The float type the model computes the computed tensor ``name`` in."""
        return self.types.get(name, torch.float32)

    def variable(self, name: str) -> Node:
        if name not in self.variables:
            raise OnnxLoadError(f"expected a computed tensor, but {name!r} is a constant")
        return self.variables[name]

    def constant(self, name: str, role: str) -> np.ndarray:
        if name not in self.constants:
            raise OnnxLoadError(f"the {role} must be a constant, but {name!r} is computed from the input")
        return self.constants[name]

    def weight(self, name: str, role: str) -> Tensor:
        """A float constant as a float64 tensor: ops are built in float64 and cast once, so derived constants
        (1/c, alpha·B, folded batch norm) are rounded only once."""
        value = self.constant(name, role)
        if value.dtype not in (np.float32, np.float64, np.float16):
            raise OnnxLoadError(f"the {role} {name!r} has type {value.dtype}; only float32/float64 are supported")
        return torch.from_numpy(np.array(value, dtype=np.float64))

    def scalar(self, name: str, role: str) -> float:
        value = self.constant(name, role)
        if value.size != 1:
            raise UnsupportedModelError(f"the {role} {name!r} must be a single number, got shape {list(value.shape)}")
        return float(value.reshape(()))

    def ints(self, name: str, role: str) -> list[int]:
        return [int(v) for v in np.asarray(self.constant(name, role)).reshape(-1)]

    # -- shapes ------------------------------------------------------------------------------------------------

    def onnx_shape(self, name: str) -> tuple[int, ...]:
        """The ONNX shape of a computed tensor."""
        shape = self.variable(name).shape
        return (1, *shape) if self.batched else shape

    def node_shape(self, onnx_shape: tuple[int, ...] | list[int]) -> tuple[int, ...]:
        """The node shape of a tensor of ``onnx_shape``; batched, its leading dimension must be the batch of 1."""
        onnx_shape = tuple(int(d) for d in onnx_shape)
        if not self.batched:
            return onnx_shape
        if len(onnx_shape) < 2 or onnx_shape[0] != 1:  # one number per sample is a vector of one, unbatched
            raise NeedsUnbatched
        return onnx_shape[1:]

    def axis(self, axis: int, rank: int) -> int:
        """The node-shape axis of ONNX ``axis`` of a tensor of ONNX ``rank`` (batched: never the batch's)."""
        if not -rank <= axis < rank:
            raise OnnxLoadError(f"axis {axis} is outside a tensor of rank {rank}")
        axis %= rank
        if self.batched:
            if axis == 0:
                raise NeedsUnbatched
            return axis - 1
        return axis

    def broadcast_constant(self, value: Tensor, rank: int) -> Tensor:
        """A constant of ONNX rank ≤ ``rank`` as a tensor that broadcasts against node tensors ``[B, *shape]``."""
        value = value.reshape((1,) * (rank - value.dim()) + tuple(value.shape))
        if self.batched:
            if value.shape[0] != 1:
                raise NeedsUnbatched
            value = value[0]
        return value

    # -- nodes -------------------------------------------------------------------------------------------------

    def fresh(self, base: str) -> str:
        """A node name not used yet, from ``base``."""
        name, count = base, 0
        while name in self._names or name in self.variables or name in self.constants:
            count += 1
            name = f"{base}#{count}"
        return name

    def emit(self, name: str, op: BoundOp, *inputs: str) -> str:
        """Add ``op`` as node ``name`` reading the tensors ``inputs``, its shape found by running it on zeros; returns
        the name.

        Not from ``onnx.shape_inference``: for AveragePool with ceil_mode it counts windows that start in the
        padding, which onnxruntime, ONNX's reference evaluator and torch all drop."""
        sources = [self.variable(source) for source in inputs]
        op.to(self.dtype)
        if op.precision is None:
            op.precision = self.precision
        probe = [torch.zeros(1, *node.shape, dtype=self.dtype) for node in sources]
        shape = tuple(op.forward(*probe).shape[1:])
        if not shape and self.batched:  # one number per sample (a reduction without keepdims): load unbatched
            raise NeedsUnbatched
        node = Node(name, op, tuple(source.name for source in sources), shape)
        self.nodes.append(node)
        self.variables[name] = node
        self._names.add(name)
        return name

    def alias(self, name: str, source: str) -> None:
        """Tensor ``name`` is tensor ``source`` (Identity, Cast between float types, an identity Pad)."""
        self.variables[name] = self.variable(source)

    def reshape(self, source: str, shape: tuple[int, ...], name: str | None = None) -> str:
        """Tensor ``source`` reshaped to node shape ``shape`` (no node where it already has it)."""
        node = self.variable(source)
        if node.shape == tuple(shape):
            if name is not None:
                self.alias(name, source)
                return name
            return source
        return self.emit(name or self.fresh(f"{source}/reshape"), Reshape(node.shape, shape), source)

    def affine(self, source: str, scale: Tensor | None, shift: Tensor | None, name: str) -> str:
        """``source · scale + shift`` for float64 ONNX constants (either may be ``None``), broadcast as ONNX does."""
        constants = [c for c in (scale, shift) if c is not None]
        in_onnx = self.onnx_shape(source)
        rank = max(len(in_onnx), *(c.dim() for c in constants))
        in_onnx = (1,) * (rank - len(in_onnx)) + in_onnx
        try:
            out_onnx = np.broadcast_shapes(in_onnx, *(tuple(c.shape) for c in constants))
        except ValueError:
            shapes = [list(c.shape) for c in constants]
            raise OnnxLoadError(f"constants of shapes {shapes} do not broadcast to {list(in_onnx)}") from None
        source = self.reshape(source, self.node_shape(in_onnx))
        scale, shift = (None if c is None else self.broadcast_constant(c, rank) for c in (scale, shift))
        op = ElementwiseAffine(scale, shift, self.variable(source).shape, self.node_shape(out_onnx))
        return self.emit(name, op, source)
