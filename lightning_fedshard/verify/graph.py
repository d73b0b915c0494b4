"""The computation graph that bounds are propagated through: nodes in topological order, each one operator."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from lightning_fedshard.verify.ops import (
    BoundOp,
    ElementwiseAffine,
    Interval,
    LinearOp,
    ReLU,
    Reshape,
    Select,
    Transpose,
)

#: Ops each of whose outputs is an affine function of one input element: the interval of the output follows exactly
#: from the input's.
_PER_ELEMENT = (ElementwiseAffine, Reshape, Select, Transpose)

__all__ = ["BoundGraph", "Node"]


def _in_precision(value: Tensor, precision: torch.dtype | None) -> Tensor:
    """``value`` rounded to the model's narrower float type, as the model holds it (float16 nodes of a graph
    computed in float32)."""
    if precision is None or precision.itemsize >= value.dtype.itemsize:
        return value
    return value.to(precision).to(value.dtype)


@dataclass(frozen=True)
class Node:
    """One value of the network: the output of ``op`` applied to the nodes named in ``inputs``.

    ``shape`` excludes the batch dimension. The network input is the node with ``op=None``.
    """

    name: str
    op: BoundOp | None
    inputs: tuple[str, ...]
    shape: tuple[int, ...]

    @property
    def size(self) -> int:
        return int(torch.Size(self.shape).numel())


class BoundGraph:
    """A feed-forward network as a list of :class:`Node` in topological order, starting with the input.

    Constants live inside the ops; every node input is another node. Built by the ONNX loader, or by hand::

        graph = BoundGraph([
            Node("x", None, (), (784,)),
            Node("fc1", Linear(W1, b1), ("x",), (256,)),
            Node("relu1", ReLU(), ("fc1",), (256,)),
            Node("fc2", Linear(W2, b2), ("relu1",), (10,)),
        ])
        y = graph(torch.rand(5, 784))
    """

    def __init__(self, nodes: list[Node], output: str | None = None) -> None:
        if not nodes or nodes[0].op is not None:
            raise ValueError("a BoundGraph starts with its input node (op=None)")
        self.nodes = list(nodes)
        self.by_name = {node.name: node for node in self.nodes}
        if len(self.by_name) != len(self.nodes):
            raise ValueError("node names must be unique")
        seen: set[str] = set()
        for node in self.nodes:
            if node.op is None and node is not self.nodes[0]:
                raise ValueError(f"node {node.name!r} has no op; only the first node is the input")
            missing = [name for name in node.inputs if name not in seen]
            if missing:
                raise ValueError(f"node {node.name!r} reads {missing} before they are computed")
            seen.add(node.name)
        self.input = self.nodes[0]
        self.output = self.by_name[output] if output is not None else self.nodes[-1]
        #: The non-linear nodes: their ops relax themselves over the intervals of some of their inputs.
        self.nonlinear = [node for node in self.nodes[1:] if node.op.relaxed_inputs]
        #: For every node whose interval a relaxation reads, the ``(consumer, input index)`` pairs that read it.
        self.relaxations: dict[str, list[tuple[Node, int]]] = {}
        #: ... and for the nodes branch-and-bound may split, the pair that says where and how (the first).
        self.splitter: dict[str, tuple[Node, int]] = {}
        for node in self.nonlinear:
            for index in node.op.relaxed_inputs:
                self.relaxations.setdefault(node.inputs[index], []).append((node, index))
            for index in node.op.split_inputs:
                self.splitter.setdefault(node.inputs[index], (node, index))
        #: Those nodes in topological order: the intervals CROWN tightens and branch-and-bound keeps per domain.
        self.bounded = [node.name for node in self.nodes if node.name in self.relaxations]
        self.split_nodes = [name for name in self.bounded if name in self.splitter]
        #: The split nodes branch-and-bound splits at 0 only (a ReLU's phases): their β terms add no constant.
        self.split_at_zero = {name for name in self.split_nodes if isinstance(self.splitter[name][0].op, ReLU)}
        #: The nodes CROWN refines, each with whether all its neurons are needed: a bounded node itself, or — where it
        #: is a larger copy of an earlier node through per-element ops (``x[:, None] − thresholds`` of a ReLU lookup
        #: table) — that node, whose refined interval then gives the copy's exactly by interval propagation.
        self.crown_targets: dict[str, bool] = {}
        for name in self.bounded:
            source = self._per_element_source(name)
            if source != name and self.by_name[source].size < self.by_name[name].size:
                self.crown_targets[source] = True
            else:
                self.crown_targets.setdefault(name, False)
        #: Whether every relaxation is exact once its neurons are split at their kinks (a ReLU-like graph): a domain
        #: with nothing left to split is then linear.
        self.exact_when_split = all(getattr(node.op, "exact_when_split", False) for node in self.nonlinear)
        self.relus = [node for node in self.nodes if isinstance(node.op, ReLU)]
        #: The pre-activation node of each ReLU node, in ReLU order (ReLU-specific code: LP programs, phase pieces).
        self.pre_activation = {relu.name: relu.inputs[0] for relu in self.relus}
        #: The float type the model takes its input in (``None``: the graph's dtype); the loader sets it.
        self.input_precision: torch.dtype | None = None
        #: The dtype the graph computes in where no op holds a float constant (a float64 ReduceMean alone): the
        #: loader sets it, :meth:`to` keeps it.
        self.working_dtype: torch.dtype | None = None
        #: The model itself, flat inputs to flat outputs (onnxruntime on the ONNX file, set by ``verify_files``):
        #: counterexamples found on this graph's float32 forward pass are confirmed on it before they count.
        self.model: Callable[[np.ndarray], np.ndarray] | None = None
        self._ancestors: dict[str, list[Node]] = {}
        self._ibp_exact: dict[str, bool] = {}

    def _per_element_source(self, name: str) -> str:
        node = self.by_name[name]
        while node.op is not None and isinstance(node.op, _PER_ELEMENT):
            node = self.by_name[node.inputs[0]]
        return node.name

    def consumer_inputs(self, consumer: Node, bounds: Mapping[str, Interval]) -> list[Interval | None]:
        """The intervals of ``consumer``'s inputs that ``bounds`` holds (``None`` for the others)."""
        return [bounds.get(name) for name in consumer.inputs]

    def refine_mask(self, name: str, bounds: Mapping[str, Interval]) -> Tensor:
        """``[B, *shape]``: the neurons of bounded node ``name`` whose tighter bounds would tighten some relaxation
        that reads it (ReLU: the unstable ones), given ``bounds`` (which holds ``name``)."""
        masks = [
            consumer.op.refine_mask(self.consumer_inputs(consumer, bounds), index)
            for consumer, index in self.relaxations[name]
        ]
        return torch.stack(masks).any(0) if len(masks) > 1 else masks[0]

    def split_mask(self, name: str, bounds: Mapping[str, Interval]) -> Tensor:
        """``[B, *shape]``: the neurons of split node ``name`` that branch-and-bound may still split."""
        consumer, index = self.splitter[name]
        return consumer.op.split_mask(self.consumer_inputs(consumer, bounds), index)

    def constants(self) -> list[Tensor]:
        """Every tensor the ops hold (weights, biases, shards, a Concat's constant parts; placeholders on the meta
        device included)."""
        held = [value for node in self.nodes[1:] for value in vars(node.op).values()]
        held = [item for value in held for item in (value if isinstance(value, list | tuple) else [value])]
        return [value for value in held if isinstance(value, Tensor)]

    @property
    def dtype(self) -> torch.dtype:
        return next((t.dtype for t in self.constants() if t.is_floating_point()), self.working_dtype or torch.float32)

    @property
    def device(self) -> torch.device:
        return next((t.device for t in self.constants() if t.device.type != "meta"), torch.device("cpu"))

    def __call__(self, x: Tensor) -> Tensor:
        """Forward pass: ``x [B, *input shape]`` (or flat ``[B, input size]``) → ``[B, *output shape]``."""
        values = {self.input.name: _in_precision(x.reshape(x.shape[0], *self.input.shape), self.input_precision)}
        for node in self.nodes[1:]:
            values[node.name] = _in_precision(
                node.op.forward(*(values[name] for name in node.inputs)), node.op.precision
            )
            if node is self.output:
                break
        return values[self.output.name]

    def ibp(self, box: Interval) -> dict[str, Interval]:
        """Interval bounds of every node up to the output for an input box ``[B, *input shape]``."""
        bounds = {self.input.name: box}
        for node in self.nodes[1:]:
            bounds[node.name] = node.op.ibp(*(bounds[name] for name in node.inputs))
            if node is self.output:
                break
        return bounds

    def complete_bounds(
        self, box: Interval, bounds: Mapping[str, Interval], upto: str | None = None
    ) -> dict[str, Interval]:
        """``bounds`` (known valid: bounded nodes' intervals, say) with every other node up to ``upto`` (the output
        by default) filled in by interval propagation from them and the input ``box``."""
        complete = {self.input.name: box}
        for node in self.ancestors(upto or self.output.name)[1:]:
            known = bounds.get(node.name)
            complete[node.name] = known if known is not None else node.op.ibp(*(complete[n] for n in node.inputs))
        return complete

    def ancestors(self, name: str) -> list[Node]:
        """The nodes ``name`` depends on, itself included, in topological order."""
        if name not in self._ancestors:
            needed = {name}
            for node in reversed(self.nodes):
                if node.name in needed:
                    needed.update(node.inputs)
            self._ancestors[name] = [node for node in self.nodes if node.name in needed]
        return self._ancestors[name]

    def ibp_is_exact(self, name: str) -> bool:
        """Whether interval propagation gives the exact range of ``name`` over a box: its ancestors are one
        chain of affine ops with at most one that mixes coordinates (element-wise maps send boxes to boxes)."""
        if name not in self._ibp_exact:
            chain = self.ancestors(name)[1:]
            linear_chain = all(len(node.inputs) == 1 and isinstance(node.op, LinearOp) for node in chain)
            mixing = sum(not isinstance(node.op, ElementwiseAffine | Reshape) for node in chain)
            self._ibp_exact[name] = linear_chain and mixing <= 1
        return self._ibp_exact[name]

    def to(self, dtype: torch.dtype | None = None, device: torch.device | str | None = None) -> BoundGraph:
        """This graph with every op's floating-point constants in ``dtype`` and all of them on ``device`` (where
        every bound, box and domain of a run on it then lives); ``None`` keeps either as it is."""
        for node in self.nodes[1:]:
            node.op.to(dtype, device)
        self.working_dtype = dtype if dtype is not None else self.working_dtype
        return self

    def with_nodes(self, nodes: list[Node]) -> BoundGraph:
        """A graph of ``nodes`` (this one's, some ops replaced: sharded, split into zones) with the same output,
        input precision, working dtype and model."""
        graph = BoundGraph(nodes, self.output.name)
        graph.input_precision, graph.working_dtype, graph.model = self.input_precision, self.working_dtype, self.model
        return graph

    def __repr__(self) -> str:
        body = "\n".join(
            f"  {node.name}: {node.op!r}({', '.join(node.inputs)}) -> {list(node.shape)}" for node in self.nodes[1:]
        )
        return f"BoundGraph(input {self.input.name} {list(self.input.shape)}\n{body}\n)"
