"""β-CROWN: bounds of branch-and-bound domains, with the split assumptions enforced by Lagrange multipliers.

A domain assumes ``s_j·(z_j − p_j) ≥ 0`` for its split neurons (``p_j = 0`` for a ReLU phase; GenBaB's split
points elsewhere). For any ``β_j ≥ 0`` the term ``−β_j s_j (z_j − p_j)`` is non-positive on the domain, so adding
it to the objective keeps a valid lower bound; in the backward pass it subtracts ``β·s`` from the coefficients
arriving at the split node and adds ``β·s·p`` to the bound. β and the output pass's parameters α are optimised
jointly by projected Adam, keeping the best bound of every (row, domain). Intermediate bounds stay those of the
parent, tightened by the splits (sound, since a child's inputs are a subset of its parent's); the relaxations that
read a split neuron are rebuilt on its narrower interval.
"""

from __future__ import annotations

from collections.abc import Collection

import torch
from torch import Tensor

from lightning_fedshard.verify.bab.domains import DomainBatch
from lightning_fedshard.verify.bounds.adam import Adam
from lightning_fedshard.verify.bounds.crown import Backward, backward_bound
from lightning_fedshard.verify.budget import time_is_up
from lightning_fedshard.verify.graph import BoundGraph
from lightning_fedshard.verify.ops import Interval
from lightning_fedshard.verify.shard.lockstep import agree

__all__ = ["beta_crown"]


def _bound(
    graph: BoundGraph,
    box: Interval,
    C: Tensor,
    domains: DomainBatch,
    bounds: dict[str, Interval],
    keep: Collection[str],
) -> Backward:
    # A ReLU's split points are zeros: a pass need not add their Σ β·s·p = 0 (and its rounding charge of 0).
    terms = {
        name: (signed, None if name in graph.split_at_zero else point)
        for name, (signed, point) in domains.beta_terms().items()
    }
    return backward_bound(graph, graph.output.name, C, box, bounds, domains.alphas, terms, keep)


def beta_crown(
    graph: BoundGraph,
    box: Interval,
    C: Tensor,
    domains: DomainBatch,
    iterations: int = 20,
    lr_alpha: float = 0.01,
    lr_beta: float = 0.05,
    stop_above: Tensor | None = None,
    keep: Collection[str] = (),
) -> Backward:
    """Lower bounds ``[S, N]`` of the spec rows ``C [S, N, *output shape]`` on every domain.

    ``domains.alphas``/``domains.betas`` are updated in place to the best values found. The returned pass is
    re-run with those values, so its ``kept`` coefficients (at the nodes in ``keep``) and ``input_A`` belong to
    the returned bound. Optimisation stops early when every domain's rows exceed ``stop_above [S, N]``, and at the
    run's deadline: between iterations, and inside a pass (one rank alone: between its operator steps) with
    :class:`~lightning_fedshard.verify.shard.lockstep.DeadlineExceeded`.
    """
    with torch.no_grad():
        # Every node's interval once for all iterations (the splits fix them): the ops' rounding bounds are
        # computed once too (:meth:`~lightning_fedshard.verify.ops.BoundOp.rounding` keeps its last).
        bounds = graph.complete_bounds(box, domains.bounds())
        best = _bound(graph, box, C, domains, bounds, ()).lower
    if iterations:
        alphas = {k: v.clone().requires_grad_() for k, v in domains.alphas.items()}
        betas = {k: v.clone().requires_grad_() for k, v in domains.betas.items()}
        trial = DomainBatch(**{**vars(domains), "alphas": alphas, "betas": betas})
        optimizer = Adam([(list(alphas.values()), lr_alpha), (list(betas.values()), lr_beta)])
        for _ in range(iterations):
            if agree(stop_above is not None and bool((best > stop_above).all())):
                break
            if time_is_up():
                break
            with torch.enable_grad():
                lower = _bound(graph, box, C, trial, bounds, ()).lower
                optimizer.zero_grad()
                if agree(not lower.requires_grad):  # no slope or split reaches the bound (constant relaxations)
                    break
                (-lower.sum()).backward()
            with torch.no_grad():
                improved = lower.detach() > best
                best = torch.where(improved, lower.detach(), best)
                for store, current in ((domains.alphas, alphas), (domains.betas, betas)):
                    for name, value in current.items():
                        mask = improved.view(*improved.shape, *([1] * (value.dim() - 2)))
                        store[name] = torch.where(mask, value.detach(), store[name])
                optimizer.step()
                for value in alphas.values():
                    value.clamp_(0, 1)
                for value in betas.values():
                    value.clamp_(min=0)
    with torch.no_grad():
        final = _bound(graph, box, C, domains, bounds, keep)
    final.lower = torch.fmax(final.lower, best)
    return final
