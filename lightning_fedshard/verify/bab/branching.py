"""Which ReLU to split next: BaBSR scores, optionally refined by filtered smart branching (FSB)."""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_fedshard.verify.bab.domains import DomainBatch
from lightning_fedshard.verify.bounds.beta import beta_crown
from lightning_fedshard.verify.graph import BoundGraph
from lightning_fedshard.verify.objective import OutputSpec
from lightning_fedshard.verify.ops import Conv2d, Interval, Linear, ReLU

__all__ = ["choose_branches"]


def _pre_activation_bias(graph: BoundGraph, pre: str) -> Tensor:
    """The constant term of the layer that computes ``pre``, per neuron (zero if it has none)."""
    node = graph.by_name[pre]
    bias = getattr(node.op, "bias", None) if isinstance(node.op, Linear | Conv2d) else None
    shape = node.shape
    if bias is None:
        return torch.zeros(shape, dtype=graph.dtype, device=graph.device)
    return bias.view(-1, *([1] * (len(shape) - 1))).expand(shape) if isinstance(node.op, Conv2d) else bias


def babsr_scores(graph: BoundGraph, domains: DomainBatch, relu_A: dict[str, Tensor], open_rows: Tensor) -> Tensor:
    """BaBSR score ``[N, Σ neurons]`` of every free unstable neuron (``-inf`` elsewhere), layers concatenated in
    the order of ``graph.relus``.

    The score estimates how much the bound would move if the neuron's relaxation were removed: its share of
    the bias through the chord (``A·b·λ`` vs ``A·b·(λ−1)``) plus the chord's intercept ``min(A, 0)·(−λl)``,
    averaged over the spec rows not yet ruled out (``open_rows [N, S]``).
    """
    weight = open_rows.T.to(graph.dtype) / open_rows.sum(1).clamp(min=1).to(graph.dtype)  # [S, N]
    scores = []
    for relu in graph.relus:
        pre = relu.inputs[0]
        bounds = Interval(domains.lower[pre], domains.upper[pre])
        slope, intercept = ReLU.upper_line(bounds)
        A = relu_A.get(relu.name)
        if A is None:
            A = torch.zeros(open_rows.shape[1], len(domains), *relu.shape, dtype=graph.dtype, device=open_rows.device)
        bias = _pre_activation_bias(graph, pre)
        through_bias = torch.maximum(A * bias * (slope - 1), A * bias * slope)
        score = (through_bias + A.clamp(max=0) * intercept).flatten(2)  # [S, N, size]
        score = (score * weight.unsqueeze(-1)).sum(0).abs()
        free = ReLU.unstable(bounds).flatten(1) & (domains.splits[pre].flatten(1) == 0)
        scores.append(torch.where(free, score, -torch.inf))
    return torch.cat(scores, 1)


def _locate(graph: BoundGraph, flat: Tensor) -> tuple[Tensor, Tensor]:
    """Concatenated neuron index → (layer index into ``graph.relus``, neuron index within the layer)."""
    sizes = torch.tensor([relu.size for relu in graph.relus], device=flat.device)
    ends = sizes.cumsum(0)
    layer = torch.searchsorted(ends, flat, right=True)
    return layer, flat - (ends - sizes)[layer]


def choose_branches(
    graph: BoundGraph,
    box: Interval,
    spec: OutputSpec,
    domains: DomainBatch,
    relu_A: dict[str, Tensor],
    candidates: int = 1,
) -> Tensor:
    """Set ``domains.branch_layer`` / ``branch_neuron``: the best BaBSR neuron, or with ``candidates > 1`` the
    best of the top candidates by FSB — each candidate's two children bounded with the parent's α and β
    (no optimisation), keeping the candidate whose worse child has the highest value.

    Returns ``[N]`` booleans: whether the domain had any free unstable neuron left to split.
    """
    open_rows = domains.margins <= 0
    scores = babsr_scores(graph, domains, relu_A, open_rows)
    k = min(candidates, scores.shape[1])
    top_scores, top = scores.topk(k, dim=1)  # [N, k]
    if k == 1:
        layer, neuron = _locate(graph, top[:, 0])
        domains.branch_layer, domains.branch_neuron = layer, neuron
        return top_scores[:, 0].isfinite()
    pres = list(graph.pre_activation.values())
    n = len(domains)
    layer, neuron = _locate(graph, top.T.reshape(-1))  # candidate-major: [k·N]
    trials = domains.repeat(k).split(pres, layer, neuron)  # [2·k·N]: active children, then inactive
    margins = beta_crown(graph, box, spec.rows(len(trials)), trials, iterations=0).lower.T - spec.rhs
    value = spec.value(torch.maximum(margins, trials.margins)).view(2, k, n).min(0).values  # [k, N]
    value = torch.where(top_scores.T.isfinite(), value, -torch.inf)
    best = value.argmax(0)
    chosen = top[torch.arange(n, device=top.device), best]
    domains.branch_layer, domains.branch_neuron = _locate(graph, chosen)
    return top_scores[:, 0].isfinite()
