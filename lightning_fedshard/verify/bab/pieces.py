"""Proving a box with few unstable ReLUs piece by piece: every combination of their phases is a piece on which
the network is linear.

Input splitting cannot prove a box whose property is tight along a ReLU's boundary: the boundary is a hyperplane,
and every axis-aligned box across it keeps the neuron unstable, its relaxation loose by about the margin. Fixing the
phase of each unstable ReLU instead (``s_j z_j ≥ 0``, for both signs ``s_j``) gives ``2^u`` pieces of the box; on
each the network is linear, and β-CROWN — the split constraints enforced by Lagrange multipliers — approaches the
exact minimum over the piece (+∞ on a piece whose phases contradict each other). The pieces are bounded together,
in rounds of a few iterations that drop the pieces proven so far (most are proven at once, a few need many).
"""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_fedshard.verify.bab.domains import DomainBatch
from lightning_fedshard.verify.bounds.alpha import initial_alphas
from lightning_fedshard.verify.bounds.beta import beta_crown
from lightning_fedshard.verify.graph import BoundGraph
from lightning_fedshard.verify.objective import OutputSpec, first_counterexample
from lightning_fedshard.verify.ops import Interval, ReLU, flat

__all__ = ["PIECES_MAX_UNSTABLE", "pieces_apply", "prove_by_pieces"]

#: Boxes with at most this many unstable ReLUs are tried piece by piece (2^u pieces each).
PIECES_MAX_UNSTABLE = 4
#: β-CROWN over the pieces: rounds, iterations per round, learning rates of α and β.
_ROUNDS, _ITERATIONS, _LR = 5, 10, (0.01, 0.05)


def pieces_apply(graph: BoundGraph) -> bool:
    """Whether the graph's only non-linear ops are ReLUs, whose phases cut a box into linear pieces."""
    return bool(graph.nonlinear) and all(isinstance(node.op, ReLU) for node in graph.nonlinear)


def _split_every_phase(graph: BoundGraph, domains: DomainBatch, owner: Tensor) -> tuple[DomainBatch, Tensor]:
    """Every combination of phases of the domains' unstable ReLUs, as domains (``owner``: their box)."""
    pres = graph.split_nodes  # every one a ReLU's input (pieces_apply)
    finished, owners = [], []
    while len(domains):
        layer = torch.full((len(domains),), -1, dtype=torch.long, device=domains.device)
        neuron = torch.zeros(len(domains), dtype=torch.long, device=domains.device)
        for index, pre in enumerate(pres):
            bounds = Interval(domains.lower[pre], domains.upper[pre])
            free = flat(ReLU.unstable(bounds), 1) & (flat(domains.splits[pre], 1) == 0)
            first = free.any(1) & (layer < 0)
            layer = torch.where(first, index, layer)
            neuron = torch.where(first, free.to(torch.int8).argmax(1), neuron)
        split = layer >= 0
        finished.append(domains.take((~split).nonzero().flatten()))
        owners.append(owner[~split])
        chosen = split.nonzero().flatten()
        zero = torch.zeros(len(chosen), dtype=domains.margins.dtype, device=domains.device)
        domains = domains.take(chosen).split(pres, layer[chosen], neuron[chosen], zero)
        owner = owner[chosen].repeat(2)
    return DomainBatch.cat(finished), torch.cat(owners)


def prove_by_pieces(
    graph: BoundGraph,
    spec: OutputSpec,
    boxes: Interval,
    bounds: dict[str, Interval],
    lower: Tensor,
) -> tuple[Tensor, Tensor | None]:
    """Which of the ``boxes [N, *input shape]`` (with pre-activation ``bounds`` and spec row bounds ``lower [S, N]``)
    every piece proves, and a counterexample if a piece's minimising corner is one. The β-CROWN rounds stop at the
    run's deadline (see :func:`~lightning_fedshard.verify.bounds.beta.beta_crown`).

    Example::

        proven, cex = prove_by_pieces(graph, spec.only(d), boxes, bounds, crown.lower)
    """
    n = boxes.lower.shape[0]
    alphas = initial_alphas(graph, graph.output.name, spec.num_rows, bounds)
    domains = DomainBatch.unsplit(graph, spec, bounds, alphas, lower)
    domains, owner = _split_every_phase(graph, domains, torch.arange(n, device=lower.device))
    cex = None
    for _ in range(_ROUNDS):
        pieces = Interval(boxes.lower[owner], boxes.upper[owner])
        stop = spec.threshold.view(-1, 1).expand(-1, len(domains))
        result = beta_crown(graph, pieces, spec.rows(len(domains)), domains, _ITERATIONS, *_LR, stop_above=stop)
        margins = torch.fmax(spec.margins(result.lower), domains.margins)
        domains.margins = margins
        open_ = (~(spec.value(domains.margins) > 0)).nonzero().flatten()  # NaN is open
        corners = result.minimiser(pieces)[:, open_].flatten(0, 1)
        cex = first_counterexample(graph, spec, corners) if corners.numel() else None
        domains, owner = domains.take(open_), owner[open_]
        if not len(domains) or cex is not None:
            break
    proven = torch.ones(n, dtype=torch.bool, device=owner.device)
    proven[owner] = False
    return proven, cex
