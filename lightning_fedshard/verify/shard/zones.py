"""Megatron-style tensor parallelism: ``Linear → activation → Linear`` zones sharded along their hidden dimension.

Inside a zone rank ``r`` holds the column-parallel rows ``W₁[r]`` (its share of the hidden neurons, with their
biases) and the row-parallel columns ``W₂[:, r]``; the second bias is replicated. Going backwards the zone
takes replicated coefficients ``A`` on its output, multiplies them by ``W₂[:, r]`` (hidden-sharded, no
communication), relaxes its local activations (any element-wise :class:`~lightning_fedshard.verify.ops.Activation`:
ReLU, sigmoid, sine, ...), multiplies by ``W₁[r]`` and sums the partial input coefficients and constant terms over
the ranks. Weights and the coefficients inside the zone take ``1/P`` of the memory.

The hidden pre-activation bounds that the relaxation needs come from interval propagation: a CROWN pass started
there would need the full-width coefficients of every rank (see the module ``shard`` docs), so zones give sound
but looser bounds, and their activations are not branched on. The row-parallel bias is added once, after the sum,
never once per rank.

Rounding (see :mod:`~lightning_fedshard.verify.floats`): the first layer and the activation charge theirs on each
rank; the second layer is one sum of ``H`` hidden products split over ``P`` ranks and then summed, charged as a sum
of ``H + P`` terms against the whole ``|W₂|·|h|``; the partial input coefficients' sum over the ranks rounds by
``γ_P`` of them.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_fedshard.verify.floats import FLOAT64_EPSILON, gamma, smallest_normal
from lightning_fedshard.verify.graph import BoundGraph, Node
from lightning_fedshard.verify.ops import Activation, BoundOp, Interval, Linear, contract, contract_abs, enclose
from lightning_fedshard.verify.shard.rows import RowPartition

__all__ = ["MegatronZone", "megatron_zones"]


class _EnterZone(torch.autograd.Function):
    """Identity on a replicated value entering a zone; its gradient is summed over the ranks, whose partial
    computations each saw it."""

    @staticmethod
    def forward(ctx, x: Tensor, group: dist.ProcessGroup) -> Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: Tensor):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _LeaveZone(torch.autograd.Function):
    """Sum of the ranks' partial results, replicated; every rank's gradient of it is its own partial's."""

    @staticmethod
    def forward(ctx, partial: Tensor, group: dist.ProcessGroup) -> Tensor:
        total = partial.contiguous().clone()
        dist.all_reduce(total, group=group)
        return total

    @staticmethod
    def backward(ctx, grad: Tensor):
        return grad, None


class MegatronZone(BoundOp):
    """``y = W₂ σ(W₁ x + b₁) + b₂`` with this rank's hidden neurons only, ``σ`` an element-wise activation;
    ``x [B, d]`` → ``y [B, m]``.

    Example::

        zone = MegatronZone.from_layers(fc1, ReLU(), fc2, RowPartition(group))
        y = zone.forward(x)                      # equal to fc2(relu(fc1(x))) on every rank
        (A_x,), bias = zone.backward(A, [x_bounds])
    """

    needs_input_bounds = True

    def __init__(
        self,
        w1: Tensor,
        b1: Tensor | None,
        activation: Activation,
        w2: Tensor,
        b2: Tensor | None,
        group: dist.ProcessGroup,
    ):
        self.w1, self.b1, self.activation, self.w2, self.b2, self.group = w1, b1, activation, w2, b2, group
        self._hidden = Linear(w1, b1)

    @classmethod
    def from_layers(
        cls, first: Linear, activation: Activation, second: Linear, partition: RowPartition
    ) -> MegatronZone:
        hidden = partition.span(first.weight.shape[0])
        b1 = None if first.bias is None else first.bias[hidden].clone()
        w2 = second.weight[:, hidden].contiguous()
        return cls(first.weight[hidden].clone(), b1, activation, w2, second.bias, partition.group)

    def _enter(self, x: Tensor) -> Tensor:
        return _EnterZone.apply(x, self.group) if x.requires_grad else x

    def _hidden_bounds(self, x: Interval) -> Interval:
        return self._hidden.ibp(Interval(self._enter(x.lower), self._enter(x.upper)))

    def forward(self, x: Tensor) -> Tensor:
        partial = self.activation.forward(self._hidden.forward(self._enter(x))) @ self.w2.T
        y = _LeaveZone.apply(partial, self.group)
        return y if self.b2 is None else y + self.b2

    def _output_error(self, hidden: Interval) -> Tensor:
        """The second layer's rounding per output (model and ours), for hidden values in ``hidden`` (this rank's)."""
        dtype = hidden.lower.dtype
        with torch.no_grad():
            reach = _LeaveZone.apply(hidden.magnitude @ self.w2.abs().T, self.group).double()
        terms = self.w1.shape[0] * dist.get_world_size(self.group) + dist.get_world_size(self.group)
        model = self.model_precision(dtype)
        factor = (gamma(terms + 4, model) + gamma(2 * terms + self.w2.shape[0] + 4, dtype) + FLOAT64_EPSILON) * (
            1 + 2 * gamma(terms + 2, dtype)
        )
        constant = 0.0 if self.b2 is None else self.b2.abs().double()
        return (reach + constant) * factor + (terms + 4) * smallest_normal(model)

    def ibp(self, x: Interval) -> Interval:
        hidden = self.activation.ibp(self._hidden_bounds(x))
        center = hidden.center
        mid = _LeaveZone.apply(center @ self.w2.T, self.group)
        rad = _LeaveZone.apply(hidden.radius_around(center) @ self.w2.abs().T, self.group)
        if self.b2 is not None:
            mid = mid + self.b2
        low, high = mid.double() - rad.double(), mid.double() + rad.double()
        return enclose(low, high, self._output_error(hidden), mid.dtype, self.precision)

    def backward(self, A, inputs, alpha=None):
        (x,) = inputs
        pre = self._hidden_bounds(x)
        A_hidden = self._enter(A) @ self.w2
        (A_pre,), activation_term = self.activation.backward(A_hidden, [pre])
        (A_x_partial,), hidden_term = self._hidden.backward(A_pre, [x])
        terms = [t for t in (activation_term, hidden_term) if t is not None]
        partial_bias = sum(terms) if terms else torch.zeros(A.shape[:2], dtype=torch.float64, device=A.device)
        A_x = _LeaveZone.apply(A_x_partial, self.group)
        bias = _LeaveZone.apply(partial_bias, self.group)
        if self.b2 is not None:
            bias = bias + contract(A, self.b2)
        ranks = dist.get_world_size(self.group)
        summed = (gamma(ranks + 1, A.dtype) + FLOAT64_EPSILON) * x.magnitude  # the partial coefficients' sum
        bias = bias - contract_abs(A, self._output_error(self.activation.ibp(pre))) - contract_abs(A_x, summed)
        return [A_x], bias

    def __repr__(self) -> str:
        hidden = f"{self.w1.shape[0]}/rank {self.activation!r}"
        return f"MegatronZone({self.w1.shape[1]}→{hidden}→{self.w2.shape[0]})"


def megatron_zones(graph: BoundGraph, group: dist.ProcessGroup, max_zones: int | None = None) -> BoundGraph:
    """A copy of ``graph`` with up to ``max_zones`` (all, if ``None``) ``Linear → activation → Linear`` chains, taken
    from the input onwards and not overlapping, replaced by :class:`MegatronZone` nodes holding this rank's
    shard. The zone node keeps the name of the chain's last node.

    Raises ``ValueError`` when the graph has no such chain (convolutional nets are not zoned).

    Example::

        sharded = megatron_zones(load_onnx("mnist-net_256x4.onnx"), dist.group.WORLD)
    """
    partition = RowPartition(group)
    consumers: dict[str, int] = {}
    for node in graph.nodes:
        for name in node.inputs:
            consumers[name] = consumers.get(name, 0) + 1
    nodes, i, zones = [graph.input], 1, 0
    while i < len(graph.nodes):
        chain = graph.nodes[i : i + 3]
        if (max_zones is None or zones < max_zones) and _is_zone(chain, consumers):
            first, activation, second = chain
            zone = MegatronZone.from_layers(first.op, activation.op, second.op, partition)
            nodes.append(Node(second.name, zone, first.inputs, second.shape))
            i, zones = i + 3, zones + 1
        else:
            nodes.append(graph.nodes[i])
            i += 1
    if not zones:
        raise ValueError("tensor-parallel zones need Linear → activation → Linear chains; this network has none")
    return graph.with_nodes(nodes)


def _is_zone(chain: list[Node], consumers: dict[str, int]) -> bool:
    if len(chain) < 3:
        return False
    first, activation, second = chain
    return (
        isinstance(first.op, Linear)
        and isinstance(activation.op, Activation)
        and isinstance(second.op, Linear)
        and activation.inputs == (first.name,)
        and second.inputs == (activation.name,)
        and consumers.get(first.name) == 1
        and consumers.get(activation.name) == 1
    )
