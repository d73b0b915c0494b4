"""Which neuron to split next, and where: estimated gains, optionally refined by filtered smart branching (FSB).

Every split node (the input of a ReLU, a sigmoid, a product, ...) is scored through the op that reads it: a ReLU
by BaBSR's score, the other non-linear ops by the row's weight on their output times the relaxation gap the split
would remove (GenBaB's idea; the split point is the op's own choice, e.g. a ReLU's 0, a product factor's 0 or
middle, elsewhere the point that leaves the smallest gaps). The scores are weighted over the spec rows still open.
"""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_fedshard.verify.bab.domains import DomainBatch
from lightning_fedshard.verify.bounds.beta import beta_crown
from lightning_fedshard.verify.graph import BoundGraph
from lightning_fedshard.verify.objective import OutputSpec
from lightning_fedshard.verify.ops import Conv2d, Interval, Linear, flat

__all__ = ["branch_scores", "choose_branches"]


def _constant_term(graph: BoundGraph, name: str) -> Tensor:
    """The constant term of the layer that computes node ``name``, per neuron (zero if it has none)."""
    node = graph.by_name[name]
    bias = getattr(node.op, "bias", None) if isinstance(node.op, Linear | Conv2d) else None
    shape = node.shape
    if bias is None:
        return torch.zeros(shape, dtype=graph.dtype, device=graph.device)
    return bias.view(-1, *([1] * (len(shape) - 1))).expand(shape) if isinstance(node.op, Conv2d) else bias


def _consumer_inputs(graph: BoundGraph, name: str, bounds: dict[str, Interval]) -> tuple[list[Interval], int]:
    consumer, index = graph.splitter[name]
    return graph.consumer_inputs(consumer, bounds), index


def branch_scores(graph: BoundGraph, domains: DomainBatch, kept: dict[str, Tensor], open_rows: Tensor) -> Tensor:
    """Score ``[N, Σ neurons]`` of every neuron branch-and-bound may split (``-inf`` elsewhere), split nodes
    concatenated in the order of ``graph.split_nodes``. ``kept`` holds the coefficients ``[S, N, *shape]`` that
    arrived at each non-linear node's output; ``open_rows [N, S]`` the rows not yet ruled out."""
    weight = open_rows.T.to(graph.dtype) / open_rows.sum(1).clamp(min=1).to(graph.dtype)  # [S, N]
    bounds = domains.bounds()
    scores = []
    for name in graph.split_nodes:
        consumer, _ = graph.splitter[name]
        inputs, index = _consumer_inputs(graph, name, bounds)
        A = kept.get(consumer.name)
        if A is None:
            A = torch.zeros(
                open_rows.shape[1], len(domains), *consumer.shape, dtype=graph.dtype, device=open_rows.device
            )
        gain = flat(consumer.op.branch_gain(A, inputs, index, _constant_term(graph, name)), 2)  # [S, N, size]
        score = (gain * weight.unsqueeze(-1)).sum(0).abs()
        free = flat(graph.split_mask(name, bounds), 1)
        scores.append(torch.where(free, score, -torch.inf))
    return torch.cat(scores, 1)


def _locate(graph: BoundGraph, flat: Tensor) -> tuple[Tensor, Tensor]:
    """Concatenated neuron index → (index into ``graph.split_nodes``, neuron index within that node)."""
    sizes = torch.tensor([graph.by_name[name].size for name in graph.split_nodes], device=flat.device)
    ends = sizes.cumsum(0)
    layer = torch.searchsorted(ends, flat, right=True)
    return layer, flat - (ends - sizes)[layer]


def _points(graph: BoundGraph, domains: DomainBatch, layer: Tensor, neuron: Tensor, owner: Tensor) -> Tensor:
    """The split point of each chosen ``(layer, neuron)`` of domain ``owner`` (all ``[M]``)."""
    bounds = domains.bounds()
    point = torch.zeros(layer.shape, dtype=graph.dtype, device=layer.device)
    # Every node's points read for every choice, kept where the choice is at that node: no host sync to find which
    # choices are where (one per node and round on a GPU).
    for index, name in enumerate(graph.split_nodes):
        here = layer == index
        consumer, input_index = graph.splitter[name]
        inputs = graph.consumer_inputs(consumer, bounds)
        points = flat(consumer.op.split_point(inputs, input_index), 1)  # [N, size]
        point = torch.where(here, points[owner, torch.where(here, neuron, 0)].to(point.dtype), point)
    return point


def choose_branches(
    graph: BoundGraph,
    box: Interval,
    spec: OutputSpec,
    domains: DomainBatch,
    kept: dict[str, Tensor],
    candidates: int = 1,
) -> Tensor:
    """Set ``domains.branch_layer`` / ``branch_neuron`` / ``branch_point``: the best-scoring neuron, or with
    ``candidates > 1`` the best of the top candidates by FSB — each candidate's two children bounded with the
    parent's α and β (no optimisation), keeping the candidate whose worse child has the highest value. Those
    trial passes stop at the run's deadline (see :func:`~lightning_fedshard.verify.bounds.beta.beta_crown`).

    Returns ``[N]`` booleans: whether the domain had any neuron left to split.
    """
    open_rows = domains.margins <= 0
    scores = branch_scores(graph, domains, kept, open_rows)
    n = len(domains)
    owners = torch.arange(n, device=scores.device)
    k = min(candidates, scores.shape[1])
    top_scores, top = scores.topk(k, dim=1)  # [N, k]
    if k == 1:
        layer, neuron = _locate(graph, top[:, 0])
        domains.branch_layer, domains.branch_neuron = layer, neuron
        domains.branch_point = _points(graph, domains, layer, neuron, owners)
        return top_scores[:, 0].isfinite()
    layer, neuron = _locate(graph, top.T.reshape(-1))  # candidate-major: [k·N]
    point = _points(graph, domains, layer, neuron, owners.repeat(k))
    trials = domains.repeat(k).split(graph.split_nodes, layer, neuron, point)  # [2·k·N]: upper halves, then lower
    margins = spec.margins(beta_crown(graph, box, spec.rows(len(trials)), trials, iterations=0).lower)
    value = spec.value(torch.fmax(margins, trials.margins)).view(2, k, n).min(0).values  # [k, N]
    value = torch.where(top_scores.T.isfinite(), value, -torch.inf)
    best = value.argmax(0)
    pick = best * n + owners  # candidate-major index of the chosen candidate
    domains.branch_layer, domains.branch_neuron, domains.branch_point = layer[pick], neuron[pick], point[pick]
    return top_scores[:, 0].isfinite()
