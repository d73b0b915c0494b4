"""FSDP for bound propagation: every rank keeps a dim-0 shard of each weight and gathers the full weight only for
the duration of one bound step.

Bound code never calls a module's forward, so FSDP2's hooks would not fire; instead each weighted op of the
graph becomes a *sharded op*: the same operator class with a mixin in front whose public entry points (forward,
IBP, CROWN backward) all-gather the op's weights, run the original arithmetic on them, and drop them. The
gathered tensors are bit-for-bit the original ones, so bounds, verdicts and counterexamples are identical to a
single-process run. While one op runs, the weights of the op most likely needed next (the next one in
topological order for forward/IBP, the previous one for a backward step) are already on their way (prefetch).

Biases and other 1-D constants stay replicated: they are a rounding error of the memory and the branching
heuristics read them directly.

Under autograd (α/β-CROWN iterations) the autograd graph would keep every gathered weight it saved until the
backward pass; as FSDP does, a saved weight is dropped and gathered again when the backward pass needs it.
Every rank must run the same sequence of bound steps (:mod:`~lightning_fedshard.verify.shard.lockstep`), and
so the same backward passes.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_fedshard.verify.graph import BoundGraph, Node
from lightning_fedshard.verify.ops import BoundOp

__all__ = ["WeightGatherer", "fsdp_shard", "weights_held"]


@dataclass(frozen=True)
class _SavedWeight:
    """What autograd keeps of a gathered weight: which one, and how the saved view lies in it."""

    op: BoundOp
    name: str
    size: torch.Size
    stride: tuple[int, ...]
    offset: int


@dataclass
class _Flight:
    op: BoundOp
    buffers: dict[str, Tensor]
    work: list


class WeightGatherer:
    """The all-gathers of one sharded graph, with at most one prefetch in flight (so at most two layers' full
    weights exist at a time outside autograd)."""

    def __init__(self, group: dist.ProcessGroup, order: list[BoundOp], prefetch: bool = True) -> None:
        self.group, self.prefetch = group, prefetch
        self.world = dist.get_world_size(group)
        self.position = {id(op): i for i, op in enumerate(order)}
        self.order = order
        self._flight: _Flight | None = None

    def _launch(self, op: BoundOp, async_op: bool) -> _Flight:
        buffers, work = {}, []
        for name in op._fsdp_layout:
            shard = getattr(op, f"{name}_shard")
            full = shard.new_empty(shard.numel() * self.world)
            work.append(dist.all_gather_single(full, shard, group=self.group, async_op=async_op))
            buffers[name] = full
        return _Flight(op, buffers, work)

    def full_weights(self, op: BoundOp, direction: int) -> dict[str, Tensor]:
        """The full weights of ``op``; then starts gathering its neighbour in ``direction`` (+1 or -1)."""
        flight, self._flight = self._flight, None
        if flight is not None:
            for work in flight.work:
                work.wait()
        if flight is None or flight.op is not op:
            flight = self._launch(op, async_op=False)
        if self.prefetch:
            neighbour = self.position[id(op)] + direction
            if 0 <= neighbour < len(self.order):
                self._flight = self._launch(self.order[neighbour], async_op=True)
        return {name: flight.buffers[name][:numel].view(shape) for name, (shape, numel) in op._fsdp_layout.items()}

    def saved_tensor_hooks(self, op: BoundOp, full: dict[str, Tensor]) -> tuple[Callable, Callable]:
        """``saved_tensors_hooks`` that store views of ``op``'s gathered weights as :class:`_SavedWeight` and
        gather them again when the backward pass unpacks them."""
        storages = {value.untyped_storage().data_ptr(): name for name, value in full.items()}

        def pack(tensor: Tensor):
            name = storages.get(tensor.untyped_storage().data_ptr()) if tensor.device.type != "meta" else None
            if name is None:
                return tensor
            return _SavedWeight(op, name, tensor.size(), tensor.stride(), tensor.storage_offset())

        def unpack(saved):
            if not isinstance(saved, _SavedWeight):
                return saved
            buffer = self._launch(saved.op, async_op=False).buffers[saved.name]
            return buffer.as_strided(saved.size, saved.stride, saved.offset)

        return pack, unpack


def _entry(method: Callable, direction: int) -> Callable:
    def gathered(self, *args, **kwargs):
        if self._fsdp_active:
            return method(self, *args, **kwargs)
        full = self._fsdp_gatherer.full_weights(self, direction)
        placeholders = {name: getattr(self, name) for name in full}
        for name, value in full.items():
            setattr(self, name, value)
        self._fsdp_active = True
        try:
            if not torch.is_grad_enabled():
                return method(self, *args, **kwargs)
            with torch.autograd.graph.saved_tensors_hooks(*self._fsdp_gatherer.saved_tensor_hooks(self, full)):
                return method(self, *args, **kwargs)
        finally:
            self._fsdp_active = False
            for name, value in placeholders.items():
                setattr(self, name, value)

    gathered.__name__ = method.__name__
    gathered.__doc__ = method.__doc__
    return gathered


#: Every method bound code calls that reads an op's weights (or its constant term: forward mode adds it to the
#: mapped functions). Outside them a weight is a meta placeholder, and a meta tensor added in place to a real one
#: is a silent no-op in torch: a reader missing here drops the weight without an error.
_ENTRY_POINTS = {
    "forward": 1,
    "ibp": 1,
    "linear": 1,
    "abs_linear": 1,
    "constant": 1,
    "constant_reach": 1,
    "rounding": 1,
    "map_rounding": 1,
    "backward": -1,
    "transpose": -1,
}
_sharded_classes: dict[type, type] = {}


def _sharded_class(cls: type) -> type:
    if cls not in _sharded_classes:
        body = {name: _entry(getattr(cls, name), d) for name, d in _ENTRY_POINTS.items() if hasattr(cls, name)}
        _sharded_classes[cls] = type(f"Fsdp{cls.__name__}", (cls,), body)
    return _sharded_classes[cls]


def _weight_names(op: BoundOp) -> list[str]:
    return [
        name
        for name, value in vars(op).items()
        if isinstance(value, Tensor) and value.is_floating_point() and value.dim() >= 2
    ]


def fsdp_shard(graph: BoundGraph, group: dist.ProcessGroup, prefetch: bool = True) -> BoundGraph:
    """A copy of ``graph`` whose weights (float constants of ≥ 2 dimensions) are sharded over ``group``: this
    rank keeps ``ceil(numel / P)`` elements of each, flattened (zero-padded at the end).

    ``graph`` itself is left as it is; drop it to free the full weights.

    Example::

        sharded = fsdp_shard(load_onnx("net.onnx"), dist.group.WORLD)
        verify(sharded, prop, config, lockstep_group=dist.group.WORLD)   # same answer as verify(graph, ...)
    """
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    nodes: list[Node] = [graph.input]
    weighted: list[BoundOp] = []
    for node in graph.nodes[1:]:
        names = _weight_names(node.op)
        op = node.op
        if names:
            op = copy.copy(node.op)
            op.__class__ = _sharded_class(type(node.op))
            op._fsdp_layout = {}
            for name in names:
                full = getattr(node.op, name).contiguous()
                length = math.ceil(full.numel() / world)
                flat = torch.nn.functional.pad(full.flatten(), (0, length * world - full.numel()))
                setattr(op, f"{name}_shard", flat[rank * length : (rank + 1) * length].clone())
                # A meta tensor keeps shape and dtype for repr/dtype queries; arithmetic on it is not reliably an
                # error (in-place into a real tensor does nothing), so every reader is an entry point above.
                setattr(op, name, full.to("meta"))
                op._fsdp_layout[name] = (full.shape, full.numel())
            op._fsdp_active = False
            weighted.append(op)
        nodes.append(Node(node.name, op, node.inputs, node.shape))
    gatherer = WeightGatherer(group, weighted, prefetch)
    for op in weighted:
        op._fsdp_gatherer = gatherer
    return graph.with_nodes(nodes)


@contextmanager
def weights_held(graph: BoundGraph) -> Iterator[None]:
    """Inside the block every sharded op of ``graph`` holds its full weights, gathered once on entry (a collective:
    every rank of the group enters together), and runs without collectives, as a rank that works on its own must
    (domain-parallel branch-and-bound, whose ranks bound different domains). No-op on a graph without shards.

    Example::

        with weights_held(sharded):              # all ranks at once
            search_my_domains(sharded)           # no rank waits for another in here
    """
    ops = [node.op for node in graph.nodes[1:] if hasattr(node.op, "_fsdp_gatherer")]
    placeholders = []
    try:
        for op in ops:  # in topological order: each gather waits on the one prefetched by the previous
            full = op._fsdp_gatherer.full_weights(op, +1)
            placeholders.append((op, {name: getattr(op, name) for name in full}))
            for name, value in full.items():
                setattr(op, name, value)
            op._fsdp_active = True
        yield
    finally:
        for op, meta in placeholders:
            op._fsdp_active = False
            for name, value in meta.items():
                setattr(op, name, value)
